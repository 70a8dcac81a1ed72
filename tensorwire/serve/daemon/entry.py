"""One tensor of the daemon's store: its two slots, its version, and who may read or write them.

Consistency model (per name):

- Two slots: ``current`` (what readers get) and ``staging``. A put receives
  into staging and its commit swaps the two under the entry's lock, so a
  reader sees the old version or the new one, whole.
- A reader *pins* the slot it reads for as long as its transfer runs; a put
  does not start receiving into a slot with pins on it (it waits, bounded),
  so a slot is never overwritten under a reader.
- Row updates (``put_rows``/``add_rows``) change ``current`` in place: they
  wait until it has no readers and hold off new ones meanwhile (writer
  preference), so a reader never sees half a row update either.
- Every commit increments ``version``. Version 0 = declared, no data yet
  (not readable).
- A put that never commits (client died, timed out, aborted) leaves the
  previous version untouched: it only ever wrote into staging.

A put may be granted ahead (shared memory, shm version 3): :class:`AheadGrant`
reserves the staging slot for a session's next put of the tensor. The store
that holds the entries, and the memory accounting, is
:class:`tensorwire.serve.daemon.store.Store`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.buffers import Slot
from tensorwire.errors import NotFoundError, TransferTimeout
from tensorwire.spec import TensorSpec
from tensorwire.serve.protocol.layout import ShardLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.daemon.shm import Region
    from tensorwire.serve.daemon.store import Store

__all__ = ["Entry", "Info", "StoreSlot", "AheadGrant", "region_of"]


class StoreSlot:
    """A slot whose bytes live in a shared-memory region (``raw``/``tensor`` as :class:`~tensorwire.buffers.Slot`)."""

    __slots__ = ("spec", "raw", "tensor", "region", "pinned", "_np")

    def __init__(self, spec: TensorSpec, region: "Region") -> None:
        self.spec = spec
        self.region = region
        self.raw: "torch.Tensor" = region.tensor[: spec.nbytes]
        self.tensor = self.raw.view(spec.torch_dtype).view(spec.shape)
        self.pinned = region.pinned
        self._np: Any = None

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    def host_array(self) -> Any:
        """Zero-copy NumPy uint8 view of the slot (cached), as :meth:`tensorwire.buffers.Slot.host_array`."""
        if self._np is None:
            self._np = self.raw.numpy()
        return self._np

    def __repr__(self) -> str:
        return f"StoreSlot({self.spec}, {self.region.name})"


def region_of(slot: object) -> "Region | None":
    """The shared-memory region behind a slot (None: ordinary memory)."""
    r = getattr(slot, "region", None)
    return None if r is None or r.closed else r


_NO_LEASE = (0, 0)


@dataclass(frozen=True)
class Info:
    spec: TensorSpec
    version: int
    nbytes: int
    layout: ShardLayout | None = None


def _wait(
    cond: threading.Condition, pred, deadline: float, what: str, poll: "Callable[[], float]" = lambda: 1.0
) -> None:
    """Under ``cond``: wait until ``pred()``; TransferTimeout at ``deadline``. ``pred`` is checked again at
    least every ``poll()`` seconds (for what changes without a notify)."""
    while not pred():
        rem = deadline - time.monotonic()
        if rem <= 0:
            raise TransferTimeout(f"{what}: timed out waiting for other transfers on this tensor")
        cond.wait(min(rem, poll()))


class AheadGrant:
    """A session's reservation of a tensor's staging slot for its next put (a *write-ahead grant*).

    Made by :meth:`Entry.grant_ahead` when the session commits a put of the
    tensor through shared memory, and named in that COMMIT's reply, so the
    session's next put of it is one copy and one COMMIT. While granted, the
    entry is reserved for a put as by :meth:`Entry.begin_put`. It ends with
    :meth:`claim` (the COMMIT that uses it: an ordinary reservation from then
    on) or :meth:`revoke`, which needs the client's page lock
    (:class:`tensorwire.serve.protocol.shm.PageLock`) unless the session is gone
    (``force``): another writer's :meth:`Entry.begin_put` and a delete revoke
    it, as does the session's next request of anything else.
    """

    __slots__ = ("entry", "idx", "ticket", "region", "_word", "_lock")

    def __init__(self, entry: "Entry", idx: int, ticket: int, region: Any, word: Any, lock: Any) -> None:
        self.entry = entry
        self.idx = idx
        self.ticket = ticket
        self.region = region
        self._word = word  # the session page's ticket cell
        self._lock = lock  # the session page's PageLock

    def _revoke_locked(self, force: bool) -> bool:
        """Under the entry's ``cond``, while it holds this grant. False: the client is writing (not now)."""
        if not force:
            if not self._lock.try_lock():
                return False
            try:
                self._word[0] = 0
            finally:
                self._lock.unlock()
        else:
            try:
                self._word[0] = 0
            except (TypeError, ValueError):  # pragma: no cover - the page is unmapped already
                pass
        self.entry.ahead = None
        self.entry._end_put_locked()
        return True

    def revoke(self, *, force: bool = False) -> bool:
        """End the grant unless the client is writing into it now (``force``: whatever it does). True: ended."""
        e = self.entry
        with e.cond:
            if e.ahead is not self:
                return True
            return self._revoke_locked(force)

    def claim(self) -> bool:
        """The COMMIT of the write it granted: from now on an ordinary reservation (``commit_put`` ends it).
        False: it was revoked (nothing to commit)."""
        e = self.entry
        with e.cond:
            if e.ahead is not self:
                return False
            e.ahead = None
            return True


class Entry:
    """One name: its spec, two slots, version and reader/writer state."""

    def __init__(self, spec: TensorSpec, store: "Store", layout: ShardLayout | None = None) -> None:
        self.spec = spec
        #: Set when this tensor is one shard of a table sharded by rows (fixed for the entry's life).
        self.layout = layout
        self.nbytes = spec.nbytes
        self._store = store
        self.slots: "list[Slot | StoreSlot | None]" = [store._new_slot(spec), None]
        self.cur = 0
        self.version = 0
        self.readers = [0, 0]
        self.row_writer = False
        self.row_waiting = 0
        self.putting = False
        self.put_waiting = 0  # begin_put callers waiting (no write-ahead grant is made meanwhile)
        self.ahead: AheadGrant | None = None  # the write-ahead grant holding the put reservation
        self.deleted = False
        self.cond = threading.Condition(threading.Lock())
        self._waiters = 0  # threads in _wait_for (under cond): a release with nobody waiting notifies nobody
        #: Cell in the store's lease table (0: no read leases; see tensorwire.serve.daemon.shm.Leases).
        self.lease = store._lease_cell() if isinstance(self.slots[0], StoreSlot) else 0

    def info(self) -> Info:
        return Info(self.spec, self.version, self.nbytes, self.layout)

    def _wait_for(self, pred: "Callable[[], bool]", deadline: float, poll: "Callable[[], float] | None" = None) -> None:
        """Under ``cond``: :func:`_wait`, counted in ``_waiters``."""
        if pred():
            return
        self._waiters += 1
        try:
            if poll is None:
                _wait(self.cond, pred, deadline, self.spec.name)
            else:
                _wait(self.cond, pred, deadline, self.spec.name, poll)
        finally:
            self._waiters -= 1

    def _notify(self) -> None:
        """Under ``cond``: wake the waiters, if any."""
        if self._waiters:
            self.cond.notify_all()

    # -- readers ---------------------------------------------------------------
    def acquire_read(self, deadline: float) -> tuple[int, int]:
        """Pin the current slot. Returns (slot index, version).

        Raises:
            NotFoundError: deleted, or never written.
        """
        idx, version, _ = self.acquire_read_leased(deadline)
        return idx, version

    def acquire_read_leased(self, deadline: float) -> tuple[int, int, tuple[int, int]]:
        """:meth:`acquire_read`, with the lease of that slot and version: (cell, generation), read in the
        same breath ((0, 0): no lease)."""
        with self.cond:
            if self.row_writer or self.row_waiting:  # a row update holds readers off (writer preference)
                self._wait_for(lambda: self.deleted or not (self.row_writer or self.row_waiting), deadline)
            if self.deleted or not self.version:
                self._check_readable()
            cur = self.cur
            self.readers[cur] += 1
            leases = self._store.leases
            lease = (self.lease, leases.gen(self.lease)) if leases is not None and self.lease else _NO_LEASE
            return cur, self.version, lease

    def _bump(self, by: int = 2) -> None:
        """Under ``cond``: the current slot's bytes or identity change (leases on it must fail)."""
        leases = self._store.leases
        if leases is not None:
            leases.bump(self.lease, by)

    def release_read(self, idx: int) -> None:
        with self.cond:
            self.readers[idx] -= 1
            if self.readers[idx] == 0:
                self._notify()
                if self.deleted:
                    self._retire()

    def _retire(self) -> None:
        """Under ``cond``: once deleted and idle (no pins, no put writing), unlink the shared-memory regions.

        Clients map regions by name: a name must stay until the read that was
        given it has released its pin (and a put's until it commits or aborts).
        """
        if self.deleted and not any(self.readers) and not self.putting and not self.row_writer:
            for sl in self.slots:
                r = region_of(sl)
                if r is not None:
                    r.close()

    def _check_readable(self) -> None:
        if self.deleted:
            raise NotFoundError(f"no tensor named {self.spec.name!r} (deleted)")
        if self.version == 0:
            raise NotFoundError(f"{self.spec.name!r} is declared but has no data yet: put it first")

    # -- whole-tensor puts -------------------------------------------------------
    def begin_put(self, deadline: float) -> int:
        """Reserve the staging slot (allocating it on first use). Returns its index."""
        with self.cond:
            self.put_waiting += 1
            try:
                # a write-ahead grant is revoked unless its client is writing: then it commits soon, but its
                # page lock wakes nobody, so look again every millisecond
                self._wait_for(
                    lambda: self.deleted or not self.putting or self._revoke_ahead(),
                    deadline,
                    poll=lambda: 0.001 if self.ahead is not None else 1.0,
                )
            finally:
                self.put_waiting -= 1
            if self.deleted:
                raise NotFoundError(f"no tensor named {self.spec.name!r} (deleted)")
            self.putting = True
        try:
            if self.version == 0:
                return self.cur  # nothing readable yet: write in place
            idx = 1 - self.cur
            if self.slots[idx] is None:
                slot = self._store._allocate_staging(self.spec)
                with self.cond:
                    self.slots[idx] = slot
                    deleted = self.deleted
                if deleted:  # deleted meanwhile: its accounting is done, the slot's must be undone
                    self._store._forget_staging(self.spec)
                    raise NotFoundError(f"no tensor named {self.spec.name!r} (deleted)")
            with self.cond:
                # a slot with readers on it is not reused until they finish
                self._wait_for(lambda: self.readers[idx] == 0, deadline)
            return idx
        except BaseException:
            self.end_put()
            raise

    def commit_put(self, idx: int, deadline: float) -> Info:
        with self.cond:
            try:
                self._wait_for(lambda: self.deleted or not self.row_writer, deadline)
                if self.deleted:
                    raise NotFoundError(f"{self.spec.name!r} was deleted while being written")
                if idx != self.cur:
                    self._bump()  # before the commit is visible to anyone: a lease on the old slot fails
                self.cur = idx
                self.version += 1
                return self.info()
            finally:
                self._end_put_locked()

    def grant_ahead(self, make: "Callable[[int], AheadGrant]") -> "AheadGrant | None":
        """Reserve the staging slot for a session's next put if that can be done now without waiting
        (no put or row update under way or waiting, no read pinning it, in shared memory): ``make(idx)``
        builds the grant. None: not now."""
        with self.cond:
            if (
                self.deleted
                or self.putting
                or self.put_waiting
                or self.row_writer
                or self.row_waiting
                or self.version == 0
                or self.ahead is not None
            ):
                return None
            idx = 1 - self.cur
            sl = self.slots[idx]
            if sl is None or region_of(sl) is None or self.readers[idx]:
                return None
            g = make(idx)
            self.putting = True
            self.ahead = g
            return g

    def _revoke_ahead(self) -> bool:
        """Under ``cond``: end the write-ahead grant holding the put reservation, unless its client is writing.
        True: ended (the reservation is free)."""
        return self.ahead is not None and self.ahead._revoke_locked(False)

    def end_put(self) -> None:
        """Release the staging reservation without committing."""
        with self.cond:
            self._end_put_locked()

    def _end_put_locked(self) -> None:
        self.putting = False
        self._notify()
        self._retire()

    def slot(self, idx: int) -> Slot:
        s = self.slots[idx]
        assert s is not None
        return s

    # -- row updates -------------------------------------------------------------
    def begin_rows(self, deadline: float) -> int:
        """Exclusive access to the current slot for an in-place row update."""
        with self.cond:
            self.row_waiting += 1
            try:
                self._wait_for(lambda: self.deleted or not (self.row_writer or self.readers[self.cur]), deadline)
            finally:
                self.row_waiting -= 1
            if self.deleted:
                self.cond.notify_all()
                raise NotFoundError(f"no tensor named {self.spec.name!r} (deleted)")
            if self.version == 0:
                self.cond.notify_all()
                raise NotFoundError(f"{self.spec.name!r} is declared but has no data yet: put it first")
            self.row_writer = True
            self._bump(1)  # odd while rows are written in place
            return self.cur

    def end_rows(self, *, changed: bool) -> Info:
        with self.cond:
            self.row_writer = False
            self._bump(1)
            if changed:
                self.version += 1
            self.cond.notify_all()
            self._retire()
            return self.info()

    def memory(self) -> int:
        return sum(self.nbytes for s in self.slots if s is not None)
