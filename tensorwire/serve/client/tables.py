"""What a sharded client knows of its tables, and what it hands back about them.

- :class:`Table`: a table sharded by rows, as this client's daemon list lays it
  out (the spec, each shard's layout and rows, the versions last seen);
- :class:`ShardedStat` / :class:`ShardStat`: the stat of such a table and of
  each of its shards;
- :class:`Buffers`: result buffers reused across calls (a fresh one per call
  costs its page faults every time).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from tensorwire.errors import ShapeMismatchError, SpecError
from tensorwire.serve.client.common import TensorStat
from tensorwire.serve.client.context import use_count
from tensorwire.serve.client.sharding import owner
from tensorwire.serve.protocol.layout import ShardLayout
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "Table",
    "ShardStat",
    "ShardedStat",
    "Buffers",
    "same",
    "check_out",
    "layouts_of",
    "sharded_stat",
    "merge_stats",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardStat:
    """One shard of a sharded table: the daemon holding it, its layout, and what it holds."""

    address: str
    layout: ShardLayout
    stat: TensorStat


@dataclass(frozen=True)
class ShardedStat(TensorStat):
    """A table sharded by rows: ``spec`` is the whole table's; ``version`` the sum of its shards' versions
    (it grows with every write); ``nbytes`` the whole table's; ``shards`` one :class:`ShardStat` per shard found."""

    shards: tuple[ShardStat, ...] = ()


class Table:
    """What a client knows of a sharded table: its spec and the layout of each shard under this client's list.

    ``starts``: the first row of shards 1 .. n - 1; ``edges``: 0, those, and the row count (a row's
    ``searchsorted`` bin in ``edges`` is 0 below the table, ``k + 1`` in shard ``k``, ``n + 1`` past it).
    """

    __slots__ = ("spec", "layouts", "ranges", "starts", "edges", "versions", "shard_shapes")

    def __init__(self, spec: TensorSpec, layouts: list[ShardLayout]) -> None:
        import numpy as np

        self.spec = spec
        self.layouts = layouts
        self.ranges = [(la.row_start, la.row_stop) for la in layouts]
        self.starts = np.array([a for a, _ in self.ranges[1:]], dtype=np.int64)
        self.edges = np.array([0, *self.starts.tolist(), spec.shape[0]], dtype=np.int64)
        self.versions = [0] * len(layouts)
        self.shard_shapes = [(b - a, *spec.shape[1:]) for a, b in self.ranges]

    @property
    def rows(self) -> int:
        return self.spec.shape[0]

    def shard_spec(self, k: int) -> TensorSpec:
        a, b = self.ranges[k]
        return TensorSpec(self.spec.name, (b - a, *self.spec.shape[1:]), self.spec.dtype)

    def stat(self) -> TensorStat:
        return TensorStat(self.spec, sum(self.versions), self.spec.nbytes)


def layouts_of(fingerprint: bytes, n: int, rows: int) -> list[ShardLayout]:
    """The layouts of a table of ``rows`` rows sharded over a list of ``n`` daemons with that fingerprint."""
    return [ShardLayout.of(fingerprint, n, k, rows) for k in range(n)]


def sharded_stat(
    t: Table, stats: Sequence[TensorStat], addresses: Sequence[str], ks: Sequence[int] = ()
) -> ShardedStat:
    """The stat of table ``t`` from those of its shards ``ks`` (all, in order, when empty)."""
    ks = ks or range(len(stats))
    shards = tuple(ShardStat(addresses[k], t.layouts[k], s) for k, s in zip(ks, stats))
    return ShardedStat(t.spec, sum(s.version for s in stats), t.spec.nbytes, None, shards)


def merge_stats(
    per: Sequence[dict[str, TensorStat]], addresses: Sequence[str], fingerprint: bytes
) -> dict[str, TensorStat]:
    """What the daemons of a list hold (``per``: each one's stats, in list order), by name: whole tensors (a
    name on several: its owner's), and the list's sharded tables as :class:`ShardedStat`. Shards of another
    list's tables are left out."""
    n = len(addresses)
    out: dict[str, TensorStat] = {}
    shards: dict[str, dict[int, TensorStat]] = {}
    for k, d in enumerate(per):
        for nm, st in d.items():
            la = st.layout
            if la is None:
                if nm not in out or owner(nm, addresses) == k:
                    out[nm] = st
            elif la.fingerprint == fingerprint and la.shards == n and la.index == k:
                shards.setdefault(nm, {})[k] = st
            else:
                log.debug("%s on %s is %s: not this client's list", nm, addresses[k], la.describe())
    for nm, got in shards.items():
        any_st = next(iter(got.values()))
        la = any_st.layout
        assert la is not None
        t = Table(
            TensorSpec(nm, (la.rows, *any_st.spec.shape[1:]), any_st.spec.dtype), layouts_of(fingerprint, n, la.rows)
        )
        ks = sorted(got)
        out[nm] = sharded_stat(t, [got[k] for k in ks], addresses, ks)
    return dict(sorted(out.items()))


def same(a: Table | None, b: Table | None) -> bool:
    """Whether two tables (or two "whole tensor" answers) are laid out alike."""
    if a is None or b is None:
        return a is b
    return a.spec == b.spec and a.layouts == b.layouts


class Buffers:
    """Reusable host buffers by key: one is handed out again only when no tensor but the pool's refers to it.

    A fresh 2 MiB ``torch.empty`` per call costs its page faults every time (~1 ms for a 4,096 x 128 float32
    result on the 2-core VM, more than the gather itself), as the one-daemon client's per-name buffers avoid.
    """

    def __init__(self) -> None:
        self._bufs: dict[Any, tuple["torch.Tensor", int | None]] = {}
        self._lock = threading.Lock()

    def take(self, key: Any, shape: tuple[int, ...], dtype: "torch.dtype") -> "torch.Tensor":
        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            got = self._bufs.get(key)
            if got is not None and got[0].numel() >= nbytes and got[1] is not None and use_count(got[0]) == got[1]:
                raw = got[0]
            else:
                raw = torch.empty(max(nbytes, 1), dtype=torch.uint8)
                if len(self._bufs) >= 256:
                    self._bufs.clear()
                self._bufs[key] = (raw, use_count(raw))
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return raw[:nbytes].view(dtype).view(shape)

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


def check_out(spec: TensorSpec, out: "torch.Tensor", shape: tuple[int, ...]) -> None:
    """``out=`` must be a tensor of ``shape`` and the table's dtype.

    Raises:
        SpecError: not a tensor. ShapeMismatchError: another shape or dtype (naming both).
    """
    import torch

    if not isinstance(out, torch.Tensor):
        raise SpecError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != spec.torch_dtype:
        raise ShapeMismatchError(
            f"{spec.name}: out= is {str(out.dtype).removeprefix('torch.')}{list(out.shape)}, "
            f"the stored tensor gives {spec.dtype}{list(shape)}"
        )
