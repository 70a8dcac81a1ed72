"""One UCX endpoint to one peer: liveness, goodbye, errors and teardown (the base of UcxTransport).

:class:`UcxConnection` holds the endpoint and everything about its life that
is not moving data: the liveness socket (the handshake's TCP connection, whose
end means the peer is gone), the goodbye exchanged on close (BYE, answered by
ACK), the recorded error and its translation from ucxx, and a teardown that
never leaves a receive pointing into a buffer the application may reuse.
:class:`~tensorwire.transport.ucx.endpoint.UcxTransport` adds the data path.
Every method runs with the engine lock held unless it says otherwise.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
import weakref
from typing import Any, Deque

from tensorwire.errors import AuthError, ClosedError, PeerLostError, ProtocolError, TensorWireError, TransportError
from tensorwire.transport._socket import tune_socket
from tensorwire.transport.base import Transport
from tensorwire.transport.ucx._ucxx import LOST_ERRORS, Array, Tag, cancelled, close_ep, np, u8, ucx
from tensorwire.transport.ucx.engine import GRAVEYARD, Engine
from tensorwire.transport.ucx.tagstate import TagState
from tensorwire.transport.ucx.wire import ACK, BYE, CTRL, KIND_SHIFT, RID_MASK, RID_SHIFT

__all__ = ["BYE_GRACE_S", "CLOSE_ACK_S", "CLOSE_DRAIN_S", "LOST_GRACE_S", "EpState", "UcxConnection", "watch"]

log = logging.getLogger(__name__)

#: close(): how long it waits for this side's sends (and then its goodbye) to complete.
CLOSE_DRAIN_S = 2.0
#: After the peer's goodbye, how long a wait whose message has not arrived keeps looking.
BYE_GRACE_S = 0.1
#: After an endpoint error without a goodbye, how long messages (or the goodbye) may still show up.
LOST_GRACE_S = 1.0
#: close(): how long it waits for the peer's ACK of its goodbye (the peer's progress answers it).
CLOSE_ACK_S = 5.0


class EpState:
    """Filled by the endpoint's close callback (called during worker progress)."""

    __slots__ = ("lost", "owner", "__weakref__")

    def __init__(self) -> None:
        self.lost = False
        self.owner: "weakref.ref[UcxConnection] | None" = None


def _on_ep_closed(state: EpState) -> None:
    state.lost = True
    t = state.owner() if state.owner is not None else None
    if t is not None:
        t._on_ep_lost()


def watch(ep: Any) -> EpState:
    state = EpState()
    ep.set_close_callback(_on_ep_closed, cb_args=(state,))
    return state


class UcxConnection(Transport):
    """A UCX endpoint to one peer, from its handshake to its teardown. See the module docstring.

    It holds the connection's tag states (:class:`~tensorwire.transport.ucx.tagstate.TagState`),
    which the subclass fills, so a teardown can release their receives.
    """

    def __init__(
        self,
        eng: Engine,
        ep: Any,
        state: EpState,
        *,
        rid: int,
        peer_rid: int,
        peer: str,
        peer_timeout: float = 30.0,
        peer_errors: bool = True,
    ) -> None:
        # Called with the engine lock held, after the subclass set up its own state.
        self._st: dict[int, TagState] = {}  # slot tag -> its state (UcxTransport makes them on first use)
        self._eng = eng
        self._eh = peer_errors  # the endpoint was made with UCX peer error handling
        self._ep = ep
        self._state = state
        self._rid = rid << RID_SHIFT
        self._peer_rid = peer_rid << RID_SHIFT
        self._peer = peer
        self._peer_timeout = peer_timeout
        self._sends: Deque[tuple[Any, Any]] = collections.deque()  # small sends in flight + their buffers
        self._error: BaseException | None = None
        self._closed = False
        self._bye_at: float | None = None  # when the peer's goodbye arrived (a graceful close)
        self._lost_at: float | None = None  # when the endpoint reported an error
        self._ctrl_buf = u8(len(BYE))
        self._ctrl_arr = Array(self._ctrl_buf)
        self._ctrl_req = ep.tag_recv(self._ctrl_arr, tag=Tag(self._rid | (CTRL << KIND_SHIFT)))
        self._acked = False  # the peer answered our goodbye
        self._live: socket.socket | None = None  # liveness socket (attach_liveness)
        eng.ctrl_watch.add(self)
        state.owner = weakref.ref(self)
        if state.lost:
            self._on_ep_lost()
        eng.adopt(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> str:
        return f"ucx to {self._peer}"

    def close(self) -> None:
        self._close(goodbye=True)

    def abort(self) -> None:
        self._close(goodbye=False)

    # -- the receives of the connection's tags (for a teardown) ----------------------
    def _posted_requests(self) -> list[tuple[int, Any]]:
        """(full 64-bit tag, request) of every receive of this connection still posted (not the CTRL one)."""
        out: list[tuple[int, Any]] = []
        for st in self._st.values():
            out.extend(st.posted_requests(self._rid))
        return out

    def _receive_buffers(self) -> Any:
        """What the buffers of those receives hang on (kept referenced for good if they stay posted)."""
        return dict(self._st)

    def _forget_requests(self) -> None:
        """After the teardown: no credit receive is armed any more."""
        for st in self._st.values():
            st.cred_req = None

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
        return [None, (bye, Array(bye))]

    def _post_goodbye(self, bye: list[Any]) -> Any:
        ep = self._ep
        if ep is None:
            return False
        try:
            return ep.tag_send(bye[1][1], tag=Tag(self._peer_rid | (CTRL << KIND_SHIFT)))
        except ucx.UCXError:
            return False

    def _teardown(self, *, goodbye: bool) -> None:
        """Say goodbye (best effort), cancel every request of the endpoint and close it."""
        if self._ep is None:
            return
        ep, self._ep = self._ep, None
        if goodbye and not self._state.lost:
            try:
                bye = np.frombuffer(bytearray(BYE), dtype=np.uint8)
                barr = Array(bye)
                req = ep.tag_send(barr, tag=Tag(self._peer_rid | (CTRL << KIND_SHIFT)))
                end = time.monotonic() + 0.2
                while not req.completed and time.monotonic() < end and not self._state.lost:
                    self._eng.worker.progress()
            except ucx.UCXError:
                pass
        self._state.owner = None
        self._eng.ctrl_watch.discard(self)
        self._drop_liveness()
        if self._eh:
            close_ep(ep)  # force close: UCX cancels the endpoint's requests
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
                GRAVEYARD.extend(pending)
        self._drain_unexpected()
        # Requests were cancelled by the close; completion may need one more progress.
        self._eng.worker.progress()
        self._forget_requests()
        self._sends.clear()
        self._eng.disown(self)

    def _release_receives(self) -> None:
        """Complete this connection's still-posted receives with empty messages from our own worker."""
        eng = self._eng
        tags = self._posted_requests()
        if self._ctrl_req is not None and not self._ctrl_req.completed:
            tags.append((self._rid | (CTRL << KIND_SHIFT), self._ctrl_req))
        if not tags:
            return
        try:
            me = eng.self_endpoint()
            empty = Array(u8(0))
            sends = [me.tag_send(empty, tag=Tag(t)) for t, _ in tags]
            end = time.monotonic() + 1.0
            while time.monotonic() < end and not all(r.completed for _, r in tags):
                eng.worker.progress()
        except Exception as exc:  # noqa: BLE001 - best effort; then the buffers are kept alive
            log.debug("ucx: releasing receives: %s", exc)
            sends = []
        if not all(r.completed for _, r in tags):
            # Still posted: keep every buffer they may write into referenced, for good.
            GRAVEYARD.append((None, (self._receive_buffers(), self._ctrl_buf, self._ctrl_arr)))
        del sends

    def _drain_unexpected(self) -> None:
        """Take small messages still queued for this connection out of UCX's unexpected queue."""
        worker = self._eng.worker
        mask = ucx.UCXXTagMask(RID_MASK << RID_SHIFT)
        scratch = u8(4096)
        sarr = Array(scratch)
        for _ in range(10000):
            try:
                probe = worker.tag_probe(Tag(self._rid), mask, remove=False)
                if not probe.matched or probe.length > len(scratch):
                    return
                probe = worker.tag_probe(Tag(self._rid), mask, remove=True)
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
        arr = Array(buf)
        try:
            req = self._ep.tag_send(arr, tag=Tag(self._peer_rid | (CTRL << KIND_SHIFT)))
        except ucx.UCXError:
            return
        if not req.completed:
            self._sends.append((req, (buf, arr)))

    def _peer_gone(self) -> bool:
        return self._bye_at is not None or self._lost_at is not None

    def _poll_ctrl(self) -> None:
        req = self._ctrl_req
        if req is None or not req.completed:
            return
        if cancelled(req):  # the endpoint failed first: the goodbye may sit in the unexpected queue
            if not self._closed:
                probe = self._eng.worker.tag_probe(Tag(self._rid | (CTRL << KIND_SHIFT)), remove=True)
                if probe.matched:
                    self._ctrl_req = self._eng.worker.tag_recv_with_handle(self._ctrl_arr, probe)
            return
        self._ctrl_req = None
        try:
            req.check_error()
        except ucx.UCXError:
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
                    self._ctrl_req = self._ep.tag_recv(self._ctrl_arr, tag=Tag(self._rid | (CTRL << KIND_SHIFT)))
                except ucx.UCXError:
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
            if isinstance(exc, getattr(ucx, "UCXMessageTruncatedError", ())):
                self._fail(ProtocolError(f"{doing}: peer {self._peer} sent more than the buffer holds"))
            elif isinstance(exc, LOST_ERRORS):
                self._fail(PeerLostError(f"{doing}: peer {self._peer} lost ({exc})"))
            else:
                self._fail(TransportError(f"{doing}: UCX error: {exc}"))
        err = self._error
        assert err is not None
        return type(err)(str(err)) if isinstance(err, TensorWireError) else PeerLostError(str(err))
