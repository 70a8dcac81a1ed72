"""Cross-memory attach with the peer of one TCP connection: the probe, announced buffers, the copy.

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
   fits in it, sent on that buffer's credit, is written into that buffer by the
   sender, then announced by a WRITTEN frame (a DATA header without payload).
   The receiver delivers it only after checking that it announced exactly that
   buffer for that (tag, step), at least that long. The sender's buffer is free
   again once its copy returned. A message that goes eagerly (before its credit
   came) takes the byte stream; a SLOT that arrives for a step already sent is
   dropped.

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
from typing import Any

from tensorwire.errors import PeerLostError, TransportError
from tensorwire.settings import env_var, setting
from tensorwire.transport.cma.syscalls import (
    address_of,
    copy,
    copy_piece,
    default_threads,
    grant_ptrace,
    load_libc,
    pidns,
    supported,
)
from tensorwire.transport.select import host_id

__all__ = ["CmaPeer", "new_cma_peer", "Frame", "HELLO", "READY", "TOKEN", "NO", "SLOT", "BODY_BYTES"]

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
        self._sent: dict[int, int] = {}  # per tag: the last step the transport sent (or is sending)
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
            dev, ino = pidns()
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
                # A SLOT for a step already sent came after that message went out eagerly, over the byte
                # stream (no credit had come yet): it can never be used, so it is not kept.
                if self.sending and step > self._sent.get(tag, 0):
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
        if (dev, ino) != pidns() or (dev, ino) == (0, 0):
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
        libc = load_libc()
        if not self._peer_pid or libc is None:
            return
        seen = (ctypes.c_char * 16)()
        try:
            copy_piece(libc.readv, self._peer_pid, ctypes.addressof(seen), self._peer_probe, 16)
            if bytes(seen) != self._challenge:
                raise OSError(errno.EPERM, f"pid {self._peer_pid} does not hold this connection's challenge")
            token = secrets.token_bytes(16)
            src = ctypes.create_string_buffer(token, 16)
            copy_piece(libc.writev, self._peer_pid, ctypes.addressof(src), self._peer_probe + 16, 16)
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
        """The peer's buffer (address, length) announced for this message, if any (each is used once).

        The transport calls this for every message it sends, in step order, whether it uses the buffer or not:
        an announcement for that step or an earlier one that comes later is dropped on arrival.
        """
        if not self.sending and self.state != "probing":
            return None  # this side never writes into the peer (another host, refused, off): nothing to track
        with self._lock:
            self._sent[tag] = step
            return self._slots.pop((tag, step), None) if self._slots else None

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
        libc = load_libc()
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
