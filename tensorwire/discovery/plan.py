"""``Plan``: the specs one stage exchanges, grouped, immutable, printable as a table.

:func:`tensorwire.discovery.discover` builds it; the names and groups are described in
:mod:`tensorwire.discovery`.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Iterator

from tensorwire.errors import ConfigError, NotFoundError, SpecError
from tensorwire.spec import TensorSpec

__all__ = ["Plan", "METHODS"]

#: The tracers :func:`~tensorwire.discovery.discover` tries, in order (the values of ``Plan.method``).
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
