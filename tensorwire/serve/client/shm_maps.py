"""The client's half of shared memory (the layout both sides share: :mod:`tensorwire.serve.protocol.shm`).

:class:`ClientMaps` maps regions by the names the daemon gives it (checked
against the name pattern; never a path), read-write, with ``MAP_POPULATE``;
keeps up to :data:`~tensorwire.serve.protocol.shm.CLIENT_MAPS` mappings (least
recently used dropped first) and drops mappings whose file the daemon has
unlinked whenever it maps a new one, so a deleted tensor's memory is returned
to the system once no process maps it. Copies in and out of regions are numpy's
(``copyto``: no OpenMP team; measured on the 2-core VM with 16 client processes,
torch's ``copy_`` fell to 4.5 GB/s in all, numpy held 14-17 GB/s), the big ones
split between the calling thread and helpers; row gathers are numpy's ``take``,
or torch's ``index_select`` (its thread pool) for a lease read (:class:`Copier`).

Beside them: the proof a session's client gives that it maps the daemon's memory
(:func:`read_hello`), its read-only view of the daemon's lease table
(:class:`LeaseTable`) and its mapping of the session page (:class:`SessionPage`).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import mmap
import os
import queue
import stat
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from tensorwire import lifecycle
from tensorwire.buffers import cuda_available
from tensorwire.cpus import usable_cpus
from tensorwire.hostmap import map_host
from tensorwire.serve.client.gather_choice import GatherChoice
from tensorwire.serve.protocol.shm import (
    CLIENT_MAPS,
    HELLO_BYTES,
    HELLO_MAGIC,
    HELLO_NONCE_BYTES,
    NAME_RE,
    PAGE_SLOTS,
    SHM_DIR,
    PageLock,
    ShmError,
    map_fd,
    page_ahead,
    page_counters,
    valid_name,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ClientMaps", "Copier", "LeaseTable", "SessionPage", "read_hello"]

log = logging.getLogger(__name__)


_READONLY_WARNING_SILENCED = False


def _silence_readonly_warning() -> None:
    """A read-only mapping of a daemon's table goes to ``torch.index_select``, which only reads it, but torch
    warns about any tensor over a read-only array: silence exactly that message."""
    global _READONLY_WARNING_SILENCED
    import warnings

    warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
    _READONLY_WARNING_SILENCED = True


_REFUSED_LOGGED = False


def _refused(exc: BaseException) -> None:  # pragma: no cover - needs a GPU
    """CUDA refused to register a region: one log line per process (the reads stage through pinned memory)."""
    global _REFUSED_LOGGED
    if not _REFUSED_LOGGED:
        _REFUSED_LOGGED = True
        log.warning(
            "shared memory: CUDA refused to map the daemon's memory (%s); CUDA reads and writes stage through "
            "pinned host memory",
            exc,
        )


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
            return map_fd(fd, st.st_size)
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
    table never changes again, so a lease must not outlive it. Lease reads
    ask :meth:`alive_lately`, which trusts an answer for :data:`ALIVE_FOR`:
    a lease outlives its daemon by at most that (a daemon that exits cleanly
    seals its table, which ends every lease at once). What such a read gets
    is still one whole version, the last the daemon committed: a daemon
    killed while it writes in place leaves the generation odd, which no
    lease matches.

    Raises (constructor):
        ShmError: not a region name of a daemon on this host, too small, or not mappable.
    """

    def __init__(self, name: str) -> None:
        m = NAME_RE.match(name) if isinstance(name, str) else None
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
        self._alive_until = 0.0  # time.monotonic() until which the last alive() stands

    #: Seconds an ``alive()`` that found the daemon running stands for lease reads. The ``flock`` costs
    #: ~2.3 us of a 1-row lease read's ~10 (2-core VM); at one per millisecond it costs a 4,096-row
    #: read (~0.3 ms) well under 1 us, while a killed daemon's leases end within a millisecond.
    ALIVE_FOR = 0.001

    def alive_lately(self) -> bool:
        """Whether the daemon runs, by an ``alive()`` of at most :data:`ALIVE_FOR` ago (made now if older)."""
        now = time.monotonic()
        if now < self._alive_until:
            return True
        if not self.alive():
            return False
        self._alive_until = now + self.ALIVE_FOR
        return True

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


class SessionPage:
    """A client's mapping of its session's hello page: the reads its leases served (counted here), and the
    ticket of its write-ahead grant with the page's :class:`PageLock`."""

    def __init__(self, name: str) -> None:
        self._mm, t = _open_map(name, HELLO_BYTES)
        del t
        self.counts = page_counters(self._mm)  # the client is the only writer
        self.ahead = page_ahead(self._mm)  # the daemon is the only writer
        try:
            self.lock = PageLock(os.path.join(SHM_DIR, name))
        except ShmError:
            self._mm.close()
            raise

    def add(self, op: str, nbytes: int) -> None:
        """One lease read of kind ``op`` ("get" or "get_rows") that copied ``nbytes``."""
        c, i = self.counts, PAGE_SLOTS[op]
        c[i] += 1
        c[i + 1] += nbytes

    def close(self) -> None:
        self.counts = self.ahead = None
        self.lock.close()
        try:
            self._mm.close()
        except BufferError:  # pragma: no cover
            pass


class ClientMaps:
    """A client's mappings of daemon regions, by name (see the module docstring). Not thread-safe
    (the client serialises its operations)."""

    def __init__(self, limit: int = CLIENT_MAPS) -> None:
        self.limit = limit
        self._maps: "collections.OrderedDict[str, tuple[mmap.mmap, torch.Tensor]]" = collections.OrderedDict()
        self._slices: "dict[str, tuple[int, int, torch.Tensor]]" = {}  # name -> the last (offset, nbytes, view)
        self._cuda: "dict[str, Any]" = {}  # name -> its tensorwire.hostmap.HostMapping (None: CUDA refused)
        self._events: dict[str, Any] = {}  # name -> the event ending the last GPU read of it
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

    def cuda_mapping(self, name: str) -> "Any | None":
        """Region ``name`` registered with CUDA (:func:`tensorwire.hostmap.map_host`: page-locked, mapped into
        the GPUs' address space, with a CUDA tensor over it on the device current at the first call); once
        per mapping, and only when a CUDA tensor is involved (CPU clients never touch CUDA). None: not
        mapped here, or CUDA refused (logged once per process): the caller stages through pinned memory."""
        if name in self._cuda:
            return self._cuda[name]
        m = self._maps.get(name)
        if m is None or not m[1].numel() or not cuda_available():
            return None
        got = None
        try:  # pragma: no cover - needs a GPU
            import torch

            got = map_host(m[1].data_ptr(), m[1].numel(), torch.cuda.current_device())
        except OSError as exc:  # pragma: no cover - needs a GPU
            _refused(exc)
        self._cuda[name] = got
        return got

    def pin_for_cuda(self, name: str) -> None:
        """Page-lock a mapping once it serves a CUDA tensor (fast DMA; only then, so CPU clients never touch CUDA)."""
        self.cuda_mapping(name)

    def cuda_view(self, name: str, src: "torch.Tensor", device: "torch.device") -> "torch.Tensor | None":
        """The bytes of ``src`` (a view of region ``name`` from :meth:`get`) as a CUDA tensor on ``device``
        (None: not registered, or registered for another device)."""
        m = self.cuda_mapping(name)
        if m is None or m.device != device.index:
            return None
        off = src.data_ptr() - self._maps[name][1].data_ptr()  # pragma: no cover - needs a GPU
        return m.tensor[off : off + src.numel()]  # pragma: no cover - needs a GPU

    def gpu_read(self, name: str, event: Any) -> None:
        """A GPU reads region ``name`` until ``event`` has passed (it is not unmapped before)."""
        self._events[name] = event

    def _drop(self, name: str) -> None:
        self._slices.pop(name, None)
        ev = self._events.pop(name, None)
        if ev is not None:  # pragma: no cover - needs a GPU
            ev.synchronize()  # no kernel reads pages about to be unregistered and unmapped
        reg = self._cuda.pop(name, None)
        if reg is not None:  # pragma: no cover - needs a GPU
            reg.close()
        m = self._maps.pop(name, None)
        if m is None:
            return
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
    #: A gather that may use torch's thread pool (``take(pool=True)``: a read from a lease, which no request
    #: to the daemon follows at once) is torch's ``index_select`` -- the kernel a local
    #: ``torch.index_select(table, 0, idx, out=...)`` runs, with the same threads -- rather than numpy's
    #: ``take`` (which holds the GIL: helpers do not speed it up). A lease get_rows of 4,096 rows of a
    #: 1,000,000 x 128 float32 table on the 16-core H100 host: 0.46-0.66 ms with numpy and 0-7 helpers,
    #: 0.105 ms with torch; on the 2-core VM, measured in turns on a quiet moment, torch's two threads
    #: 216 us against numpy's 365 us. Not after a request (an OpenMP team spins a while after its work, on
    #: the cores the daemon needs to answer the client's next request: there a get_rows without leases went
    #: 1.04 -> 1.47 ms on the 16-core host). Whether torch's or numpy's wins on a machine busy with other
    #: work is measured as the reads go (:meth:`torch_gather`); False: numpy's always.
    TORCH_GATHER = True

    def __init__(self) -> None:
        self._tasks: "queue.SimpleQueue[_Pieces | None]" = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        cpus = self._cpus = usable_cpus()
        self.parallel = cpus > 1
        self._loadavg = -1
        #: torch's gather or numpy's for a lease read, measured (:meth:`torch_gather`)
        self.choice = GatherChoice()
        if self.parallel:
            try:
                self._loadavg = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # pragma: no cover - not Linux: always split
                pass

    def _running(self) -> int:
        """Tasks runnable on the machine now, this thread included (``/proc/loadavg``; 0: unknown)."""
        if self._loadavg < 0:  # pragma: no cover
            return 0
        try:
            return int(os.pread(self._loadavg, 64, 0).split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):  # pragma: no cover
            return 0

    def torch_gather(self, nbytes: int) -> bool:
        """Whether a lease gather of ``nbytes`` is torch's index_select (else numpy's take): :data:`TORCH_GATHER`
        and the faster of the two in their latest times (:class:`~.gather_choice.GatherChoice`; the caller
        times the gather and tells :meth:`gathered`)."""
        return self.TORCH_GATHER and self.choice.pick(nbytes)

    def gathered(self, torch: bool, nbytes: int, seconds: float) -> None:
        """A lease gather of ``nbytes`` (torch's or numpy's, as :meth:`torch_gather` said) took ``seconds``."""
        self.choice.took(torch, nbytes, seconds)

    def _split(self, nbytes: int, least: int) -> int:
        """Helpers to split a copy of ``nbytes`` over now (0: do it in the calling thread)."""
        if nbytes < least or not self.parallel:
            return 0
        most = min(self.MAX_HELPERS, self._cpus - 1)
        running = self._running()
        if not running:  # pragma: no cover - unknown
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
        rows, width = len(index), table.shape[1]
        if pool and rows:
            use = self.torch_gather(rows * width)
            t0 = time.perf_counter()
            if use:
                import torch

                if not table.flags.writeable and not _READONLY_WARNING_SILENCED:
                    _silence_readonly_warning()
                torch.index_select(torch.from_numpy(table), 0, torch.from_numpy(index), out=torch.from_numpy(out))
            else:
                self._take(table, index, out)
            self.gathered(use, rows * width, time.perf_counter() - t0)
            return
        self._take(table, index, out)

    def _take(self, table: Any, index: Any, out: Any) -> None:
        """numpy's take of rows ``index`` of ``table`` into ``out``, split over helper threads where that pays."""
        import numpy as np

        rows, width = len(index), table.shape[1]
        helpers = self._split(rows * width, self.TAKE_SPLIT_BYTES) if rows >= self.PIECES else 0
        if not helpers:
            np.take(table, index, axis=0, out=out, mode="clip")  # "clip": unbuffered (indices are in range)
            return
        pieces = min(rows, max(self.PIECES, 2 * (helpers + 1)))
        step = (rows + pieces - 1) // pieces

        def piece(i: int) -> None:
            a, b = i * step, min(rows, (i + 1) * step)
            if a < b:
                np.take(table, index[a:b], axis=0, out=out[a:b], mode="clip")

        self._run(piece, pieces, helpers)

    def close(self) -> None:
        threads, self._threads = self._threads, []
        for _ in threads:
            self._tasks.put(None)
        for th in threads:
            lifecycle.join(th)
        if self._loadavg >= 0:
            os.close(self._loadavg)
            self._loadavg = -1
