"""The daemon's half of shared memory (the layout both sides share: :mod:`tensorwire.serve.protocol.shm`).

:class:`Registry`, one per server, makes the regions the store keeps its slots in:

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

Beside it: the read-lease table (:class:`Leases`, shm version 2), a session's
hello region (:func:`new_hello`) and what its client counted in it
(:func:`page_counts`).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.serve.protocol.shm import (
    HELLO_BYTES,
    HELLO_MAGIC,
    HELLO_NONCE_BYTES,
    LEASE_CELLS,
    MAX_REGIONS,
    NAME_RE,
    SHM_DIR,
    ShmError,
    cuda_register,
    cuda_unregister,
    map_fd,
    page_counters,
    round_page,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Region", "Registry", "Leases", "new_hello", "page_counts", "unlink_all", "clean_stale"]

log = logging.getLogger(__name__)

_LOCK_RE = re.compile(r"^tensorwire-([0-9]{1,10})-([0-9a-f]{8})\.lock$")
_TMP_LOCK_RE = re.compile(r"^\.tensorwire-([0-9]{1,10})-([0-9a-f]{8})\.lock\.tmp$")


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
        self.pinned = cuda_register(tensor)
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
            cuda_unregister(self.tensor)
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
        m = NAME_RE.match(n)
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
                mm, tensor = map_fd(fd, size)
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


def page_counts(region: Region) -> tuple[int, int, int, int]:
    """Daemon side: what a session's client counted in its page (get ops, get bytes, get_rows ops, bytes)."""
    a = page_counters(region._mm)
    return int(a[0]), int(a[1]), int(a[2]), int(a[3])
