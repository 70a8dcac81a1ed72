"""Rows of a table sharded by rows: get_rows, put_rows and add_rows over the daemons that hold its shards.

A read whose daemons all share this host's memory is one gather by this
process over their slots, mapped side by side in a
:class:`~tensorwire.serve.client.window.RowWindow` (no per-daemon parts, no
reordering pass); every other read runs each daemon's part in parallel (on
:class:`~tensorwire.serve.client.daemons.Daemons`) and puts the rows in the
caller's order. A row update sends each daemon its part in parallel, each
value row copied once, from the caller's tensor straight to its daemon.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.buffers import as_bytes
from tensorwire.errors import SpecError
from tensorwire.serve.client.common import TensorStat
from tensorwire.serve.client.daemons import Daemons, Task
from tensorwire.serve.client.sharding import RowSplit
from tensorwire.serve.client.tables import Buffers, Table, check_out, same
from tensorwire.serve.client.window import RowWindow
from tensorwire.serve.client.window import supported as window_supported
from tensorwire.serve.protocol.shm import SHM_DIR, Copier, ShmError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.client import Client

__all__ = ["ShardedRows"]

log = logging.getLogger(__name__)

#: Tables whose shards a client keeps mapped side by side (:class:`RowWindow`); past it, the least recently read
#: is unmapped.
MAX_WINDOWS = 32


class ShardedRows:
    """The row operations of a sharded client (see the module docstring).

    ``sharded(name, table, tasks, read)``: the client's way to run per-shard tasks, each daemon's client
    expecting its shard's layout.
    """

    def __init__(self, daemons: Daemons, sharded: Callable[[str, Table, list[Task], bool], list[Any]]) -> None:
        self.daemons = daemons
        self._sharded = sharded
        self.bufs = Buffers()
        #: name -> (the table, its shards mapped side by side), least recently read first
        self._windows: "collections.OrderedDict[str, tuple[Table, RowWindow]]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._copier: Copier | None = None  # made on the first gather over a window
        self._copy_lock = threading.Lock()

    def update(self, name: str, t: Table, idx: "torch.Tensor", values: "torch.Tensor", *, add: bool) -> TensorStat:
        """put_rows / add_rows of table ``t``: each daemon gets its part in parallel; a value row is copied once,
        from ``values`` straight to its daemon (its shared-memory scratch or the bytes sent)."""
        split = RowSplit(idx, t.rows, self.daemons.n, t.starts)
        order = split.order
        parts = split.parts or [(0, idx, 0, 0)]  # nothing to write: shard 0 still checks the values' spec

        def part(local: "torch.Tensor", a: int, b: int) -> "Callable[[Client], Any]":
            if order is None:
                return lambda c: c.update_rows(name, local, values[a:b], add=add)
            return lambda c: c.update_rows(name, local, values, add=add, pick=order[a:b])

        stats = self._sharded(name, t, [(k, part(local, a, b)) for k, local, a, b in parts], False)
        for (k, *_), s in zip(parts, stats):
            t.versions[k] = s.version
        return t.stat()

    def get_rows(self, name: str, t: Table, idx: "torch.Tensor", out: "torch.Tensor | None") -> "torch.Tensor":
        """Rows ``idx`` of table ``t``, in the order given: one gather over the daemons' shared memory
        (:meth:`fused`) where it can be made, else each daemon's rows put in order here (:meth:`split`)."""
        got = self.fused(name, t, idx, out)
        return got if got is not None else self.split(name, t, idx, out)

    def get(self, name: str, t: Table, out: "torch.Tensor | None") -> "torch.Tensor":
        """All of table ``t``: each shard (one whole version of it) straight into its rows of the result."""
        import torch

        spec = t.spec
        dest = out
        if out is not None:
            check_out(spec, out, spec.shape)
            if not (out.device.type == "cpu" and out.is_contiguous()):
                dest = None
        if dest is None:
            dest = torch.empty(spec.shape, dtype=spec.torch_dtype)
        tasks = [(k, _get(name, dest[a:b])) for k, (a, b) in enumerate(t.ranges) if b > a]
        if tasks:
            self._sharded(name, t, tasks, True)
        if out is not None and dest is not out:
            out.copy_(dest)
            return out
        return dest

    def close(self) -> None:
        with self._lock:
            wins = [w for _, w in self._windows.values()]
            self._windows.clear()
        for w in wins:
            _close_window(w)
        if self._copier is not None:
            self._copier.close()

    def fused(self, name: str, t: Table, idx: "torch.Tensor", out: "torch.Tensor | None") -> "torch.Tensor | None":
        """get_rows in one gather over the daemons' shared memory; None where that cannot be done.

        Each daemon's slot is mapped into the table's :class:`~tensorwire.serve.client.window.RowWindow`,
        so a row of the table is a row of one array and the rows of every shard go to their places in
        the result in one ``take``. Every daemon's version stays put meanwhile: read through a lease of
        its client (no request; the gather counts only if no writer came, else it is made again
        pinned), or pinned by a request of its client, whose lock this holds until the gather is done.
        """
        import numpy as np

        spec = t.spec
        n = idx.numel()
        row_bytes = spec.nbytes // t.rows if t.rows else 0
        if not n or not row_bytes or not window_supported():
            return None
        inp = idx.numpy()
        # bin 0: below row 0, bin k + 1: shard k, bin n + 1: past the last row (one pass finds both)
        bins = np.searchsorted(t.edges, inp, side="right")
        counts = np.bincount(bins, minlength=self.daemons.n + 2).tolist()
        if counts[0] or counts[-1]:
            lo, hi = int(inp.min()), int(inp.max())
            raise SpecError(f"index: row {lo if lo < 0 else hi} out of range for a tensor of {t.rows} rows")
        counts = counts[1:-1]
        ks = [k for k in range(self.daemons.n) if counts[k]]
        clients = [self.daemons.on(k, lambda c: c) for k in ks]
        if not all(c.shm for c in clients):
            return None
        win = self._window(name, t, row_bytes)
        if win is None:
            return None
        shape = (idx.numel(), *spec.shape[1:])
        if out is not None:
            check_out(spec, out, shape)
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dest = out if direct else self.bufs.take((name, "rows"), shape, spec.torch_dtype)
        assert dest is not None
        dest_rows = as_bytes(dest).numpy().reshape(n, row_bytes)
        rows = None
        locks = [c.lock for c in clients]
        locks.append(win.lock)
        for pin_all in (False, True):
            for lk in locks:  # in shard order, the window last: no two callers wait on each other
                lk.acquire()
            try:
                if win.closed:
                    return None
                views = []
                for k, c in zip(ks, clients):
                    c.expect_layout(name, t.layouts[k])
                    v = None if pin_all else c.shm_lease(name)
                    if v is None:
                        v = self.daemons.on(k, _pin(name, counts[k]))
                    if v is None or v.spec.shape != t.shard_shapes[k] or v.spec.dtype != spec.dtype:
                        return None  # not in shared memory (or not what this client knows): per daemon
                    views.append(v)
                try:
                    for k, v in zip(ks, views):
                        win.bind(k, v)
                except ShmError as exc:
                    log.debug("%s: its shards cannot be mapped side by side (%s); gathering per daemon", name, exc)
                    return None
                if rows is None:
                    rows = inp + win.delta[bins - 1]
                leased = all(v.cells is not None for v in views)
                assert self._copier is not None
                with self._copy_lock:
                    self._copier.take(win.array, rows, dest_rows, pool=leased)
                if not all(v.valid() for v in views):
                    continue  # a writer came while this copied out of a lease: once more, pinned
                for k, c in zip(ks, clients):
                    c.shm_count(counts[k] * row_bytes, leased=leased)
                break
            finally:
                for lk in reversed(locks):
                    lk.release()
        if out is not None and dest is not out:
            out.copy_(dest)
            return out
        return dest

    def _window(self, name: str, t: Table, row_bytes: int) -> RowWindow | None:
        """The table's window (made on first use; None: one cannot be made here)."""
        with self._lock:
            if self._copier is None:
                self._copier = Copier()
            got = self._windows.get(name)
            if got is not None and (got[0] is t or same(got[0], t)) and not got[1].closed:
                self._windows.move_to_end(name)
                return got[1]
        try:
            win = RowWindow([b - a for a, b in t.ranges], row_bytes, [a for a, _ in t.ranges])
        except ShmError as exc:
            log.debug("%s: no window over its shards (%s)", name, exc)
            return None
        old: list[RowWindow] = []
        with self._lock:
            got = self._windows.pop(name, None)
            if got is not None:
                old.append(got[1])
            self._windows[name] = (t, win)
            while len(self._windows) > MAX_WINDOWS:
                old.append(self._windows.popitem(last=False)[1][1])
            for nm, (_, w) in list(self._windows.items()):  # tables deleted meanwhile (by anyone)
                if w is not win and not any(os.path.exists(os.path.join(SHM_DIR, r)) for r in w.regions()):
                    old.append(self._windows.pop(nm)[1])
        for w in old:
            _close_window(w)
        return win

    def drop_window(self, name: str) -> None:
        with self._lock:
            got = self._windows.pop(name, None)
        if got is not None:
            _close_window(got[1])

    def split(self, name: str, t: Table, idx: "torch.Tensor", out: "torch.Tensor | None") -> "torch.Tensor":
        """get_rows with each daemon gathering its own rows, in parallel (in shard order, then put in the
        caller's order here: the rows arrive as one message per daemon)."""
        spec = t.spec
        split = RowSplit(idx, t.rows, self.daemons.n, t.starts)
        shape = (split.n, *spec.shape[1:])
        if out is not None:
            check_out(spec, out, shape)
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dtype = spec.torch_dtype
        if split.order is None:
            dest = out if direct else self.bufs.take((name, "rows"), shape, dtype)
        else:
            # rows in shard order (a scratch buffer of this call), then into the caller's order
            dest = self.bufs.take((name, "sorted", threading.get_ident()), shape, dtype)
        assert dest is not None
        if split.parts:
            self._sharded(name, t, [(k, _get_rows(name, local, dest[a:b])) for k, local, a, b in split.parts], True)
        if split.order is not None:
            if direct:
                assert out is not None
                return split.gather(dest, out)
            result = split.gather(dest, self.bufs.take((name, "rows"), shape, dtype))
            del dest
        else:
            result = dest
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result


def _get(name: str, dest: "torch.Tensor") -> "Callable[[Client], Any]":
    return lambda c: c.get(name, out=dest)


def _pin(name: str, rows: int) -> "Callable[[Client], Any]":
    return lambda c: c.shm_pin(name, rows)


def _get_rows(name: str, local: "torch.Tensor", dest: "torch.Tensor") -> "Callable[[Client], Any]":
    return lambda c: c.get_rows(name, local, out=dest)


def _close_window(w: RowWindow) -> None:
    with w.lock:  # a gather out of it finishes first
        w.close()
