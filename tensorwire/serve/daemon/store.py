"""The daemon's tensors: per-name double-buffered slots, versions, and memory accounting.

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

Memory: validation happens before any allocation. A tensor of N bytes
reserves 2N against ``max_bytes`` (current + staging); the staging slot is
allocated on the first replacing put only, so tensors that are written once
and then updated by rows hold N. The sessions' shared-memory scratch regions
(row updates through shared memory) are charged against ``max_bytes`` too.

Shared memory (a store made with a :class:`~tensorwire.serve.protocol.shm.Registry`):
every slot of a non-empty tensor is a region the daemon created under
``/dev/shm`` (:class:`StoreSlot`), so clients on this host can copy straight in
and out of it. Where a region cannot be had (``/dev/shm`` full, too many
regions) the slot is ordinary memory, with a warning, and served over the
socket. A deleted tensor's regions are unlinked as soon as no read pins them
and no put is writing into them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.buffers import Slot
from tensorwire.errors import NotFoundError, ResourceExhaustedError, ShapeMismatchError, SpecError, TransferTimeout
from tensorwire.spec import TensorSpec
from tensorwire.serve.daemon.config import format_size
from tensorwire.serve.daemon.snapshot import check_storable_name
from tensorwire.serve.protocol.common import MAX_TENSORS
from tensorwire.serve.protocol.layout import ShardLayout, check_layout
from tensorwire.serve.protocol.shm import ShmError, Leases

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.daemon.metrics import Metrics
    from tensorwire.serve.protocol.shm import Leases, Region, Registry

__all__ = ["Store", "Entry", "Info", "StoreSlot", "normalise_spec"]

log = logging.getLogger(__name__)


def normalise_spec(spec: TensorSpec) -> TensorSpec:
    """What the store keeps: static shapes, host memory (the device of the writer is not part of it), and
    names its snapshots can hold (``__metadata__`` is safetensors' own: refused with a SpecError)."""
    check_storable_name(spec.name)
    if spec.is_dynamic:
        raise SpecError(f"{spec.name}: the store holds static shapes; dynamic dims are not supported")
    if spec.device != "cpu":
        spec = TensorSpec(spec.name, spec.shape, spec.dtype, "cpu")
    return spec


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
        #: Cell in the store's lease table (0: no read leases; see tensorwire.serve.protocol.shm.Leases).
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


class Store:
    """All tensors of the daemon, with the ``max_bytes`` accounting."""

    def __init__(self, max_bytes: int, metrics: "Metrics | None" = None, *, shm: "Registry | None" = None) -> None:
        self.max_bytes = max_bytes
        self._metrics = metrics
        #: Where slots live when clients may map them (None: ordinary memory, no shared-memory path).
        self.shm = shm
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._reserved = 0
        self._allocated = 0
        self._buffers = 0  # of _reserved: sessions' row and request buffers
        self._nslots = 0
        #: Read leases of tensors in shared memory (made with the first such tensor; None: none).
        self.leases: "Leases | None" = None
        self._leases_lock = threading.Lock()
        self._leases_failed = False
        if metrics is not None:
            metrics.max_bytes.set(max_bytes)

    def lease_table(self) -> "Leases | None":
        """The read-lease table (made on first use; None: no shared memory, or it could not be made)."""
        with self._leases_lock:
            if self.leases is None and not self._leases_failed and self.shm is not None:
                try:
                    self.leases = Leases(self.shm)
                except ShmError as exc:
                    self._leases_failed = True
                    log.warning("shared memory: no read leases (%s); reads ask the daemon each time", exc)
            return self.leases

    def _lease_cell(self) -> int:
        """A lease cell for a new tensor in shared memory (0: none)."""
        leases = self.lease_table()
        return leases.alloc() if leases is not None else 0

    def _new_slot(self, spec: TensorSpec) -> "Slot | StoreSlot":
        """A slot for ``spec``: a shared-memory region when the store has them, else ordinary memory."""
        reg = self.shm
        if reg is not None and spec.nbytes:
            try:
                return StoreSlot(spec, reg.create(spec.nbytes))
            except ShmError as exc:
                reg.warn_once(
                    f"slot-{exc.errno}",
                    "shared memory: %s; such tensors are kept in ordinary memory and served over the data connection",
                    exc,
                )
        return Slot(spec)

    # -- shared-memory scratch (charged like tensors) ----------------------------------------
    def charge(self, nbytes: int, what: str, *, buffers: bool = False) -> None:
        """Reserve ``nbytes`` of ``max_bytes`` for something other than a tensor (a session's scratch region;
        ``buffers``: a session's row or request buffers in ordinary memory, counted apart as well).

        Raises:
            ResourceExhaustedError: it does not fit; nothing changed.
        """
        with self._lock:
            if self._reserved + nbytes > self.max_bytes:
                raise ResourceExhaustedError(f"{what} needs {format_size(nbytes)} but only {self._free_text()}")
            self._reserved += nbytes
            self._allocated += nbytes
            if buffers:
                self._buffers += nbytes
            self._update_gauges()

    def uncharge(self, nbytes: int, *, buffers: bool = False) -> None:
        with self._lock:
            self._reserved -= nbytes
            self._allocated -= nbytes
            if buffers:
                self._buffers -= nbytes
            self._update_gauges()

    def close(self) -> None:
        """Shutdown: unlink every shared-memory region (the tensors stay readable in this process)."""
        with self._leases_lock:
            self._leases_failed = True
            if self.leases is not None:
                self.leases.close()  # every lease fails from now on
        if self.shm is not None:
            self.shm.close()

    # -- accounting ---------------------------------------------------------------
    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def allocated(self) -> int:
        return self._allocated

    def _free_text(self) -> str:
        """What is left of ``--max-bytes``, for the errors that refuse a reservation (under the lock)."""
        return f"{format_size(max(0, self.max_bytes - self._reserved))} of --max-bytes {format_size(self.max_bytes)} is free"

    def _update_gauges(self) -> None:
        m = self._metrics
        if m is not None:
            m.tensors.set(len(self._entries))
            m.slots.set(self._nslots)
            m.memory.set(self._allocated)
            m.reserved.set(self._reserved)
            m.session_buffers.set(self._buffers)

    def _allocate_staging(self, spec: TensorSpec) -> "Slot | StoreSlot":
        slot = self._new_slot(spec)  # already reserved at declare
        with self._lock:
            self._allocated += spec.nbytes
            self._nslots += 1
            self._update_gauges()
        return slot

    def _forget_staging(self, spec: TensorSpec) -> None:
        with self._lock:
            self._allocated -= spec.nbytes
            self._nslots -= 1
            self._update_gauges()

    # -- names ------------------------------------------------------------------
    def get(self, name: str) -> Entry:
        with self._lock:
            e = self._entries.get(name)
        if e is None:
            raise NotFoundError(f"no tensor named {name!r}")
        return e

    def check_layout(self, name: str, expected: ShardLayout | None) -> "Entry | None":
        """Refuse a request for ``name`` that expects another shard layout than the tensor has (None: whole).

        A name not held passes (the operation itself reports it, or creates it with ``expected``).
        Returns the entry found (None: not held), which the request may use instead of looking it up again.

        Raises:
            LayoutMismatchError: saying what is held and what was expected.
        """
        with self._lock:
            e = self._entries.get(name)
        if e is not None and (e.layout is not None or expected is not None):
            check_layout(name, e.layout, expected)
        return e

    def declare(self, spec: TensorSpec, *, layout: ShardLayout | None = None) -> tuple[Entry, bool]:
        """The entry for ``spec.name``, creating (and allocating) it if new, as a shard of ``layout`` if given.

        Everything is validated before anything is allocated.

        Raises:
            SpecError: dynamic spec, or ``layout`` does not fit the spec's rows.
            LayoutMismatchError: the name exists with another layout (or a whole tensor vs a shard).
            ShapeMismatchError: the name exists with another spec (both named).
            ResourceExhaustedError: over ``max_bytes`` or the tensor count; nothing changed.
        """
        spec = normalise_spec(spec)
        if layout is not None and (not spec.shape or spec.shape[0] != layout.shard_rows):
            raise SpecError(f"{spec.name}: {spec.describe()} cannot be {layout.describe()}")
        need = 2 * spec.nbytes
        with self._lock:
            e = self._entries.get(spec.name)
            if e is not None:
                check_layout(spec.name, e.layout, layout)
                if e.spec != spec:
                    raise ShapeMismatchError(
                        f"{spec.name}: stored as {e.spec.describe()}, this put is {spec.describe()} "
                        f"(delete it first to change its spec)"
                    )
                return e, False
            if len(self._entries) >= MAX_TENSORS:
                raise ResourceExhaustedError(f"the store holds the maximum of {MAX_TENSORS} tensors")
            if self._reserved + need > self.max_bytes:
                raise ResourceExhaustedError(
                    f"{spec.name}: {spec.describe()} needs {format_size(need)} (2 x {format_size(spec.nbytes)}, "
                    f"double-buffered) but only {self._free_text()}; nothing was changed"
                )
            self._reserved += need
            try:
                e = Entry(spec, self, layout)
            except (RuntimeError, MemoryError) as exc:
                self._reserved -= need
                raise ResourceExhaustedError(f"{spec.name}: cannot allocate {format_size(spec.nbytes)}: {exc}") from exc
            self._entries[spec.name] = e
            self._allocated += spec.nbytes
            self._nslots += 1
            self._update_gauges()
        log.debug("declared %s", spec)
        return e, True

    def delete(self, name: str) -> None:
        with self._lock:
            e = self._entries.pop(name, None)
            if e is None:
                raise NotFoundError(f"no tensor named {name!r}")
            self._reserved -= 2 * e.nbytes
            self._allocated -= e.memory()
            self._nslots -= sum(1 for s in e.slots if s is not None)
            self._update_gauges()
        with e.cond:
            e.deleted = True
            e._revoke_ahead()  # unless its client is writing: then its COMMIT fails and ends the put
            if self.leases is not None:
                self.leases.free(e.lease)
            e.lease = 0
            e.cond.notify_all()
            e._retire()

    def entries(self) -> list[Entry]:
        with self._lock:
            return [self._entries[k] for k in sorted(self._entries)]

    def names_after(self, token: str, limit: int) -> tuple[list[Entry], str]:
        """A page of entries by name after ``token``; returns (entries, next token or '')."""
        with self._lock:
            names = sorted(n for n in self._entries if n > token)
            page = names[:limit]
            out = [self._entries[n] for n in page]
        nxt = page[-1] if len(names) > limit else ""
        return out, nxt

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def restore(self, spec: TensorSpec, version: int, fill, *, layout: ShardLayout | None = None) -> None:
        """Declare ``spec`` (a shard of ``layout`` if given) and fill its current slot via ``fill(flat_uint8)``
        (startup only)."""
        e, _ = self.declare(spec, layout=layout)
        fill(e.slot(e.cur).raw)
        with e.cond:
            e.version = max(1, int(version))
