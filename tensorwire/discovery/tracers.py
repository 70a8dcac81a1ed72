"""The tracers :func:`tensorwire.discovery.discover` tries, in order: export, fx, meta, eager.

Each returns the output leaves of the stage (shape, dtype, device, dynamic flags);
:func:`trace_outputs` tries them in the order asked and says why earlier ones
failed. What each one runs, and what it never touches, is described in
:mod:`tensorwire.discovery`. torch is imported on first use.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from tensorwire.discovery.dims import Args, Dyn, Kwargs, detached, map_inputs, probe_inputs
from tensorwire.errors import ConfigError, SpecError, TensorWireError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Out", "trace_outputs"]

# one output leaf: (shape, dtype, device, dynamic flags or None)
Out = tuple[tuple[int, ...], Any, Any, Any]


def trace_outputs(
    module: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: Mapping[str, "torch.Tensor"],
    dyn: Mapping[str, tuple[int, ...]],
    methods: tuple[str, ...],
) -> tuple[list[Out], str, list[tuple[str, str]]]:
    args, kwargs = detached(args, kwargs)
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


def _static(leaves: Iterable[Any]) -> list[Out]:
    return [(tuple(int(d) for d in t.shape), t.dtype, t.device, None) for t in leaves]


def _two_sizes(
    trace: Callable[[tuple[Any, ...], dict[str, Any]], list[Out]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dyn: Mapping[str, tuple[int, ...]],
) -> list[Out]:
    """Trace at the example sizes and, with dynamic dims, at the probe sizes; compare."""
    full = trace(args, kwargs)
    if not dyn:
        return full
    probe = trace(*probe_inputs(args, kwargs, dyn))
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
def _outputs_export(module: Any, args: Args, kwargs: Kwargs, dyn: Dyn) -> list[Out]:
    small = any(inputs_dim < 2 for inputs_dim in _dynamic_sizes(args, kwargs, dyn))
    if dyn and not small:  # sizes 0 and 1 are always specialised by export: probe instead
        try:
            return _export_symbolic(module, args, kwargs, dyn)
        except TensorWireError:
            raise
        except Exception:  # noqa: BLE001 - any failure falls back to exporting statically
            pass  # e.g. the module specialises a dynamic dim: export statically at two sizes
    return _two_sizes(lambda a, k: _export_symbolic(module, a, k, {}), args, kwargs, dyn)


def _dynamic_sizes(args: Args, kwargs: Kwargs, dyn: Dyn) -> list[int]:
    sizes: list[int] = []
    map_inputs(args, kwargs, lambda n, t: sizes.extend(t.shape[d] for d in dyn.get(n, ())))
    return sizes


def _export_symbolic(module: Any, args: Args, kwargs: Kwargs, dyn: Dyn) -> list[Out]:
    import torch
    from torch.export import Dim
    from torch.export.graph_signature import OutputKind

    # fresh tensor objects: export records dynamic-dim marks on the objects it is given,
    # which would leak into a later static export (and into the caller's tensors)
    args, kwargs = detached(args, kwargs)
    dynamic_shapes = None
    if dyn:
        ds_args, ds_kwargs = map_inputs(
            args, kwargs, lambda n, t: {d: Dim.DYNAMIC for d in dyn[n]} if n in dyn else None, lambda v: None
        )
        bound = inspect.signature(module.forward).bind(*ds_args, **ds_kwargs)
        dynamic_shapes = dict(bound.arguments)
    with _quiet(stderr=True):
        ep = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    results = out_node.args[0]
    specs = ep.graph_signature.output_specs
    outs: list[Out] = []
    for spec, node in zip(specs, results):
        if spec.kind != OutputKind.USER_OUTPUT or not isinstance(node, torch.fx.Node):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        outs.append(_symbolic_leaf(len(outs), val))
    return outs


def _symbolic_leaf(index: int, val: "torch.Tensor") -> Out:
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
def _outputs_fx(module: Any, args: Args, kwargs: Kwargs, dyn: Dyn) -> list[Out]:
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

    def run(a: tuple[Any, ...], k: dict[str, Any]) -> list[Out]:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fa, fk = map_inputs(a, k, lambda _n, t: fake_mode.from_tensor(t))
        values = sig.bind(*fa, **fk)  # placeholders follow the signature order
        values.apply_defaults()
        with _quiet(), torch.no_grad():
            result = ShapeProp(gm, fake_mode=fake_mode).propagate(*values.arguments.values())
        return _static(_tensor_leaves(result))

    return _two_sizes(run, args, kwargs, dyn)


# -- meta ----------------------------------------------------------------------
def _outputs_meta(module: Any, args: Args, kwargs: Kwargs, dyn: Dyn) -> list[Out]:
    import torch
    from torch.func import functional_call

    state = {n: torch.empty_like(p, device="meta") for n, p in module.named_parameters(remove_duplicate=False)}
    state.update({n: torch.empty_like(b, device="meta") for n, b in module.named_buffers(remove_duplicate=False)})

    def run(a: tuple[Any, ...], k: dict[str, Any]) -> list[Out]:
        ma, mk = map_inputs(a, k, lambda _n, t: torch.empty_like(t, device="meta"))
        with torch.no_grad():
            result = functional_call(module, state, ma, mk, tie_weights=True, strict=False)
        return _static(_tensor_leaves(result))

    return _two_sizes(run, args, kwargs, dyn)


# -- eager (last resort) ---------------------------------------------------------
def _outputs_eager(module: Any, args: Args, kwargs: Kwargs, dyn: Dyn) -> list[Out]:
    import torch

    def run(a: tuple[Any, ...], k: dict[str, Any]) -> list[Out]:
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
