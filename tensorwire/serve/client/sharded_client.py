"""``ShardedClient``: one client over N ``tensorwire serve`` daemons.

::

    import tensorwire as tw

    c = tw.Client(["h1:7100", "h2:7100", "h3:7100"], token=...)   # or tw.Client("dns:///tw-serve.ns.svc:7100")
    c.put("weights", w)                          # a whole tensor, on the daemon its name hashes to
    c.put("emb", table, shard="rows")            # rows split over the three daemons
    rows = c.get_rows("emb", idx)                # each daemon gathers its rows, in parallel
    c.add_rows("emb", idx, grads)                # duplicates accumulate, as index_add_

Placement is a pure function of the ordered daemon list
(:mod:`tensorwire.serve.client.sharding`): a whole tensor lives on the daemon of the
highest rendezvous weight for its name; a table put with ``shard="rows"`` has
shard ``k`` -- the contiguous rows :func:`~tensorwire.serve.protocol.layout.row_ranges`
gives it -- on daemon ``k``. Each daemon is reached through its own
:class:`tensorwire.serve.client.Client` (its fastest path: shared memory on this
host, UCX or TCP otherwise); the parts of an operation that spans daemons run
on them in parallel and the result is what one daemon holding the whole table
would return.

Layout check: every shard is stored with its :class:`~tensorwire.serve.protocol.layout.ShardLayout`
(shard count, index, rows, the daemon list's fingerprint) and every request of
its data carries the layout this client expects. A daemon holding something
else refuses (:class:`~tensorwire.errors.LayoutMismatchError`), so a client
over another list -- other members, another order -- never reads or writes the
wrong rows. There is no reshard command.

Consistency: each shard an operation touches is read whole (one version of
it) or written atomically, as on one daemon; an operation spanning shards is
not atomic across them (a reader may see shard 0 after a row update and shard
1 before it; a write that fails on one daemon may have been applied on the
others, and says so in its error).

A lost daemon: an operation that needs it raises
:class:`~tensorwire.errors.ShardLostError` (a ``PeerLostError``) naming its
address, within the client's timeout; operations on the other daemons go on;
once it is back (restored from its snapshot) the next call reconnects.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from tensorwire.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    LayoutMismatchError,
    NotFoundError,
    ShapeMismatchError,
    ShardLostError,
    SpecError,
    TransportError,
    VersionMismatchError,
)
from tensorwire.serve.client.common import SnapshotInfo, TensorStat
from tensorwire.serve.client.sharding import RowSplit, owner, resolve_daemons
from tensorwire.serve.client.window import RowWindow
from tensorwire.serve.client.window import supported as window_supported
from tensorwire.buffers import as_bytes
from tensorwire.serve.protocol.shm import SHM_DIR, Copier, ShmError
from tensorwire.serve.protocol.tls import TLSConfig
from tensorwire.serve.protocol.common import as_index
from tensorwire.serve.protocol.layout import ShardLayout, check_layout, fingerprint
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.client import Client

__all__ = ["ShardedClient", "ShardedStat", "ShardStat"]

log = logging.getLogger(__name__)

#: Names whose placement a client remembers (whole or sharded, and the table's rows); past it, it forgets them all.
_MAX_TABLES = 1 << 16
#: Tables whose shards a client keeps mapped side by side (:class:`RowWindow`); past it, the least recently read
#: is unmapped.
_MAX_WINDOWS = 32


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


class _Buffers:
    """Reusable host buffers by key: one is handed out again only when no tensor but the pool's refers to it.

    A fresh 2 MiB ``torch.empty`` per call costs its page faults every time (~1 ms for a 4,096 x 128 float32
    result on the 2-core VM, more than the gather itself), as the one-daemon client's per-name buffers avoid.
    """

    def __init__(self) -> None:
        self._bufs: dict[Any, tuple["torch.Tensor", int | None]] = {}
        self._lock = threading.Lock()

    def take(self, key: Any, shape: tuple[int, ...], dtype: "torch.dtype") -> "torch.Tensor":
        import torch

        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            got = self._bufs.get(key)
            if got is not None and got[0].numel() >= nbytes and got[1] is not None and _use_count(got[0]) == got[1]:
                raw = got[0]
            else:
                raw = torch.empty(max(nbytes, 1), dtype=torch.uint8)
                if len(self._bufs) >= 256:
                    self._bufs.clear()
                self._bufs[key] = (raw, _use_count(raw))
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        return raw[:nbytes].view(dtype).view(shape)

    def clear(self) -> None:
        with self._lock:
            self._bufs.clear()


def _use_count(t: "torch.Tensor") -> int | None:
    import torch

    fn = getattr(torch._C, "_storage_Use_Count", None)
    return None if fn is None else int(fn(t.untyped_storage()._cdata))


class _Table:
    """What a client knows of a sharded table: its spec and the layout of each shard under this client's list."""

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


class ShardedClient:
    """A client over an ordered list of ``tensorwire serve`` daemons. See the module docstring.

    Args:
        daemons: ``["host:port", ...]`` (their order is part of the layout of
            every sharded table) or ``"dns:///name:port"`` (every address of
            ``name``, ordered: :func:`tensorwire.serve.client.sharding.resolve_daemons`).
        token, tls, transport, timeout, connect_timeout, name, data_requests:
            as :class:`tensorwire.serve.client.Client`, for every daemon.
        reverse_dns: name the addresses a ``dns:///`` name resolves to by their
            reverse-DNS names (stable across pod restarts in a StatefulSet).
        parallel: run the parts of an operation on several daemons in
            threads (True), or one after the other in the calling thread
            (False). None (default): threads, except for a read (get,
            get_rows) whose daemons are all reached through shared memory --
            then each part is a copy by this process of a fraction of a
            millisecond, and handing it to another thread cost more than it
            saved (measured on the 2-core VM: bench/bench_sharded.py). Writes
            keep their threads: each daemon applies its part itself.

    Raises:
        AuthError, ConfigError: from any daemon (nothing is kept open).
        ShardLostError: no daemon could be reached. A daemon that cannot be
            reached while others can is only logged: operations that need it
            raise ShardLostError until it is back.
    """

    def __init__(
        self,
        daemons: "str | Sequence[str]",
        *,
        token: str | None = None,
        tls: "TLSConfig | Mapping[str, Any] | bool | None" = None,
        transport: str = "auto",
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        name: str = "",
        data_requests: bool = True,
        reverse_dns: bool = True,
        parallel: bool | None = None,
        single: "type[Client] | None" = None,
    ) -> None:
        if not timeout or timeout <= 0:
            raise ConfigError("timeout must be positive")
        if single is None:
            raise ConfigError(
                "make a sharded client with tw.Client([address, ...]) (it passes the one-daemon "
                "client class as single=)"
            )
        self._single = single
        #: The ordered daemon list (normalised ``host:port``).
        self.addresses: list[str] = resolve_daemons(daemons, reverse=reverse_dns)
        self.address = ",".join(self.addresses)
        #: The list's fingerprint: every shard this client writes records it.
        self.fingerprint: bytes = fingerprint(self.addresses)
        self._n = n = len(self.addresses)
        self._kw: dict[str, Any] = dict(
            token=token,
            tls=TLSConfig.coerce(tls),
            transport=transport,
            timeout=timeout,
            connect_timeout=connect_timeout,
            name=name,
            data_requests=data_requests,
        )
        self._clients: list[Client | None] = [None] * n
        self._connecting = [threading.Lock() for _ in range(n)]
        self._tables: dict[str, _Table | None] = {}  # name -> sharded table, or None: a whole tensor
        self._lock = threading.Lock()
        self._closed = False
        self._parallel = parallel
        self._bufs = _Buffers()
        #: name -> (the table, its shards mapped side by side), least recently read first
        self._windows: "collections.OrderedDict[str, tuple[_Table, RowWindow]]" = collections.OrderedDict()
        self._copier: Copier | None = None  # made on the first gather over a window
        self._copy_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="tensorwire-shard") if n > 1 else None
        outcomes = self._fan([(k, lambda c: None) for k in range(n)], settle=True)
        errs = [e for e in outcomes if isinstance(e, BaseException)]
        fatal = [e for e in errs if isinstance(e, (AuthError, ConfigError, VersionMismatchError))]
        if fatal or len(errs) == n:
            self.close()
            raise (fatal or errs)[0]
        for e in errs:
            log.warning("sharded client: %s; operations that need it fail until it is back", e)

    # -- daemons -------------------------------------------------------------------------------
    def _lost(self, k: int, exc: BaseException) -> ShardLostError:
        a = self.addresses[k]
        return ShardLostError(f"daemon {a} (number {k} of {self._n}) is unreachable: {exc}", address=a)

    def _client(self, k: int) -> Client:
        c = self._clients[k]
        if c is not None:
            return c
        with self._connecting[k]:
            c = self._clients[k]
            if c is None:
                if self._closed:
                    raise ClosedError("client is closed")
                try:
                    c = self._single(self.addresses[k], **self._kw)
                except TransportError as exc:
                    raise self._lost(k, exc) from exc
                if not c.layout_checks:
                    c.close()
                    raise ConfigError(
                        f"daemon {self.addresses[k]} does not record shard layouts (an older "
                        f"tensorwire serve): a client over several daemons needs every one to"
                    )
                self._clients[k] = c
            return c

    def _on(self, k: int, fn: Callable[[Client], Any]) -> Any:
        """``fn(client of daemon k)``; a transport failure becomes ShardLostError naming the daemon."""
        try:
            return fn(self._client(k))
        except ShardLostError:
            raise
        except TransportError as exc:
            raise self._lost(k, exc) from exc

    def _fan(
        self, tasks: list[tuple[int, Callable[[Client], Any]]], *, settle: bool = False, read: bool = False
    ) -> list[Any]:
        """Run ``fn`` on each daemon of ``tasks`` (in parallel when more than one); their results, in order.

        Every task runs to its end; then the first error is raised (``settle``: returned in its place).
        ``read``: the tasks are reads, which may run in this thread (see ``parallel``).
        """
        if len(tasks) == 1 and not settle:
            k, fn = tasks[0]
            return [self._on(k, fn)]
        if read and not settle and not self._threads([k for k, _ in tasks]):
            return [self._on(k, fn) for k, fn in tasks]  # an error stops the rest (reads: nothing to finish)

        def run(k: int, fn: Callable[[Client], Any]) -> Any:
            try:
                return self._on(k, fn)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                return _Failed(exc)

        # the first part in this thread, the others on the pool's (n - 1 threads: one per other daemon)
        futs = [self._pool.submit(run, k, fn) for k, fn in tasks[1:]] if self._pool is not None else []
        out = [run(*tasks[0])] if tasks else []
        out += [f.result() for f in futs]
        if settle:
            return [r.exc if isinstance(r, _Failed) else r for r in out]
        for r in out:
            if isinstance(r, _Failed):
                raise r.exc
        return out

    def _threads(self, ks: Sequence[int]) -> bool:
        """Whether parts on daemons ``ks`` run in threads (see ``parallel``)."""
        if self._parallel is not None:
            return self._parallel
        for k in ks:
            c = self._clients[k]
            if c is None or not c.shm:
                return True
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client is closed")

    # -- placement -------------------------------------------------------------------------------
    def owner(self, name: str) -> str:
        """The daemon that holds (or would hold) whole tensor ``name``."""
        return self.addresses[owner(name, self.addresses)]

    def _layouts(self, rows: int) -> list[ShardLayout]:
        return [ShardLayout.of(self.fingerprint, self._n, k, rows) for k in range(self._n)]

    def _remember(self, name: str, table: _Table | None) -> None:
        with self._lock:
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            self._tables[name] = table

    def _forget(self, name: str) -> None:
        with self._lock:
            self._tables.pop(name, None)

    def _table(self, name: str) -> _Table | None:
        """The sharded table ``name`` (None: a whole tensor), asked of its owner the first time.

        Raises:
            NotFoundError: the owner holds nothing of that name.
            LayoutMismatchError: it holds a shard of another daemon list's table.
        """
        self._check_open()
        with self._lock:
            if name in self._tables:
                return self._tables[name]
        k = owner(name, self.addresses)
        st = self._on(k, lambda c: c.stat(name))
        if st.layout is None:
            self._remember(name, None)
            return None
        rows = st.layout.rows
        check_layout(
            name, st.layout, ShardLayout.of(self.fingerprint, self._n, k, rows), where=f"daemon {self.addresses[k]}"
        )
        t = _Table(TensorSpec(name, (rows, *st.spec.shape[1:]), st.spec.dtype), self._layouts(rows))
        t.versions[k] = st.version
        self._remember(name, t)
        return t

    def _whole(self, name: str, fn: Callable[[Client], Any]) -> Any:
        """``fn`` on the owner of whole tensor ``name``, expecting a whole tensor there."""

        def call(c: Client) -> Any:
            c.expect_layout(name, None)
            return fn(c)

        return self._on(owner(name, self.addresses), call)

    def _sharded(
        self, name: str, t: _Table, tasks: list[tuple[int, Callable[[Client], Any]]], *, read: bool = False
    ) -> list[Any]:
        """Run per-shard tasks of table ``t``, each client expecting its shard's layout; a layout refusal makes
        this client forget what it knew of ``name`` (the next call asks again)."""

        def bind(k: int, fn: Callable[[Client], Any]) -> Callable[[Client], Any]:
            def call(c: Client) -> Any:
                c.expect_layout(name, t.layouts[k])
                return fn(c)

            return call

        try:
            return self._fan([(k, bind(k, fn)) for k, fn in tasks], read=read)
        except LayoutMismatchError:
            self._forget(name)
            raise

    def _read(self, name: str, whole: Callable[[Client], Any], sharded: Callable[[_Table], Any]) -> Any:
        """A read of ``name``: once more after a layout refusal if the table turned out to have changed."""
        for attempt in (0, 1):
            t = self._table(name)
            try:
                if t is None:
                    return self._whole(name, whole)
                return sharded(t)
            except LayoutMismatchError:
                self._forget(name)
                self._drop_window(name)
                if attempt or _same(self._table(name), t):
                    raise
                log.debug("%s changed its layout; reading again", name)
            except NotFoundError:
                self._drop_window(name)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the API ------------------------------------------------------------------------------------
    def put(self, name: str, tensor: "torch.Tensor", *, shard: str | None = None) -> TensorStat:
        """Store ``tensor`` under ``name``: whole on its owner, or with ``shard="rows"`` split by rows over all daemons.

        A sharded put first declares every shard (each daemon reserves its
        memory, checks ``--max-bytes`` and the layout), then writes them in
        parallel; a put that fails on one daemon may have written the others.

        Raises:
            LayoutMismatchError: ``name`` exists with another layout (delete it first).
            ShapeMismatchError, ResourceExhaustedError: as Client.put, from any daemon.
            ShardLostError: a daemon it needs is unreachable.
        """
        import torch

        self._check_open()
        if not isinstance(tensor, torch.Tensor):
            raise SpecError(f"put: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if shard is None:
            st = self._whole(name, lambda c: c.put(name, tensor))
            self._remember(name, None)
            return st
        if shard != "rows":
            raise ConfigError(f"shard must be None or 'rows', got {shard!r}")
        if tensor.dim() < 1:
            raise SpecError(f"{name}: a 0-d tensor has no rows to shard")
        t = self._declare_all(TensorSpec(name, tuple(tensor.shape), tensor.dtype))
        stats = self._sharded(
            name, t, [(k, lambda c, k=k: c.put(name, tensor[t.ranges[k][0] : t.ranges[k][1]])) for k in range(self._n)]
        )
        t.versions = [s.version for s in stats]
        self._remember(name, t)
        return self._sharded_stat(t, stats)

    def declare(self, spec: TensorSpec, *, shard: str | None = None) -> TensorStat:
        """Declare ``spec`` (whole on its owner, or ``shard="rows"`` over all daemons); see Client.declare."""
        self._check_open()
        if shard is None:
            return self._whole(spec.name, lambda c: c.declare(spec))
        if shard != "rows" or not spec.shape:
            raise ConfigError("declare: shard must be None or 'rows' (with at least one dimension)")
        t = self._declare_all(spec)
        self._remember(spec.name, t)
        return self._sharded_stat(
            t, [TensorStat(t.shard_spec(k), v, t.shard_spec(k).nbytes, t.layouts[k]) for k, v in enumerate(t.versions)]
        )

    def _declare_all(self, spec: TensorSpec) -> _Table:
        """Declare every shard of ``spec`` (each daemon checks the layout and reserves its memory under
        ``--max-bytes``). If one refuses, the shards declared here that hold no data are deleted again."""
        name = spec.name
        t = _Table(spec, self._layouts(spec.shape[0]))
        declared = self._fan(
            [(k, _bound(t, name, k, lambda c, k=k: c.declare(t.shard_spec(k)))) for k in range(self._n)], settle=True
        )
        failed = [e for e in declared if isinstance(e, BaseException)]
        if failed:
            undo = [
                (k, _bound(t, name, k, lambda c: c.delete(name)))
                for k, st in enumerate(declared)
                if isinstance(st, TensorStat) and st.version == 0
            ]
            if undo:
                self._fan(undo, settle=True)
            self._forget(name)
            raise failed[0]
        t.versions = [st.version for st in declared]
        return t

    def get(self, name: str, *, out: "torch.Tensor | None" = None) -> "torch.Tensor":
        """The current version of ``name``: a whole tensor, or a sharded table assembled from its shards
        (each one a whole version of itself; see the module docstring)."""

        def sharded(t: _Table) -> "torch.Tensor":
            import torch

            spec = t.spec
            dest = out
            if out is not None:
                _check_out(spec, out, spec.shape)
                if not (out.device.type == "cpu" and out.is_contiguous()):
                    dest = None
            if dest is None:
                dest = torch.empty(spec.shape, dtype=spec.torch_dtype)
            tasks = [(k, lambda c, a=a, b=b: c.get(name, out=dest[a:b])) for k, (a, b) in enumerate(t.ranges) if b > a]
            if tasks:
                self._sharded(name, t, tasks, read=True)
            if out is not None and dest is not out:
                out.copy_(dest)
                return out
            return dest

        return self._read(name, lambda c: c.get(name, out=out), sharded)

    def get_rows(self, name: str, index: Any, *, out: "torch.Tensor | None" = None) -> "torch.Tensor":
        """Rows ``index`` of dim 0 of ``name``, in the order given.

        With every daemon it needs on this host (shared memory), one gather by this process over their
        slots, straight into the result (:meth:`_fused_rows`); else each daemon gathers its own rows, in
        parallel, and they are put in the caller's order here.

        Raises:
            SpecError: an index out of range (nothing is sent).
        """
        idx = as_index(index)

        def sharded(t: _Table) -> "torch.Tensor":
            got = self._fused_rows(name, t, idx, out)
            return got if got is not None else self._split_rows(name, t, idx, out)

        return self._read(name, lambda c: c.get_rows(name, idx, out=out), sharded)

    def _fused_rows(
        self, name: str, t: _Table, idx: "torch.Tensor", out: "torch.Tensor | None"
    ) -> "torch.Tensor | None":
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
        counts = np.bincount(bins, minlength=self._n + 2).tolist()
        if counts[0] or counts[-1]:
            lo, hi = int(inp.min()), int(inp.max())
            raise SpecError(f"index: row {lo if lo < 0 else hi} out of range for a tensor of {t.rows} rows")
        counts = counts[1:-1]
        ks = [k for k in range(self._n) if counts[k]]
        clients = [self._on(k, lambda c: c) for k in ks]
        if not all(c.shm for c in clients):
            return None
        win = self._window(name, t, row_bytes)
        if win is None:
            return None
        shape = (idx.numel(), *spec.shape[1:])
        if out is not None:
            _check_out(spec, out, shape)
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dest = out if direct else self._bufs.take((name, "rows"), shape, spec.torch_dtype)
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
                        v = self._on(k, lambda c, k=k: c.shm_pin(name, counts[k]))
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

    def _window(self, name: str, t: _Table, row_bytes: int) -> RowWindow | None:
        """The table's window (made on first use; None: one cannot be made here)."""
        with self._lock:
            if self._copier is None:
                self._copier = Copier()
            got = self._windows.get(name)
            if got is not None and (got[0] is t or _same(got[0], t)) and not got[1].closed:
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
            while len(self._windows) > _MAX_WINDOWS:
                old.append(self._windows.popitem(last=False)[1][1])
            for nm, (_, w) in list(self._windows.items()):  # tables deleted meanwhile (by anyone)
                if w is not win and not any(os.path.exists(os.path.join(SHM_DIR, r)) for r in w.regions()):
                    old.append(self._windows.pop(nm)[1])
        for w in old:
            _close_window(w)
        return win

    def _drop_window(self, name: str) -> None:
        with self._lock:
            got = self._windows.pop(name, None)
        if got is not None:
            _close_window(got[1])

    def _split_rows(self, name: str, t: _Table, idx: "torch.Tensor", out: "torch.Tensor | None") -> "torch.Tensor":
        """get_rows with each daemon gathering its own rows, in parallel (in shard order, then put in the
        caller's order here: the rows arrive as one message per daemon)."""
        spec = t.spec
        split = RowSplit(idx, t.rows, self._n, t.starts)
        shape = (split.n, *spec.shape[1:])
        if out is not None:
            _check_out(spec, out, shape)
        direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
        dtype = spec.torch_dtype
        if split.order is None:
            dest = out if direct else self._bufs.take((name, "rows"), shape, dtype)
        else:
            # rows in shard order (a scratch buffer of this call), then into the caller's order
            dest = self._bufs.take((name, "sorted", threading.get_ident()), shape, dtype)
        assert dest is not None
        if split.parts:
            self._sharded(
                name,
                t,
                [
                    (k, lambda c, k=k, local=local, a=a, b=b: c.get_rows(name, local, out=dest[a:b]))
                    for k, local, a, b in split.parts
                ],
                read=True,
            )
        if split.order is not None:
            if direct:
                assert out is not None
                return split.gather(dest, out)
            result = split.gather(dest, self._bufs.take((name, "rows"), shape, dtype))
            del dest
        else:
            result = dest
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result

    def put_rows(self, name: str, index: Any, values: "torch.Tensor") -> TensorStat:
        """Overwrite rows ``index`` of ``name`` with ``values`` (indices unique), each shard's part on its daemon."""
        return self._rows(name, index, values, add=False)

    def add_rows(self, name: str, index: Any, values: "torch.Tensor") -> TensorStat:
        """Add ``values`` to rows ``index`` of ``name`` (duplicates accumulate, as ``index_add_``)."""
        return self._rows(name, index, values, add=True)

    def _rows(self, name: str, index: Any, values: "torch.Tensor", *, add: bool) -> TensorStat:
        """put_rows / add_rows: each daemon gets its part in parallel; a value row is copied once, from
        ``values`` straight to its daemon (its shared-memory scratch or the bytes sent)."""
        import torch

        idx = as_index(index)
        if not isinstance(values, torch.Tensor):
            raise SpecError(f"values must be a torch.Tensor, got {type(values).__name__}")
        n = idx.numel()
        if values.dim() < 1 or values.shape[0] != n:
            raise ShapeMismatchError(f"{name}: {n} indices but values of shape {list(values.shape)}")
        t = self._table(name)
        if t is None:
            return self._whole(name, lambda c: c.update_rows(name, idx, values, add=add))
        split = RowSplit(idx, t.rows, self._n, t.starts)
        order = split.order
        parts = split.parts or [(0, idx, 0, 0)]  # nothing to write: shard 0 still checks the values' spec

        def part(local: "torch.Tensor", a: int, b: int) -> Callable[[Client], Any]:
            if order is None:
                return lambda c: c.update_rows(name, local, values[a:b], add=add)
            return lambda c: c.update_rows(name, local, values, add=add, pick=order[a:b])

        stats = self._sharded(name, t, [(k, part(local, a, b)) for k, local, a, b in parts])
        for (k, *_), s in zip(parts, stats):
            t.versions[k] = s.version
        return t.stat()

    def _sharded_stat(self, t: _Table, stats: Sequence[TensorStat], ks: Sequence[int] | None = None) -> ShardedStat:
        ks = range(len(stats)) if ks is None else ks
        shards = tuple(ShardStat(self.addresses[k], t.layouts[k], s) for k, s in zip(ks, stats))
        return ShardedStat(t.spec, sum(s.version for s in stats), t.spec.nbytes, None, shards)

    def stat(self, name: str) -> TensorStat:
        """Spec, version and size of ``name``; for a sharded table a :class:`ShardedStat` listing every shard.

        Raises:
            NotFoundError: no such name. ShardLostError: a daemon holding a shard is unreachable.
        """
        self._forget(name)
        t = self._table(name)
        if t is None:
            return self._whole(name, lambda c: c.stat(name))
        stats = self._sharded(name, t, [(k, lambda c: c.stat(name)) for k in range(self._n)])
        for k, s in enumerate(stats):
            check_layout(name, s.layout, t.layouts[k], where=f"daemon {self.addresses[k]}")
        t.versions = [s.version for s in stats]
        return self._sharded_stat(t, stats)

    def stats(self) -> dict[str, TensorStat]:
        """Every name the daemons hold: whole tensors, and this list's sharded tables as :class:`ShardedStat`
        (shards of another daemon list's tables are left out).

        Raises:
            ShardLostError: a daemon is unreachable (the listing would be incomplete).
        """
        self._check_open()
        per = self._fan([(k, lambda c: c.stats()) for k in range(self._n)])
        out: dict[str, TensorStat] = {}
        shards: dict[str, dict[int, TensorStat]] = {}
        for k, d in enumerate(per):
            for nm, st in d.items():
                la = st.layout
                if la is None:
                    if nm not in out or owner(nm, self.addresses) == k:
                        out[nm] = st
                elif la.fingerprint == self.fingerprint and la.shards == self._n and la.index == k:
                    shards.setdefault(nm, {})[k] = st
                else:
                    log.debug("%s on %s is %s: not this client's list", nm, self.addresses[k], la.describe())
        for nm, got in shards.items():
            any_st = next(iter(got.values()))
            la = any_st.layout
            assert la is not None
            t = _Table(TensorSpec(nm, (la.rows, *any_st.spec.shape[1:]), any_st.spec.dtype), self._layouts(la.rows))
            ks = sorted(got)
            out[nm] = self._sharded_stat(t, [got[k] for k in ks], ks)
        return dict(sorted(out.items()))

    def list(self) -> dict[str, TensorSpec]:
        """Every name the daemons hold, with its spec (a sharded table's: the whole table's)."""
        return {k: v.spec for k, v in self.stats().items()}

    def delete(self, name: str) -> None:
        """Delete ``name``: a whole tensor on its owner, or every shard of a sharded table.

        Raises:
            NotFoundError: no such name (no shard of it either).
            ShardLostError: a daemon holding a shard is unreachable (the others' shards are deleted).
        """
        self._forget(name)  # ask afresh: never delete on what this client remembers
        self._drop_window(name)
        t = self._table(name)
        self._forget(name)
        if t is None:
            self._whole(name, lambda c: c.delete(name))
            return
        got = self._fan([(k, _bound(t, name, k, lambda c: c.delete(name))) for k in range(self._n)], settle=True)
        errs = [e for e in got if isinstance(e, BaseException) and not isinstance(e, NotFoundError)]
        if errs:
            raise errs[0]

    def snapshot(self) -> list[SnapshotInfo]:
        """Ask every daemon to write its snapshot now; one :class:`SnapshotInfo` per daemon, in list order."""
        self._check_open()
        return self._fan([(k, lambda c: c.snapshot()) for k in range(self._n)])

    # -- state ------------------------------------------------------------------------------------------
    @property
    def data_paths(self) -> dict[str, str | None]:
        """How tensor bytes move to each daemon connected so far (``"shm"``, ``"ucx"``, ``"tcp"``; None: not now)."""
        return {a: (c.data_path if c is not None else None) for a, c in zip(self.addresses, self._clients)}

    @property
    def data_path(self) -> str | None:
        """The data path all connected daemons share, ``"mixed"`` if they differ, None if none is connected."""
        paths = {p for p in self.data_paths.values() if p is not None}
        return None if not paths else paths.pop() if len(paths) == 1 else "mixed"

    def bytes_moved(self) -> int:
        return sum(c.bytes_moved() for c in self._clients if c is not None)

    def close(self) -> None:
        """Close every daemon's client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for k in range(self._n):
            with self._connecting[k]:
                c, self._clients[k] = self._clients[k], None
            if c is not None:
                c.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        with self._lock:
            wins = [w for _, w in self._windows.values()]
            self._windows.clear()
        for w in wins:
            _close_window(w)
        if self._copier is not None:
            self._copier.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShardedClient({self.addresses!r}, {'closed' if self._closed else self.data_path or 'not connected'})"


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _bound(t: _Table, name: str, k: int, fn: Callable[[Client], Any]) -> Callable[[Client], Any]:
    """``fn`` with daemon k's client expecting shard k of ``t``."""

    def call(c: Client) -> Any:
        c.expect_layout(name, t.layouts[k])
        return fn(c)

    return call


def _close_window(w: RowWindow) -> None:
    with w.lock:  # a gather out of it finishes first
        w.close()


def _same(a: _Table | None, b: _Table | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.spec == b.spec and a.layouts == b.layouts


def _check_out(spec: TensorSpec, out: "torch.Tensor", shape: tuple[int, ...]) -> None:
    import torch

    if not isinstance(out, torch.Tensor):
        raise SpecError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != spec.torch_dtype:
        raise ShapeMismatchError(
            f"{spec.name}: out= is {str(out.dtype).removeprefix('torch.')}{list(out.shape)}, "
            f"the stored tensor gives {spec.dtype}{list(shape)}"
        )
