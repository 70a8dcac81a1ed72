"""The process-wide UCX engines: one context and worker per trust level, progressed by the waiting threads.

Every UCX call and every transport's bookkeeping happens under the engine's
lock. A thread that waits (for a receive, a credit, a send, a connection)
drives the worker itself: it polls ``worker.progress()`` for up to
:data:`SPIN_US`, yielding the core between two polls, then arms the worker and
sleeps in ``poll()`` on its epoll fd (woken by UCX events, by sockets it
watches, or through an eventfd by another thread). A daemon thread progresses
the worker every 50 ms while no thread waits, and only while the engine has
connections or listeners: closing the last one ends it (joined), the next one
starts it again. At interpreter exit the engines close what is still open, end
that thread and let go of their UCX worker and context
(:mod:`tensorwire.lifecycle`). Why this model, with measurements:
``docs/transports.md``.

Also here: the buffer descriptors handed to UCX (:func:`as_array`), built once
per address and size.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import os
import secrets
import select
import sys
import threading
import time
import weakref
from typing import Any, Callable, Deque

from tensorwire import lifecycle
from tensorwire.errors import ConfigError, TransportError
from tensorwire.settings import setting
from tensorwire.transport.ucx._ucxx import Array, close_ep, context_defaults, np, u8, ucx
from tensorwire.transport.ucx.wire import RID_MASK

__all__ = [
    "CUDA_SPIN",
    "ENGINES",
    "GRAVEYARD",
    "Engine",
    "Op",
    "as_array",
    "engine",
    "error_handling",
    "is_cuda",
]

log = logging.getLogger(__name__)

#: Microseconds a waiting thread polls the worker (yielding in between) before it sleeps.
SPIN_US = setting("ucx_spin_us")
#: The same for a wait on a transfer of CUDA memory. cuda_ipc copies are issued and
#: completed from worker progress and do not wake a sleeping worker promptly: measured on
#: 2 x H200 (bench/results/gpu_h200x2_2026-11-22-2.md), a 256 MiB send + ack took 1,281 us
#: with 100 us of spinning and 781 us with 2 ms (raw ucxx, always polling: 712 us).
CUDA_SPIN_US = setting("ucx_cuda_spin_us")
#: UCX endpoint keepalive interval (seconds) unless UCX_KEEPALIVE_INTERVAL is set.
KEEPALIVE_S = 2.0


def error_handling() -> bool:
    """Whether this process's UCX listeners make their endpoints with peer error handling.

    ``TENSORWIRE_UCX_ERROR_HANDLING``: ``peer`` (default) or ``none``. A
    listener tells each dialler which one it chose (REPLY flag), so the two
    ends of a connection always agree. See "Peer death and error handling" in
    ``docs/transports.md``: ``none`` lets UCX use cma (single-copy rendezvous
    between processes of one host) but UCX 1.21 then *aborts the process* when
    the peer dies during a transfer; ``peer`` never aborts but UCX leaves cma
    and the shared-memory transports out of such endpoints.
    """
    mode = setting("ucx_error_handling")
    if mode not in ("none", "peer"):
        raise ConfigError(f"TENSORWIRE_UCX_ERROR_HANDLING must be 'none' or 'peer', got {mode!r}")
    return mode == "peer"


#: Transports an untrusted peer's address may not select (see Engine: they act on the process id,
#: segment or IPC handle the address names).
UNTRUSTED_EXCLUDED = "sm,cma,posix,sysv,xpmem,knem,cuda_ipc,rocm_ipc"


class Cai:
    """A flat byte range of device memory, described by address only (no reference to its owner)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


#: (data_ptr, nbytes, is_cuda) -> ucxx Array describing that memory by address only (see as_array).
DESCRIPTORS: dict[tuple[int, int, bool], Any] = {}
_MAX_DESCRIPTORS = 4096


_TENSOR: Any = None  # torch.Tensor, once torch has been imported (this module never imports it)


def as_array(buf: Any, *, writable: bool) -> tuple[Any, Any, int]:
    """(keep-alive object, ucxx Array, nbytes) for a buffer: a contiguous tensor (its bytes, any dtype) or
    anything with the buffer protocol. Zero-copy."""
    global _TENSOR
    tensor = _TENSOR
    if tensor is None and "torch" in sys.modules:
        tensor = _TENSOR = sys.modules["torch"].Tensor
    if tensor is not None and isinstance(buf, tensor):
        if not buf.is_contiguous():
            raise ConfigError("UCX buffers must be contiguous tensors")
        n = buf.nbytes
        if n == 0:
            z = u8(0)
            return z, Array(z), 0
        # Building a descriptor through NumPy or torch's __cuda_array_interface__ costs 2 to tens
        # of us; slots and a training loop's tensors come back at the same addresses, so it is
        # built from the address alone -- a ctypes array over host memory, Cai over device memory
        # (straight to/from GPU memory) -- and reused by (address, size, kind). It references no
        # tensor, so the cache keeps no memory alive; the caller keeps ``buf`` alive while UCX uses it.
        # Any dtype: only the address and the byte count matter (no flat uint8 view to build).
        key = (buf.data_ptr(), n, buf.is_cuda)
        arr = DESCRIPTORS.get(key)
        if arr is None:
            if key[2] and not engine().ctx.cuda_support:
                raise ConfigError("this UCX build has no CUDA support; use host buffers")
            if len(DESCRIPTORS) >= _MAX_DESCRIPTORS:
                DESCRIPTORS.clear()
            arr = DESCRIPTORS[key] = Array(Cai(key[0], n) if key[2] else (ctypes.c_char * n).from_address(key[0]))
        return buf, arr, n
    mv = memoryview(buf)
    if writable and mv.readonly and mv.nbytes:  # (an empty one is fine: nothing is ever written into it)
        raise ConfigError("receive buffer is read-only")
    arr = np.frombuffer(mv.cast("B"), dtype=np.uint8) if mv.nbytes else u8(0)
    return (buf, arr), Array(arr), arr.nbytes


#: CUDA_SPIN_US in seconds.
CUDA_SPIN = CUDA_SPIN_US / 1e6


def is_cuda(keep: Any) -> bool:
    """Whether a buffer kept by as_array is CUDA memory (kept as the tensor itself)."""
    return getattr(keep, "is_cuda", False) is True


# -- the process-wide progress engine --------------------------------------------------


class Engine:
    """One UCX context + worker per process, progressed by the threads that wait on it.

    Every UCX call and every transport's bookkeeping happens under ``lock``.
    ``wait(pred, deadline)`` progresses the worker until ``pred()`` (called
    under the lock; it may raise) holds: it spins for ``spin`` seconds, then one
    thread sleeps on the worker's epoll fd and the others on ``cond``.
    """

    SLICE = 0.25
    TICK = 0.05
    FD_CHECK = 0.001  # while spinning, how often sockets are polled
    HOUSEKEEPING = 7  # idle progress() calls run ucxx's full progress once in HOUSEKEEPING + 1
    BUSY_HOUSEKEEPING = 63  # ... and progress() calls that did something, once in BUSY_HOUSEKEEPING + 1
    CLOCK_EVERY = 3  # a spinning waiter reads the clock (and calls pred() unprompted) once in CLOCK_EVERY + 1 polls

    def __init__(self, peer_timeout: float = 30.0, *, untrusted: bool = False) -> None:
        config = context_defaults()
        # Liveness (process-wide: the first listener/connection's peer_timeout decides),
        # like the TCP transport's keepalive: idle peer_timeout/3, probes every idle/2, 3 of them.
        idle = max(1, int(peer_timeout / 3))
        for name, value in (
            ("KEEPALIVE_INTERVAL", f"{KEEPALIVE_S}s"),
            ("TCP_KEEPIDLE", f"{idle}s"),
            ("TCP_KEEPINTVL", f"{max(1, idle // 2)}s"),
            ("TCP_KEEPCNT", "3"),
        ):
            if f"UCX_{name}" not in os.environ:
                config[name] = value
        self.untrusted = untrusted
        if untrusted:
            # Peers that are not trusted (serve clients) never get transports that act on a
            # process id or memory segment named in the address they send: cma would
            # process_vm_readv/writev whatever pid that address names (any process of this uid),
            # posix/sysv would attach whatever segment it names, cuda_ipc opens the handles it
            # names. Whatever UCX_TLS says, these stay out of this process's context.
            tls = os.environ.get("UCX_TLS", "").strip()
            if not tls or tls == "all" or tls.startswith("^"):
                config["TLS"] = "^" + ",".join(x for x in (tls[1:], UNTRUSTED_EXCLUDED) if x)
            else:
                kept = [t for t in tls.split(",") if t and t not in UNTRUSTED_EXCLUDED.split(",")]
                config["TLS"] = ",".join(kept) or "tcp"
        feats = (ucx.Feature.TAG, ucx.Feature.WAKEUP)
        try:
            self.ctx = ucx.UCXContext(config_dict=config, feature_flags=feats)
            self.worker = ucx.UCXWorker(self.ctx)
            self.worker.init_blocking_progress_mode()
            epfd = self.worker.epoll_file_descriptor
            self.address = self.worker.address.tobytes()  # what peers create their endpoints from
        except ucx.UCXError as exc:
            raise TransportError(f"cannot start UCX: {exc}") from exc
        self.pid = os.getpid()
        self.spin = SPIN_US / 1e6
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.poller = select.poll()
        self.poller.register(epfd, select.POLLIN)
        self.poller.register(self.wake_fd, select.POLLIN)
        self._self_ep: Any = None
        self.fd_handlers: dict[int, Callable[[int], None]] = {}  # liveness sockets, listening sockets
        self.sleeping = False
        self.cond_waiters = 0  # threads in cond.wait (under the lock)
        self.wanted: list[None] = []  # one entry per thread queued for the lock (append/pop are atomic)
        self.active = 0  # threads inside wait()
        self.servicing: set[Any] = set()  # listeners with handshakes in progress
        self.objects: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.ctrl_watch: "weakref.WeakSet[Any]" = weakref.WeakSet()  # transports awaiting a control message
        self._ctrl_owed = False  # something progressed since ctrl_watch was last looked at
        self.events = 0  # progress() calls that did something (UcxTransport.repost_and_wait watches it)
        self._idle = 0  # progress() calls that found nothing (ucxx's housekeeping runs every HOUSEKEEPING-th)
        self._ctrl_scan_at = 0.0
        self.stopped = False
        self._rids = itertools.count(secrets.randbelow(RID_MASK))
        self._ticker: threading.Thread | None = None  # runs while ``objects`` has members (adopt / disown)
        self._tick_stop = threading.Event()  # the running ticker's: set to end it
        lifecycle.track(self, lifecycle.ENGINES)

    # -- what the engine serves, and its progress thread ---------------------------------
    def adopt(self, obj: Any) -> None:
        """Under the lock: ``obj`` (a connection or listener, with ``close()``) uses this engine until
        :meth:`disown`; the progress thread runs meanwhile."""
        if self.stopped:
            raise TransportError("the UCX engine is shut down (the interpreter is exiting)")
        self.objects.add(obj)
        if self._ticker is None:
            stop = self._tick_stop = threading.Event()
            th = threading.Thread(target=_tick, args=(weakref.ref(self), stop), daemon=True, name="tensorwire-ucx-tick")
            self._ticker = th
            th.start()

    def disown(self, obj: Any) -> None:
        """Under the lock: ``obj`` was closed. The last one gone, the progress thread ends (joined)."""
        self.objects.discard(obj)
        if not self.objects:
            self._stop_ticker()

    def _stop_ticker(self) -> None:
        # Under the lock or not: the ticker never blocks on the lock and leaves once its event is set.
        th, self._ticker = self._ticker, None
        if th is not None:
            self._tick_stop.set()
            lifecycle.join(th)

    def close(self) -> None:
        """At interpreter exit (:mod:`tensorwire.lifecycle`): close every connection and listener still
        open, end the progress thread, let go of the worker and context. Idempotent."""
        if self.pid != os.getpid() or self.stopped:
            return
        for obj in list(self.objects):
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - best effort at exit
                log.debug("ucx: closing %r at exit: %s", obj, exc)
        self.stopped = True
        self._stop_ticker()
        with self.op():
            ep, self._self_ep = self._self_ep, None
            if ep is not None:
                close_ep(ep)
            self.fd_handlers.clear()
            try:
                os.close(self.wake_fd)
            except OSError:
                pass
        with _ENGINE_LOCK:
            if ENGINES.get(self.untrusted) is self:
                del ENGINES[self.untrusted]
        # The worker and context go with the last reference to this engine (a request kept in
        # GRAVEYARD holds the worker: UCX may still write into its buffers until then).

    def self_endpoint(self) -> Any:
        """Under the lock: an endpoint to this process's own worker (see UcxTransport._release_receives)."""
        if self._self_ep is None:
            self._self_ep = ucx.UCXEndpoint.create_from_worker_address(
                self.worker, ucx.UCXAddress.create_from_buffer(self.address), False
            )
        return self._self_ep

    def new_rid(self) -> int:
        while True:
            rid = next(self._rids) & RID_MASK
            if rid:
                return rid

    # -- locking -------------------------------------------------------------------
    def op(self) -> "Op":
        """Context manager: take the lock for a short operation (a spinning waiter yields)."""
        return Op(self)

    def notify(self) -> None:
        """Under the lock: wake every waiter so it re-checks its condition."""
        if self.cond_waiters:  # (notify_all checks the lock's owner first: ~0.5 us per message otherwise)
            self.cond.notify_all()
        if self.sleeping:
            try:
                os.eventfd_write(self.wake_fd, 1)
            except OSError:
                pass

    def progress(self) -> bool:
        """Under the lock: progress the worker; True if anything happened."""
        w = self.worker
        if not w.progress_once():
            idle = self._idle = self._idle + 1
            if not idle & self.HOUSEKEEPING:
                w.progress()  # also runs ucxx's housekeeping (cancellations after endpoint errors): 0.6 us
                if self._ctrl_owed:
                    self._scan_ctrl()
            return False
        while w.progress_once():
            pass
        events = self.events = self.events + 1
        if not events & self.BUSY_HOUSEKEEPING:
            w.progress()  # (a stream that keeps the worker busy still gets it now and then)
            self._scan_ctrl()
        else:
            self._ctrl_owed = True  # looked at by the next idle progress() (or the 64th busy one)
        return True

    def _scan_ctrl(self) -> None:
        # Answer a peer's goodbye whoever progresses (the ticker too); at most once a
        # millisecond -- a stream of messages progresses every few microseconds.
        now = time.monotonic()
        if now >= self._ctrl_scan_at:
            self._ctrl_owed = False
            self._ctrl_scan_at = now + self.FD_CHECK
            for t in list(self.ctrl_watch):
                req = t._ctrl_req
                if req is not None and req.completed:
                    t._poll_ctrl()

    def service(self) -> None:
        for lst in list(self.servicing):
            lst._service()

    def watch_fd(self, fd: int, handler: Callable[[int], None]) -> None:
        """Under the lock: call ``handler(events)`` (under the lock) when ``fd`` is readable or fails."""
        self.fd_handlers[fd] = handler
        self.poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        if self.sleeping:
            self.notify()  # the sleeper's poll() started without this fd

    def unwatch_fd(self, fd: int) -> None:
        if self.fd_handlers.pop(fd, None) is not None:
            try:
                self.poller.unregister(fd)
            except (KeyError, ValueError):
                pass

    def dispatch(self, events: list[tuple[int, int]]) -> None:
        """Under the lock: run the handlers of the fds ``poll()`` reported."""
        for fd, ev in events:
            h = self.fd_handlers.get(fd)
            if h is not None:
                try:
                    h(ev)
                except Exception:
                    log.exception("ucx: handler of fd %d failed", fd)

    # -- waiting -------------------------------------------------------------------
    def wait(self, pred: Callable[[], bool], deadline: float | None, *, spin: float | None = None) -> bool:
        """Progress until ``pred()`` is true (True) or the deadline passes (False).

        ``spin``: seconds to poll before sleeping (default ``self.spin``).
        """
        spin = self.spin if spin is None else spin
        worker = self.worker
        lock = self.lock
        self.wanted.append(None)
        lock.acquire()
        self.wanted.pop()
        self.active += 1
        try:
            if pred():  # already there: no need to progress
                return True
            spin_end = -1.0  # set at the first reading of the clock
            fd_check = 0.0
            polls = 0
            look = False  # whether something happened that pred() must see
            progress = self.progress
            while True:
                if progress():
                    self.notify()  # what we progressed may be what other threads wait for
                    look = True
                if self.servicing:
                    self.service()
                    look = True
                polls += 1
                quick = polls & self.CLOCK_EVERY
                if look or not quick:
                    # pred() after something happened -- progress, a socket, another thread holding the
                    # lock meanwhile -- and on the polls that read the clock (its time-based conditions)
                    if pred():
                        return True
                    look = False
                if quick:
                    # Spin, but give the core away between two polls: on a busy machine the peer (or
                    # our own sender thread) may need it to answer us. Most polls skip the clock.
                    if self.wanted:
                        lock.release()
                        os.sched_yield()
                        lock.acquire()
                        look = True
                    else:
                        os.sched_yield()
                    continue
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if spin_end < 0:
                    spin_end = now + spin
                if now < spin_end:
                    if self.fd_handlers and now >= fd_check and not self.sleeping:  # (a sleeper polls them)
                        # Sockets (handshakes, liveness) are otherwise looked at only when a thread
                        # sleeps or by the ticker, which stands aside while anyone waits.
                        fd_check = now + self.FD_CHECK
                        ready = self.poller.poll(0)
                        if ready:
                            self.dispatch(ready)
                            look = True
                            continue
                    if self.wanted:
                        lock.release()
                        os.sched_yield()
                        lock.acquire()
                        look = True
                    else:
                        os.sched_yield()
                    continue
                step = self.SLICE if deadline is None else min(self.SLICE, deadline - now)
                look = True
                if self.sleeping:
                    self.cond_waiters += 1
                    try:
                        self.cond.wait(step)
                    finally:
                        self.cond_waiters -= 1
                    continue
                if not worker.arm():
                    continue  # events pending: progress again
                self.sleeping = True
                lock.release()
                events: list[tuple[int, int]] = []
                try:
                    events = self.poller.poll(max(1, int(step * 1000) + 1))
                    try:
                        os.eventfd_read(self.wake_fd)
                    except OSError:
                        pass
                finally:
                    lock.acquire()
                    self.sleeping = False
                if events and self.fd_handlers:
                    self.dispatch(events)
                spin_end = time.monotonic() + spin
        finally:
            self.active -= 1
            lock.release()


class Op:
    __slots__ = ("eng",)

    def __init__(self, eng: Engine) -> None:
        self.eng = eng

    def __enter__(self) -> Engine:
        eng = self.eng
        eng.wanted.append(None)
        eng.lock.acquire()
        eng.wanted.pop()
        return eng

    def __exit__(self, *exc: object) -> None:
        self.eng.lock.release()


def _tick(ref: "weakref.ref[Engine]", stop: threading.Event) -> None:
    """Progress the worker now and then while no thread waits (handshakes, credits, peer loss).

    Ends when ``stop`` is set (the engine's last connection or listener closed, or the process exits) or
    the engine is gone; it never blocks on the engine's lock, so a thread holding it may join it.
    """
    while not stop.wait(Engine.TICK):
        eng = ref()
        if eng is None or eng.stopped or eng.pid != os.getpid():
            return
        if eng.active or eng.wanted or not eng.lock.acquire(blocking=False):
            del eng
            continue
        try:
            if stop.is_set():
                return
            did = eng.progress()
            if eng.fd_handlers:  # liveness and listening sockets (no thread sleeps on them now)
                events = eng.poller.poll(0)
                if events:
                    eng.dispatch(events)
            if eng.servicing:
                eng.service()
            if did:
                eng.notify()
        except Exception:
            log.exception("ucx progress tick failed")
        finally:
            eng.lock.release()
        del eng


#: The process's engines: one for trusted peers (links between the ranks of a job, clients of a daemon) and,
#: made only by a listener for untrusted peers (the serve daemon), one whose context has no shared-memory, cma or
#: cuda_ipc transport. UCX settings are per context, so the two never share one; a process that holds both (a
#: daemon and a client of another daemon, or a test) runs two contexts, each with its own progress.
ENGINES: dict[bool, Engine] = {}
#: (request, buffers) UCX may still use after their connection was torn down without a
#: clean close: kept referenced so their memory is never reused under UCX.
GRAVEYARD: Deque[tuple[Any, Any]] = collections.deque()
_ENGINE_LOCK = threading.Lock()


def engine(peer_timeout: float = 30.0, *, untrusted: bool | None = None) -> Engine:
    """The process's engine for ``untrusted`` peers, created on first use (and again in a forked child).

    ``untrusted``: True for a listener whose peers are not trusted (serve
    clients): that engine's UCX context has no shared-memory, cma or cuda_ipc
    transport. False: the trusted engine. None (an outgoing connection): the
    trusted engine, made if this process has none.
    """
    want = bool(untrusted)
    eng = ENGINES.get(want)
    if eng is None or eng.pid != os.getpid():
        with _ENGINE_LOCK:
            eng = ENGINES.get(want)
            if eng is None or eng.pid != os.getpid():
                eng = ENGINES[want] = Engine(peer_timeout, untrusted=want)
    return eng


# -- endpoint state shared by the handshake and the transport --------------------------
