"""Shared memory between ``tensorwire serve`` and clients on the same host.

When a client and the daemon share a machine (and a ``/dev/shm`` mount, and a
uid), tensor bytes need not cross a socket at all: the daemon keeps its slots
in files under ``/dev/shm`` that it creates, and a client maps them and moves
the bytes with one ``memcpy`` (a ``copy_`` / ``index_select`` in its own
process). The control of every operation -- which slot, which version, pins,
commits -- still goes through the session's data-plane requests
(:mod:`tensorwire.serve.protocol.wire`, ``FLAG_SHM``), so the store's consistency model
is unchanged.

Daemon side (:class:`Registry`, one per server):

- Regions are files ``/dev/shm/tensorwire-<pid>-<8 hex>-<24 hex>`` created
  ``O_EXCL | O_NOFOLLOW`` with mode 0600, their pages allocated up front
  (``posix_fallocate``: a full ``/dev/shm`` is an error at allocation, never a
  SIGBUS later) and mapped ``MAP_SHARED``. With CUDA present they are
  page-locked (``cudaHostRegister``), as the daemon's other slots are.
- The process holds an ``flock`` on ``/dev/shm/tensorwire-<pid>-<8 hex>.lock``
  for its lifetime. Regions are unlinked when their tensor is deleted (once
  no read pins it), when a session closes (its scratch and hello regions),
  on shutdown, and at interpreter exit (``atexit``). A SIGKILLed daemon leaves
  its files behind; the next daemon started on the host removes every set
  whose lock no process holds any more (the kernel drops the lock of a dead
  process: pids from other pid namespaces cannot fool it), before it creates
  its own.

Read leases (:class:`Leases` on the daemon, :class:`LeaseTable` on the client,
shm version 2): a table of per-tensor generations that lets a client read the
version it was last handed again without a request, and without ever seeing a
write; the client counts such reads in its session's page
(:class:`SessionPage`), which the daemon folds into its metrics.

Write-ahead grants (shm version 3): with the reply to a put's COMMIT the daemon
may reserve the tensor's staging slot for the same session's next put
(:class:`tensorwire.serve.daemon.store.AheadGrant`); the client then writes there and
sends only a COMMIT. Who may touch that slot is settled by an ``flock`` on the
session page (:class:`PageLock`) and a ticket in the page
(:data:`PAGE_AHEAD_OFFSET`).

Client side (:class:`ClientMaps`, :class:`Copier`): maps regions by the names the daemon gives
it (checked against the name pattern; never a path), read-write, with
``MAP_POPULATE``; keeps up to :data:`CLIENT_MAPS` mappings (least recently
used dropped first) and drops mappings whose file the daemon has unlinked
whenever it maps a new one, so a deleted tensor's memory is returned to the
system once no process maps it. Copies in and out of regions are numpy's
(``copyto``: no OpenMP team; measured on the 2-core VM with 16 client
processes, torch's ``copy_`` fell to 4.5 GB/s in all, numpy held 14-17 GB/s),
the big ones split between the calling thread and helpers; row gathers are
numpy's ``take``, or torch's ``index_select`` (its thread pool) for a lease
read when many cores are idle (:class:`Copier`).
"""

from __future__ import annotations

import atexit
import collections
import errno
import fcntl
import logging
import mmap
import os
import queue
import re
import secrets
import stat
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.buffers import cuda_available

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "SHM_VERSION",
    "SHM_DIR",
    "Region",
    "Registry",
    "ShmError",
    "ClientMaps",
    "Copier",
    "Leases",
    "LeaseTable",
    "SessionPage",
    "PageLock",
    "HELLO_BYTES",
    "read_hello",
    "valid_name",
    "unlink_all",
    "clean_stale",
]

log = logging.getLogger(__name__)

#: Version of the shared-memory protocol (OpenSession*.shm); 0 = none. 2 adds read leases (:class:`Leases`),
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
_NAME_RE = re.compile(r"^tensorwire-([0-9]{1,10})-([0-9a-f]{8})-([0-9a-f]{24})$")
_LOCK_RE = re.compile(r"^tensorwire-([0-9]{1,10})-([0-9a-f]{8})\.lock$")
_TMP_LOCK_RE = re.compile(r"^\.tensorwire-([0-9]{1,10})-([0-9a-f]{8})\.lock\.tmp$")
_MMAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover
        return os.cpu_count() or 1


_READONLY_WARNING_SILENCED = False


def _silence_readonly_warning() -> None:
    """A read-only mapping of a daemon's table goes to ``torch.index_select``, which only reads it, but torch
    warns about any tensor over a read-only array: silence exactly that message."""
    global _READONLY_WARNING_SILENCED
    import warnings

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
    _READONLY_WARNING_SILENCED = True


class ShmError(OSError):
    """A region could not be created or mapped (the caller falls back to the socket path)."""


def valid_name(name: str) -> bool:
    """Whether ``name`` is a region name as a daemon makes them (nothing else is ever opened)."""
    return isinstance(name, str) and _NAME_RE.match(name) is not None


def round_page(n: int) -> int:
    return max(_PAGE, (n + _PAGE - 1) // _PAGE * _PAGE)


def _cuda_register(t: "torch.Tensor") -> bool:
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


def _cuda_unregister(t: "torch.Tensor") -> None:  # pragma: no cover - needs a GPU
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except Exception as exc:  # noqa: BLE001
        log.debug("cudaHostUnregister failed: %s", exc)


def _map_fd(fd: int, size: int) -> tuple[mmap.mmap, "torch.Tensor"]:
    import torch

    mm = mmap.mmap(fd, size, flags=_MMAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


# -- daemon side --------------------------------------------------------------------------------------------


class Region:
    """One region the daemon created: ``tensor`` is a flat uint8 view of all ``size`` bytes."""

    __slots__ = ("name", "path", "size", "tensor", "pinned", "_mm", "_registry", "_closed", "__weakref__")

    def __init__(
        self, registry: "Registry", name: str, path: str, size: int, mm: mmap.mmap, tensor: "torch.Tensor"
    ) -> None:
        self._registry = registry
        self.name = name
        self.path = path
        self.size = size
        self._mm = mm
        self.tensor = tensor
        self.pinned = _cuda_register(tensor)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unlink the name (clients can no longer map it). Idempotent.

        The mapping stays valid for whoever still holds a view of it (an
        in-flight socket transfer, a client's mapping); the memory goes back
        to the system when the last one drops it.
        """
        if self._closed:
            return
        self._closed = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # pragma: no cover
            log.warning("cannot unlink %s: %s", self.path, exc)
        if self.pinned:  # pragma: no cover - needs a GPU
            _cuda_unregister(self.tensor)
            self.pinned = False
        self._registry._forget(self)

    def __repr__(self) -> str:
        return f"Region({self.name}, {self.size} B{', closed' if self._closed else ''})"


_live: "weakref.WeakSet[Registry]" = weakref.WeakSet()
_live_lock = threading.Lock()
_atexit_registered = False


def unlink_all() -> None:
    """Unlink every region (and lock file) of every registry of this process (exit paths)."""
    with _live_lock:
        regs = list(_live)
    for r in regs:
        try:
            r.close()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(directory: str = SHM_DIR, *, keep: tuple[str, ...] = ()) -> int:
    """Remove the regions of tensorwire daemons that are gone; returns files removed.

    A set (``tensorwire-<pid>-<tag>*``) is stale when nobody holds the flock of
    its lock file (its process exited, whatever pid namespace it lived in), or
    -- without a lock file -- when its pid is not alive. Only files this uid
    owns are touched; ``keep`` names prefixes of live registries of this process.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    uid = os.geteuid()
    prefixes: dict[str, bool] = {}  # prefix -> stale
    for n in names:
        m = _LOCK_RE.match(n) or _TMP_LOCK_RE.match(n)
        if m is None:
            continue
        prefix = f"tensorwire-{m.group(1)}-{m.group(2)}"
        if prefix in keep:
            continue
        path = os.path.join(directory, n)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                prefixes.setdefault(prefix, False)
                continue
            prefixes[prefix] = prefixes.get(prefix, True)
        finally:
            os.close(fd)
    removed = 0
    for n in names:
        m = _NAME_RE.match(n)
        lm = m or _LOCK_RE.match(n) or _TMP_LOCK_RE.match(n)
        if lm is None:
            continue
        prefix = f"tensorwire-{lm.group(1)}-{lm.group(2)}"
        if prefix in keep:
            continue
        stale = prefixes.get(prefix)
        if stale is None:  # no lock file: the pid decides
            stale = not _pid_alive(int(lm.group(1)))
        if not stale:
            continue
        path = os.path.join(directory, n)
        try:
            if os.lstat(path).st_uid != uid:
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    if removed:
        log.info("removed %d shared-memory files of tensorwire daemons that are gone from %s", removed, directory)
    return removed


class Registry:
    """The daemon's regions (see the module docstring). Thread-safe.

    Raises (constructor):
        ShmError: the directory is missing or not usable (the daemon serves without shared memory).
    """

    def __init__(
        self,
        directory: str = SHM_DIR,
        *,
        max_regions: int = MAX_REGIONS,
        on_change: Callable[[int, int], None] | None = None,
    ) -> None:
        global _atexit_registered
        self.directory = directory
        self.max_regions = max_regions
        self.prefix = f"tensorwire-{os.getpid()}-{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}
        self._bytes = 0
        self._closed = False
        self._on_change = on_change
        self._warned: set[str] = set()
        if not os.path.isdir(directory):
            raise ShmError(errno.ENOENT, f"{directory} does not exist")
        with _live_lock:
            keep = tuple(r.prefix for r in _live)
        clean_stale(directory, keep=keep)
        self._lock_fd = self._make_lock()
        with _live_lock:
            _live.add(self)
            if not _atexit_registered:
                atexit.register(unlink_all)
                _atexit_registered = True
        try:
            self.create(1).close()  # proves creating, sizing and mapping work here
        except ShmError:
            self.close()
            raise

    def _make_lock(self) -> int:
        """Create and flock the lock file under a temporary name, then rename it (no unlocked window)."""
        tmp = os.path.join(self.directory, f".{self.prefix}.lock.tmp")
        final = os.path.join(self.directory, f"{self.prefix}.lock")
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ShmError(exc.errno, f"cannot create a file in {self.directory}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, final)
        except OSError as exc:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise ShmError(exc.errno, f"cannot lock a file in {self.directory}: {exc.strerror}") from None
        return fd

    @property
    def regions(self) -> int:
        return len(self._regions)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def names(self) -> list[str]:
        with self._lock:
            return list(self._regions)

    def create(self, nbytes: int) -> Region:
        """A new region of at least ``nbytes`` (page-rounded), zero-filled, mapped in this process.

        Raises:
            ShmError: closed registry, too many regions, ``/dev/shm`` full or anything else
                the system refused (nothing is left behind).
        """
        size = round_page(nbytes)
        with self._lock:
            if self._closed:
                raise ShmError(errno.EBADF, "shared memory is closed")
            if len(self._regions) >= self.max_regions:
                raise ShmError(errno.EMFILE, f"{self.max_regions} shared-memory regions exist already")
        name = f"{self.prefix}-{secrets.token_hex(12)}"
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ShmError(exc.errno, f"cannot create {path}: {exc.strerror}") from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
                mm, tensor = _map_fd(fd, size)
            except OSError as exc:
                os.unlink(path)
                hint = ""
                if exc.errno == errno.ENOSPC:
                    hint = (
                        f" ({self.directory} is full: it is a tmpfs with a size limit; docker: --shm-size, "
                        "Kubernetes: an emptyDir with medium: Memory)"
                    )
                raise ShmError(
                    exc.errno, f"cannot allocate {size} bytes in {self.directory}: {exc.strerror}{hint}"
                ) from None
        finally:
            os.close(fd)
        region = Region(self, name, path, size, mm, tensor)
        with self._lock:
            closed = self._closed
            if not closed:
                self._regions[name] = region
                self._bytes += size
                n, b = len(self._regions), self._bytes
        if closed:
            region.close()
            raise ShmError(errno.EBADF, "shared memory is closed")
        if self._on_change is not None:
            self._on_change(n, b)
        return region

    def _forget(self, region: Region) -> None:
        with self._lock:
            if self._regions.pop(region.name, None) is None:
                return
            self._bytes -= region.size
            n, b = len(self._regions), self._bytes
        if self._on_change is not None:
            self._on_change(n, b)

    def warn_once(self, key: str, msg: str, *args: Any) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(msg, *args)

    def close(self) -> None:
        """Unlink every region and the lock file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            regions = list(self._regions.values())
        for r in regions:
            r.close()
        try:
            os.unlink(os.path.join(self.directory, f"{self.prefix}.lock"))
        except OSError:
            pass
        try:
            os.close(self._lock_fd)
        except OSError:  # pragma: no cover
            pass
        with _live_lock:
            _live.discard(self)


class Leases:
    """The daemon's lease table: one uint64 *generation* per tensor kept in shared memory.

    A read lease lets a client on this host read the version it was last
    handed again without asking the daemon (no request, no pin): the reply to
    a shared-memory read names the tensor's cell and its generation at the
    moment the version was pinned. The daemon changes a cell's generation
    before anything could make that lease wrong:

    - a commit that makes another slot current: ``+2``;
    - a row update in place: odd from before the first byte is written until
      after the last (``+1``, ``+1``);
    - delete, and closing the table (shutdown): ``+2`` / odd for good.

    A client reads the generation, copies, and reads it again: equal to its
    lease both times means the bytes it copied are the version it was handed,
    whole (a writer into that slot bumps the cell first, and on x86 loads are
    not reordered with loads). Anything else: the client drops the lease and
    asks the daemon (the ordinary pinned read). Generations only grow, also
    across the reuse of a freed cell, so an old lease never matches again.

    Every change is made by the daemon under the tensor's lock; clients only
    read the table (it is mapped read-only on their side).
    """

    def __init__(self, registry: Registry, cells: int = LEASE_CELLS) -> None:
        import ctypes

        self.region = registry.create(8 * cells)
        self._cells = (ctypes.c_uint64 * cells).from_buffer(self.region._mm)
        self._free = list(range(cells - 1, 0, -1))  # cell 0 is never handed out
        self._lock = threading.Lock()
        self._closed = False

    @property
    def name(self) -> str:
        return self.region.name

    def alloc(self) -> int:
        """A free cell (its generation even), or 0 when none is left (that tensor gets no leases)."""
        with self._lock:
            if self._closed or not self._free:
                return 0
            cell = self._free.pop()
            g = self._cells[cell]
            if g & 1:  # pragma: no cover - freed cells are left even
                self._cells[cell] = g + 1
            return cell

    def gen(self, cell: int) -> int:
        return self._cells[cell] if cell else 0

    def bump(self, cell: int, by: int = 2) -> None:
        """Advance ``cell``'s generation (by 2: a new state; by 1: into or out of a write in place)."""
        if cell:
            self._cells[cell] += by

    def free(self, cell: int) -> None:
        """The tensor is gone: invalidate its leases and keep the cell for another tensor."""
        if not cell:
            return
        with self._lock:
            g = self._cells[cell]
            self._cells[cell] = (g | 1) + 1  # even, and past every generation handed out for it
            if not self._closed:
                self._free.append(cell)

    def close(self) -> None:
        """Shutdown: every cell odd for good (each lease fails; clients ask, and learn the daemon is going)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            cells = self._cells
            for i in range(1, len(cells)):
                cells[i] = cells[i] | 1
        self.region.close()


def new_hello(registry: Registry) -> tuple[Region, bytes]:
    """A session's hello region and the nonce written in it (the client proves it can read it)."""
    region = registry.create(HELLO_BYTES)
    nonce = secrets.token_bytes(HELLO_NONCE_BYTES)
    region.tensor[: len(HELLO_MAGIC)].copy_(_as_tensor(HELLO_MAGIC))
    region.tensor[len(HELLO_MAGIC) : len(HELLO_MAGIC) + HELLO_NONCE_BYTES].copy_(_as_tensor(nonce))
    return region, nonce


def _as_tensor(b: bytes) -> "torch.Tensor":
    import torch

    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


# -- client side -----------------------------------------------------------------------------------------------


def _open_map(name: str, need: int) -> tuple[mmap.mmap, "torch.Tensor"]:
    """Map region ``name`` read-write; it must hold at least ``need`` bytes.

    Raises:
        ShmError: not a region name, not there, not a regular file, too small, or not mappable.
    """
    if not valid_name(name):
        raise ShmError(errno.EINVAL, f"{name!r} is not a tensorwire shared-memory region name")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ShmError(exc.errno, f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < max(1, need):
            raise ShmError(errno.EINVAL, f"{path} is not a region of at least {need} bytes")
        try:
            return _map_fd(fd, st.st_size)
        except OSError as exc:
            raise ShmError(exc.errno, f"cannot map {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def read_hello(name: str) -> bytes:
    """The proof nonce of a session's hello region (mapped and unmapped at once).

    Raises:
        ShmError: the region is not reachable from this process, or is not a hello region.
    """
    mm, t = _open_map(name, HELLO_BYTES)
    try:
        head = bytes(mm[: len(HELLO_MAGIC) + HELLO_NONCE_BYTES])
    finally:
        del t
        try:
            mm.close()
        except BufferError:  # pragma: no cover - a view is still alive somewhere
            pass
    if head[: len(HELLO_MAGIC)] != HELLO_MAGIC:
        raise ShmError(errno.EINVAL, f"{name} is not a hello region")
    return head[len(HELLO_MAGIC) :]


class LeaseTable:
    """A client's read-only view of a daemon's :class:`Leases`, with the daemon's liveness.

    ``alive()`` asks the kernel whether the daemon still holds the ``flock``
    of its lock file (one non-blocking ``flock`` call): a SIGKILLed daemon's
    table never changes again, so a lease must not outlive it.

    Raises (constructor):
        ShmError: not a region name of a daemon on this host, too small, or not mappable.
    """

    def __init__(self, name: str) -> None:
        m = _NAME_RE.match(name) if isinstance(name, str) else None
        if m is None:
            raise ShmError(errno.EINVAL, f"{name!r} is not a tensorwire shared-memory region name")
        path = os.path.join(SHM_DIR, name)
        lock = os.path.join(SHM_DIR, f"tensorwire-{m.group(1)}-{m.group(2)}.lock")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmError(exc.errno, f"cannot open {path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < 16 or size % 8:
                raise ShmError(errno.EINVAL, f"{path} is not a lease table")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as exc:
            raise ShmError(exc.errno, f"cannot map {path}: {exc.strerror}") from None
        finally:
            os.close(fd)
        try:
            self._lock_fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            mm.close()
            raise ShmError(exc.errno, f"cannot open {lock}: {exc.strerror}") from None
        import numpy as np

        self._mm = mm
        #: The generations, read-only (an aligned 8-byte load each).
        self.cells = np.frombuffer(mm, dtype=np.uint64)
        self.size = size // 8
        self.name = name

    def alive(self) -> bool:
        """Whether the daemon still runs (holds its lock)."""
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        self.cells = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # pragma: no cover - a caller still holds a view
            pass


#: The session page's counters (uint64 from PAGE_STATS_OFFSET): operations, then bytes, of each read kind.
_PAGE_SLOTS = {"get": 0, "get_rows": 2}
assert PAGE_AHEAD_OFFSET >= PAGE_STATS_OFFSET + 16 * len(_PAGE_SLOTS)


def _page_counters(mm: mmap.mmap) -> Any:
    """The session page's counters as a uint64 numpy view of ``mm`` (see :data:`_PAGE_SLOTS`)."""
    import numpy as np

    return np.frombuffer(mm, dtype=np.uint64, count=2 * len(_PAGE_SLOTS), offset=PAGE_STATS_OFFSET)


def page_ahead(mm: mmap.mmap) -> Any:
    """The session page's write-ahead ticket (one uint64 numpy element at :data:`PAGE_AHEAD_OFFSET`)."""
    import numpy as np

    return np.frombuffer(mm, dtype=np.uint64, count=1, offset=PAGE_AHEAD_OFFSET)


class PageLock:
    """An ``flock`` on a session page's file: who may touch a write-ahead grant's slot (shm version 3).

    A *write-ahead grant* (:class:`tensorwire.serve.daemon.store.AheadGrant`) is the
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


class SessionPage:
    """A client's mapping of its session's hello page: the reads its leases served (counted here), and the
    ticket of its write-ahead grant with the page's :class:`PageLock`."""

    def __init__(self, name: str) -> None:
        self._mm, t = _open_map(name, HELLO_BYTES)
        del t
        self.counts = _page_counters(self._mm)  # the client is the only writer
        self.ahead = page_ahead(self._mm)  # the daemon is the only writer
        try:
            self.lock = PageLock(os.path.join(SHM_DIR, name))
        except ShmError:
            self._mm.close()
            raise

    def add(self, op: str, nbytes: int) -> None:
        """One lease read of kind ``op`` ("get" or "get_rows") that copied ``nbytes``."""
        c, i = self.counts, _PAGE_SLOTS[op]
        c[i] += 1
        c[i + 1] += nbytes

    def close(self) -> None:
        self.counts = self.ahead = None
        self.lock.close()
        try:
            self._mm.close()
        except BufferError:  # pragma: no cover
            pass


def page_counts(region: Region) -> tuple[int, int, int, int]:
    """Daemon side: what a session's client counted in its page (get ops, get bytes, get_rows ops, bytes)."""
    a = _page_counters(region._mm)
    return int(a[0]), int(a[1]), int(a[2]), int(a[3])


class ClientMaps:
    """A client's mappings of daemon regions, by name (see the module docstring). Not thread-safe
    (the client serialises its operations)."""

    def __init__(self, limit: int = CLIENT_MAPS) -> None:
        self.limit = limit
        self._maps: "collections.OrderedDict[str, tuple[mmap.mmap, torch.Tensor]]" = collections.OrderedDict()
        self._slices: "dict[str, tuple[int, int, torch.Tensor]]" = {}  # name -> the last (offset, nbytes, view)
        self._pinned: set[str] = set()
        self.mapped = 0  # regions mapped so far (a test hook and a debugging aid)

    def get(self, name: str, offset: int, nbytes: int) -> "torch.Tensor":
        """Bytes ``[offset, offset + nbytes)`` of region ``name`` (a uint8 view).

        Raises:
            ShmError: the region cannot be mapped or is smaller than that.
        """
        if offset < 0 or nbytes < 0:
            raise ShmError(errno.EINVAL, f"bad region range {offset}+{nbytes}")
        last = self._slices.get(name)
        if last is not None and last[0] == offset and last[1] == nbytes:
            return last[2]  # the usual case: the same slot again (a view costs ~10 us to make)
        m = self._maps.get(name)
        if m is None:
            self._evict_unlinked()
            m = _open_map(name, offset + nbytes)
            self.mapped += 1
            self._maps[name] = m
            while len(self._maps) > self.limit:
                self._drop(next(iter(self._maps)))
        else:
            self._maps.move_to_end(name)
        t = m[1]
        if offset + nbytes > t.numel():
            raise ShmError(errno.EINVAL, f"{name} holds {t.numel()} bytes, not {offset}+{nbytes}")
        view = t[offset : offset + nbytes]
        self._slices[name] = (offset, nbytes, view)
        return view

    def pin_for_cuda(self, name: str) -> None:
        """Page-lock a mapping once it serves a CUDA tensor (fast DMA; only then, so CPU clients never touch CUDA)."""
        if name in self._pinned or name not in self._maps:
            return
        if _cuda_register(self._maps[name][1]):  # pragma: no cover - needs a GPU
            self._pinned.add(name)

    def _drop(self, name: str) -> None:
        self._slices.pop(name, None)
        m = self._maps.pop(name, None)
        if m is None:
            return
        if name in self._pinned:  # pragma: no cover - needs a GPU
            self._pinned.discard(name)
            _cuda_unregister(m[1])
        mm, t = m
        del t, m
        try:
            mm.close()
        except BufferError:
            pass  # a view is still alive: the mapping goes when it does

    def _evict_unlinked(self) -> None:
        for name in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            self._drop(name)

    def names(self) -> list[str]:
        return list(self._maps)

    def close(self) -> None:
        for name in list(self._maps):
            self._drop(name)


class _Pieces:
    """One split copy: pieces ``0 .. n - 1`` taken by whoever comes first (the caller, the helper)."""

    __slots__ = ("fn", "n", "next", "inflight", "error", "cond")

    def __init__(self, fn: Callable[[int], None], n: int) -> None:
        self.fn = fn
        self.n = n
        self.next = 0
        self.inflight = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition(threading.Lock())

    def work(self) -> None:
        cond = self.cond
        while True:
            with cond:
                if self.next >= self.n or self.error is not None:
                    return
                i = self.next
                self.next += 1
                self.inflight += 1
            try:
                self.fn(i)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with cond:
                    self.error = self.error or exc
            finally:
                with cond:
                    self.inflight -= 1
                    if not self.inflight:
                        cond.notify_all()

    def wait(self) -> None:
        with self.cond:
            self.next = self.n  # nothing more starts
            while self.inflight:
                self.cond.wait()


class Copier:
    """Copies and row gathers of this process, big ones split between the calling thread and helpers.

    numpy releases the GIL while it copies; the pieces are taken in turn by
    whichever thread is free, so a helper that is slow to wake costs little:
    the caller does the pieces meanwhile. A copy is split only when the
    machine is not oversubscribed at that moment (no more runnable tasks than
    CPUs, ``/proc/loadavg``), over as many helpers as there are cores left
    (at most :data:`MAX_HELPERS`; one on a 2-core machine):
    measured on the 2-core VM, a 16 MiB get went 9.0 -> 10.4 GB/s split for
    one client, but 16 clients at once got less in all with helpers than
    without (8.5 vs 9.9 GB/s); on a 16-core host one helper left a 4,096-row
    gather at 0.42 ms where torch's own threads index in 0.15 ms
    (bench/results/serve_h100_2026-11-23-2.md). Not re-entrant (a client runs one
    operation at a time).
    """

    #: Copies of at least this many bytes are split (unless the machine is oversubscribed).
    SPLIT_BYTES = 4 << 20
    #: Gathers too: they wait on memory (random rows), so a second thread pays off sooner (measured:
    #: 4,096 rows of 512 bytes from a 1,000,000-row table, 414 -> 321 us).
    TAKE_SPLIT_BYTES = 1 << 20
    #: Pieces of a split copy: at least this many, and two per thread.
    PIECES = 8
    #: Helper threads at most (memory bandwidth, not cores, bounds a copy beyond a few threads).
    MAX_HELPERS = 7
    #: A gather that may use torch's thread pool (``take(pool=True)``: a read from a lease, which no
    #: request to the daemon follows at once) on a machine of at least TORCH_GATHER_MIN_CPUS cores, not
    #: oversubscribed at the moment (as for splitting), is torch's ``index_select`` rather than numpy's
    #: ``take`` (which holds the GIL: helpers do not speed it up). A lease get_rows of 4,096 rows of a 1,000,000 x 128 float32 table on the
    #: 16-core H100 host: 0.46-0.66 ms with numpy and 0-7 helpers, 0.105 ms with torch. Not after a
    #: request (an OpenMP team spins a while after its work, on the cores the daemon needs to answer the
    #: client's next request: there a get_rows without leases went 1.04 -> 1.47 ms), and not on a
    #: 2-core machine (0.72-0.84 vs 0.95-1.14 ms, and the same spinning).
    TORCH_GATHER = True
    TORCH_GATHER_MIN_CPUS = 4

    def __init__(self) -> None:
        self._tasks: "queue.SimpleQueue[_Pieces | None]" = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        cpus = self._cpus = usable_cpus()
        self.parallel = cpus > 1
        self._loadavg = -1
        if self.parallel:
            try:
                self._loadavg = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # pragma: no cover - not Linux: always split
                pass

    def _split(self, nbytes: int, least: int) -> int:
        """Helpers to split a copy of ``nbytes`` over now (0: do it in the calling thread)."""
        if nbytes < least or not self.parallel:
            return 0
        most = min(self.MAX_HELPERS, self._cpus - 1)
        if self._loadavg < 0:  # pragma: no cover
            return most
        try:
            running = int(os.pread(self._loadavg, 64, 0).split()[3].split(b"/")[0])  # this thread included
        except (OSError, ValueError, IndexError):  # pragma: no cover
            return most
        # not oversubscribed (one runnable besides us on a 2-core machine may well be the daemon polling for
        # our next request, which yields its core at once); one helper per core left, that one included
        if running > self._cpus:
            return 0
        return max(1, min(most, self._cpus - running + 1))

    def _run(self, fn: Callable[[int], None], n: int, helpers: int) -> None:
        job = _Pieces(fn, n)
        while len(self._threads) < helpers:
            th = threading.Thread(target=self._loop, name=f"tensorwire-client-copy-{len(self._threads)}", daemon=True)
            th.start()
            self._threads.append(th)
        for _ in range(helpers):
            self._tasks.put(job)  # a helper that comes late finds nothing left and waits for the next
        try:
            job.work()
        finally:
            job.wait()
        if job.error is not None:
            raise job.error

    def _loop(self) -> None:
        while True:
            job = self._tasks.get()
            if job is None:
                return
            job.work()

    def copy(self, dst: Any, src: Any) -> None:
        """``dst[:] = src`` for flat uint8 numpy arrays of one length."""
        import numpy as np

        n = len(dst)
        helpers = self._split(n, self.SPLIT_BYTES)
        if not helpers:
            np.copyto(dst, src)
            return
        pieces = max(self.PIECES, 2 * (helpers + 1))
        step = ((n + pieces - 1) // pieces + 63) // 64 * 64

        def piece(i: int) -> None:
            a, b = i * step, min(n, (i + 1) * step)
            if a < b:
                np.copyto(dst[a:b], src[a:b])

        self._run(piece, pieces, helpers)

    def take(self, table: Any, index: Any, out: Any, *, pool: bool = False) -> None:
        """Rows ``index`` of ``table`` (a 2-D uint8 numpy array: rows x row bytes) into ``out`` (indices checked).

        ``pool``: torch's thread pool may do it (see :data:`TORCH_GATHER`)."""
        import numpy as np

        rows, width = len(index), table.shape[1]
        helpers = self._split(rows * width, self.TAKE_SPLIT_BYTES) if rows >= self.PIECES else 0
        if not helpers:
            np.take(table, index, axis=0, out=out, mode="clip")  # "clip": unbuffered (indices are in range)
            return
        if pool and self.TORCH_GATHER and self._cpus >= self.TORCH_GATHER_MIN_CPUS:
            import torch

            if not table.flags.writeable and not _READONLY_WARNING_SILENCED:
                _silence_readonly_warning()
            torch.index_select(torch.from_numpy(table), 0, torch.from_numpy(index), out=torch.from_numpy(out))
            return
        pieces = min(rows, max(self.PIECES, 2 * (helpers + 1)))
        step = (rows + pieces - 1) // pieces

        def piece(i: int) -> None:
            a, b = i * step, min(rows, (i + 1) * step)
            if a < b:
                np.take(table, index[a:b], axis=0, out=out[a:b], mode="clip")

        self._run(piece, pieces, helpers)

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        self._threads = []
        if self._loadavg >= 0:
            os.close(self._loadavg)
            self._loadavg = -1
