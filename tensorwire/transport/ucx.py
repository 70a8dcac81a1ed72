"""UCX data plane (ucxx core API): tagged rendezvous straight into the posted slots.

Importing this module raises :class:`ImportError` when ucxx is not installed
(the caller falls back to TCP). Importing ucxx makes it write a few ``UCX_*``
variables into ``os.environ``; this module undoes that and hands the same
settings to its UCX context instead, so importing tensorwire never changes
the process environment. No UCX context or worker exists until the first
listener or connection is made.

Tag layout (64-bit UCX tags; matching is per *worker*, not per endpoint, and
one worker serves every connection of the process)::

    63 ........ 33 | 32 31 | 30 ........ 0
    receiver's id  | kind  | slot tag (0 <= tag < 2**31)

    kind 0 DATA    payload, received straight into the posted buffer
    kind 1 HEADER  88-byte header (step, nbytes, shape) for header tags
    kind 2 CREDIT  16-byte credit (capacity, flags) from receiver to sender
    kind 3 CTRL    8-byte goodbye, slot tag 0

The receiver's id is a 31-bit number the *receiving* process assigns to the
connection (unique for the life of the process; ids are never reused) and
tells its peer during the handshake. So data, header and credit tags are
disjoint, and two connections of one process never match each other's
messages.

Credits (``check_credit_blocks_sender``): :meth:`UcxTransport.post_recv`
posts a real UCX tag receive on the slot's memory (no intermediate buffer:
eager messages are copied in by UCX, rendezvous messages are fetched
zero-copy into it) and sends one 16-byte CREDIT message (the buffer's
capacity and whether it wants a header) to the peer. :meth:`UcxTransport.send`
spends one credit per message: without one it waits, up to its timeout, and
raises :class:`~tensorwire.TransferTimeout` having sent nothing. UCX's
rendezvous alone would only make *large* sends wait; small (eager) sends
complete at once and UCX would buffer them in its unexpected queue, without
bound. The explicit credit makes every message size behave like the base
contract and like the TCP transport, and it also carries what the sender must
know: whether the receiver wants a header, and the capacity, so a message that
does not fit is refused on the sender (:class:`~tensorwire.ProtocolError`,
nothing sent, the credit kept) instead of breaking the receive. Measured cost
(bench/results/ucx-progress_cpu2_2026-11-22.md, raw ucxx with the same progress loop):
a 4 KiB round trip goes from ~42 to ~76 µs on this 2-core machine -- one more
small message each way, which costs CPU on both sides even when the credit
is off the critical path (it is sent when the buffer is posted, normally well
before the data is needed) -- and nothing measurable from 1 MiB up. Holding
credits back to send them next to the data (as the TCP transport does) did not
measure better here, so credits go out at once and no thread ever has to
flush another connection's credits before it blocks.

Headers: a tag posted with ``header=True`` gets a second small receive on the
HEADER tag; the credit tells the sender, which then sends the header (step,
byte count, shape) before the payload. Header-less tags carry no header:
ucxx's Python API does not report how many bytes a tag receive got, so on
those tags a message must fill the posted buffer exactly (fixed specs always
do); the sender enforces it from the credit's capacity.

Progress model ("caller progresses: spin, then sleep"), chosen by measurement
(a probe kept in the history of bench/; table in bench/results/ucx-progress_cpu2_2026-11-22.md).
There is one UCX context and one worker per process, created lazily and
shared by every listener and connection, and one process-wide lock around
every UCX call. A thread that waits (for a receive, a credit, a send to
complete, a connection) drives the worker itself: it calls
``worker.progress()`` for up to ``SPIN_US`` (100 µs; env
``TENSORWIRE_UCX_SPIN_US``), with ``sched_yield()`` between two polls, then
arms the worker and sleeps in ``poll()`` on the worker's epoll fd. It is woken
by UCX events, or through an eventfd when another thread closes something or
progressed on its behalf; further waiting threads sleep on a condition
variable meanwhile, and a thread that needs the lock for a post or a send
makes a spinning waiter step aside. Why:

- pure polling in the waiting thread has the best latency but keeps a core
  busy for as long as anything waits;
- ucxx's progress thread (``start_progress_thread``) hands every completion
  from its thread to the waiting one: several times the round-trip latency
  of polling on this 2-core machine, and the polling variant burns a core;
- blocking mode alone (``progress_worker_event``) burns nothing but pays a
  sleep/wake-up on every message;
- spinning a little first catches a reply that is on its way (a round trip
  here is 20-60 µs) at polling's latency, and sleeping afterwards costs ~0 %
  CPU while idle. Yielding while spinning matters when cores are oversubscribed
  (the probe's ``--paired-yield`` experiment): it costs ~1-2 µs when the answer
  is immediate, but without it the spinner holds the core the peer needs to
  answer, and round trips grow towards the spin length (72 vs 184 µs median
  with a peer that works 30 µs before answering).

A daemon thread progresses the worker every 50 ms while no thread waits, so
handshakes, credits and peer-loss notices move while the application computes.

Connection set-up ("worker addresses over a TCP handshake"). The data-plane
address of a UCX listener is a plain TCP socket bound to the node's address
(UCX's own sockaddr listener binds every interface, and its endpoints are the
slow kind, below). The connecting side sends a 36-byte hello -- magic, protocol
version, its receiver id, the 16-byte nonce learned over the control plane,
the length of its UCX worker address -- then the address. The listener checks
the nonce *before* creating anything, creates its endpoint from the peer's
worker address and answers OK plus its own receiver id and worker address (or
NO, then closes); the dialler creates its endpoint from that. A connection that
sends garbage, a wrong nonce or nothing within ``HELLO_TIMEOUT`` (5 s) is
dropped; the listener keeps serving. Data never goes over this socket.

Peer death and error handling. UCX 1.21 through ucxx 0.52 installs no error
callback on an endpoint made without peer error handling, and then treats any
transport error on it as fatal: a peer SIGKILLed while a cma rendezvous reads
its memory (``process_vm_readv ... No such process``) aborts *this* process
(6 of 6 trials with 64 MiB messages). With peer error handling the same kill is
an endpoint error and surfaces as PeerLostError (0 aborts). But UCX admits to
an endpoint with peer error handling only lanes that can report a failed peer:
sysv/posix shared memory are left out, and cma too (its memory domain does not
advertise ``INVALIDATE_RMA``, which UCX requires of rendezvous lanes under peer
error handling; cuda_ipc does advertise it), so host memory between two
processes of one host goes over tcp/lo. Measured on the 2-core machine, loaded
(``tensorwire bench -b tensorwire-ucx``, runs in turns; bench/results/
ucx-error-handling_cpu2_2026-11-24.md): stream 1 MiB 1.30 -> 0.23 GB/s,
16 MiB 1.74 -> 0.32 GB/s, 4 KiB round trip p50 105 -> 166 us. Without cma (sysv
fragments instead) 16 MiB fell to 0.2-0.6 GB/s, so keeping the shared-memory
transports and dropping only cma is no way out either. The choice: **peer
error handling by default** -- no peer's death may take down this process --
and ``TENSORWIRE_UCX_ERROR_HANDLING=none`` for jobs that accept that risk for
cma's speed (ranks of one host whose deaths end the job anyway). The listener
decides and tells the dialler in its answer (REPLY flag ``R_PEER_ERRORS``), so
the two ends never disagree.

Untrusted peers (``UcxListener(untrusted=True)``, the serve daemon): the
process's UCX context gets no shm / cma / cuda_ipc transport at all (these act
on the pid, segment or IPC handle the peer's address names: with cma, a forged
address would make the daemon read or write any process of its uid), every
endpoint has peer error handling, and each peer's worker address is first
unpacked by a sandbox process (:class:`_AddressCheck`): UCX asserts, and
aborts, on a malformed one. A dialler proves it holds the listener's link
secret (``secret=``) in its hello (HMAC of the nonce) before the listener
reads its address.

Liveness: so a peer that vanishes must be detected by tensorwire itself. The
handshake's TCP connection stays open for the life of the transport as the
liveness channel; its end means the peer is gone: a killed process's kernel
closes it at once (EOF), a cut cable or a frozen host is caught by TCP
keepalive (idle ``peer_timeout``/3, probes every idle/2, 3 probes, plus
``TCP_USER_TIMEOUT``), like the TCP transport. The socket is registered with
the engine's ``poll()`` (and polled by the ticker), so a waiter sleeping on the
UCX worker wakes up for it. Pending and later operations then raise
:class:`~tensorwire.PeerLostError`, after ``LOST_GRACE_S`` (1 s) in which
messages or a goodbye may still show up. Graceful close (like TCP, where
frames already in the stream are read before the goodbye): ``close()`` waits
(bounded, ``CLOSE_DRAIN_S``) for this side's sends in flight, sends an 8-byte
BYE on the CTRL tag and waits (bounded, ``CLOSE_ACK_S``) for the peer's ACK,
which the peer's progress (any waiting thread or the ticker) sends as soon as
the BYE is processed -- UCX delivers it after everything sent before it, so
those receives have completed by then -- and only then closes the endpoint and
the liveness socket. After a BYE, completed receives are still returned,
buffers may still be posted (no credit goes out), a wait with nothing arrived
raises PeerLostError after ``BYE_GRACE_S`` and sends raise PeerLostError. With
``TENSORWIRE_UCX_ERROR_HANDLING=peer`` UCX's own endpoint errors (and its
keepalive, every ``KEEPALIVE_S``) are reported too, and a receive UCX cancelled
when the endpoint failed is refilled from the unexpected queue if its message
is there. UCX settings are per context, so the first listener or connection of
the process decides them; ``UCX_*`` variables set by the user always win.

Buffers: a tensor goes to UCX as a descriptor of its address and size -- a
ctypes array over host memory, a minimal ``__cuda_array_interface__`` object for
device memory -- built once per (address, size) and reused (slots, and a
training loop's tensors, come back at the same addresses; building one through
NumPy or torch's interface costs 2 to tens of us per message). Descriptors hold
no reference to the tensor, so the cache keeps no memory alive; instead the
transport holds a reference to every buffer until UCX is done with it (ucxx
does not). Close your transports: ``close()`` ends the endpoint's requests,
closes it and drains this connection's leftover small messages (e.g. unused
credits) from UCX's unexpected queue.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import itertools
import logging
import os
import secrets
import select
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Any, Callable, Deque

from tensorwire.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    ConnectTimeout,
    PeerLostError,
    ProtocolError,
    TensorWireError,
    TransferTimeout,
    TransportError,
    VersionMismatchError,
)
from tensorwire.transport.base import HEADER_DIMS, NONCE_BYTES, PROOF_BYTES, Listener, Received, Transport
from tensorwire.transport.base import link_proof, proof_matches
from tensorwire.transport.base import remaining as _remaining
from tensorwire.transport._socket import dial, tune_socket
from tensorwire.settings import setting


def _import_ucxx() -> tuple[Any, Any, dict[str, str]]:
    """Import ucxx's core API; undo its os.environ edits and return them as UCX options."""
    already = "ucxx" in sys.modules
    before = None if already else dict(os.environ)
    try:
        import ucxx._lib.libucxx as libucxx
        from ucxx._lib.arr import Array
    except ImportError:
        raise
    except Exception as exc:  # a broken install (libucx missing, ...): same as absent
        raise ImportError(f"ucxx is installed but cannot be loaded: {exc}") from exc
    finally:
        changed: dict[str, str] = {}
        if before is not None:
            after = dict(os.environ)
            for k, v in after.items():
                if before.get(k) != v:
                    changed[k] = v
            for k in after:
                if k not in before:
                    del os.environ[k]
            for k, v in before.items():
                if after.get(k) != v:
                    os.environ[k] = v
    return libucxx, Array, changed


_ucx, _Array, _UCXX_ENV_DEFAULTS = _import_ucxx()
_Tag = _ucx.UCXXTag
import numpy as np  # noqa: E402 - ucxx depends on numpy; after the ucxx check on purpose

__all__ = ["UcxTransport", "UcxListener"]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 3


#: Microseconds a waiting thread polls the worker (yielding in between) before it sleeps.
SPIN_US = setting("ucx_spin_us")
#: The same for a wait on a transfer of CUDA memory. cuda_ipc copies are issued and
#: completed from worker progress and do not wake a sleeping worker promptly: measured on
#: 2 x H200 (bench/results/gpu_h200x2_2026-11-22-2.md), a 256 MiB send + ack took 1,281 us
#: with 100 us of spinning and 781 us with 2 ms (raw ucxx, always polling: 712 us).
CUDA_SPIN_US = setting("ucx_cuda_spin_us")
#: UCX endpoint keepalive interval (seconds) unless UCX_KEEPALIVE_INTERVAL is set.
KEEPALIVE_S = 2.0
#: close(): how long it waits for this side's sends (and then its goodbye) to complete.
CLOSE_DRAIN_S = 2.0
#: After the peer's goodbye, how long a wait whose message has not arrived keeps looking.
BYE_GRACE_S = 0.1
#: After an endpoint error without a goodbye, how long messages (or the goodbye) may still show up.
LOST_GRACE_S = 1.0

DATA, HEADER, CREDIT, CTRL = 0, 1, 2, 3
_TAG_BITS = 31
_KIND_SHIFT = 31
_RID_SHIFT = 33
_RID_MASK = (1 << 31) - 1
_MAX_TAG = 1 << _TAG_BITS

#: magic, version, client receiver id, nonce, proof of the link secret (zeros without one), address length
HELLO = struct.Struct(f"<8sII{NONCE_BYTES}s{PROOF_BYTES}sI")
REPLY = struct.Struct("<8sIIII")  # magic, version, server receiver id, flags (R_*), address length
#: REPLY flag: the listener made its endpoint with UCX peer error handling; the dialler must too.
R_PEER_ERRORS = 1
MAX_ADDRESS = 1 << 16  # UCX worker addresses are a few hundred bytes to a few KiB
HELLO_MAGIC = b"TWUCXHI\0"
REPLY_OK = b"TWUCXOK\0"
REPLY_NO = b"TWUCXNO\0"
HDR = struct.Struct(f"<QQB7x{HEADER_DIMS}q")  # step, nbytes, ndim (255: none), dims
CRED = struct.Struct("<QI4x")  # capacity, flags
F_HEADER = 1
NO_SHAPE = 255
BYE = b"TWUCXBYE"
ACK = b"TWUCXACK"  # answer to BYE: everything sent before the goodbye has been received here
#: close(): how long it waits for the peer's ACK of its goodbye (the peer's progress answers it).
CLOSE_ACK_S = 5.0
assert HELLO.size == 52 and REPLY.size == 24 and HDR.size == 88 and CRED.size == 16


def _error_handling() -> bool:
    """Whether this process's UCX listeners make their endpoints with peer error handling.

    ``TENSORWIRE_UCX_ERROR_HANDLING``: ``peer`` (default) or ``none``. A
    listener tells each dialler which one it chose (REPLY flag), so the two
    ends of a connection always agree. See "Peer death and error handling" in
    the module docstring: ``none`` lets UCX use cma (single-copy rendezvous
    between processes of one host) but UCX 1.21 then *aborts the process* when
    the peer dies during a transfer; ``peer`` never aborts but UCX leaves cma
    and the shared-memory transports out of such endpoints.
    """
    mode = setting("ucx_error_handling")
    if mode not in ("none", "peer"):
        raise ConfigError(f"TENSORWIRE_UCX_ERROR_HANDLING must be 'none' or 'peer', got {mode!r}")
    return mode == "peer"


_LOST_ERRORS = tuple(
    getattr(_ucx, n)
    for n in (
        "UCXConnectionResetError",
        "UCXEndpointTimeoutError",
        "UCXUnreachableError",
        "UCXNotConnectedError",
        "UCXRejectedError",
        "UCXIOError",
        "UCXTimedOutError",
        "UCXCloseError",
        "UCXCanceledError",
    )
    if hasattr(_ucx, n)
)


#: Transports an untrusted peer's address may not select (see _Engine: they act on the process id,
#: segment or IPC handle the address names).
_UNTRUSTED_EXCLUDED = "sm,cma,posix,sysv,xpmem,knem,cuda_ipc,rocm_ipc"


def _u8(n: int) -> Any:
    return np.zeros(n, dtype=np.uint8)


class _Cai:
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


#: (data_ptr, nbytes, is_cuda) -> ucxx Array describing that memory by address only (see _as_array).
_DESCRIPTORS: dict[tuple[int, int, bool], Any] = {}
_MAX_DESCRIPTORS = 4096


def _as_array(buf: Any, *, writable: bool) -> tuple[Any, Any, int]:
    """(keep-alive object, ucxx Array, nbytes) for a buffer: a contiguous tensor (its bytes, any dtype) or
    anything with the buffer protocol. Zero-copy."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise ConfigError("UCX buffers must be contiguous tensors")
        n = buf.nbytes
        if n == 0:
            z = _u8(0)
            return z, _Array(z), 0
        # Building a descriptor through NumPy or torch's __cuda_array_interface__ costs 2 to tens
        # of us; slots and a training loop's tensors come back at the same addresses, so it is
        # built from the address alone -- a ctypes array over host memory, _Cai over device memory
        # (straight to/from GPU memory) -- and reused by (address, size, kind). It references no
        # tensor, so the cache keeps no memory alive; the caller keeps ``buf`` alive while UCX uses it.
        # Any dtype: only the address and the byte count matter (no flat uint8 view to build).
        key = (buf.data_ptr(), n, buf.is_cuda)
        arr = _DESCRIPTORS.get(key)
        if arr is None:
            if key[2] and not _engine().ctx.cuda_support:
                raise ConfigError("this UCX build has no CUDA support; use host buffers")
            if len(_DESCRIPTORS) >= _MAX_DESCRIPTORS:
                _DESCRIPTORS.clear()
            arr = _DESCRIPTORS[key] = _Array(_Cai(key[0], n) if key[2] else (ctypes.c_char * n).from_address(key[0]))
        return buf, arr, n
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise ConfigError("receive buffer is read-only")
    arr = np.frombuffer(mv.cast("B"), dtype=np.uint8) if mv.nbytes else _u8(0)
    return (buf, arr), _Array(arr), arr.nbytes


_CUDA_SPIN = CUDA_SPIN_US / 1e6
#: byte count -> Received(byte count) of a header-less tag (immutable, shared)
_RECEIVED: dict[int, Received] = {}


def _is_cuda(keep: Any) -> bool:
    """Whether a buffer kept by _as_array is CUDA memory (kept as the tensor itself)."""
    return getattr(keep, "is_cuda", False) is True


def _check_tag(tag: int) -> int:
    if not 0 <= tag < _MAX_TAG:
        raise ConfigError(f"tag {tag} out of range [0, 2**31)")
    return tag


# -- the process-wide progress engine --------------------------------------------------


class _Engine:
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

    def __init__(self, peer_timeout: float = 30.0, *, untrusted: bool = False) -> None:
        opts = _ucx.get_current_options()
        config: dict[str, str] = {}
        for k, v in _UCXX_ENV_DEFAULTS.items():
            if k.startswith("UCX_") and k[4:] in opts and k not in os.environ:
                config[k[4:]] = v
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
                config["TLS"] = "^" + ",".join(x for x in (tls[1:], _UNTRUSTED_EXCLUDED) if x)
            else:
                kept = [t for t in tls.split(",") if t and t not in _UNTRUSTED_EXCLUDED.split(",")]
                config["TLS"] = ",".join(kept) or "tcp"
        feats = (_ucx.Feature.TAG, _ucx.Feature.WAKEUP)
        try:
            self.ctx = _ucx.UCXContext(config_dict=config, feature_flags=feats)
            self.worker = _ucx.UCXWorker(self.ctx)
            self.worker.init_blocking_progress_mode()
            epfd = self.worker.epoll_file_descriptor
            self.address = self.worker.address.tobytes()  # what peers create their endpoints from
        except _ucx.UCXError as exc:
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
        self._rids = itertools.count(secrets.randbelow(_RID_MASK))
        self._ticker = threading.Thread(
            target=_tick, args=(weakref.ref(self),), daemon=True, name="tensorwire-ucx-tick"
        )
        self._ticker.start()

    def self_endpoint(self) -> Any:
        """Under the lock: an endpoint to this process's own worker (see UcxTransport._release_receives)."""
        if self._self_ep is None:
            self._self_ep = _ucx.UCXEndpoint.create_from_worker_address(
                self.worker, _ucx.UCXAddress.create_from_buffer(self.address), False
            )
        return self._self_ep

    def new_rid(self) -> int:
        while True:
            rid = next(self._rids) & _RID_MASK
            if rid:
                return rid

    # -- locking -------------------------------------------------------------------
    def op(self) -> "_Op":
        """Context manager: take the lock for a short operation (a spinning waiter yields)."""
        return _Op(self)

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
        did = False
        while w.progress_once():
            did = True
        if did or not self._idle & self.HOUSEKEEPING:
            w.progress()  # also runs ucxx's housekeeping (cancellations after endpoint errors): 0.6 us idle
        if not did:
            self._idle += 1
        else:
            self._ctrl_owed = True
            self.events += 1
        if self._ctrl_owed:
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
        return did

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
            spin_end = time.monotonic() + spin
            fd_check = 0.0
            while True:
                if self.progress():
                    self.notify()  # what we progressed may be what other threads wait for
                if self.servicing:
                    self.service()
                if pred():
                    return True
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                if now < spin_end:
                    if self.fd_handlers and now >= fd_check and not self.sleeping:  # (a sleeper polls them)
                        # Sockets (handshakes, liveness) are otherwise looked at only when a thread
                        # sleeps or by the ticker, which stands aside while anyone waits.
                        fd_check = now + self.FD_CHECK
                        events = self.poller.poll(0)
                        if events:
                            self.dispatch(events)
                            continue
                    # Spin, but give the core away between two polls: on a busy machine
                    # the peer (or our own sender thread) may need it to answer us.
                    if self.wanted:
                        lock.release()
                        os.sched_yield()
                        lock.acquire()
                    else:
                        os.sched_yield()
                    continue
                step = self.SLICE if deadline is None else min(self.SLICE, deadline - now)
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


class _Op:
    __slots__ = ("eng",)

    def __init__(self, eng: _Engine) -> None:
        self.eng = eng

    def __enter__(self) -> _Engine:
        eng = self.eng
        eng.wanted.append(None)
        eng.lock.acquire()
        eng.wanted.pop()
        return eng

    def __exit__(self, *exc: object) -> None:
        self.eng.lock.release()


def _tick(ref: "weakref.ref[_Engine]") -> None:
    """Progress the worker now and then while no thread waits (handshakes, credits, peer loss)."""
    while True:
        time.sleep(_Engine.TICK)
        eng = ref()
        if eng is None or eng.stopped or eng.pid != os.getpid():
            return
        if eng.active or eng.wanted or not eng.lock.acquire(blocking=False):
            del eng
            continue
        try:
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
_ENGINES: dict[bool, _Engine] = {}
#: (request, buffers) UCX may still use after their connection was torn down without a
#: clean close: kept referenced so their memory is never reused under UCX.
_GRAVEYARD: Deque[tuple[Any, Any]] = collections.deque()
_ENGINE_LOCK = threading.Lock()


def _engine(peer_timeout: float = 30.0, *, untrusted: bool | None = None) -> _Engine:
    """The process's engine for ``untrusted`` peers, created on first use (and again in a forked child).

    ``untrusted``: True for a listener whose peers are not trusted (serve
    clients): that engine's UCX context has no shared-memory, cma or cuda_ipc
    transport. False: the trusted engine. None (an outgoing connection): the
    trusted engine, made if this process has none.
    """
    want = bool(untrusted)
    eng = _ENGINES.get(want)
    if eng is None or eng.pid != os.getpid():
        with _ENGINE_LOCK:
            eng = _ENGINES.get(want)
            if eng is None or eng.pid != os.getpid():
                eng = _ENGINES[want] = _Engine(peer_timeout, untrusted=want)
    return eng


@atexit.register
def _shutdown() -> None:
    for eng in list(_ENGINES.values()):
        if eng.pid != os.getpid():
            continue
        eng.stopped = True
        for obj in list(eng.objects):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


# -- endpoint state shared by the handshake and the transport --------------------------


class _EpState:
    """Filled by the endpoint's close callback (called during worker progress)."""

    __slots__ = ("lost", "owner", "__weakref__")

    def __init__(self) -> None:
        self.lost = False
        self.owner: "weakref.ref[UcxTransport] | None" = None


def _on_ep_closed(state: _EpState) -> None:
    state.lost = True
    t = state.owner() if state.owner is not None else None
    if t is not None:
        t._on_ep_lost()


def _watch(ep: Any) -> _EpState:
    state = _EpState()
    ep.set_close_callback(_on_ep_closed, cb_args=(state,))
    return state


def _cancelled(req: Any) -> bool:
    """True for no request, or one that ended cancelled (UCX cancels an endpoint's requests on error)."""
    if req is None:
        return True
    if not req.completed:
        return False
    try:
        req.check_error()
    except _ucx.UCXCanceledError:
        return True
    except _ucx.UCXError:
        return False
    return False


def _filled(req: Any) -> bool:
    """Completed and not cancelled (a failed one counts: _finish reports its error)."""
    return req is not None and req.completed and not _cancelled(req)


def _close_ep(ep: Any) -> None:
    """Cancel the endpoint's requests and close it (force: never waits for the peer)."""
    try:
        ep.close_blocking()
    except Exception as exc:  # noqa: BLE001 - closing is best effort
        log.debug("ucx endpoint close: %s", exc)


# -- the transport ---------------------------------------------------------------------


class _Post:
    __slots__ = ("req", "keep", "arr", "cap", "hreq", "hbuf", "harr")

    def __init__(self, req: Any, keep: Any, arr: Any, cap: int, hreq: Any, hbuf: Any, harr: Any) -> None:
        self.req = req  # None: posted after the peer left, filled only from UCX's unexpected queue
        self.keep = keep
        self.arr = arr
        self.cap = cap
        self.hreq = hreq
        self.hbuf = hbuf
        self.harr = harr


class _SendOp:
    """A message posted by :meth:`UcxTransport.start_send`; :meth:`UcxTransport.wait_send` completes it."""

    __slots__ = ("tag", "reqs", "n", "cuda", "finished", "error")

    def __init__(self, tag: int, reqs: list[Any], n: int, cuda: bool) -> None:
        self.tag = tag
        self.reqs = reqs
        self.n = n
        self.cuda = cuda
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        """Whether the bytes are out (or the send failed); no progress is made here."""
        return self.finished or self.error is not None or all(r.completed for r, _ in self.reqs)


class _Tags:
    """The six UCX tag objects of one slot tag of one connection, built once (0.4 us each per message otherwise)."""

    __slots__ = ("data_rx", "hdr_rx", "cred_rx", "data_tx", "hdr_tx", "cred_tx")

    def __init__(self, rid: int, peer_rid: int, tag: int) -> None:
        self.data_rx = _Tag(rid | (DATA << _KIND_SHIFT) | tag)
        self.hdr_rx = _Tag(rid | (HEADER << _KIND_SHIFT) | tag)
        self.cred_rx = _Tag(rid | (CREDIT << _KIND_SHIFT) | tag)
        self.data_tx = _Tag(peer_rid | (DATA << _KIND_SHIFT) | tag)
        self.hdr_tx = _Tag(peer_rid | (HEADER << _KIND_SHIFT) | tag)
        self.cred_tx = _Tag(peer_rid | (CREDIT << _KIND_SHIFT) | tag)


class _CreditRx:
    __slots__ = ("req", "buf", "arr")

    def __init__(self) -> None:
        self.req: Any = None
        self.buf = _u8(CRED.size)
        self.arr = _Array(self.buf)


class UcxTransport(Transport):
    """A UCX endpoint to one peer with credit flow control. See the module docstring."""

    kind = "ucx"
    reaches_cuda = True
    any_dtype = True
    async_send = True

    def __init__(
        self,
        eng: _Engine,
        ep: Any,
        state: _EpState,
        *,
        rid: int,
        peer_rid: int,
        peer: str,
        peer_timeout: float = 30.0,
        peer_errors: bool = True,
    ) -> None:
        # Called with the engine lock held.
        self._eng = eng
        self._eh = peer_errors  # the endpoint was made with UCX peer error handling
        self._ep = ep
        self._state = state
        self._rid = rid << _RID_SHIFT
        self._peer_rid = peer_rid << _RID_SHIFT
        self._peer = peer
        self._peer_timeout = peer_timeout
        self._posted: dict[int, Deque[_Post]] = collections.defaultdict(collections.deque)
        self._credits: dict[int, Deque[tuple[int, int]]] = collections.defaultdict(collections.deque)
        self._credit_rx: dict[int, _CreditRx] = {}
        self._send_steps: dict[int, int] = collections.defaultdict(int)
        self._sends: Deque[tuple[Any, Any]] = collections.deque()  # small sends in flight + their buffers
        self._credit_pool: list[tuple[Any, Any]] = []
        self._tag_objs: dict[int, _Tags] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._bye_at: float | None = None  # when the peer's goodbye arrived (a graceful close)
        self._lost_at: float | None = None  # when the endpoint reported an error
        self.bytes_sent = 0
        self.bytes_received = 0
        self._ctrl_buf = _u8(len(BYE))
        self._ctrl_arr = _Array(self._ctrl_buf)
        self._ctrl_req = ep.tag_recv(self._ctrl_arr, tag=_Tag(self._rid | (CTRL << _KIND_SHIFT)))
        self._acked = False  # the peer answered our goodbye
        self._ctrl_sends: list[Any] = []
        self._live: socket.socket | None = None  # liveness socket (attach_liveness)
        eng.ctrl_watch.add(self)
        state.owner = weakref.ref(self)
        if state.lost:
            self._on_ep_lost()
        eng.objects.add(self)

    # -- public API ----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> str:
        return f"ucx to {self._peer}"

    def post_recv(self, tag: int, buf: Any, *, header: bool = False) -> None:
        _check_tag(tag)
        keep, arr, cap = _as_array(buf, writable=True)
        with self._eng.op():
            self._check_usable()
            self._post_locked(tag, keep, arr, cap, header)

    def _tags(self, tag: int) -> _Tags:
        t = self._tag_objs.get(tag)
        if t is None:
            t = self._tag_objs[tag] = _Tags(self._rid, self._peer_rid, tag)
        return t

    def _post_locked(self, tag: int, keep: Any, arr: Any, cap: int, header: bool) -> None:
        """post_recv under the engine lock (usability already checked)."""
        hbuf = harr = None
        if header:
            hbuf = _u8(HDR.size)
            harr = _Array(hbuf)
        if self._peer_gone():
            # The peer said goodbye (or its endpoint failed moments ago): like a TCP
            # stream not yet read up to its end, accept the post; no credit goes out and
            # only a message already sent can fill it (else its wait raises PeerLostError).
            self._posted[tag].append(_Post(None, keep, arr, cap, None, hbuf, harr))
            return
        try:
            tags = self._tag_objs.get(tag) or self._tags(tag)
            req = self._ep.tag_recv(arr, tag=tags.data_rx)
            hreq = None
            if header:
                hreq = self._ep.tag_recv(harr, tag=tags.hdr_rx)
            self._posted[tag].append(_Post(req, keep, arr, cap, hreq, hbuf, harr))
            self._grant(tag, cap, F_HEADER if header else 0)
        except _ucx.UCXError as exc:
            raise self._fail_from(exc, f"posting a receive on tag {tag}") from exc

    def wait_recv(self, tag: int, *, timeout: float | None) -> Received:
        return self._wait_recv(tag, timeout, None)

    def repost_and_wait(self, tag: int, buf: Any, *, header: bool = False, timeout: float | None) -> Received:
        # The post (a tag receive and a credit: ~10 us of Python per message on an H200 host)
        # runs inside the wait, once progress has done something -- normally picked up the
        # message the peer announced, whose rendezvous (the cuda_ipc copy) then overlaps the
        # post instead of following it -- or when the message is complete, or at the timeout.
        # It cannot be needed earlier: the peer spends this credit on the message after the
        # one awaited here. Measured on 2 x H200 (a probe in bench/'s history, tw-trace): posting
        # first put the post on the critical path of every message of a stream.
        _check_tag(tag)
        keep, arr, cap = _as_array(buf, writable=True)
        return self._wait_recv(tag, timeout, (keep, arr, cap, header))

    def _wait_recv(self, tag: int, timeout: float | None, repost: tuple[Any, Any, int, bool] | None) -> Received:
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Received] = []
        eng = self._eng
        events0 = eng.events

        def post() -> None:
            nonlocal repost
            if repost is not None:
                r, repost = repost, None
                self._check_usable()
                self._post_locked(tag, *r)

        def ready() -> bool:
            if self._closed:
                # Closed by this side: its receives were released (completed empty), not filled.
                self._check_usable()
            q = self._posted.get(tag)
            if q:
                p = q[0]
                if self._peer_gone() and not self._closed:
                    self._salvage(tag, p)
                if _filled(p.req) and (p.hreq is None or _filled(p.hreq)):
                    q.popleft()
                    out.append(self._finish(tag, p))
                    post()
                    return True
            if repost is not None and (early or eng.events != events0 or not q):
                post()  # (with nothing posted, the buffer is the one awaited)
            self._check_usable()
            if self._bye_at is not None and time.monotonic() - self._bye_at >= BYE_GRACE_S:
                raise PeerLostError(f"peer {self._peer} closed the link (nothing more arrived on tag {tag})")
            return False

        q = self._posted.get(tag)
        head = q[0].keep if q else (repost[0] if repost is not None else None)
        cuda = head is not None and _is_cuda(head)
        spin = _CUDA_SPIN if cuda else None
        # Host memory: the post goes first when the awaited message is not complete yet -- the wait is
        # idle then (a round trip: the peer has not answered), where after the message it would delay
        # the caller's answer by the post (a tag receive and a credit, ~4 us); in a stream it costs the
        # same either way (the copy of a host rendezvous runs inside progress, nothing to overlap).
        early = not cuda
        if not self._eng.wait(ready, deadline, spin=spin):
            if repost is not None:
                with self._eng.op():
                    post()
            raise TransferTimeout(f"receive on tag {tag} timed out after {timeout}s (peer {self._peer})")
        return out[0]

    def _try_post(
        self, tag: int, keep: Any, arr: Any, n: int, step: int | None, shape: tuple[int, ...] | None, reqs: list[Any]
    ) -> bool:
        """Under the lock: spend a credit on ``tag`` and post the message (True), or find none (False)."""
        self._check_usable()
        if self._bye_at is not None:
            raise PeerLostError(f"peer {self._peer} closed the link")
        if self._lost_at is not None:
            self._fail(PeerLostError(f"peer {self._peer} lost (its connection closed or timed out)"))
            self._check_usable()
        credit = self._take_credit(tag)
        if credit is None:
            return False
        self._post_send(tag, credit, keep, arr, n, step, shape, reqs)
        self._arm_credit(tag)  # after the data: the message goes out first
        return True

    def _sent(self, tag: int, reqs: list[Any]) -> bool:
        """Under the lock: whether every request of a posted message completed (raises its error)."""
        for r, _ in reqs:
            if not r.completed:
                self._check_usable()
                return False
        for r, _ in reqs:
            try:
                r.check_error()
            except _ucx.UCXError as exc:
                raise self._fail_from(exc, f"send on tag {tag}") from exc
        return True

    @staticmethod
    def _prepare_send(
        tag: int, buf: Any, shape: tuple[int, ...] | None, timeout: float | None
    ) -> tuple[float | None, Any, Any, int]:
        """What send and start_send check first: (deadline, keep-alive, ucxx Array, nbytes)."""
        _check_tag(tag)
        deadline = None if timeout is None else time.monotonic() + timeout
        keep, arr, n = _as_array(buf, writable=False)
        if shape is not None and len(shape) > HEADER_DIMS:
            raise ProtocolError(f"rank {len(shape)} exceeds {HEADER_DIMS}")
        return deadline, keep, arr, n

    def send(
        self,
        tag: int,
        buf: Any,
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> None:
        deadline, keep, arr, n = self._prepare_send(tag, buf, shape, timeout)
        reqs: list[Any] = []  # (request, buffers it reads) once the message is posted
        eng = self._eng
        # Fast path (a credit in hand, an eager message out at once): one pass under the lock, no
        # waiting loop -- what eng.wait's first check does, without its set-up.
        eng.wanted.append(None)
        eng.lock.acquire()
        eng.wanted.pop()
        try:
            if self._try_post(tag, keep, arr, n, step, shape, reqs) and self._sent(tag, reqs):
                self.bytes_sent += n
                return
        except TensorWireError:
            if reqs:
                self._settle(reqs)
            raise
        finally:
            eng.lock.release()

        def progressed() -> bool:
            # phase 1: a credit, then post header + payload; phase 2: the payload is out of ``buf``
            # (eager sends usually finish right here)
            if not reqs and not self._try_post(tag, keep, arr, n, step, shape, reqs):
                return False
            return self._sent(tag, reqs)

        try:
            ok = self._eng.wait(progressed, deadline, spin=_CUDA_SPIN if _is_cuda(keep) else None)
        except TensorWireError:
            if reqs:
                with self._eng.op():
                    self._settle(reqs)
            raise
        if not ok:
            if not reqs:
                raise TransferTimeout(
                    f"no credit to send on tag {tag} within {timeout}s (peer {self._peer} posted no buffer)"
                )
            # The message is on its way and cannot be recalled: the link is broken.
            with self._eng.op():
                self._fail(PeerLostError(f"send on tag {tag} to {self._peer} stalled past its timeout"))
                self._teardown(goodbye=True)
                self._settle(reqs)
            raise TransferTimeout(f"send on tag {tag} did not complete within {timeout}s (peer {self._peer})")
        self.bytes_sent += n

    def start_send(
        self,
        tag: int,
        buf: Any,
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> "_SendOp":
        """Post a message without waiting for its bytes to leave ``buf``: :meth:`wait_send` does.

        Waits (up to ``timeout``) only for the receiver's credit, like :meth:`send`,
        and raises TransferTimeout having sent nothing if none comes. Several
        messages may be in flight at once (as many as the receiver posted
        buffers for); ``buf`` must stay untouched until the message is out.
        The transport keeps ``buf`` referenced until UCX is done with it, even
        if nobody waits.
        """
        deadline, keep, arr, n = self._prepare_send(tag, buf, shape, timeout)
        reqs: list[Any] = []

        def posted() -> bool:
            if not self._try_post(tag, keep, arr, n, step, shape, reqs):
                return False
            self._settle(reqs)  # referenced until complete, whoever waits (or nobody)
            return True

        if not self._eng.wait(posted, deadline, spin=_CUDA_SPIN if _is_cuda(keep) else None):
            raise TransferTimeout(
                f"no credit to send on tag {tag} within {timeout}s (peer {self._peer} posted no buffer)"
            )
        return _SendOp(tag, reqs, n, _is_cuda(keep))

    def wait_send(self, op: "_SendOp", *, timeout: float | None) -> None:
        """Wait until the message of :meth:`start_send` is out of its buffer.

        Raises:
            TransferTimeout: not yet within ``timeout`` (the send goes on; wait again).
            PeerLostError, ClosedError, ...: the send failed.
        """
        if op.error is not None:
            raise op.error
        if op.finished:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            ok = self._eng.wait(lambda: self._sent(op.tag, op.reqs), deadline, spin=_CUDA_SPIN if op.cuda else None)
        except TensorWireError as exc:
            op.error = exc
            raise
        if not ok:
            raise TransferTimeout(
                f"send on tag {op.tag} not complete within {timeout}s (peer {self._peer}); it goes on"
            )
        op.finished = True
        self.bytes_sent += op.n

    def _post_send(
        self,
        tag: int,
        credit: tuple[int, int],
        keep: Any,
        arr: Any,
        n: int,
        step: int | None,
        shape: tuple[int, ...] | None,
        reqs: list[Any],
    ) -> None:
        """Spend ``credit``: post the header (if the receiver wants one) and the payload."""
        cap, flags = credit
        want_header = bool(flags & F_HEADER)
        if n > cap or (n != cap and not want_header):
            self._credits[tag].appendleft(credit)
            raise ProtocolError(
                f"{n} bytes do not fit the peer's {cap}-byte buffer on tag {tag}"
                + ("" if want_header else " (a tag without header takes exactly its buffer's size)")
            )
        s = self._send_steps[tag] = self._send_steps[tag] + 1
        tags = self._tag_objs.get(tag) or self._tags(tag)
        try:
            if want_header:
                hbuf = _u8(HDR.size)
                if shape is None:
                    HDR.pack_into(hbuf, 0, s if step is None else step, n, NO_SHAPE, *((0,) * HEADER_DIMS))
                else:
                    dims = tuple(int(d) for d in shape) + (0,) * (HEADER_DIMS - len(shape))
                    HDR.pack_into(hbuf, 0, s if step is None else step, n, len(shape), *dims)
                harr = _Array(hbuf)
                reqs.append((self._ep.tag_send(harr, tag=tags.hdr_tx), (hbuf, harr)))
            reqs.append((self._ep.tag_send(arr, tag=tags.data_tx), (keep, arr)))
        except _ucx.UCXError as exc:
            raise self._fail_from(exc, f"send on tag {tag}") from exc

    def close(self) -> None:
        self._close(goodbye=True)

    def abort(self) -> None:
        self._close(goodbye=False)

    # -- internals (engine lock held unless noted) ------------------------------------
    def _attach_liveness(self, sock: socket.socket) -> None:
        """Watch ``sock``: its end (EOF, reset, keepalive timeout) means the peer is gone."""
        sock.setblocking(False)
        tune_socket(sock, peer_timeout=self._peer_timeout)
        self._live = sock
        if self._closed:
            self._drop_liveness()
            return
        self._eng.watch_fd(sock.fileno(), self._on_live_event)

    def _on_live_event(self, events: int) -> None:
        sock = self._live
        if sock is None:
            return
        try:
            data = sock.recv(64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            why = f"liveness socket: {exc}"
        else:
            if data:
                return  # the peer sends nothing after its hello; ignore stray bytes
            why = "liveness socket closed"
        log.debug("ucx: peer %s gone (%s)", self._peer, why)
        self._drop_liveness()
        self._state.lost = True
        self._on_ep_lost()

    def _abort_locked(self) -> None:
        """abort() for a caller that holds the engine lock."""
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._error = ClosedError("transport closed")
        self._teardown(goodbye=False)
        self._eng.notify()

    def _drop_liveness(self) -> None:
        sock, self._live = self._live, None
        if sock is not None:
            self._eng.unwatch_fd(sock.fileno())
            sock.close()

    def _close(self, *, goodbye: bool) -> None:
        eng = self._eng
        with eng.op():
            if self._closed:
                return
            self._closed = True
            alive = self._error is None and not self._peer_gone()
            if self._error is None:
                self._error = ClosedError("transport closed")
            eng.notify()  # other threads' waits end with ClosedError
            bye = None
            if goodbye and alive and self._ep is not None:
                bye = self._start_goodbye()
        if bye is not None:
            # Graceful close: this side's sends still in flight complete first (the peer
            # receives them: rendezvous data is fetched from us), then the goodbye, which
            # UCX delivers after them; only then the endpoint closes. Bounded.
            state = self._state
            end = time.monotonic() + CLOSE_DRAIN_S

            def drained() -> bool:
                if state.lost:
                    return True
                if any(not r.completed for r, _ in self._sends):
                    return False
                if bye[0] is None:
                    bye[0] = self._post_goodbye(bye)
                    if bye[0] is not False:
                        nonlocal end
                        end = time.monotonic() + CLOSE_ACK_S
                if bye[0] is False:
                    return True
                self._poll_ctrl()
                return bye[0].completed and (self._acked or self._bye_at is not None)

            try:
                while not eng.wait(drained, end) and time.monotonic() < end:
                    pass  # ``end`` moved: the goodbye went out and now waits for its ACK
            except Exception as exc:  # noqa: BLE001 - closing is best effort
                log.debug("ucx close: draining: %s", exc)
        with eng.op():
            self._teardown(goodbye=False)
            eng.notify()

    def _start_goodbye(self) -> list[Any]:
        """[request or None (not sent yet) or False (failed), buffers]: the goodbye's state."""
        bye = np.frombuffer(bytearray(BYE), dtype=np.uint8)
        return [None, (bye, _Array(bye))]

    def _post_goodbye(self, bye: list[Any]) -> Any:
        ep = self._ep
        if ep is None:
            return False
        try:
            return ep.tag_send(bye[1][1], tag=_Tag(self._peer_rid | (CTRL << _KIND_SHIFT)))
        except _ucx.UCXError:
            return False

    def _teardown(self, *, goodbye: bool) -> None:
        """Say goodbye (best effort), cancel every request of the endpoint and close it."""
        if self._ep is None:
            return
        ep, self._ep = self._ep, None
        if goodbye and not self._state.lost:
            try:
                bye = np.frombuffer(bytearray(BYE), dtype=np.uint8)
                barr = _Array(bye)
                req = ep.tag_send(barr, tag=_Tag(self._peer_rid | (CTRL << _KIND_SHIFT)))
                end = time.monotonic() + 0.2
                while not req.completed and time.monotonic() < end and not self._state.lost:
                    self._eng.worker.progress()
            except _ucx.UCXError:
                pass
        self._state.owner = None
        self._eng.ctrl_watch.discard(self)
        self._drop_liveness()
        if self._eh:
            _close_ep(ep)  # force close: UCX cancels the endpoint's requests
        else:
            # Without error handling UCX's close flushes, which never ends when the peer is
            # unreachable (a cut network): complete our own posted receives through a loopback
            # endpoint instead, so no receive is left pointing into a slot, then close
            # asynchronously (the engine's progress finishes it when it can).
            self._release_receives()
            try:
                ep.close()
            except Exception as exc:  # noqa: BLE001 - best effort
                log.debug("ucx endpoint close: %s", exc)
            pending = [(r, k) for r, k in self._sends if not r.completed]
            if pending:  # sends the lost peer will never fetch: their buffers must outlive them
                _GRAVEYARD.extend(pending)
        self._drain_unexpected()
        # Requests were cancelled by the close; completion may need one more progress.
        self._eng.worker.progress()
        self._credit_rx.clear()
        self._sends.clear()
        self._eng.objects.discard(self)

    def _release_receives(self) -> None:
        """Complete this connection's still-posted receives with empty messages from our own worker."""
        eng = self._eng
        tags: list[tuple[int, Any]] = []
        for tag, q in self._posted.items():
            for p in q:
                if p.req is not None and not p.req.completed:
                    tags.append((self._rid | (DATA << _KIND_SHIFT) | tag, p.req))
                if p.hreq is not None and not p.hreq.completed:
                    tags.append((self._rid | (HEADER << _KIND_SHIFT) | tag, p.hreq))
        for tag, rx in self._credit_rx.items():
            if rx.req is not None and not rx.req.completed:
                tags.append((self._rid | (CREDIT << _KIND_SHIFT) | tag, rx.req))
        if self._ctrl_req is not None and not self._ctrl_req.completed:
            tags.append((self._rid | (CTRL << _KIND_SHIFT), self._ctrl_req))
        if not tags:
            return
        try:
            me = eng.self_endpoint()
            empty = _Array(_u8(0))
            sends = [me.tag_send(empty, tag=_Tag(t)) for t, _ in tags]
            end = time.monotonic() + 1.0
            while time.monotonic() < end and not all(r.completed for _, r in tags):
                eng.worker.progress()
        except Exception as exc:  # noqa: BLE001 - best effort; then the buffers are kept alive
            log.debug("ucx: releasing receives: %s", exc)
            sends = []
        if not all(r.completed for _, r in tags):
            # Still posted: keep every buffer they may write into referenced, for good.
            _GRAVEYARD.append((None, (dict(self._posted), dict(self._credit_rx), self._ctrl_buf, self._ctrl_arr)))
        del sends

    def _drain_unexpected(self) -> None:
        """Take small messages still queued for this connection out of UCX's unexpected queue."""
        worker = self._eng.worker
        mask = _ucx.UCXXTagMask(_RID_MASK << _RID_SHIFT)
        scratch = _u8(4096)
        sarr = _Array(scratch)
        for _ in range(10000):
            try:
                probe = worker.tag_probe(_Tag(self._rid), mask, remove=False)
                if not probe.matched or probe.length > len(scratch):
                    return
                probe = worker.tag_probe(_Tag(self._rid), mask, remove=True)
                if not probe.matched:
                    return
                req = worker.tag_recv_with_handle(sarr, probe)
                end = time.monotonic() + 0.1
                while not req.completed and time.monotonic() < end:
                    worker.progress()
            except Exception as exc:  # noqa: BLE001 - best effort
                log.debug("draining unexpected ucx messages: %s", exc)
                return

    def _settle(self, reqs: list[Any]) -> None:
        """Keep in-flight buffers referenced until UCX is done with them."""
        pending = [(r, k) for r, k in reqs if not r.completed]
        if pending:
            self._sends.extend(pending)

    def _grant(self, tag: int, cap: int, flags: int) -> None:
        """Send one credit; its 16-byte buffer comes from a pool (eager sends usually finish at once)."""
        pool = self._credit_pool
        cbuf, carr = pool.pop() if pool else (_u8(CRED.size), None)
        if carr is None:
            carr = _Array(cbuf)
        CRED.pack_into(cbuf, 0, cap, flags)
        req = self._ep.tag_send(carr, tag=(self._tag_objs.get(tag) or self._tags(tag)).cred_tx)
        if req.completed:
            pool.append((cbuf, carr))
        else:
            self._sends.append((req, (cbuf, carr)))
        sends = self._sends
        while sends and sends[0][0].completed:
            sends.popleft()

    def _take_credit(self, tag: int) -> tuple[int, int] | None:
        q = self._credits[tag]
        rx = self._credit_rx.get(tag)
        if rx is None:
            rx = self._credit_rx[tag] = _CreditRx()
        while True:
            if rx.req is None:
                if q:
                    break  # one in hand: the receive for the next is armed after the send (_arm_credit)
                rx.req = self._ep.tag_recv(rx.arr, tag=(self._tag_objs.get(tag) or self._tags(tag)).cred_rx)
            if not rx.req.completed:
                break
            req, rx.req = rx.req, None
            try:
                req.check_error()
            except _ucx.UCXError as exc:
                raise self._fail_from(exc, f"waiting for a credit on tag {tag}") from exc
            q.append(CRED.unpack_from(rx.buf))
        return q.popleft() if q else None

    def _arm_credit(self, tag: int) -> None:
        """Keep a receive posted for the next credit on ``tag`` (credits sent meanwhile wait in UCX's queue)."""
        rx = self._credit_rx.get(tag)
        if rx is not None and rx.req is None:
            try:
                rx.req = self._ep.tag_recv(rx.arr, tag=(self._tag_objs.get(tag) or self._tags(tag)).cred_rx)
            except _ucx.UCXError as exc:
                raise self._fail_from(exc, f"waiting for a credit on tag {tag}") from exc

    def _finish(self, tag: int, p: _Post) -> Received:
        try:
            p.req.check_error()
            if p.hreq is not None:
                p.hreq.check_error()
        except _ucx.UCXError as exc:
            raise self._fail_from(exc, f"receive on tag {tag}") from exc
        if p.hreq is None:
            self.bytes_received += p.cap
            got = _RECEIVED.get(p.cap)
            if got is None:  # immutable: one per size (a frozen dataclass costs ~1 us to build)
                got = Received(p.cap)
                if len(_RECEIVED) < 4096:
                    _RECEIVED[p.cap] = got
            return got
        step, nbytes, ndim, *dims = HDR.unpack_from(p.hbuf)
        if nbytes > p.cap:
            self._fail(ProtocolError(f"peer {self._peer} announced {nbytes} bytes for a {p.cap}-byte slot"))
            self._check_usable()
        if ndim == NO_SHAPE:
            shape = None
        elif ndim <= HEADER_DIMS:
            shape = tuple(dims[:ndim])
        else:
            self._fail(ProtocolError(f"bad ndim {ndim} from {self._peer}"))
            self._check_usable()
        self.bytes_received += nbytes
        return Received(nbytes, shape, step)

    def _on_ep_lost(self) -> None:
        # Not fatal yet: after a graceful close the endpoint error follows the goodbye, and
        # messages sent before it may still be queued here (UCX cancels this endpoint's
        # receives; _salvage takes their messages from the unexpected queue). Without a
        # goodbye within LOST_GRACE_S, _check_usable declares the peer lost.
        if self._lost_at is None:
            self._lost_at = time.monotonic()
        try:
            self._eng.notify()
        except RuntimeError:  # called outside the engine lock (UCX's async thread)
            pass

    def _send_ctrl(self, msg: bytes) -> None:
        """Best effort: the peer may be gone already."""
        if self._ep is None or self._state.lost:
            return
        buf = np.frombuffer(bytearray(msg), dtype=np.uint8)
        arr = _Array(buf)
        try:
            req = self._ep.tag_send(arr, tag=_Tag(self._peer_rid | (CTRL << _KIND_SHIFT)))
        except _ucx.UCXError:
            return
        if not req.completed:
            self._sends.append((req, (buf, arr)))

    def _peer_gone(self) -> bool:
        return self._bye_at is not None or self._lost_at is not None

    def _salvage(self, tag: int, p: _Post) -> None:
        """The peer is gone: refill a receive UCX cancelled (or never posted) from the unexpected queue."""
        worker = self._eng.worker
        for kind, attr, arr in ((DATA, "req", p.arr), (HEADER, "hreq", p.harr)):
            if arr is None or not _cancelled(getattr(p, attr)):
                continue
            try:
                probe = worker.tag_probe(_Tag(self._rid | (kind << _KIND_SHIFT) | tag), remove=True)
                if probe.matched:
                    setattr(p, attr, worker.tag_recv_with_handle(arr, probe))
            except _ucx.UCXError as exc:
                raise self._fail_from(exc, f"receive on tag {tag}") from exc

    def _poll_ctrl(self) -> None:
        req = self._ctrl_req
        if req is None or not req.completed:
            return
        if _cancelled(req):  # the endpoint failed first: the goodbye may sit in the unexpected queue
            if not self._closed:
                probe = self._eng.worker.tag_probe(_Tag(self._rid | (CTRL << _KIND_SHIFT)), remove=True)
                if probe.matched:
                    self._ctrl_req = self._eng.worker.tag_recv_with_handle(self._ctrl_arr, probe)
            return
        self._ctrl_req = None
        try:
            req.check_error()
        except _ucx.UCXError:
            self._on_ep_lost()
            return
        msg = bytes(self._ctrl_buf)
        if msg in (BYE, ACK):
            if msg == BYE:
                self._bye_at = time.monotonic()
                self._send_ctrl(ACK)
            else:
                self._acked = True
            if self._closed and self._ep is not None and not self._acked:
                try:  # a closing side that got the peer's goodbye still waits for the ACK of its own
                    self._ctrl_req = self._ep.tag_recv(self._ctrl_arr, tag=_Tag(self._rid | (CTRL << _KIND_SHIFT)))
                except _ucx.UCXError:
                    pass
            self._eng.notify()
        else:
            self._fail(ProtocolError(f"unknown control message {bytes(self._ctrl_buf)!r} from {self._peer}"))

    def _check_usable(self) -> None:
        if self._error is None:
            self._poll_ctrl()
            lost = self._lost_at
            if (
                self._error is None
                and self._bye_at is None
                and lost is not None
                and time.monotonic() - lost >= LOST_GRACE_S
            ):
                self._error = PeerLostError(f"peer {self._peer} lost (its connection closed or timed out)")
        err = self._error
        if err is not None:
            if isinstance(err, (TransportError, ClosedError, ProtocolError, AuthError)):
                raise type(err)(str(err)) from err
            raise PeerLostError(str(err)) from err

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._eng.notify()

    def _fail_from(self, exc: BaseException, doing: str) -> TensorWireError:
        """Translate a ucxx error: the recorded cause if there is one, else PeerLostError."""
        if self._error is None:
            if isinstance(exc, getattr(_ucx, "UCXMessageTruncatedError", ())):
                self._fail(ProtocolError(f"{doing}: peer {self._peer} sent more than the buffer holds"))
            elif isinstance(exc, _LOST_ERRORS):
                self._fail(PeerLostError(f"{doing}: peer {self._peer} lost ({exc})"))
            else:
                self._fail(TransportError(f"{doing}: UCX error: {exc}"))
        err = self._error
        assert err is not None
        return type(err)(str(err)) if isinstance(err, TensorWireError) else PeerLostError(str(err))


# -- connection set-up -----------------------------------------------------------------


def _listen(host: str, port: int) -> socket.socket:
    """The listener's TCP socket (handshake, then liveness), bound to ``host`` only."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise TransportError(f"cannot resolve {host!r} for the UCX data listener: {exc}") from exc
    info = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot listen for UCX data connections on {host!r} port {port}: {exc}") from exc
    return sock


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """Blocking read of exactly ``n`` bytes before ``deadline`` (socket.timeout / ConnectionError otherwise)."""
    buf = bytearray()
    while len(buf) < n:
        rem = _remaining(deadline)
        if rem is not None and rem <= 0:
            raise socket.timeout("handshake timed out")
        sock.settimeout(10.0 if rem is None else max(0.01, rem))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


class _Pending:
    """A handshake in progress on the listener (non-blocking reads, driven by the engine)."""

    __slots__ = ("sock", "buf", "need", "deadline", "peer")

    def __init__(self, sock: socket.socket, deadline: float, peer: str) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.need = HELLO.size
        self.deadline = deadline
        self.peer = peer


class _AddressCheck:
    """A sandbox process that unpacks untrusted UCX worker addresses (module ``ucx_addrcheck``).

    :meth:`check` is True when the sandbox made an endpoint from the address;
    False when it refused it, died (UCX aborted on it) or did not answer in time.
    A dead sandbox is replaced at the next check. Thread-safe (one check at a time).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Any = None
        self.started = 0  # sandboxes started (tests watch it)

    def _spawn(self) -> Any:
        import subprocess

        eng = _engine()
        tls = eng.ctx.config.get("TLS", "") if hasattr(eng.ctx, "config") else ""
        proc = subprocess.Popen(
            [sys.executable, "-m", "tensorwire.transport.ucx_addrcheck", tls],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        self.started += 1
        return proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.kill()
                proc.wait(5)
            except Exception:  # noqa: BLE001 - best effort
                pass
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except Exception:  # noqa: BLE001
                    pass

    def _read1(self, deadline: float) -> bytes:
        fd = self._proc.stdout.fileno()
        rem = deadline - time.monotonic()
        if rem <= 0 or not select.select([fd], [], [], rem)[0]:
            return b""
        return os.read(fd, 1)

    def check(self, addr: bytes, *, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._kill()
                    self._proc = self._spawn()
                    # a fresh sandbox imports ucxx first (about a second): allow for it
                    if self._read1(deadline + 10.0) != b"R":
                        self._kill()
                        return False
                self._proc.stdin.write(struct.pack("<I", len(addr)) + addr)
                self._proc.stdin.flush()
                answer = self._read1(deadline)
            except (OSError, ValueError) as exc:
                log.debug("ucx address sandbox: %s", exc)
                answer = b""
            if answer != b"Y":
                if answer != b"N":
                    self._kill()  # died on it (or hung): the next check starts a fresh one
                return False
            return True

    def close(self) -> None:
        with self._lock:
            self._kill()


class UcxListener(Listener):
    """Accepts UCX data connections; routes each to the link whose nonce it presents.

    The listening socket is a plain TCP socket bound to ``host``: a connecting
    peer sends its hello (magic, version, receiver id, nonce, its UCX worker
    address) there; a good hello gets an answer with this side's receiver id
    and worker address, each side creates its UCX endpoint from the other's
    worker address, and the TCP connection stays open as the liveness channel.
    """

    kind = "ucx"
    HELLO_TIMEOUT = 5.0

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        port: int = 0,
        peer_timeout: float = 30.0,
        untrusted: bool = False,
        secret: bytes | None = None,
    ) -> None:
        """
        Args:
            untrusted: the peers are not trusted (serve clients): this process's UCX
                context gets no shared-memory / cma / cuda_ipc transport, every endpoint
                has peer error handling, and a peer's worker address is first unpacked by
                a sandbox process (:class:`_AddressCheck`), since UCX aborts on a malformed one.
            secret: the link secret a dialler must prove it holds (``link_proof``), checked
                in constant time before anything else is done for it; None: none asked.

        Raises:
            TransportError: cannot listen.
        """
        self._eng = eng = _engine(peer_timeout, untrusted=untrusted)
        self._untrusted = untrusted
        self._peer_errors = untrusted or _error_handling()
        self._secret = bytes(secret) if secret else None
        self._check = _AddressCheck() if untrusted else None
        self._host = host
        self._peer_timeout = peer_timeout
        self._expected: set[bytes] = set()
        self._parked: dict[bytes, UcxTransport] = {}
        self._conns: dict[int, _Pending] = {}
        self._closed = False
        self._count = 0
        self._checking = 0  # worker addresses in the sandbox now
        self.rejected = 0
        self._sock = _listen(host, port)
        self._port = self._sock.getsockname()[1]
        with eng.op():
            eng.watch_fd(self._sock.fileno(), self._on_accept)
            eng.objects.add(self)

    @property
    def address(self) -> tuple[str, int]:
        return (self._host, self._port)

    def expect(self, nonce: bytes) -> None:
        with self._eng.op():
            self._expected.add(bytes(nonce))

    def forget(self, nonce: bytes) -> None:
        with self._eng.op():
            self._expected.discard(nonce)
            t = self._parked.pop(nonce, None)
        if t is not None:
            t.abort()

    def accept(self, nonce: bytes, *, timeout: float | None) -> UcxTransport:
        deadline = None if timeout is None else time.monotonic() + timeout
        nonce = bytes(nonce)
        got: list[UcxTransport] = []

        def ready() -> bool:
            t = self._parked.pop(nonce, None)
            if t is not None:
                self._expected.discard(nonce)
                got.append(t)
                return True
            if self._closed:
                raise ClosedError("listener closed")
            return False

        if not self._eng.wait(ready, deadline):
            raise ConnectTimeout(f"no UCX data connection arrived on port {self._port} within {timeout}s")
        return got[0]

    def close(self) -> None:
        eng = self._eng
        with eng.op():
            if self._closed:
                return
            self._closed = True
            eng.unwatch_fd(self._sock.fileno())
            self._sock.close()
            for fd, pend in list(self._conns.items()):
                eng.unwatch_fd(fd)
                pend.sock.close()
            self._conns.clear()
            parked = list(self._parked.values())
            self._parked.clear()
            eng.servicing.discard(self)
            eng.objects.discard(self)
            eng.notify()
        for t in parked:
            t.abort()
        if self._check is not None:
            self._check.close()

    # -- engine lock held ------------------------------------------------------------
    def _on_accept(self, events: int) -> None:
        """The listening socket is readable: take every waiting connection."""
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("ucx data listener: accept: %s", exc)
                return
            if self._closed:
                sock.close()
                continue
            self._count += 1
            sock.setblocking(False)
            fd = sock.fileno()
            self._conns[fd] = _Pending(
                sock, time.monotonic() + self.HELLO_TIMEOUT, f"ucx-client#{self._count}@{addr[0]}:{addr[1]}"
            )
            self._eng.watch_fd(fd, lambda ev, fd=fd: self._on_hello(fd))
            self._eng.servicing.add(self)

    def _service(self) -> None:
        """Drop connections whose hello did not arrive in time."""
        now = time.monotonic()
        for fd, pend in list(self._conns.items()):
            if now >= pend.deadline:
                self._drop(fd, f"no hello within {self.HELLO_TIMEOUT}s")
        if not self._conns:
            self._eng.servicing.discard(self)

    def _drop(self, fd: int, why: str, *, reply: bytes | None = None) -> None:
        pend = self._conns.pop(fd, None)
        if pend is None:
            return
        self._eng.unwatch_fd(fd)
        self._reject(pend, why, reply=reply)

    def _reject(self, pend: _Pending, why: str, *, reply: bytes | None = None) -> None:
        if reply is not None:
            try:
                pend.sock.send(reply)  # small: fits the socket buffer of a fresh connection
            except OSError:
                pass
        pend.sock.close()
        self.rejected += 1
        log.warning("ucx data listener: dropped connection %s: %s", pend.peer, why)

    def _on_hello(self, fd: int) -> None:
        pend = self._conns.get(fd)
        if pend is None:
            return
        try:
            data = pend.sock.recv(pend.need - len(pend.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(fd, f"hello failed: {exc}")
            return
        if not data:
            self._drop(fd, "closed before its hello")
            return
        pend.buf += data
        if len(pend.buf) < pend.need:
            return
        magic, version, client_rid, nonce, proof, alen = HELLO.unpack_from(pend.buf)
        if magic != HELLO_MAGIC:
            self._drop(fd, f"bad hello magic {bytes(magic)!r}")
            return
        no = REPLY.pack(REPLY_NO, PROTOCOL_VERSION, 0, 0, 0)
        if version != PROTOCOL_VERSION:
            self._drop(fd, f"peer speaks data protocol v{version}, this is v{PROTOCOL_VERSION}", reply=no)
            return
        if not client_rid or client_rid > _RID_MASK or not 0 < alen <= MAX_ADDRESS:
            self._drop(fd, "bad hello fields")
            return
        if not proof_matches(self._secret, nonce, proof):
            self._drop(fd, "wrong or missing link secret", reply=no)
            return
        if nonce not in self._expected or nonce in self._parked or self._closed:
            self._drop(fd, "unknown data-plane credential", reply=no)
            return
        if pend.need == HELLO.size:
            pend.need += alen  # now read the worker address
            return
        addr = bytes(pend.buf[HELLO.size :])
        if self._check is None:
            self._complete(fd, pend, nonce, client_rid, addr)
            return
        # Untrusted: UCX aborts the process on a malformed worker address (an assertion in its
        # address unpacking), so a sandbox process unpacks it first, off the engine lock.
        del self._conns[fd]
        self._eng.unwatch_fd(fd)
        self._checking += 1
        check = self._check

        def run() -> None:
            ok = check.check(addr, timeout=self.HELLO_TIMEOUT)
            with self._eng.op():
                self._checking -= 1
                if not ok:
                    self._reject(pend, "its UCX worker address does not unpack (refused)", reply=no)
                elif self._closed or nonce not in self._expected or nonce in self._parked:
                    self._reject(pend, "listener closed or credential used meanwhile", reply=no)
                else:
                    self._conns[fd] = pend
                    self._complete(fd, pend, nonce, client_rid, addr)

        threading.Thread(target=run, daemon=True, name="tensorwire-ucx-addrcheck").start()

    def _complete(self, fd: int, pend: _Pending, nonce: bytes, client_rid: int, addr: bytes) -> None:
        """Under the lock: make the endpoint to a checked hello's worker address, answer, park the transport."""
        eng = self._eng
        no = REPLY.pack(REPLY_NO, PROTOCOL_VERSION, 0, 0, 0)
        eh = self._peer_errors
        try:
            ep = _ucx.UCXEndpoint.create_from_worker_address(eng.worker, _ucx.UCXAddress.create_from_buffer(addr), eh)
        except Exception as exc:  # noqa: BLE001 - one bad peer must not stop the listener
            self._drop(fd, f"cannot create a UCX endpoint to its worker address: {exc}", reply=no)
            return
        self._conns.pop(fd, None)
        eng.unwatch_fd(fd)
        rid = eng.new_rid()
        mine = eng.address
        try:
            pend.sock.setblocking(True)
            pend.sock.settimeout(self.HELLO_TIMEOUT)
            flags = R_PEER_ERRORS if eh else 0
            pend.sock.sendall(REPLY.pack(REPLY_OK, PROTOCOL_VERSION, rid, flags, len(mine)) + mine)
        except OSError as exc:
            _close_ep(ep)
            self._reject(pend, f"answering failed: {exc}")
            return
        t = UcxTransport(
            eng,
            ep,
            _watch(ep),
            rid=rid,
            peer_rid=client_rid,
            peer=pend.peer,
            peer_timeout=self._peer_timeout,
            peer_errors=eh,
        )
        t._attach_liveness(pend.sock)
        self._parked[nonce] = t
        eng.notify()

    # -- dialling --------------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        nonce: bytes,
        *,
        timeout: float | None,
        peer_timeout: float = 30.0,
        secret: bytes | None = None,
    ) -> UcxTransport:
        """Dial a UCX data listener and present ``nonce`` (and the proof of ``secret``, the link secret).

        The endpoint gets UCX peer error handling when the listener's answer says so.

        Raises:
            ConnectTimeout: no connection/answer within ``timeout``.
            AuthError: the listener refused the credential.
            VersionMismatchError: the listener speaks another protocol version.
            PeerLostError: the address cannot be resolved.
        """
        if len(nonce) != NONCE_BYTES:
            raise ConfigError(f"nonce must be {NONCE_BYTES} bytes")
        deadline = None if timeout is None else time.monotonic() + timeout
        eng = _engine(peer_timeout)
        peer = f"{host}:{port}"
        # Any socket error is retried until the deadline (a listener not up yet, a reset, a slow SYN).
        sock = dial(host, port, deadline, retry=(OSError,), timeout_without_deadline=10.0, what="UCX data listener")
        try:
            tune_socket(sock, peer_timeout=peer_timeout)
            with eng.op():
                rid = eng.new_rid()
                mine = eng.address
            sock.sendall(
                HELLO.pack(
                    HELLO_MAGIC, PROTOCOL_VERSION, rid, bytes(nonce), link_proof(secret, bytes(nonce)), len(mine)
                )
                + mine
            )
            magic, version, server_rid, flags, alen = REPLY.unpack(_recv_exact(sock, REPLY.size, deadline))
            if magic == REPLY_NO:
                if version != PROTOCOL_VERSION:
                    raise VersionMismatchError(f"peer speaks data protocol v{version}, this is v{PROTOCOL_VERSION}")
                raise AuthError(f"UCX data listener {peer} refused the connection (bad credential)")
            if (
                magic != REPLY_OK
                or version != PROTOCOL_VERSION
                or not 0 < server_rid <= _RID_MASK
                or not 0 < alen <= MAX_ADDRESS
            ):
                raise ProtocolError(f"unexpected hello reply from {peer}")
            addr = _recv_exact(sock, alen, deadline)
        except socket.timeout:
            sock.close()
            raise ConnectTimeout(f"UCX hello to {peer} not answered in time") from None
        except OSError as exc:
            sock.close()
            raise PeerLostError(f"UCX handshake with {peer} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        with eng.op():
            try:
                ep = _ucx.UCXEndpoint.create_from_worker_address(
                    eng.worker, _ucx.UCXAddress.create_from_buffer(addr), bool(flags & R_PEER_ERRORS)
                )
            except _ucx.UCXError as exc:
                sock.close()
                raise TransportError(f"cannot create a UCX endpoint to {peer}: {exc}") from exc
            t = UcxTransport(
                eng,
                ep,
                _watch(ep),
                rid=rid,
                peer_rid=server_rid,
                peer=peer,
                peer_timeout=peer_timeout,
                peer_errors=bool(flags & R_PEER_ERRORS),
            )
            t._attach_liveness(sock)
        return t
