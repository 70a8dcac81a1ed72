"""``ShardedClient``: one client over N ``tensorwire serve`` daemons.

::

    import tensorwire as tw

    c = tw.Client(["h1:7100", "h2:7100", "h3:7100"], token=...)   # or tw.Client("dns:///tw-serve.ns.svc:7100")
    c.put("weights", w)                          # a whole tensor, on the daemon its name hashes to
    c.put("emb", table, shard="rows")            # rows split over the three daemons
    rows = c.get_rows("emb", idx)                # one gather over all shards (same host), or per daemon
    c.add_rows("emb", idx, grads)                # duplicates accumulate, as index_add_

Placement is a pure function of the ordered daemon list
(:mod:`tensorwire.serve.client.sharding`): a whole tensor lives on the daemon of the
highest rendezvous weight for its name; a table put with ``shard="rows"`` has
shard ``k`` -- the contiguous rows :func:`~tensorwire.serve.protocol.layout.row_ranges`
gives it -- on daemon ``k``. Each daemon is reached through its own
:class:`tensorwire.serve.client.Client` (its fastest path: shared memory on this
host, UCX or TCP otherwise); the parts of an operation that spans daemons run
on them in parallel and the result is what one daemon holding the whole table
would return. A ``get_rows`` whose daemons all share this host's memory is one
gather by this process over their slots, mapped side by side
(:mod:`tensorwire.serve.client.sharded_rows`).

Layout check: every shard is stored with its :class:`~tensorwire.serve.protocol.layout.ShardLayout`
(shard count, index, rows, the daemon list's fingerprint) and every request of
its data carries the layout this client expects. A daemon holding something
else refuses (:class:`~tensorwire.errors.LayoutMismatchError`), so a client
over another list -- other members, another order -- never reads or writes the
wrong rows. There is no reshard command: a table moves to another list by a
get through a client over the old list, a delete, and a put with
``shard="rows"`` through a client over the new one (the error says so).

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

import builtins
import logging
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from tensorwire import lifecycle
from tensorwire.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    LayoutMismatchError,
    NotFoundError,
    ShapeMismatchError,
    SpecError,
    VersionMismatchError,
)
from tensorwire.serve.client.arrays import As, as_tensor, check_as, convert
from tensorwire.serve.client.common import SnapshotInfo, TensorStat
from tensorwire.serve.client.daemons import Daemons
from tensorwire.serve.client.placement import Placement, bound
from tensorwire.serve.client.sharded_rows import ShardedRows
from tensorwire.serve.client.sharding import owner, resolve_daemons
from tensorwire.serve.client.tables import ShardedStat, ShardStat, Table, merge_stats, same, sharded_stat
from tensorwire.serve.protocol.common import as_index
from tensorwire.serve.protocol.layout import check_layout, fingerprint
from tensorwire.serve.protocol.tls import TLSConfig
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.client import Client

__all__ = ["ShardedClient", "ShardedStat", "ShardStat"]

log = logging.getLogger(__name__)


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
            (False). None (default): threads (a pool made once, one thread
            per daemon but the first), except for a ``get`` whose daemons are
            all reached through shared memory -- then each part is a copy by
            this process, and handing it to another thread costs more than it
            saves on a few cores. A ``get_rows`` over shared memory is one
            gather in the calling thread whatever this says. Writes keep
            their threads: each daemon applies its part itself.

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
        n = len(self.addresses)
        kw: dict[str, Any] = dict(
            token=token,
            tls=TLSConfig.coerce(tls),
            transport=transport,
            timeout=timeout,
            # a daemon reached again during an operation is so within the operation's timeout
            connect_timeout=min(connect_timeout, timeout),
            name=name,
            data_requests=data_requests,
        )
        self._daemons = Daemons(self.addresses, single, kw, parallel=parallel)
        self._placement = Placement(self.addresses, self.fingerprint, self._daemons)
        self._closed = False
        self._rows = ShardedRows(self._daemons, self._placement.sharded)
        outcomes = self._daemons.fan([(k, lambda c: None) for k in range(n)], settle=True)
        errs = [e for e in outcomes if isinstance(e, BaseException)]
        fatal = [e for e in errs if isinstance(e, (AuthError, ConfigError, VersionMismatchError))]
        if fatal or len(errs) == n:
            self.close()
            raise (fatal or errs)[0]
        for e in errs:
            log.warning("sharded client: %s; operations that need it fail until it is back", e)
        lifecycle.track(self)  # closed at interpreter exit if the script does not (tensorwire.lifecycle)

    # -- daemons -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client is closed")

    # -- placement -------------------------------------------------------------------------------
    def owner(self, name: str) -> str:
        """The daemon that holds (or would hold) whole tensor ``name``."""
        return self.addresses[owner(name, self.addresses)]

    def _read(self, name: str, whole: Callable[[Client], Any], sharded: Callable[[Table], Any]) -> Any:
        """A read of ``name``: once more after a layout refusal if the table turned out to have changed."""
        for attempt in (0, 1):
            t = self._placement.table(name)
            try:
                if t is None:
                    return self._placement.whole(name, whole)
                return sharded(t)
            except LayoutMismatchError:
                self._placement.forget(name)
                self._rows.drop_window(name)
                if attempt or same(self._placement.table(name), t):
                    raise
                log.debug("%s changed its layout; reading again", name)
            except NotFoundError:
                self._rows.drop_window(name)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- the API ------------------------------------------------------------------------------------
    def put(self, name: str, tensor: Any, *, shard: str | None = None) -> TensorStat:
        """Store ``tensor`` under ``name``: whole on its owner, or with ``shard="rows"`` split by rows over all daemons.

        ``tensor``: a torch tensor or any array with ``__dlpack__`` (read where it lies), as Client.put.

        A sharded put first declares every shard (each daemon reserves its
        memory, checks ``--max-bytes`` and the layout), then writes them in
        parallel; a put that fails on one daemon may have written the others.

        Raises:
            LayoutMismatchError: ``name`` exists with another layout (delete it first).
            ShapeMismatchError, ResourceExhaustedError: as Client.put, from any daemon.
            ShardLostError: a daemon it needs is unreachable.
        """
        self._check_open()
        tensor = as_tensor("put: tensor", tensor)
        if shard is None:
            st = self._placement.whole(name, lambda c: c.put(name, tensor))
            self._placement.remember(name, None)
            return st
        if shard != "rows":
            raise ConfigError(f"shard must be None or 'rows', got {shard!r}")
        if tensor.dim() < 1:
            raise SpecError(f"{name}: a 0-d tensor has no rows to shard")
        t = self._declare_all(TensorSpec(name, tuple(tensor.shape), tensor.dtype))
        stats = self._placement.sharded(
            name,
            t,
            [(k, _put(name, tensor[a:b])) for k, (a, b) in enumerate(t.ranges)],
        )
        t.versions = [s.version for s in stats]
        self._placement.remember(name, t)
        return self._sharded_stat(t, stats)

    def declare(self, spec: TensorSpec, *, shard: str | None = None) -> TensorStat:
        """Declare ``spec`` (whole on its owner, or ``shard="rows"`` over all daemons); see Client.declare."""
        self._check_open()
        if shard is None:
            return self._placement.whole(spec.name, lambda c: c.declare(spec))
        if shard != "rows" or not spec.shape:
            raise ConfigError("declare: shard must be None or 'rows' (with at least one dimension)")
        t = self._declare_all(spec)
        self._placement.remember(spec.name, t)
        return self._sharded_stat(
            t, [TensorStat(t.shard_spec(k), v, t.shard_spec(k).nbytes, t.layouts[k]) for k, v in enumerate(t.versions)]
        )

    def _declare_all(self, spec: TensorSpec) -> Table:
        """Declare every shard of ``spec`` (each daemon checks the layout and reserves its memory under
        ``--max-bytes``). If one refuses, the shards declared here that hold no data are deleted again."""
        name = spec.name
        t = Table(spec, self._placement.layouts(spec.shape[0]))
        declared = self._daemons.fan(
            [(k, bound(t, name, k, _declare(t.shard_spec(k)))) for k in range(self._daemons.n)],
            settle=True,
        )
        failed = [e for e in declared if isinstance(e, BaseException)]
        if failed:
            undo = [
                (k, bound(t, name, k, lambda c: c.delete(name)))
                for k, st in enumerate(declared)
                if isinstance(st, TensorStat) and st.version == 0
            ]
            if undo:
                self._daemons.fan(undo, settle=True)
            self._placement.forget(name)
            raise failed[0]
        t.versions = [st.version for st in declared]
        return t

    def get(self, name: str, *, out: Any = None, as_: "As | None" = None) -> Any:
        """The current version of ``name``: a whole tensor, or a sharded table assembled from its shards
        (each one a whole version of itself; see the module docstring). ``out`` and ``as_``: as Client.get."""
        kind = check_as(as_, out)
        if out is not None:
            t = as_tensor("get: out", out, writable=True)
            got = self._read(name, lambda c: c.get(name, out=t), lambda tab: self._rows.get(name, tab, t))
            return got if t is out else out
        dest = self._cuda_dest(name, None) if kind == "cupy" else None
        return convert(
            self._read(name, lambda c: c.get(name, out=dest), lambda tab: self._rows.get(name, tab, dest)), kind
        )

    def get_rows(self, name: str, index: Any, *, out: Any = None, as_: "As | None" = None) -> Any:
        """Rows ``index`` of dim 0 of ``name``, in the order given.

        With every daemon it needs on this host (shared memory), one gather by this process over their
        slots, straight into the result; else each daemon gathers its own rows, in parallel, and they are
        put in the caller's order here (:mod:`tensorwire.serve.client.sharded_rows`). ``out`` and ``as_``:
        as Client.get.

        Raises:
            SpecError: an index out of range (nothing is sent).
        """
        idx = as_index(index)
        kind = check_as(as_, out)
        t = as_tensor("get_rows: out", out, writable=True) if out is not None else None
        if kind == "cupy":
            t = self._cuda_dest(name, idx.numel())
        got = self._read(
            name, lambda c: c.get_rows(name, idx, out=t), lambda tab: self._rows.get_rows(name, tab, idx, t)
        )
        if out is not None:
            return got if t is out else out
        return convert(got, kind)

    def _cuda_dest(self, name: str, rows: int | None) -> "torch.Tensor":
        """A new CUDA tensor for ``name`` (``rows`` rows of it; None: all of it), on the current device."""
        import torch

        spec = self.stat(name).spec
        if rows is not None and not spec.shape:
            raise SpecError(f"{name}: a 0-d tensor has no rows")
        shape = spec.shape if rows is None else (rows, *spec.shape[1:])
        return torch.empty(shape, dtype=spec.torch_dtype, device=torch.device("cuda", torch.cuda.current_device()))

    def put_rows(self, name: str, index: Any, values: Any) -> TensorStat:
        """Overwrite rows ``index`` of ``name`` with ``values`` (indices unique), each shard's part on its daemon."""
        return self._update(name, index, values, add=False)

    def add_rows(self, name: str, index: Any, values: Any) -> TensorStat:
        """Add ``values`` to rows ``index`` of ``name`` (duplicates accumulate, as ``index_add_``)."""
        return self._update(name, index, values, add=True)

    def _update(self, name: str, index: Any, values: Any, *, add: bool) -> TensorStat:
        idx = as_index(index)
        values = as_tensor("values", values)
        n = idx.numel()
        if values.dim() < 1 or values.shape[0] != n:
            raise ShapeMismatchError(f"{name}: {n} indices but values of shape {list(values.shape)}")
        t = self._placement.table(name)
        if t is None:
            return self._placement.whole(name, lambda c: c.update_rows(name, idx, values, add=add))
        return self._rows.update(name, t, idx, values, add=add)

    def _sharded_stat(self, t: Table, stats: Sequence[TensorStat]) -> ShardedStat:
        return sharded_stat(t, stats, self.addresses)

    def stat(self, name: str) -> TensorStat:
        """Spec, version and size of ``name``; for a sharded table a :class:`ShardedStat` listing every shard.

        Raises:
            NotFoundError: no such name. ShardLostError: a daemon holding a shard is unreachable.
        """
        self._placement.forget(name)
        t = self._placement.table(name)
        if t is None:
            return self._placement.whole(name, lambda c: c.stat(name))
        stats = self._placement.sharded(name, t, [(k, lambda c: c.stat(name)) for k in range(self._daemons.n)])
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
        per = self._daemons.fan([(k, lambda c: c.stats()) for k in range(self._daemons.n)])
        return merge_stats(per, self.addresses, self.fingerprint)

    def list(self) -> dict[str, TensorSpec]:
        """Every name the daemons hold, with its spec (a sharded table's: the whole table's)."""
        return {k: v.spec for k, v in self.stats().items()}

    def delete(self, name: str) -> None:
        """Delete ``name``: a whole tensor on its owner, or every shard of a sharded table.

        Raises:
            NotFoundError: no such name (no shard of it either).
            ShardLostError: a daemon holding a shard is unreachable (the others' shards are deleted).
        """
        self._placement.forget(name)  # ask afresh: never delete on what this client remembers
        self._rows.drop_window(name)
        t = self._placement.table(name)
        self._placement.forget(name)
        if t is None:
            self._placement.whole(name, lambda c: c.delete(name))
            return
        got = self._daemons.fan(
            [(k, bound(t, name, k, lambda c: c.delete(name))) for k in range(self._daemons.n)], settle=True
        )
        errs = [e for e in got if isinstance(e, BaseException) and not isinstance(e, NotFoundError)]
        if errs:
            raise errs[0]

    def snapshot(self) -> "builtins.list[SnapshotInfo]":
        """Ask every daemon to write its snapshot now; one :class:`SnapshotInfo` per daemon, in list order."""
        self._check_open()
        return self._daemons.fan([(k, lambda c: c.snapshot()) for k in range(self._daemons.n)])

    # -- state ------------------------------------------------------------------------------------------
    @property
    def data_paths(self) -> dict[str, str | None]:
        """How tensor bytes move to each daemon connected so far (``"shm"``, ``"ucx"``, ``"tcp"``; None: not now)."""
        return {a: (c.data_path if c is not None else None) for a, c in zip(self.addresses, self._daemons.clients)}

    @property
    def data_path(self) -> str | None:
        """The data path all connected daemons share, ``"mixed"`` if they differ, None if none is connected."""
        paths = {p for p in self.data_paths.values() if p is not None}
        return None if not paths else paths.pop() if len(paths) == 1 else "mixed"

    def bytes_moved(self) -> int:
        return sum(c.bytes_moved() for c in self._daemons.clients if c is not None)

    def close(self) -> None:
        """Close every daemon's client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._daemons.close()
        finally:
            self._rows.close()
            lifecycle.untrack(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ShardedClient({self.addresses!r}, {'closed' if self._closed else self.data_path or 'not connected'})"


def _put(name: str, part: "torch.Tensor") -> Callable[[Client], Any]:
    return lambda c: c.put(name, part)


def _declare(spec: TensorSpec) -> Callable[[Client], Any]:
    return lambda c: c.declare(spec)
