"""gRPC control plane between peers: negotiate a link, exchange data-plane addresses.

Each :class:`~tensorwire.Node` runs one small gRPC server (``tensorwire.v1.Control``
plus ``grpc.health.v1``). To set up a link, both sides *declare* their side
locally (:meth:`ControlServer.declare`) and call the peer's ``Negotiate``,
which blocks until the peer has declared the same link and returns that
declaration. Each side then checks both directions with the same symmetric
rule, so a mismatch fails on **both** sides with the same
:class:`~tensorwire.ShapeMismatchError`.

Protobuf only — no pickle; a protocol version in every offer; tensor bytes
never travel here.

Authentication (:mod:`tensorwire.p2p.linkauth`): a server made with
``secret=`` answers only requests whose declaration carries its HMAC under the
job's link secret, and signs its answer; anything else is ``UNAUTHENTICATED``
before a declaration is looked at (so a stranger learns no nonce or port and
takes nothing away from the real peer). A request is answered once: its nonce
presented again (a replay) is refused too.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Mapping, Sequence

from tensorwire import lifecycle
from tensorwire._proto import spec_from_proto, spec_to_proto
from tensorwire.errors import AuthError, ConnectTimeout, ProtocolError, TransportError, VersionMismatchError
from tensorwire.p2p.linkauth import MAC_METADATA, mac_matches, offer_mac
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import grpc

    from tensorwire.v1 import control_pb2
    from tensorwire.v1.control_pb2 import LinkOffer as LinkOffer  # re-exported for annotations

__all__ = ["PROTOCOL_VERSION", "ControlServer", "negotiate", "make_offer", "offer_specs"]

log = logging.getLogger(__name__)

#: Version of the control protocol; a peer with another version is refused.
PROTOCOL_VERSION = 1
#: Control messages are small; anything larger is refused by gRPC itself.
MAX_CONTROL_MESSAGE = 4 << 20

_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_CONTROL_MESSAGE),
    ("grpc.max_send_message_length", MAX_CONTROL_MESSAGE),
    ("grpc.so_reuseport", 0),
]


class ControlServer:
    """The per-node gRPC server: the Control servicer and health checking.

    Args:
        host: address to bind (the address peers reach this node on).
        port: 0 for an ephemeral port (the bound port is ``self.port``).
        secret: the job's link secret: callers must prove it (``None``: anyone may negotiate).
    """

    #: Request nonces remembered as answered (a replayed request is refused).
    REMEMBER = 4096
    #: Seconds between two WARNINGs about refused callers.
    LOG_EVERY = 10.0

    def __init__(
        self, host: str = "127.0.0.1", *, port: int = 0, max_workers: int = 16, secret: bytes | None = None
    ) -> None:
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from tensorwire.v1 import control_pb2_grpc

        self._cond = threading.Condition()
        self._declared: dict[tuple[int, str], "control_pb2.LinkOffer"] = {}
        self._closed = False
        self._secret = bytes(secret) if secret else None
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._in_flight: set[bytes] = set()
        #: Negotiate calls refused for a missing or wrong credential, since creation.
        self.refused = 0
        self._quiet = 0
        self._logged_at = -1e9
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tw-control"), options=_OPTIONS
        )
        control_pb2_grpc.add_ControlServicer_to_server(_Servicer(self), self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self._server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise TransportError(f"cannot bind control server to {bind}: {exc}") from exc
        if not self.port:
            raise TransportError(f"cannot bind control server to {bind}")
        self.host = host
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health.set("tensorwire.v1.Control", health_pb2.HealthCheckResponse.SERVING)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def declare(self, offer: "control_pb2.LinkOffer") -> None:
        """Publish this side's declaration of the link to ``offer.to_rank`` (answered once)."""
        with self._cond:
            self._declared[(offer.to_rank, offer.link_name)] = offer
            self._cond.notify_all()

    def wait_served(self, peer: int, link_name: str, timeout: float) -> bool:
        """Wait until the peer has been handed our declaration (True) or ``timeout`` (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (peer, link_name) in self._declared and not self._closed:
                rem = deadline - time.monotonic()
                if rem <= 0:
                    return False
                self._cond.wait(min(rem, 0.2))
            return True

    def _wait_declared(self, peer: int, link_name: str, timeout: float) -> "control_pb2.LinkOffer | None":
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                # One answer per declaration: a later negotiation of the same (peer, name)
                # must wait for the next declaration, never get this one's old nonce.
                offer = self._declared.pop((peer, link_name), None)
                if offer is not None:
                    self._cond.notify_all()  # wake wait_served
                    return offer
                if self._closed:
                    return None
                rem = deadline - time.monotonic()
                if rem <= 0:
                    return None
                self._cond.wait(min(rem, 0.5))

    def _admit(self, request: "control_pb2.NegotiateRequest", mac: bytes | None, peer: str) -> str | None:
        """Check a request's credential and claim its nonce; the reason it is refused, or None."""
        if self._secret is None:
            return None
        nonce = bytes(request.offer.nonce)
        if not mac_matches(self._secret, request.offer, mac, role=b"ask"):
            why = "missing or wrong link credential"
        else:
            with self._cond:
                if nonce in self._seen or nonce in self._in_flight:
                    why = "a request answered before was presented again"
                else:
                    self._in_flight.add(nonce)
                    return None
        with self._cond:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged_at >= self.LOG_EVERY:
                more = f" (and {self._quiet} more since the last report)" if self._quiet else ""
                self._quiet, self._logged_at = 0, now
                log.warning("tensorwire control: refused Negotiate from %s: %s%s", peer, why, more)
            else:
                self._quiet += 1
        return why

    def _done(self, nonce: bytes, *, answered: bool) -> None:
        with self._cond:
            self._in_flight.discard(nonce)
            if answered:
                self._seen[nonce] = None
                while len(self._seen) > self.REMEMBER:
                    self._seen.popitem(last=False)

    def close(self, grace: float = 0.5) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        from grpc_health.v1 import health_pb2

        self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        # At interpreter exit, no grace: grpc would wait it out in a thread of its own that may still be
        # cancelling calls (in grpc's C++) when the interpreter finalizes (see tensorwire.lifecycle).
        if lifecycle.exiting():
            self._server.stop(None)
        else:
            self._server.stop(grace).wait(grace + 1)


class _Servicer:
    """Thin servicer: validates the request and answers with the local declaration."""

    def __init__(self, owner: ControlServer) -> None:
        self._owner = owner

    def Negotiate(
        self, request: "control_pb2.NegotiateRequest", context: "grpc.ServicerContext"
    ) -> "control_pb2.NegotiateResponse":
        import grpc

        offer = request.offer
        owner = self._owner
        mac = next((bytes(v) for k, v in context.invocation_metadata() if k == MAC_METADATA), None)
        why = owner._admit(request, mac, context.peer())
        if why is not None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"link negotiation refused: {why}")
        answered = False
        try:
            reply = self._answer(request, context)
            answered = True
            return reply
        finally:
            if owner._secret is not None:
                owner._done(bytes(offer.nonce), answered=answered)

    def _answer(
        self, request: "control_pb2.NegotiateRequest", context: "grpc.ServicerContext"
    ) -> "control_pb2.NegotiateResponse":
        import grpc

        from tensorwire.v1 import control_pb2

        offer = request.offer
        if offer.protocol_version != PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {offer.protocol_version} not supported; this node speaks {PROTOCOL_VERSION}",
            )
        remaining = context.time_remaining()
        timeout = 60.0 if remaining is None else max(0.0, remaining - 0.05)
        mine = self._owner._wait_declared(offer.from_rank, offer.link_name, timeout)
        if mine is None:
            context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"rank {offer.to_rank} did not declare link {offer.link_name!r} to rank {offer.from_rank} in time",
            )
        secret = self._owner._secret
        if secret is not None:
            context.set_trailing_metadata(
                ((MAC_METADATA, offer_mac(secret, mine, role=b"answer", bound=bytes(offer.nonce))),)
            )
        return control_pb2.NegotiateResponse(offer=mine)


def negotiate(
    address: str, offer: "control_pb2.LinkOffer", *, timeout: float, secret: bytes | None = None
) -> "control_pb2.LinkOffer":
    """Send our declaration to the peer's control server; return the peer's.

    Retries while the peer's server is not up yet, until ``timeout``. With
    ``secret`` (the job's link secret) the request carries its MAC and the
    answer must carry the peer's.

    Raises:
        AuthError: the peer refused our credential, or its answer lacks a good one
            (it does not hold this job's link secret).
        ConnectTimeout: the peer did not answer or declare in time.
        VersionMismatchError: the peer speaks another protocol version.
        ProtocolError: the peer answered with something malformed.
    """
    import grpc

    from tensorwire.v1 import control_pb2, control_pb2_grpc

    deadline = time.monotonic() + timeout
    delay = 0.05
    metadata = ((MAC_METADATA, offer_mac(secret, offer, role=b"ask")),) if secret else None
    with grpc.insecure_channel(address, options=_OPTIONS) as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        while True:
            rem = deadline - time.monotonic()
            if rem <= 0:
                raise ConnectTimeout(f"control plane of peer at {address} did not answer within {timeout:.1f}s")
            try:
                reply, call = stub.Negotiate.with_call(
                    control_pb2.NegotiateRequest(offer=offer), timeout=rem, wait_for_ready=True, metadata=metadata
                )
                break
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAUTHENTICATED:
                    raise AuthError(
                        f"peer at {address} refused to negotiate link {offer.link_name!r}: "
                        f"{exc.details()} (do both ranks hold the same link secret?)"
                    ) from exc
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise VersionMismatchError(f"peer at {address}: {exc.details()}") from exc
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise ConnectTimeout(
                        f"peer at {address} did not declare link {offer.link_name!r} within {timeout:.1f}s: {exc.details()}"
                    ) from exc
                if code == grpc.StatusCode.UNAVAILABLE:
                    time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                    delay = min(delay * 2, 1.0)
                    continue
                raise TransportError(f"negotiation with {address} failed: {code.name}: {exc.details()}") from exc
    peer = reply.offer
    if secret:
        mac = next((bytes(v) for k, v in (call.trailing_metadata() or ()) if k == MAC_METADATA), None)
        if not mac_matches(secret, peer, mac, role=b"answer", bound=bytes(offer.nonce)):
            raise AuthError(f"peer at {address} answered without proof of this job's link secret")
    if peer.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"peer at {address} speaks protocol {peer.protocol_version}, this is {PROTOCOL_VERSION}"
        )
    if peer.from_rank != offer.to_rank or peer.to_rank != offer.from_rank or peer.link_name != offer.link_name:
        raise ProtocolError(
            f"peer at {address} answered for link {peer.from_rank}->{peer.to_rank} {peer.link_name!r}, "
            f"expected {offer.to_rank}->{offer.from_rank} {offer.link_name!r}"
        )
    return peer


def make_offer(
    *,
    run_id: str,
    from_rank: int,
    to_rank: int,
    link_name: str,
    send: Sequence[TensorSpec],
    recv: Sequence[TensorSpec],
    data: Mapping[str, tuple[str, int]],
    transport: str,
    nonce: bytes,
    has_cuda: bool,
    host_id: str,
) -> "control_pb2.LinkOffer":
    """This side's declaration of a link: its specs and its data listeners (kind -> (host, port))."""
    from tensorwire.v1 import control_pb2, types_pb2

    return control_pb2.LinkOffer(
        protocol_version=PROTOCOL_VERSION,
        run_id=run_id,
        from_rank=from_rank,
        to_rank=to_rank,
        link_name=link_name,
        send=[spec_to_proto(s) for s in send],
        recv=[spec_to_proto(s) for s in recv],
        data=[types_pb2.TransportAddress(kind=k, host=h, port=p) for k, (h, p) in data.items()],
        transport=transport,
        nonce=nonce,
        has_cuda=has_cuda,
        host_id=host_id,
    )


def offer_specs(offer: "control_pb2.LinkOffer") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The specs an offer sends and receives.

    Raises:
        SpecError: the peer sent an invalid spec.
    """
    return [spec_from_proto(m) for m in offer.send], [spec_from_proto(m) for m in offer.recv]
