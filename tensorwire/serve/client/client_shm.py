"""What a one-daemon :class:`~tensorwire.serve.client.client.Client` shows of its shared memory.

:class:`ClientShm` is a base class of ``Client``: its counters of what went
through shared memory (all sessions), and what a
:class:`~tensorwire.serve.client.sharded_client.ShardedClient` calls to make
one gather over several daemons' shared memory itself
(:mod:`tensorwire.serve.client.sharded_rows`): each client's lock, held across
the gather; the version its read lease names, or one its daemon pins for the
gather; and the count of what was read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorwire.serve.client.shm_path import ShmMemory, ShmPath
from tensorwire.serve.client.window import ShardView

if TYPE_CHECKING:  # pragma: no cover
    import threading

    from tensorwire.serve.client.session import Path

__all__ = ["ClientShm"]


class ClientShm:
    """The shared-memory side of a :class:`~tensorwire.serve.client.client.Client` (see the module docstring).

    It reads the client's lock, session path and shared-memory state, and runs its operations through
    the client's ``_run``.
    """

    _lock: "threading.RLock"
    _path: "Path | None"
    _mem: ShmMemory

    if TYPE_CHECKING:  # pragma: no cover - defined by Client

        def _check_open(self) -> None: ...

        def _run(self, op: str, *args: Any) -> Any: ...

    # -- counters (all sessions) --------------------------------------------------------------------
    @property
    def shm_bytes(self) -> int:
        """Bytes this client copied through shared memory (all sessions)."""
        return self._mem.shm_bytes

    @property
    def lease_reads(self) -> int:
        """Reads served from a read lease, without a request (all sessions)."""
        return self._mem.lease_reads

    @property
    def lease_misses(self) -> int:
        """Read leases found stale (the read then asked the daemon)."""
        return self._mem.lease_misses

    @property
    def ahead_puts(self) -> int:
        """Puts written into a write-ahead grant's slot (one round trip instead of two; all sessions)."""
        return self._mem.ahead_puts

    # -- for the sharded client: one gather over several daemons' shared memory -------------------------
    @property
    def lock(self) -> "threading.RLock":
        """Held by each operation of this client. A sharded client holds the locks of several clients
        across one gather from their daemons' shared memory, so that their pins stay meanwhile."""
        return self._lock

    def shm_lease(self, name: str) -> ShardView | None:
        """The version of ``name`` this client's read lease names, if the lease holds now (no request).

        Call with :attr:`lock` held, and count the read only if :meth:`ShardView.valid` still holds
        after copying out of it (:meth:`shm_count`).
        """
        self._check_open()
        p = self._path
        return p.lease_view(name) if isinstance(p, ShmPath) else None

    def shm_pin(self, name: str, rows: int) -> ShardView | None:
        """Have the daemon pin the current version of ``name`` for a gather of ``rows`` rows that this
        process makes itself (a shared-memory get_rows request without an index).

        None: this session moves no bytes through shared memory, or the tensor is not in it. Call with
        :attr:`lock` held until the gather is done: the pin goes back with this client's next request.

        Raises:
            as get_rows (NotFoundError, LayoutMismatchError, PeerLostError, ...).
        """
        view: ShardView | None = self._run("pin_view", name, rows)
        return view

    def shm_count(self, nbytes: int, *, leased: bool) -> None:
        """Count a gather of ``nbytes`` made out of a view of this client (a lease read: for the daemon too)."""
        p = self._path
        if isinstance(p, ShmPath):
            p.count(nbytes, leased=leased)
        else:
            self._mem.shm_bytes += nbytes
