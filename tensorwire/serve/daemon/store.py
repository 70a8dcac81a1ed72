"""The daemon's tensors by name, and the memory accounting (one tensor: :mod:`tensorwire.serve.daemon.entry`).

Each name is an :class:`~tensorwire.serve.daemon.entry.Entry`: two slots
(``current`` and ``staging``), a version, and the pins and reservations of its
readers and writers (the consistency model is in that module's docstring).

Memory: validation happens before any allocation. A tensor of N bytes
reserves 2N against ``max_bytes`` (current + staging); the staging slot is
allocated on the first replacing put only, so tensors that are written once
and then updated by rows hold N. The sessions' shared-memory scratch regions
(row updates through shared memory) are charged against ``max_bytes`` too.

Shared memory (a store made with a :class:`~tensorwire.serve.daemon.shm.Registry`):
every slot of a non-empty tensor is a region the daemon created under
``/dev/shm`` (:class:`~tensorwire.serve.daemon.entry.StoreSlot`), so clients on this host can copy straight in
and out of it. Where a region cannot be had (``/dev/shm`` full, too many
regions) the slot is ordinary memory, with a warning, and served over the
socket. A deleted tensor's regions are unlinked as soon as no read pins them
and no put is writing into them.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from tensorwire.buffers import Slot
from tensorwire.errors import NotFoundError, ResourceExhaustedError, ShapeMismatchError, SpecError
from tensorwire.spec import TensorSpec
from tensorwire.serve.daemon.config import format_size
from tensorwire.serve.daemon.entry import Entry, Info, StoreSlot
from tensorwire.serve.daemon.shm import Leases
from tensorwire.serve.daemon.snapshot import check_storable_name
from tensorwire.serve.protocol.common import MAX_TENSORS
from tensorwire.serve.protocol.layout import ShardLayout, check_layout
from tensorwire.serve.protocol.shm import ShmError

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.daemon.metrics import Metrics
    from tensorwire.serve.daemon.shm import Registry

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
