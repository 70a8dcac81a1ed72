"""Same-host single-copy transfers for the TCP transport: Linux cross-memory attach (CMA).

Between two processes of one host a TCP byte stream costs two kernel copies
(sender -> socket buffer -> receiver) and runs at the loopback's speed. With
cross-memory attach (``process_vm_writev(2)``) the **sender copies its bytes
straight into the receiver's posted buffer**: one copy, the kernel walking both
address spaces -- the one-sided write into a preallocated receive buffer of
MSRA's design. The TCP connection stays the control channel; large messages
are split into pieces copied by a few threads at once (ctypes releases the GIL
during the call).

Protocol, on frames of :mod:`tensorwire.transport.tcp` (a control frame carries
a subtype and a 64-byte body):

1. **Probe**, once per connection, symmetric, begun as the connection is made.
   Each side sends HELLO: its pid, pid namespace, host id
   (:func:`~tensorwire.transport.select.host_id`), the address of a 32-byte probe
   buffer and a random challenge. A side that finds the peer on its host and in
   its pid namespace puts the peer's challenge into its probe buffer, lets the
   peer ptrace it where Yama asks for that (below), and answers READY; otherwise
   NO. On READY a side first *reads* the peer's probe buffer
   (``process_vm_readv``) and compares it with its challenge -- proof that the
   pid names the peer and no other process, before anything is ever written --
   then writes a random token into the second half of that buffer and sends
   TOKEN. The peer compares the token with what landed: from then on it
   announces its large receive buffers. Anything that fails (seccomp, Yama,
   another user, another namespace, ``TENSORWIRE_CMA=off``) leaves that
   direction on the byte stream, with one log line. Until the probe is done
   every message takes the byte stream.
2. **Receive**: each buffer of at least ``TENSORWIRE_CMA_MIN_BYTES`` posted
   after that goes out as SLOT (tag, the step of the message it will hold,
   address, length), ahead of its credit. The k-th buffer posted on a tag holds
   the k-th message of that tag (the TCP transport checks steps: +1 each time).
3. **Send**: a message of at least that size whose (tag, step) has a SLOT and
   fits in it is written into that buffer by the sender, then announced by a
   WRITTEN frame (a DATA header without payload). The receiver delivers it only
   after checking that it announced exactly that buffer for that (tag, step),
   at least that long. The sender's buffer is free again once its copy returned.

Permissions: ``process_vm_writev`` needs the right to ptrace the target (same
user and dumpable, or ``CAP_SYS_PTRACE``). Under Yama ``ptrace_scope`` 1 the
target must also name its writer with ``prctl(PR_SET_PTRACER, pid)``; the kernel
keeps one such name per process, and names it *and its descendants*. So a
process grants its only CMA peer by pid, and once it has several, their nearest
common ancestor (under ``torchrun`` the launcher process of the node, whose
children are the ranks). The grant is never narrowed while the process lives.
Scopes 2 and 3 need ``CAP_SYS_PTRACE``: the probe finds out.

Security: only connections that proved the link secret (links of one job)
ever probe; the serve daemon's listeners take no secret and treat a CMA frame
as a protocol error. The copying side's own memory is never named by the
peer: the sender copies from the buffer its caller passed, of the message's
length; the peer's address is only ever used as the *target* of that copy, so
a lying peer can only overwrite its own memory. The receiver delivers a
WRITTEN message only into the one buffer it announced for that step, and never
one longer than that buffer. The probe's read proves the pid is the peer, and a
pidfd of the peer, checked before every copy, keeps a recycled pid from being
written into after the peer died.

Failures: a peer that dies before or during a copy makes the copy fail with
ESRCH or a short count, or its pidfd report the exit: :class:`~tensorwire.PeerLostError`
on the sender; the receiver never got the WRITTEN frame of that message, so a
partly written buffer is never delivered (the connection's end raises
PeerLostError there). A copy refused outright (EPERM: the peer withdrew its
permission) sends that message and every later one over the byte stream. Any
other failure (EFAULT: the peer unmapped the buffer it announced) is a
:class:`~tensorwire.TransportError` and breaks the connection. No error of the
system call ever aborts the process.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import select
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

from tensorwire.errors import PeerLostError, TransportError
from tensorwire.settings import env_var, setting
from tensorwire.transport.select import host_id

__all__ = [
    "CmaPeer",
    "new_cma_peer",
    "supported",
    "ptrace_scope",
    "grant_ptrace",
    "common_ancestor",
    "address_of",
    "HELLO",
    "READY",
    "TOKEN",
    "NO",
    "SLOT",
    "BODY_BYTES",
]

log = logging.getLogger(__name__)

#: Subtypes of a control frame.
HELLO, READY, TOKEN, NO, SLOT = 1, 2, 3, 4, 5
BODY_BYTES = 64
#: HELLO body: host id (16 bytes), pid namespace (st_dev, st_ino), challenge (16 bytes), reserved.
_HELLO_BODY = struct.Struct("<16sQQ16s16x")
_TOKEN_BODY = struct.Struct("<16s48x")
_SLOT_BODY = struct.Struct("<Q56x")
_NO_BODY = bytes(BODY_BYTES)
assert _HELLO_BODY.size == _TOKEN_BODY.size == _SLOT_BODY.size == BODY_BYTES

#: Why a side said NO (the ``nbytes`` field of the frame).
_REASONS = {
    1: f"{env_var('cma')}=off",
    2: "cross-memory attach is not available here",
    3: "another host",
    4: "another pid namespace",
    5: "could not allow the peer to ptrace this process",
    6: "no pidfd for the peer",
}
_OFF, _UNSUPPORTED, _OTHER_HOST, _OTHER_PIDNS, _NO_GRANT, _NO_PIDFD = 1, 2, 3, 4, 5, 6

#: A message is split into pieces of at least this many bytes for the copy threads. One thread copied
#: about 3 GB/s on a 16-core host (1 MiB messages of bench/results/distributed_h100_2026-11-24-2.md, against
#: 11-13 GB/s for 16 MiB and more in four pieces), so a 1 MiB message is already worth splitting.
PIECE_MIN = 256 << 10
_PAGE = 4096
_PR_SET_PTRACER = 0x59616D61


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Libc:
    """``process_vm_readv``, ``process_vm_writev`` and ``prctl`` of the C library (GIL released in calls)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.readv = libc.process_vm_readv
        self.writev = libc.process_vm_writev
        for fn in (self.readv, self.writev):
            fn.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
            fn.restype = ctypes.c_ssize_t
        self.prctl = libc.prctl
        self.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        self.prctl.restype = ctypes.c_int


_LIBC: _Libc | None = None
_LIBC_ERROR: str | None = None
_LIBC_LOCK = threading.Lock()


def _libc() -> _Libc | None:
    global _LIBC, _LIBC_ERROR
    if _LIBC is None and _LIBC_ERROR is None:
        with _LIBC_LOCK:
            if _LIBC is None and _LIBC_ERROR is None:
                try:
                    _LIBC = _Libc()
                except (OSError, AttributeError) as exc:  # not Linux, or a C library without these calls
                    _LIBC_ERROR = str(exc)
    return _LIBC


def supported() -> bool:
    """Whether this process can try cross-memory attach at all (Linux, the calls and pidfds exist)."""
    return _libc() is not None and hasattr(os, "pidfd_open")


def address_of(view: memoryview) -> int:
    """Address of a writable byte view's first byte.

    Raises:
        TypeError: the view is read-only.
    """
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


# -- the copy ------------------------------------------------------------------------------------------


def _call(fn: Any, pid: int, local: int, remote: int, n: int) -> int:
    liov = _IoVec(local, n)
    riov = _IoVec(remote, n)
    got = int(fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0))
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return got


def _copy_piece(fn: Any, pid: int, local: int, remote: int, n: int) -> None:
    """Copy ``n`` bytes; a short count (a fault part-way) is resumed once more to learn its errno."""
    done = 0
    while done < n:
        got = _call(fn, pid, local + done, remote + done, n - done)
        if got == 0:
            raise OSError(errno.EFAULT, "no byte copied")
        done += got


_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, the pool)
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process's copy threads (made on first use; again in a forked child, whose copy of the
    parent's pool has no threads)."""
    global _POOL
    pid = os.getpid()
    if _POOL is None or _POOL[0] != pid:
        with _POOL_LOCK:
            if _POOL is None or _POOL[0] != pid:
                _POOL = (pid, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tensorwire-cma"))
    return _POOL[1]


def default_threads() -> int:
    """Copy threads per message under ``TENSORWIRE_CMA_THREADS=0``: a quarter of the cores, 1 to 4."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def copy(fn: Any, pid: int, local: int, remote: int, n: int, *, threads: int) -> None:
    """Copy ``n`` bytes between this process (``local``) and ``pid`` (``remote``) with ``fn``
    (``process_vm_writev`` or ``process_vm_readv``), in up to ``threads`` pieces at once.

    Returns after every piece finished, also when one failed.

    Raises:
        OSError: the first failure (ESRCH before any other: the peer is gone).
    """
    pieces = min(threads, n // PIECE_MIN)
    if pieces <= 1:
        _copy_piece(fn, pid, local, remote, n)
        return
    size = -(-n // pieces)
    size = -(-size // _PAGE) * _PAGE
    futures: list[Future[None]] = []
    pool = _pool(max(1, threads - 1))
    for off in range(size, n, size):
        futures.append(pool.submit(_copy_piece, fn, pid, local + off, remote + off, min(size, n - off)))
    errors: list[OSError] = []
    try:
        _copy_piece(fn, pid, local, remote, min(size, n))
    except OSError as exc:
        errors.append(exc)
    for f in futures:
        failure = f.exception()
        if failure is not None:
            errors.append(failure if isinstance(failure, OSError) else OSError(errno.EIO, str(failure)))
    if errors:
        errors.sort(key=lambda e: e.errno != errno.ESRCH)
        raise errors[0]


# -- Yama -------------------------------------------------------------------------------------------------


def ptrace_scope() -> int:
    """Yama's ``kernel.yama.ptrace_scope`` (0 when Yama is not there)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[1])  # after "(comm) state": ppid


def _ancestry(pid: int) -> list[int]:
    """``pid``, its parent, ... up to the root of this pid namespace (empty if ``pid`` is gone)."""
    chain: list[int] = []
    try:
        while pid > 0 and pid not in chain and len(chain) < 4096:
            chain.append(pid)
            pid = _parent(pid)
    except (OSError, ValueError, IndexError):
        if not chain:
            return []
    return chain


def common_ancestor(chains: Iterable[list[int]]) -> int | None:
    """The nearest process in every chain (each: a process then its ancestors); None: none in common."""
    chains = list(chains)
    if not chains or any(not c for c in chains):
        return None
    others = [set(c) for c in chains[1:]]
    return next((p for p in chains[0] if all(p in s for s in others)), None)


_GRANT_LOCK = threading.Lock()
_GRANTED_PEERS: set[int] = set()
_GRANTED: int | None = None
_GRANT_PID = 0  # the process that granted (a forked child inherits no Yama exception)


def grant_ptrace(
    peer: int,
    *,
    scope: int | None = None,
    prctl: Callable[[int], int] | None = None,
    ancestry: Callable[[int], list[int]] | None = None,
) -> str | None:
    """Let ``peer`` ptrace this process where Yama (``ptrace_scope`` 1) asks for it; None when done,
    else why not. Scope 0: nothing to do; 2 and 3 cannot be granted (the probe tells whether the peer
    has ``CAP_SYS_PTRACE``). Names the one peer, then the nearest common ancestor of every peer and of
    the process named before (so a grant only ever widens). ``prctl`` and ``ancestry`` stand in for
    the system in tests."""
    global _GRANTED, _GRANT_PID
    if scope is None:
        scope = ptrace_scope()
    if scope != 1 or peer == os.getpid():
        return None
    lineage = ancestry or _ancestry
    with _GRANT_LOCK:
        if _GRANT_PID != os.getpid():
            _GRANTED_PEERS.clear()
            _GRANTED, _GRANT_PID = None, os.getpid()
        if peer in _GRANTED_PEERS:
            return None
        mine = lineage(peer)
        if not mine:
            return f"process {peer} is gone"
        chains = [mine] + [c for c in (lineage(p) for p in sorted(_GRANTED_PEERS)) if c]
        if _GRANTED is not None:
            chains += [c for c in (lineage(_GRANTED),) if c]
        target = common_ancestor(chains)
        if target is None:
            return f"processes {sorted(_GRANTED_PEERS | {peer})} have no common ancestor"
        if target != _GRANTED:
            err = prctl(target) if prctl is not None else _set_ptracer(target)
            if err:
                return f"prctl(PR_SET_PTRACER, {target}) failed: {os.strerror(err)}"
            log.info(
                "cross-memory attach under Yama ptrace_scope 1: process %d and its descendants may now ptrace this one",
                target,
            )
            _GRANTED = target
        _GRANTED_PEERS.add(peer)
        return None


def _set_ptracer(pid: int) -> int:
    """``prctl(PR_SET_PTRACER, pid)``: 0 or an errno."""
    libc = _libc()
    if libc is None:
        return errno.ENOSYS
    if libc.prctl(_PR_SET_PTRACER, pid, 0, 0, 0) != 0:
        return ctypes.get_errno() or errno.EINVAL
    return 0


def _pidns() -> tuple[int, int]:
    try:
        st = os.stat("/proc/self/ns/pid")
        return st.st_dev, st.st_ino
    except OSError:
        return 0, 0


# -- one connection ---------------------------------------------------------------------------------------

#: (subtype, tag, step, nbytes, 64-byte body): a control frame for the TCP transport to send.
Frame = tuple[int, int, int, int, bytes]


class CmaPeer:
    """Cross-memory attach with the peer of one TCP connection: its probe, announced buffers and copies.

    The TCP transport calls :meth:`start` once, :meth:`on_frame` for each control frame (reader thread),
    :meth:`on_post` under its lock for every posted receive buffer, :meth:`take_frames` where it sends
    credits, :meth:`slot_for` and :meth:`write` when it sends, :meth:`landed` / :meth:`streamed` when a
    message arrives, and :meth:`close` with the connection.

    Attributes:
        sending: this side writes large messages into the peer's buffers (its probe passed).
        receiving: the peer writes into this side's buffers (this side announces them).
        state: ``"probing"``, ``"on"`` (at least one direction), or ``"off: <why>"``.
        bytes_written: bytes this side wrote into the peer; messages_written / messages_landed: counts.
    """

    def __init__(self, *, enabled: bool, min_bytes: int, threads: int, peer: str = "") -> None:
        self.min_bytes = max(1, int(min_bytes))
        self.threads = max(1, int(threads))
        self._peer = peer
        self._enabled = enabled
        self._lock = threading.Lock()
        self._out: list[Frame] = []
        self.sending = False
        self.receiving = False
        self.state = "probing" if enabled else f"off: {_REASONS[_OFF]}"
        self._done = not enabled  # no more announcements can ever come
        self._pid = os.getpid()
        self._peer_pid = 0
        self._peer_probe = 0
        self._pidfd = -1
        self._poll: Any = None
        self._probe = (ctypes.c_char * 32)()
        self._challenge = secrets.token_bytes(16)
        self._posts: dict[int, int] = {}
        self._announced: dict[tuple[int, int], tuple[Any, int]] = {}
        self._slots: dict[tuple[int, int], tuple[int, int]] = {}
        self._sent_token = False
        self._got_token = False
        self.bytes_written = 0
        self.messages_written = 0
        self.messages_landed = 0

    # -- probe --------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Queue this side's first frame: HELLO, or NO when cross-memory attach is off or unavailable."""
        with self._lock:
            if not self._enabled:
                self._out.append((NO, 0, 0, _OFF, _NO_BODY))
                return
            if not supported():
                self._off(_REASONS[_UNSUPPORTED])
                self._out.append((NO, 0, 0, _UNSUPPORTED, _NO_BODY))
                return
            dev, ino = _pidns()
            body = _HELLO_BODY.pack(bytes.fromhex(host_id() or "00" * 16)[:16], dev, ino, self._challenge)
            self._out.append((HELLO, 0, self._pid, ctypes.addressof(self._probe), body))

    @property
    def has_frames(self) -> bool:
        return bool(self._out)

    def take_frames(self) -> list[Frame]:
        """Control frames to send now, in order (SLOT frames ahead of the credits sent with them)."""
        with self._lock:
            out, self._out = self._out, []
        return out

    def put_back(self, frames: list[Frame]) -> None:
        """Frames :meth:`take_frames` gave that were not sent after all (no byte of them): first again."""
        with self._lock:
            self._out[:0] = frames

    def on_frame(self, sub: int, tag: int, step: int, nbytes: int, body: bytes) -> None:
        """A control frame arrived (the connection's reader thread). Never raises for a failed probe."""
        with self._lock:
            if sub == SLOT:
                if self.sending:
                    (addr,) = _SLOT_BODY.unpack(body)
                    self._slots[(tag, step)] = (addr, nbytes)
                return
            if self._done or self.state != "probing":
                return  # NO sent or received: the rest of the probe is moot
            if sub == HELLO:
                self._on_hello(step, nbytes, body)
            elif sub == READY:
                self._on_ready()
            elif sub == TOKEN:
                self._on_token(nbytes, body)
            elif sub == NO:
                self._off(f"the peer declined: {_REASONS.get(nbytes, f'reason {nbytes}')}")
                log.debug("cross-memory attach with %s: %s", self._peer, self.state)

    def _off(self, why: str) -> None:
        self.state = f"off: {why}"
        self.sending = self.receiving = False
        self._done = True
        self._posts.clear()

    def _say_no(self, reason: int, detail: str, *, level: int) -> None:
        self._out.append((NO, 0, 0, reason, _NO_BODY))
        self._off(detail)
        log.log(
            level, "cross-memory attach with %s is off, the byte stream carries every message: %s", self._peer, detail
        )

    def _on_hello(self, pid: int, probe: int, body: bytes) -> None:
        theirs_host, dev, ino, challenge = _HELLO_BODY.unpack(body)
        mine = host_id()
        if not mine or theirs_host != bytes.fromhex(mine)[:16]:
            self._say_no(_OTHER_HOST, _REASONS[_OTHER_HOST], level=logging.DEBUG)
            return
        if (dev, ino) != _pidns() or (dev, ino) == (0, 0):
            self._say_no(_OTHER_PIDNS, _REASONS[_OTHER_PIDNS], level=logging.INFO)
            return
        why = grant_ptrace(pid)
        if why is not None:
            self._say_no(_NO_GRANT, f"{_REASONS[_NO_GRANT]}: {why}", level=logging.WARNING)
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:
            self._say_no(_NO_PIDFD, f"{_REASONS[_NO_PIDFD]} {pid}: {exc}", level=logging.WARNING)
            return
        self._pidfd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._peer_pid = pid
        self._peer_probe = probe
        ctypes.memmove(self._probe, challenge, 16)
        self._out.append((READY, 0, 0, 0, _NO_BODY))

    def _on_ready(self) -> None:
        libc = _libc()
        if not self._peer_pid or libc is None:
            return
        seen = (ctypes.c_char * 16)()
        try:
            _copy_piece(libc.readv, self._peer_pid, ctypes.addressof(seen), self._peer_probe, 16)
            if bytes(seen) != self._challenge:
                raise OSError(errno.EPERM, f"pid {self._peer_pid} does not hold this connection's challenge")
            token = secrets.token_bytes(16)
            src = ctypes.create_string_buffer(token, 16)
            _copy_piece(libc.writev, self._peer_pid, ctypes.addressof(src), self._peer_probe + 16, 16)
        except OSError as exc:
            self._out.append((TOKEN, 0, 0, 0, _NO_BODY))
            self.state = "probing"  # the other direction may still come on
            log.warning(
                "cross-memory attach into %s (pid %d) is not allowed here (%s): messages to it take the byte "
                "stream. Containers need process_vm_writev allowed by seccomp; Yama ptrace_scope 2 or 3 needs "
                "CAP_SYS_PTRACE; %s=off turns the probe off.",
                self._peer,
                self._peer_pid,
                exc,
                env_var("cma"),
            )
            self._finish_probe(sent=True)
            return
        self.sending = True
        self._out.append((TOKEN, 0, 0, 1, _TOKEN_BODY.pack(token)))
        self._finish_probe(sent=True)

    def _on_token(self, ok: int, body: bytes) -> None:
        (token,) = _TOKEN_BODY.unpack(body)
        if ok and self._probe.raw[16:32] == token:
            self.receiving = True
        elif ok:  # a write that claims success but did not land here: not the process it says it is
            log.warning("cross-memory attach from %s: its probe write did not land here; byte stream", self._peer)
        self._finish_probe(received=True)

    def _finish_probe(self, *, sent: bool = False, received: bool = False) -> None:
        self._sent_token = self._sent_token or sent
        self._got_token = self._got_token or received
        if not (self._sent_token and self._got_token):
            return
        if self.sending or self.receiving:
            self.state = "on"
            log.debug(
                "cross-memory attach with %s (pid %d): sending %s, receiving %s",
                self._peer,
                self._peer_pid,
                self.sending,
                self.receiving,
            )
        else:
            self._off("the probe failed both ways")
        if not self.receiving:
            self._done = True
            self._posts.clear()

    # -- receive side -------------------------------------------------------------------------------------
    def on_post(self, tag: int, post: Any, view: memoryview) -> None:
        """A receive buffer was posted on ``tag`` (under the transport's lock): count it, and announce it
        when it is large and the peer writes into this side."""
        if self._done:
            return
        k = self._posts.get(tag, 0) + 1
        self._posts[tag] = k
        if self.receiving and len(view) >= self.min_bytes:
            try:
                addr = address_of(view)
            except TypeError:
                return
            with self._lock:
                self._announced[(tag, k)] = (post, len(view))
                self._out.append((SLOT, tag, k, len(view), _SLOT_BODY.pack(addr)))

    def landed(self, tag: int, step: int, post: Any, nbytes: int) -> str | None:
        """A WRITTEN message arrived for ``post``: None if this side announced exactly that buffer for
        (tag, step) and the message fits it, else what is wrong (the message must not be delivered)."""
        with self._lock:
            got = self._announced.pop((tag, step), None)
        if got is None:
            return f"no buffer was announced for step {step} of tag {tag}"
        if got[0] is not post:
            return f"step {step} of tag {tag} names another buffer than the one it fills"
        if nbytes > got[1]:
            return f"{nbytes} bytes written into an announced buffer of {got[1]}"
        self.messages_landed += 1
        return None

    def streamed(self, tag: int, step: int) -> None:
        """A byte-stream message arrived for (tag, step): forget its announcement, if any."""
        if self._announced:
            with self._lock:
                self._announced.pop((tag, step), None)

    # -- send side ----------------------------------------------------------------------------------------
    def slot_for(self, tag: int, step: int) -> tuple[int, int] | None:
        """The peer's buffer (address, length) announced for this message, if any (each is used once)."""
        if not self._slots:
            return None
        return self._slots.pop((tag, step), None)

    def alive(self) -> bool:
        """False once the peer process has exited (its pidfd says so)."""
        p = self._poll
        return p is None or not p.poll(0)

    def write(self, payload: memoryview, slot: tuple[int, int]) -> bool:
        """Copy ``payload`` into the peer's announced buffer ``slot``. False: not copied (too long for it,
        a read-only buffer, or the peer refuses writes now): send it over the byte stream.

        Raises:
            PeerLostError: the peer exited before or during the copy.
            TransportError: the copy failed otherwise (the connection can no longer be trusted).
        """
        addr, cap = slot
        n = len(payload)
        libc = _libc()
        if n > cap or not self.sending or libc is None:
            return False
        try:
            local = address_of(payload)
        except TypeError:
            return False
        if not self.alive():
            raise PeerLostError(f"peer {self._peer} (pid {self._peer_pid}) exited")
        try:
            copy(libc.writev, self._peer_pid, local, addr, n, threads=self.threads)
        except OSError as exc:
            if exc.errno == errno.ESRCH or not self.alive():
                raise PeerLostError(
                    f"peer {self._peer} (pid {self._peer_pid}) exited during a cross-memory write of {n} bytes"
                ) from exc
            if exc.errno == errno.EPERM:
                self.sending = False
                log.warning(
                    "cross-memory attach into %s (pid %d) refused (%s): the byte stream carries its messages now",
                    self._peer,
                    self._peer_pid,
                    exc,
                )
                return False
            raise TransportError(
                f"cross-memory write of {n} bytes into {self._peer} (pid {self._peer_pid}) at {addr:#x} failed: {exc}"
            ) from exc
        self.bytes_written += n
        self.messages_written += 1
        return True

    def close(self) -> None:
        """Release the pidfd. Idempotent."""
        fd, self._pidfd = self._pidfd, -1
        self.sending = False
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def new_cma_peer(*, authenticated: bool, peer: str = "") -> CmaPeer | None:
    """The CMA state of a new TCP connection: None for one that proved no link secret (it never probes
    and treats CMA frames as a protocol error), else a :class:`CmaPeer` following the settings."""
    if not authenticated:
        return None
    threads = setting("cma_threads") or default_threads()
    return CmaPeer(enabled=setting("cma") != "off", min_bytes=setting("cma_min_bytes"), threads=threads, peer=peer)
