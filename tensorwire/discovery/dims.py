"""The example inputs of a stage: their names, their dynamic dims, and the smaller "probe" inputs.

:func:`map_inputs` is the single definition of the input names (``input.<i>``,
``input.<kw>``, ``input.<kw>.<j>``); :func:`resolve_dynamic` turns the ``dynamic``
argument of :func:`tensorwire.discovery.discover` into dims per input name, and
:func:`probe_inputs` shrinks (or grows) those dims for the second trace.

torch is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from tensorwire.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Args", "Kwargs", "Dyn", "map_inputs", "collect_inputs", "resolve_dynamic", "probe_inputs", "detached"]

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Dyn = Mapping[str, tuple[int, ...]]  # input name -> its dynamic dims


def map_inputs(
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


def collect_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, "torch.Tensor"]:
    found: dict[str, torch.Tensor] = {}

    def grab(name: str, t: "torch.Tensor") -> "torch.Tensor":
        found[name] = t
        return t

    map_inputs(args, kwargs, grab)
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


def resolve_dynamic(dynamic: Any, inputs: Mapping[str, "torch.Tensor"]) -> dict[str, tuple[int, ...]]:
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


def probe_inputs(args: Args, kwargs: Kwargs, dyn: Dyn) -> tuple[Args, Kwargs]:
    def shrink(name: str, t: "torch.Tensor") -> "torch.Tensor":
        for d in dyn.get(name, ()):
            t = _resize(t, d, _probe_size(t.shape[d]))
        return t

    return map_inputs(args, kwargs, shrink)


def detached(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return map_inputs(args, kwargs, lambda _n, t: t.detach())
