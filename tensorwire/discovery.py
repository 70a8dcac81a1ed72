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

torch is imported on first use of this module; ``tensorwire`` imports this
module lazily.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import io
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from tensorwire.errors import ConfigError, NotFoundError, SpecError, TensorWireError
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["discover", "discover_call", "Plan", "METHODS"]

#: The tracers :func:`discover` tries, in order.
METHODS: tuple[str, ...] = ("export", "fx", "meta", "eager")

_GROUPS: tuple[str, ...] = (
    "inputs",
    "outputs",
    "grads_of_inputs",
    "grads_of_outputs",
    "params",
    "grads_of_params",
    "buffers",
)
_FLOATING = {"float32", "float16", "bfloat16", "float64"}


# ---------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------
class Plan:
    """The tensors one stage exchanges, as validated :class:`TensorSpec` lists.

    Immutable (attributes cannot be set) and compared by value. Each group is
    returned as a fresh ``list[TensorSpec]`` in a stable order:

    - ``inputs`` / ``outputs``: in argument / output-leaf order;
    - ``grads_of_inputs`` / ``grads_of_outputs``: same order, floating only;
    - ``params`` / ``grads_of_params``: ``named_parameters()`` order;
    - ``buffers``: ``named_buffers()`` order (persistent, supported dtypes).

    Other fields: ``method`` (``"export"``, ``"fx"``, ``"meta"`` or
    ``"eager"``: the tracer whose result this is), ``attempts`` (``(method,
    reason)`` for each tracer that failed first) and ``notes`` (what was
    skipped and why).
    """

    __slots__ = ("_groups", "_all", "method", "attempts", "notes")
    _groups: dict[str, tuple[TensorSpec, ...]]
    _all: dict[str, TensorSpec]
    method: str
    attempts: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]

    def __init__(
        self,
        *,
        inputs: Iterable[TensorSpec] = (),
        outputs: Iterable[TensorSpec] = (),
        grads_of_inputs: Iterable[TensorSpec] = (),
        grads_of_outputs: Iterable[TensorSpec] = (),
        params: Iterable[TensorSpec] = (),
        grads_of_params: Iterable[TensorSpec] = (),
        buffers: Iterable[TensorSpec] = (),
        method: str,
        attempts: Iterable[tuple[str, str]] = (),
        notes: Iterable[str] = (),
    ) -> None:
        groups = {
            "inputs": tuple(inputs),
            "outputs": tuple(outputs),
            "grads_of_inputs": tuple(grads_of_inputs),
            "grads_of_outputs": tuple(grads_of_outputs),
            "params": tuple(params),
            "grads_of_params": tuple(grads_of_params),
            "buffers": tuple(buffers),
        }
        everything: dict[str, TensorSpec] = {}
        for group, specs in groups.items():
            for spec in specs:
                if not isinstance(spec, TensorSpec):
                    raise SpecError(f"Plan.{group} must hold TensorSpec objects, got {type(spec).__name__}")
                if spec.name in everything:
                    raise SpecError(f"Plan: duplicate tensor name {spec.name!r}")
                everything[spec.name] = spec
        if method not in METHODS:
            raise ConfigError(f"Plan.method must be one of {METHODS}, got {method!r}")
        object.__setattr__(self, "_groups", groups)
        object.__setattr__(self, "_all", everything)
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "attempts", tuple((str(m), str(r)) for m, r in attempts))
        object.__setattr__(self, "notes", tuple(str(n) for n in notes))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Plan is immutable; cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Plan is immutable; cannot delete {name!r}")

    # -- groups ---------------------------------------------------------------
    @property
    def inputs(self) -> list[TensorSpec]:
        return list(self._groups["inputs"])

    @property
    def outputs(self) -> list[TensorSpec]:
        return list(self._groups["outputs"])

    @property
    def grads_of_inputs(self) -> list[TensorSpec]:
        return list(self._groups["grads_of_inputs"])

    @property
    def grads_of_outputs(self) -> list[TensorSpec]:
        return list(self._groups["grads_of_outputs"])

    @property
    def params(self) -> list[TensorSpec]:
        return list(self._groups["params"])

    @property
    def grads_of_params(self) -> list[TensorSpec]:
        return list(self._groups["grads_of_params"])

    @property
    def buffers(self) -> list[TensorSpec]:
        return list(self._groups["buffers"])

    @property
    def all(self) -> dict[str, TensorSpec]:
        """Every spec by name, groups in the order of :attr:`groups`."""
        return dict(self._all)

    def group(self, group: str) -> list[TensorSpec]:
        """One group by its attribute name (``"inputs"``, ``"grads_of_params"``, ...)."""
        if group not in self._groups:
            raise ConfigError(f"unknown group {group!r}; groups: {', '.join(_GROUPS)}")
        return list(self._groups[group])

    groups = _GROUPS

    # -- lookup ---------------------------------------------------------------
    def __getitem__(self, name: str) -> TensorSpec:
        try:
            return self._all[name]
        except (KeyError, TypeError):
            close = difflib.get_close_matches(str(name), list(self._all), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise NotFoundError(f"no tensor named {name!r} in this plan{hint}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._all

    def __len__(self) -> int:
        return len(self._all)

    def __iter__(self) -> Iterator[TensorSpec]:
        """Iterate over every spec, in the order of :attr:`all`."""
        return iter(tuple(self._all.values()))

    def check(self, name: str, tensor: Any) -> None:
        """Check ``tensor`` against the spec called ``name``.

        Raises:
            NotFoundError: no spec of that name.
            ShapeMismatchError: wrong dtype/device/rank, a static dim differs,
                or a dynamic dim is larger than its declared maximum.
        """
        self[name].check_tensor(tensor)

    # -- sizes ----------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Total bytes of every spec (dynamic dims at their maximum)."""
        return sum(s.nbytes for s in self._all.values())

    @property
    def nbytes_by_group(self) -> dict[str, int]:
        """Bytes per group (dynamic dims at their maximum) plus ``"total"``."""
        out = {g: sum(s.nbytes for s in specs) for g, specs in self._groups.items()}
        out["total"] = sum(out.values())
        return out

    # -- value semantics --------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self._groups == other._groups and self.method == other.method

    def __hash__(self) -> int:
        return hash((tuple(self._groups.values()), self.method))

    def __repr__(self) -> str:
        counts = ", ".join(f"{g}={len(s)}" for g, s in self._groups.items())
        return f"Plan(method={self.method!r}, {counts}, nbytes={self.nbytes})"

    def __str__(self) -> str:
        rows = [("name", "dtype", "shape", "device", "bytes")]
        sections: list[tuple[int, str]] = []
        for group, specs in self._groups.items():
            if not specs:
                continue
            sections.append((len(rows), f"{group} ({len(specs)}, {_human(sum(s.nbytes for s in specs))})"))
            for s in specs:
                dims = ", ".join(f"<={d}" if s.dynamic and s.dynamic[i] else str(d) for i, d in enumerate(s.shape))
                rows.append((s.name, s.dtype, f"[{dims}]", s.device, _human(s.nbytes)))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]

        def fmt(r: tuple[str, ...]) -> str:
            return "  ".join(
                (cell.rjust(w) if c == 4 else cell.ljust(w)) for c, (cell, w) in enumerate(zip(r, widths))
            ).rstrip()

        lines = [f"Plan via {self.method}: {len(self._all)} tensors, {_human(self.nbytes)} (dynamic dims at max)"]
        lines.append(fmt(rows[0]))
        marks = dict(sections)
        for i in range(1, len(rows)):
            if i in marks:
                lines.append(f"-- {marks[i]}")
            lines.append(fmt(rows[i]))
        for method, reason in self.attempts:
            lines.append(f"({method} failed: {reason})")
        return "\n".join(lines)


def _human(n: float) -> str:
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return f"{n} B"  # pragma: no cover


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

    inputs = _collect_inputs(args, kwargs)
    if not inputs:
        raise ConfigError(
            "discover() needs at least one tensor among the example arguments "
            "(call it as discover(module, *example_args, **example_kwargs))"
        )
    for name, t in inputs.items():
        _spec(name, tuple(t.shape), t.dtype, t.device)  # validates dtype/device, naming the input
    dyn = _resolve_dynamic(dynamic, inputs)

    input_specs = [_spec(n, tuple(t.shape), t.dtype, t.device, dyn.get(n)) for n, t in inputs.items()]
    param_specs, grad_param_specs = [], []
    for pname, p in module.named_parameters():
        param_specs.append(_spec(f"param.{pname}", tuple(p.shape), p.dtype, p.device))
        if p.requires_grad:
            grad_param_specs.append(_spec(f"grad.param.{pname}", tuple(p.shape), p.dtype, p.device))
    notes: list[str] = []
    buffer_specs = _buffer_specs(module, notes) if buffers else []

    outs, method, attempts = _trace_outputs(module, args, kwargs, inputs, dyn, methods)
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
# inputs and the dynamic argument
# ---------------------------------------------------------------------------
def _spec(name: str, shape: tuple[int, ...], dtype: Any, device: Any, dynamic: Any = None) -> TensorSpec:
    try:
        return TensorSpec(name, shape, dtype, device, dynamic=dynamic)
    except SpecError as exc:
        msg = str(exc)
        if not msg.startswith(f"{name}:"):
            msg = f"{name}: {msg}"
        raise SpecError(msg) from None


def _map_inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    on_tensor: Callable[[str, "torch.Tensor"], Any],
    on_other: Callable[[Any], Any] = lambda v: v,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Rebuild (args, kwargs) with each tensor leaf replaced by ``on_tensor(name, t)``.

    This is also the single definition of the input names.
    """
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    leaves, spec = tree_flatten(args)
    new, i = [], 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            new.append(on_tensor(f"input.{i}", leaf))
            i += 1
        else:
            new.append(on_other(leaf))
    new_args = tuple(tree_unflatten(new, spec))
    new_kwargs: dict[str, Any] = {}
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            new_kwargs[key] = on_tensor(f"input.{key}", value)
            continue
        leaves, spec = tree_flatten(value)
        new, j = [], 0
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                new.append(on_tensor(f"input.{key}.{j}", leaf))
                j += 1
            else:
                new.append(on_other(leaf))
        new_kwargs[key] = tree_unflatten(new, spec)
    return new_args, new_kwargs


def _collect_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, "torch.Tensor"]:
    found: dict[str, torch.Tensor] = {}

    def grab(name: str, t: "torch.Tensor") -> "torch.Tensor":
        found[name] = t
        return t

    _map_inputs(args, kwargs, grab)
    return found


def _input_aliases(inputs: Mapping[str, "torch.Tensor"]) -> dict[Any, list[str]]:
    """Every key that may select inputs in ``dynamic`` -> the input names it selects."""
    aliases: dict[Any, list[str]] = {}
    for name in inputs:
        aliases.setdefault(name, []).append(name)
        rest = name[len("input.") :]
        parts = rest.split(".")
        if parts[0].isdigit():
            aliases.setdefault(int(parts[0]), []).append(name)
        else:
            aliases.setdefault(rest, []).append(name)
            if len(parts) == 2:  # container kwarg: "input.kw" and "kw" select all of its leaves
                aliases.setdefault(parts[0], []).append(name)
                aliases.setdefault(f"input.{parts[0]}", []).append(name)
    return aliases


def _dims_of(value: Any, where: str) -> list[int]:
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"dynamic: {where}: expected a dim index or a sequence of dim indices, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple, set, frozenset, range)):
        dims = list(value)
        if all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            return dims
    raise ConfigError(f"dynamic: {where}: expected a dim index or a sequence of dim indices, got {value!r}")


def _resolve_dynamic(dynamic: Any, inputs: Mapping[str, "torch.Tensor"]) -> dict[str, tuple[int, ...]]:
    """Normalise ``dynamic`` to {input name: sorted non-negative dims} (only inputs with dynamic dims)."""
    if dynamic is None or dynamic is False:
        return {}
    wanted: dict[str, set[int]] = {}

    def add(name: str, dims: Iterable[int], where: str) -> None:
        rank = inputs[name].dim()
        for d in dims:
            if not -rank <= d < rank:
                raise ConfigError(
                    f"dynamic: {where}: dim {d} is out of range for {name} with shape {tuple(inputs[name].shape)}"
                )
            wanted.setdefault(name, set()).add(d % rank)

    if isinstance(dynamic, Mapping):
        aliases = _input_aliases(inputs)
        for key, value in dynamic.items():
            if isinstance(key, bool):
                raise ConfigError(f"dynamic: invalid key {key!r}")
            if key in aliases:
                dims = _dims_of(value, f"{key!r}")
                for name in aliases[key]:
                    add(name, dims, repr(key))
            elif isinstance(key, int):
                n = sum(1 for k in aliases if isinstance(k, int))
                raise ConfigError(f"dynamic: there is no positional tensor input {key} (there are {n})")
            elif isinstance(key, str) and (key.startswith("input.") or not key.isidentifier()):
                raise ConfigError(f"dynamic: no input named {key!r}; inputs: {', '.join(inputs)}")
            elif isinstance(key, str):  # a named dim such as "batch"
                if isinstance(value, Mapping):
                    for sel, dim in value.items():
                        if isinstance(sel, bool) or sel not in aliases:
                            raise ConfigError(
                                f"dynamic: named dim {key!r}: no input {sel!r}; inputs: {', '.join(inputs)}"
                            )
                        for name in aliases[sel]:
                            add(name, _dims_of(dim, f"{key!r}[{sel!r}]"), f"named dim {key!r}")
                else:
                    dims = _dims_of(value, f"named dim {key!r}")
                    for name in inputs:
                        add(name, dims, f"named dim {key!r}")
            else:
                raise ConfigError(f"dynamic: invalid key {key!r} (use an int, an input name or a dim name)")
    else:
        try:
            dims = _dims_of(dynamic, "value")
        except ConfigError:
            raise ConfigError(
                f"dynamic must be None, a dim index, a sequence of dim indices or a dict, got {dynamic!r}"
            ) from None
        for name in inputs:
            add(name, dims, "every input")
    return {name: tuple(sorted(d)) for name, d in wanted.items() if d}


def _probe_size(n: int) -> int:
    """A second size for a dynamic dim: half (>= 2, so no broadcasting surprise), else one more."""
    return n // 2 if n >= 4 else n + 1


def _resize(t: "torch.Tensor", dim: int, n: int) -> "torch.Tensor":
    """``t`` with ``dim`` of size ``n``: a view when shrinking, repeated data when growing."""
    import torch

    size = t.shape[dim]
    if n <= size:
        return t.narrow(dim, 0, n)
    if size == 0:
        shape = list(t.shape)
        shape[dim] = n
        return t.new_zeros(shape)
    reps = -(-n // size)
    return torch.cat([t] * reps, dim=dim).narrow(dim, 0, n)


def _probe_inputs(args: "_Args", kwargs: "_Kwargs", dyn: "_Dyn") -> tuple["_Args", "_Kwargs"]:
    def shrink(name: str, t: "torch.Tensor") -> "torch.Tensor":
        for d in dyn.get(name, ()):
            t = _resize(t, d, _probe_size(t.shape[d]))
        return t

    return _map_inputs(args, kwargs, shrink)


def _detached(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return _map_inputs(args, kwargs, lambda _n, t: t.detach())


# ---------------------------------------------------------------------------
# tracing
# ---------------------------------------------------------------------------
# one output leaf: (shape, dtype, device, dynamic flags or None)
_Out = tuple[tuple[int, ...], Any, Any, Any]
_Args = tuple[Any, ...]
_Kwargs = dict[str, Any]
_Dyn = Mapping[str, tuple[int, ...]]  # input name -> its dynamic dims


def _trace_outputs(
    module: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: Mapping[str, "torch.Tensor"],
    dyn: Mapping[str, tuple[int, ...]],
    methods: tuple[str, ...],
) -> tuple[list[_Out], str, list[tuple[str, str]]]:
    args, kwargs = _detached(args, kwargs)
    attempts: list[tuple[str, str]] = []
    last: BaseException | None = None
    tracers = {"export": _outputs_export, "fx": _outputs_fx, "meta": _outputs_meta, "eager": _outputs_eager}
    for method in methods:
        try:
            with _forked_rng(module, inputs):
                outs = tracers[method](module, args, kwargs, dyn)
            return outs, method, attempts
        except TensorWireError:
            raise
        except Exception as exc:  # noqa: BLE001 - a tracer that cannot follow this module: try the next one
            attempts.append((method, _reason(exc)))
            last = exc
    detail = "; ".join(f"{m}: {r}" for m, r in attempts)
    raise ConfigError(f"could not trace {type(module).__name__} with the example arguments ({detail})") from last


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(exc).__name__}: {first}"


@contextlib.contextmanager
def _forked_rng(module: Any, inputs: Mapping[str, "torch.Tensor"]) -> Iterator[None]:
    """Leave the global RNG state (CPU and the CUDA devices in use) as it was."""
    import torch

    cuda = set()
    for t in list(inputs.values()) + list(module.parameters()) + list(module.buffers()):
        if t.device.type == "cuda":
            cuda.add(t.device.index if t.device.index is not None else torch.cuda.current_device())
    with torch.random.fork_rng(devices=sorted(cuda)):
        yield


@contextlib.contextmanager
def _quiet(stderr: bool = False) -> Iterator[None]:
    """Silence torch's tracing chatter while a tracer runs.

    Failures are not lost: they are reported in ``Plan.attempts`` or in the
    final error. ``stderr=True`` also swallows what ``torch.export`` prints
    directly to ``sys.stderr`` when it fails (the partial graph).
    """
    names = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export", "torch.fx")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            warnings.simplefilter("ignore")
            if stderr:
                stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _tensor_leaves(value: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _static(leaves: Iterable[Any]) -> list[_Out]:
    return [(tuple(int(d) for d in t.shape), t.dtype, t.device, None) for t in leaves]


def _two_sizes(
    trace: Callable[[tuple[Any, ...], dict[str, Any]], list[_Out]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dyn: Mapping[str, tuple[int, ...]],
) -> list[_Out]:
    """Trace at the example sizes and, with dynamic dims, at the probe sizes; compare."""
    full = trace(args, kwargs)
    if not dyn:
        return full
    probe = trace(*_probe_inputs(args, kwargs, dyn))
    if len(probe) != len(full):
        raise SpecError(
            f"the number of tensor outputs changes with the dynamic dims ({len(full)} at the example sizes, "
            f"{len(probe)} at the probe sizes); tensorwire needs a fixed set of outputs"
        )
    outs = []
    for i, ((shape, dtype, device, _), (pshape, pdtype, _, _)) in enumerate(zip(full, probe)):
        if pdtype != dtype or len(pshape) != len(shape):
            raise SpecError(
                f"output.{i} changes dtype or rank with the dynamic dims "
                f"({dtype}{list(shape)} vs {pdtype}{list(pshape)})"
            )
        flags = tuple(a != b for a, b in zip(shape, pshape))
        outs.append((shape, dtype, device, flags if any(flags) else None))
    return outs


# -- export ------------------------------------------------------------------
def _outputs_export(module: Any, args: _Args, kwargs: _Kwargs, dyn: _Dyn) -> list[_Out]:
    small = any(inputs_dim < 2 for inputs_dim in _dynamic_sizes(args, kwargs, dyn))
    if dyn and not small:  # sizes 0 and 1 are always specialised by export: probe instead
        try:
            return _export_symbolic(module, args, kwargs, dyn)
        except TensorWireError:
            raise
        except Exception:  # noqa: BLE001 - any failure falls back to exporting statically
            pass  # e.g. the module specialises a dynamic dim: export statically at two sizes
    return _two_sizes(lambda a, k: _export_symbolic(module, a, k, {}), args, kwargs, dyn)


def _dynamic_sizes(args: _Args, kwargs: _Kwargs, dyn: _Dyn) -> list[int]:
    sizes: list[int] = []
    _map_inputs(args, kwargs, lambda n, t: sizes.extend(t.shape[d] for d in dyn.get(n, ())))
    return sizes


def _export_symbolic(module: Any, args: _Args, kwargs: _Kwargs, dyn: _Dyn) -> list[_Out]:
    import torch
    from torch.export import Dim
    from torch.export.graph_signature import OutputKind

    # fresh tensor objects: export records dynamic-dim marks on the objects it is given,
    # which would leak into a later static export (and into the caller's tensors)
    args, kwargs = _detached(args, kwargs)
    dynamic_shapes = None
    if dyn:
        ds_args, ds_kwargs = _map_inputs(
            args, kwargs, lambda n, t: {d: Dim.DYNAMIC for d in dyn[n]} if n in dyn else None, lambda v: None
        )
        bound = inspect.signature(module.forward).bind(*ds_args, **ds_kwargs)
        dynamic_shapes = dict(bound.arguments)
    with _quiet(stderr=True):
        ep = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    results = out_node.args[0]
    specs = ep.graph_signature.output_specs
    outs: list[_Out] = []
    for spec, node in zip(specs, results):
        if spec.kind != OutputKind.USER_OUTPUT or not isinstance(node, torch.fx.Node):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        outs.append(_symbolic_leaf(len(outs), val))
    return outs


def _symbolic_leaf(index: int, val: "torch.Tensor") -> _Out:
    import torch

    shape, flags = [], []
    for d, size in enumerate(val.shape):
        if not isinstance(size, torch.SymInt):
            shape.append(int(size))
            flags.append(False)
            continue
        node = size.node
        expr = node.expr
        env = node.shape_env
        known = getattr(env, "backed_var_to_val", None)
        if known is None:
            known = env.var_to_val
        unknown = [s for s in expr.free_symbols if s not in known]
        if unknown:
            raise SpecError(
                f"output.{index}: dim {d} has a size that depends on tensor values ({expr}); "
                "tensorwire needs outputs whose maximum size is known before data flows"
            )
        shape.append(int(expr.xreplace({s: known[s] for s in expr.free_symbols})))
        flags.append(bool(expr.free_symbols))
    return (tuple(shape), val.dtype, val.device, tuple(flags) if any(flags) else None)


# -- fx ------------------------------------------------------------------------
def _outputs_fx(module: Any, args: _Args, kwargs: _Kwargs, dyn: _Dyn) -> list[_Out]:
    import torch
    from torch.fx import symbolic_trace
    from torch.fx.passes.shape_prop import ShapeProp
    from torch._subclasses.fake_tensor import FakeTensorMode

    sig = inspect.signature(module.forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
        raise TypeError("forward(*args/**kwargs) is not supported by symbolic_trace")
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {k: v for k, v in bound.arguments.items() if not _tensor_leaves(v)}
    with _quiet():
        gm = symbolic_trace(module, concrete_args=concrete)

    def run(a: tuple[Any, ...], k: dict[str, Any]) -> list[_Out]:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fa, fk = _map_inputs(a, k, lambda _n, t: fake_mode.from_tensor(t))
        values = sig.bind(*fa, **fk)  # placeholders follow the signature order
        values.apply_defaults()
        with _quiet(), torch.no_grad():
            result = ShapeProp(gm, fake_mode=fake_mode).propagate(*values.arguments.values())
        return _static(_tensor_leaves(result))

    return _two_sizes(run, args, kwargs, dyn)


# -- meta ----------------------------------------------------------------------
def _outputs_meta(module: Any, args: _Args, kwargs: _Kwargs, dyn: _Dyn) -> list[_Out]:
    import torch
    from torch.func import functional_call

    state = {n: torch.empty_like(p, device="meta") for n, p in module.named_parameters(remove_duplicate=False)}
    state.update({n: torch.empty_like(b, device="meta") for n, b in module.named_buffers(remove_duplicate=False)})

    def run(a: tuple[Any, ...], k: dict[str, Any]) -> list[_Out]:
        ma, mk = _map_inputs(a, k, lambda _n, t: torch.empty_like(t, device="meta"))
        with torch.no_grad():
            result = functional_call(module, state, ma, mk, tie_weights=True, strict=False)
        return _static(_tensor_leaves(result))

    return _two_sizes(run, args, kwargs, dyn)


# -- eager (last resort) ---------------------------------------------------------
def _outputs_eager(module: Any, args: _Args, kwargs: _Kwargs, dyn: _Dyn) -> list[_Out]:
    import torch

    def run(a: tuple[Any, ...], k: dict[str, Any]) -> list[_Out]:
        with _restored_buffers(module), torch.no_grad():
            result = module(*a, **k)
        return _static(_tensor_leaves(result))

    return _two_sizes(run, args, kwargs, dyn)


@contextlib.contextmanager
def _restored_buffers(module: Any) -> Iterator[None]:
    """Put every buffer (object and values) back after a real forward (e.g. BatchNorm stats)."""
    import torch

    saved = []
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            saved.append((mod, name, buf, None if buf is None else buf.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for mod, name, buf, copy in saved:
                mod._buffers[name] = buf
                if buf is not None:
                    buf.copy_(copy)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
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
