"""Shared memory between ``tensorwire serve`` and clients on the same host: what both sides agree on.

When a client and the daemon share a machine (and a ``/dev/shm`` mount, and a
uid), tensor bytes need not cross a socket at all: the daemon keeps its slots
in files under ``/dev/shm`` that it creates, and a client maps them and moves
the bytes with one ``memcpy`` (a ``copy_`` / ``index_select`` in its own
process). The control of every operation -- which slot, which version, pins,
commits -- still goes through the session's data-plane requests
(:mod:`tensorwire.serve.protocol.wire`, ``FLAG_SHM``), so the store's consistency model
is unchanged.

This module is the layout both sides share: the protocol versions, region names
(:data:`NAME_RE`), the hello page (its magic and nonce, the lease-read counters at
:data:`PAGE_STATS_OFFSET`, the write-ahead ticket at :data:`PAGE_AHEAD_OFFSET`),
the page's :class:`PageLock`, and how a region file is mapped. The daemon's half
(creating, unlinking and cleaning up regions, the lease table) is
:mod:`tensorwire.serve.daemon.shm`; the client's half (mapping regions by name,
copying in and out of them, reading leases) is :mod:`tensorwire.serve.client.shm_maps`.

Read leases (the daemon's :class:`~tensorwire.serve.daemon.shm.Leases`, the client's
:class:`~tensorwire.serve.client.shm_maps.LeaseTable`, shm version 2): a table of
per-tensor generations that lets a client read the version it was last handed
again without a request, and without ever seeing a write; the client counts such
reads in its session's page (:class:`~tensorwire.serve.client.shm_maps.SessionPage`),
which the daemon folds into its metrics.

Write-ahead grants (shm version 3): with the reply to a put's COMMIT the daemon
may reserve the tensor's staging slot for the same session's next put
(:class:`tensorwire.serve.daemon.entry.AheadGrant`); the client then writes there and
sends only a COMMIT. Who may touch that slot is settled by an ``flock`` on the
session page (:class:`PageLock`) and a ticket in the page
(:data:`PAGE_AHEAD_OFFSET`).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
from typing import TYPE_CHECKING, Any

from tensorwire.buffers import cuda_available

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "SHM_VERSION",
    "LEASE_VERSION",
    "AHEAD_VERSION",
    "SHM_DIR",
    "MAX_REGIONS",
    "CLIENT_MAPS",
    "LEASE_CELLS",
    "LEASE_MACHINES",
    "NAME_RE",
    "ShmError",
    "PageLock",
    "HELLO_BYTES",
    "HELLO_MAGIC",
    "HELLO_NONCE_BYTES",
    "PAGE_SLOTS",
    "PAGE_STATS_OFFSET",
    "PAGE_AHEAD_OFFSET",
    "valid_name",
    "round_page",
    "map_fd",
    "cuda_register",
    "cuda_unregister",
    "page_counters",
    "page_ahead",
]

log = logging.getLogger(__name__)

#: Version of the shared-memory protocol (OpenSession*.shm); 0 = none. 2 adds read leases,
#: 3 write-ahead grants (:class:`PageLock`).
SHM_VERSION = 3
#: The first version with read leases.
LEASE_VERSION = 2
#: The first version with write-ahead grants.
AHEAD_VERSION = 3
#: Where regions live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
#: Regions one daemon creates at most (each is a mapping; Linux allows ~65k per process by default).
#: Slots past it are ordinary memory and served over the socket.
MAX_REGIONS = 16384
#: Mappings a client keeps.
CLIENT_MAPS = 256
#: The hello region: magic, then the session's proof nonce.
HELLO_BYTES = mmap.PAGESIZE
HELLO_MAGIC = b"TWSHMHI1"
HELLO_NONCE_BYTES = 32
#: Where a client counts, in its session's hello page, the reads it served from leases (four uint64:
#: get operations and bytes, get_rows operations and bytes; the daemon adds them to its metrics).
PAGE_STATS_OFFSET = 64
#: Where the daemon writes, in a session's page, the ticket of the write-ahead grant its client holds
#: (uint64; 0: none), only while it holds the page's flock or while the client waits for its reply.
PAGE_AHEAD_OFFSET = 96
#: Lease cells in a daemon's table (cell 0 means "no lease"); one per tensor kept in shared memory.
LEASE_CELLS = MAX_REGIONS + 1
#: Machines where a lease read is safe: loads are not reordered with other loads (x86-TSO), so a
#: generation read after the copy is read after every byte of it. Elsewhere clients never use leases.
LEASE_MACHINES = ("x86_64", "amd64", "i686", "i386")

_PAGE = mmap.PAGESIZE
#: A region's name: ``tensorwire-<pid>-<8 hex>-<24 hex>`` (the daemon's pid and registry tag, then the region's).
NAME_RE = re.compile(r"^tensorwire-([0-9]{1,10})-([0-9a-f]{8})-([0-9a-f]{24})$")
_MMAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ShmError(OSError):
    """A region could not be created or mapped (the caller falls back to the socket path)."""


def valid_name(name: str) -> bool:
    """Whether ``name`` is a region name as a daemon makes them (nothing else is ever opened)."""
    return isinstance(name, str) and NAME_RE.match(name) is not None


def round_page(n: int) -> int:
    return max(_PAGE, (n + _PAGE - 1) // _PAGE * _PAGE)


def cuda_register(t: "torch.Tensor") -> bool:
    """Page-lock a mapping for CUDA DMA, if CUDA is usable here (never initialises anything otherwise)."""
    if t.numel() == 0 or not cuda_available():
        return False
    try:  # pragma: no cover - needs a GPU
        import torch

        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        return int(getattr(rc, "value", rc)) == 0
    except Exception as exc:  # pragma: no cover  # noqa: BLE001
        log.debug("cudaHostRegister failed (%s); the region stays pageable", exc)
        return False


def cuda_unregister(t: "torch.Tensor") -> None:  # pragma: no cover - needs a GPU
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception as exc:  # noqa: BLE001
        log.debug("cudaHostUnregister failed: %s", exc)


def map_fd(fd: int, size: int) -> tuple[mmap.mmap, "torch.Tensor"]:
    import torch

    mm = mmap.mmap(fd, size, flags=_MMAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


#: The session page's counters (uint64 from PAGE_STATS_OFFSET): operations, then bytes, of each read kind.
PAGE_SLOTS = {"get": 0, "get_rows": 2}
assert PAGE_AHEAD_OFFSET >= PAGE_STATS_OFFSET + 16 * len(PAGE_SLOTS)


def page_counters(mm: mmap.mmap) -> Any:
    """The session page's counters as a uint64 numpy view of ``mm`` (see :data:`PAGE_SLOTS`)."""
    import numpy as np

    return np.frombuffer(mm, dtype=np.uint64, count=2 * len(PAGE_SLOTS), offset=PAGE_STATS_OFFSET)


def page_ahead(mm: mmap.mmap) -> Any:
    """The session page's write-ahead ticket (one uint64 numpy element at :data:`PAGE_AHEAD_OFFSET`)."""
    import numpy as np

    return np.frombuffer(mm, dtype=np.uint64, count=1, offset=PAGE_AHEAD_OFFSET)


class PageLock:
    """An ``flock`` on a session page's file: who may touch a write-ahead grant's slot (shm version 3).

    A *write-ahead grant* (:class:`tensorwire.serve.daemon.entry.AheadGrant`) is the
    staging slot of a tensor, reserved by the daemon for a session's next put
    of it when it commits the last one, so that put is one copy and one COMMIT
    (no reserving round trip first). The client holds this lock (exclusive)
    from before it checks the page's ticket until the reply to its COMMIT; the
    daemon takes it, non-blocking, to revoke the grant (another writer wants
    the tensor, the session asked for something else, the tensor is deleted)
    and clears the ticket meanwhile. So a revocation never happens while the
    client writes, and a client never starts writing after one: the kernel
    arbitrates, a process that dies drops its lock, and neither side waits on
    the other (a failed ``try_lock`` means "not now").
    """

    def __init__(self, path: str) -> None:
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmError(exc.errno, f"cannot open {path}: {exc.strerror}") from None

    def try_lock(self) -> bool:
        """Take the lock if nobody else holds it (never waits)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
