"""``discover``: find the tensors a pipeline stage or worker exchanges.

::

    import tensorwire as tw

    plan = tw.discover(stage, torch.randn(8, 128, 512), dynamic=0)
    print(plan)                      # a table: name, dtype, shape, device, bytes
    plan.inputs, plan.outputs        # list[TensorSpec]
    plan["grad.output.0"]            # one spec by name
    plan.check("input.0", x)         # ShapeMismatchError if x does not fit

:func:`discover` takes the module and example arguments exactly as you would
call it (``stage(*example_args, **example_kwargs)``) and returns a
:class:`Plan`: the specs of the stage's inputs, outputs, the gradients of both,
its parameters and their gradients (and persistent buffers). It does **not**
run a training step: no backward, no optimizer, parameters and their ``.grad``
are never written.

Names (a stable, public contract)
---------------------------------
==============================  ==============================================
``input.<i>``                   the i-th tensor among the flattened (pytree)
                                positional arguments; non-tensor leaves do not
                                take an index
``input.<kw>``                  a tensor keyword argument ``kw``
``input.<kw>.<j>``              the j-th tensor leaf of a container kwarg
``output.<i>``                  the i-th tensor leaf of the flattened output
``grad.input.<...>``            gradient of a floating-point input (same
                                shape, dtype, dynamic dims); integer/bool
                                inputs such as token ids get none
``grad.output.<i>``             gradient of a floating-point output
``param.<qualified name>``      every ``module.named_parameters()``, with or
                                without ``requires_grad``
``grad.param.<qualified name>`` parameters with ``requires_grad``
``buffer.<qualified name>``     persistent buffers of a supported dtype
==============================  ==============================================

Dynamic dims
------------
A dynamic dim may vary per message up to a maximum; **the maximum is the size
in the example arguments**. ``dynamic`` may be:

- ``None`` (default): everything is static;
- an ``int`` ``d`` or a sequence of ints: those dims of **every** tensor input
  (``dynamic=0`` is "the batch dim");
- a ``dict`` whose keys select inputs and whose values are a dim or a sequence
  of dims: ``{0: [0]}`` (positional tensor input 0), ``{"input.1": 0}``,
  ``{"mask": 0}`` or ``{"input.mask": 0}`` (a kwarg; a container kwarg key
  applies to all of its tensors);
- in that dict, a key that names no input is a *named dim*, e.g.
  ``{"batch": 0, "seq": 1}``: its value is the dim in every tensor input, or a
  dict ``{input key: dim}`` to place it in some inputs only. Keys naming an
  input win over named dims; use the ``input.<...>`` spelling when in doubt.

Negative dims count from the end. A dim out of range, an unknown input, or a
malformed value raises :class:`~tensorwire.errors.ConfigError`.

Output dims (and their gradients) are marked dynamic when they follow a
dynamic input dim. With ``torch.export`` this is read from the symbolic shapes
of the exported graph; otherwise the stage is traced twice, at the example
sizes and at smaller "probe" sizes (half, or one more for sizes below 4), and
every output dim whose size differs is dynamic. The maximum of an output dim
is its size at the example arguments (dims are assumed to grow with inputs;
if one does not, sending a larger tensor later fails loudly via
``check_shape``, it never overflows silently). Output sizes that depend on
tensor *values* (``nonzero``, boolean masking) cannot have a static maximum
and raise :class:`~tensorwire.errors.SpecError` when detected.

Tracers (``Plan.method``), tried in order
-----------------------------------------
1. ``"export"``: ``torch.export.export(strict=False)``; shapes and dtypes come
   from the fake-tensor metadata of the graph's output node
   (``node.meta["val"]``). Dynamic dims are exported with ``Dim.DYNAMIC``; if
   that fails (e.g. the stage specialises a dim), the stage is exported
   statically twice (example and probe sizes).
2. ``"fx"``: ``torch.fx.symbolic_trace`` then ``ShapeProp`` under a
   ``FakeTensorMode`` (no real memory, no real compute).
3. ``"meta"``: the stage's own ``forward`` under ``torch.no_grad()`` through
   ``torch.func.functional_call`` with meta-device copies of its parameters,
   buffers and inputs (nothing is copied for real; the module is not changed).
4. ``"eager"``: the **last resort**, needed only when the forward depends on
   tensor values (e.g. ``if x.sum() > 0:``), which no tracer can follow. The
   forward runs for real on the example arguments under ``torch.no_grad()``
   with the RNG state forked; buffers (e.g. BatchNorm running stats) are
   snapshotted and restored afterwards. Parameters are never written.

The first three never run the stage on real data. ``Plan.method`` says which
tracer produced the result and ``Plan.attempts`` why earlier ones failed. Use
:func:`discover_call` to restrict the tracers (e.g. ``methods=("export",
"fx", "meta")`` to forbid the eager forward). Note that ``export``, ``fx`` and
``meta`` still execute the Python code of ``forward`` (with fake or meta
tensors), so Python side effects in it (prints, counters) do happen.

The package: this module holds :func:`discover` and :func:`discover_call`;
:mod:`~tensorwire.discovery.plan` the :class:`Plan`;
:mod:`~tensorwire.discovery.dims` the input names, the ``dynamic`` argument
and the probe inputs; :mod:`~tensorwire.discovery.tracers` the four tracers.
torch is imported on first use of this package; ``tensorwire`` imports it
lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from tensorwire.discovery.dims import collect_inputs, resolve_dynamic
from tensorwire.discovery.plan import METHODS, Plan
from tensorwire.discovery.tracers import trace_outputs
from tensorwire.errors import ConfigError, SpecError
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["discover", "discover_call", "Plan", "METHODS"]

_FLOATING = {"float32", "float16", "bfloat16", "float64"}


# ---------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------
def discover(module: Any, /, *example_args: Any, dynamic: Any = None, **example_kwargs: Any) -> Plan:
    """The :class:`Plan` of ``module`` called as ``module(*example_args, **example_kwargs)``.

    Args:
        module: a ``torch.nn.Module`` (a pipeline stage, a worker's model).
        *example_args: example positional arguments (pytrees of tensors and
            constants). Their sizes are the maxima of dynamic dims.
        dynamic: which dims are dynamic; see the module docs (``0``,
            ``[0, 1]``, ``{0: [0]}``, ``{"mask": 0}``, ``{"batch": 0}``).
        **example_kwargs: example keyword arguments.

    Returns:
        the Plan; ``plan.method`` says how it was traced.

    Raises:
        ConfigError: not a module, no tensor input, a bad ``dynamic``, or a
            stage that no tracer could run (every failure is listed).
        SpecError: a tensor of an unsupported dtype/device (named), or an
            output whose size depends on tensor values.
    """
    return discover_call(module, example_args, example_kwargs, dynamic=dynamic)


def discover_call(
    module: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic: Any = None,
    methods: Iterable[str] = METHODS,
    buffers: bool = True,
) -> Plan:
    """:func:`discover` with the arguments as a tuple and a dict, plus options.

    Args:
        methods: the tracers to try, in order (a subset of :data:`METHODS`);
            leave out ``"eager"`` to never run the forward on real data.
        buffers: include ``buffer.<name>`` specs.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"discover() needs a torch.nn.Module, got {type(module).__name__}")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise ConfigError(f"args must be a tuple or list of example arguments, got {type(args).__name__}")
    args = tuple(args)
    kwargs = dict(kwargs or {})
    if not all(isinstance(k, str) for k in kwargs):
        raise ConfigError("kwargs keys must be str")
    methods = tuple(methods)
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ConfigError(f"methods must be a non-empty subset of {METHODS}, got {methods!r}")

    inputs = collect_inputs(args, kwargs)
    if not inputs:
        raise ConfigError(
            "discover() needs at least one tensor among the example arguments "
            "(call it as discover(module, *example_args, **example_kwargs))"
        )
    for name, t in inputs.items():
        _spec(name, tuple(t.shape), t.dtype, t.device)  # validates dtype/device, naming the input
    dyn = resolve_dynamic(dynamic, inputs)

    input_specs = [_spec(n, tuple(t.shape), t.dtype, t.device, dyn.get(n)) for n, t in inputs.items()]
    param_specs, grad_param_specs = [], []
    for pname, p in module.named_parameters():
        param_specs.append(_spec(f"param.{pname}", tuple(p.shape), p.dtype, p.device))
        if p.requires_grad:
            grad_param_specs.append(_spec(f"grad.param.{pname}", tuple(p.shape), p.dtype, p.device))
    notes: list[str] = []
    buffer_specs = _buffer_specs(module, notes) if buffers else []

    outs, method, attempts = trace_outputs(module, args, kwargs, inputs, dyn, methods)
    ref_device = _reference_device(module, inputs)
    output_specs = []
    for i, (shape, dtype, device, flags) in enumerate(outs):
        if device.type == "meta":
            device = ref_device
        output_specs.append(_spec(f"output.{i}", shape, dtype, device, flags))

    grads_in = [s.with_name(f"grad.{s.name}") for s in input_specs if s.dtype in _FLOATING]
    grads_out = [s.with_name(f"grad.{s.name}") for s in output_specs if s.dtype in _FLOATING]
    return Plan(
        inputs=input_specs,
        outputs=output_specs,
        grads_of_inputs=grads_in,
        grads_of_outputs=grads_out,
        params=param_specs,
        grads_of_params=grad_param_specs,
        buffers=buffer_specs,
        method=method,
        attempts=attempts,
        notes=notes,
    )


# ---------------------------------------------------------------------------
# specs of the module's own tensors
# ---------------------------------------------------------------------------
def _spec(name: str, shape: tuple[int, ...], dtype: Any, device: Any, dynamic: Any = None) -> TensorSpec:
    try:
        return TensorSpec(name, shape, dtype, device, dynamic=dynamic)
    except SpecError as exc:
        msg = str(exc)
        if not msg.startswith(f"{name}:"):
            msg = f"{name}: {msg}"
        raise SpecError(msg) from None


def _buffer_specs(module: Any, notes: list[str]) -> list[TensorSpec]:
    persistent = set()
    for prefix, mod in module.named_modules():
        for name in mod._buffers:
            if name not in mod._non_persistent_buffers_set:
                persistent.add(f"{prefix}.{name}" if prefix else name)
    specs = []
    for name, buf in module.named_buffers():
        if name not in persistent:
            continue
        try:
            specs.append(_spec(f"buffer.{name}", tuple(buf.shape), buf.dtype, buf.device))
        except SpecError as exc:
            notes.append(f"skipped buffer.{name}: {exc}")
    return specs


def _reference_device(module: Any, inputs: Mapping[str, "torch.Tensor"]) -> Any:
    """Where real outputs would live, for tracers (meta) that cannot say."""
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return next(iter(inputs.values())).device
