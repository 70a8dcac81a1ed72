"""The data-plane interface: one small abstract class, two real implementations.

A :class:`Transport` is a connected, bidirectional, tag-matched message channel
to exactly one peer. Its model is UCX's tagged rendezvous, which the TCP
transport reproduces:

- The **receiver posts** preallocated buffers per tag (:meth:`Transport.post_recv`).
  Messages on one tag fill that tag's posted buffers in FIFO order. A posted
  buffer is the sender's *credit*: the sender of a message on a tag with no
  free posted buffer waits (bounded by its timeout) — so a receiver never has
  to allocate, buffer or drop anything, and nothing is ever written over a
  buffer the application still holds.
- The **sender sends** straight from the caller's memory (:meth:`Transport.send`
  returns once the bytes are out of it). Sends on one tag are delivered in order.
- :meth:`Transport.wait_recv` waits for the oldest posted buffer of a tag to be
  filled and returns a :class:`Received` (actual shape for dynamic specs, step).

Buffers are flat ``uint8`` torch tensors, contiguous, allocated once
(:class:`tensorwire.buffers.Slot`). A transport with ``reaches_cuda = False``
only ever gets host buffers (the Link stages CUDA data through pinned slots).

Errors (all :class:`tensorwire.TensorWireError`):

- :class:`~tensorwire.PeerLostError`: connection reset/closed by the peer, or
  the peer unreachable for longer than the liveness timeout;
- :class:`~tensorwire.TransferTimeout`: the operation's own timeout expired;
- :class:`~tensorwire.ProtocolError`: the peer sent a malformed frame;
- :class:`~tensorwire.ClosedError`: used after :meth:`Transport.close`.

``close()`` is idempotent and always frees the connection; pending waits in
other threads are woken with :class:`~tensorwire.ClosedError`.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import hmac
import os
import secrets
import time
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from tensorwire.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "Transport",
    "Listener",
    "Received",
    "TransportKind",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "new_nonce",
    "link_proof",
    "proof_matches",
    "register",
    "get_factory",
    "available_kinds",
]

TransportKind = Literal["tcp", "ucx", "memory"]
NONCE_BYTES = 16
#: Dims carried in a frame header for dynamic shapes (== spec.MAX_RANK).
HEADER_DIMS = 8


def remaining(deadline: float | None) -> float | None:
    """Seconds left until a ``time.monotonic()`` deadline (None: no deadline)."""
    return None if deadline is None else deadline - time.monotonic()


def new_nonce() -> bytes:
    """A fresh random data-plane credential."""
    return secrets.token_bytes(NONCE_BYTES)


#: Bytes of the proof a data handshake carries that the dialler holds the link secret.
PROOF_BYTES = 16
_NO_PROOF = bytes(PROOF_BYTES)


def link_proof(secret: bytes | None, nonce: bytes) -> bytes:
    """What a dialler presents beside ``nonce``: HMAC-SHA256(secret, nonce), truncated; zeros without a secret.

    The nonce is fresh per connection, so a proof seen on the wire is worth
    nothing for another connection, and the secret itself never travels.
    """
    if not secret:
        return _NO_PROOF
    return hmac.new(secret, b"tensorwire-data-v1\0" + nonce, hashlib.sha256).digest()[:PROOF_BYTES]


def proof_matches(secret: bytes | None, nonce: bytes, proof: bytes) -> bool:
    """Constant-time check of a dialler's proof (always true for a listener without a secret)."""
    if not secret:
        return True
    return hmac.compare_digest(link_proof(secret, nonce), bytes(proof))


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
    """What a completed receive reports.

    Attributes:
        nbytes: bytes written into the posted buffer.
        shape: actual shape, when the sender sent one (dynamic specs), else None.
        step: the sender's per-tag message counter, when the transport carries it.
    """

    nbytes: int
    shape: tuple[int, ...] | None = None
    step: int | None = None


class Transport(abc.ABC):
    """A connected, tag-matched, bidirectional channel to one peer."""

    #: "tcp", "ucx" or "memory".
    kind: ClassVar[str]
    #: Whether buffers may live in CUDA memory.
    reaches_cuda: ClassVar[bool] = False
    #: Whether ``send`` and ``post_recv`` take any contiguous tensor (its bytes), not only flat uint8.
    any_dtype: ClassVar[bool] = False
    #: Whether the transport has ``start_send(tag, buf, *, step, shape, timeout) -> op`` (posts once a
    #: credit is there, returns without waiting for the bytes) and ``wait_send(op, *, timeout)``.
    async_send: ClassVar[bool] = False

    def start_send(
        self,
        tag: int,
        buf: "torch.Tensor",
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> Any:
        """Post ``buf`` as the next message on ``tag`` once a credit is there, without waiting for its bytes.

        Only transports with :attr:`async_send`; :meth:`wait_send` completes the returned operation, and
        ``buf`` must stay untouched until it returned.

        Raises:
            NotImplementedError: this transport has no asynchronous send (``async_send`` is False).
            TransferTimeout, PeerLostError, ClosedError: as :meth:`send`.
        """
        raise NotImplementedError(f"{type(self).__name__} has no start_send (async_send is False)")

    def wait_send(self, op: Any, *, timeout: float | None) -> None:
        """Wait until the message posted by :meth:`start_send` is out of its buffer.

        Raises:
            NotImplementedError: this transport has no asynchronous send.
            TransferTimeout, PeerLostError, ClosedError: as :meth:`send`.
        """
        raise NotImplementedError(f"{type(self).__name__} has no wait_send (async_send is False)")

    @abc.abstractmethod
    def post_recv(self, tag: int, buf: "torch.Tensor", *, header: bool = False) -> None:
        """Post ``buf`` to receive the next unfilled message on ``tag``.

        Args:
            tag: the slot's tag (0 <= tag < 2**31).
            buf: flat contiguous uint8 tensor; must stay alive and untouched
                until :meth:`wait_recv` returns it.
            header: the messages on this tag carry an actual shape (dynamic spec).

        Raises:
            ClosedError, PeerLostError.
        """

    def prepare_recv(self, buf: "torch.Tensor") -> Any:
        """``buf`` as this transport wants it for :meth:`post_recv` and :meth:`repost_and_wait`, made once.

        For buffers posted again and again (a Link's slots): what this returns may be passed to
        those two in place of ``buf``, and spares them the per-call work of describing ``buf``
        (UCX: its descriptor and the record of its receive). Valid while ``buf`` lives at the same
        address. Default: ``buf`` itself.
        """
        return buf

    @abc.abstractmethod
    def wait_recv(self, tag: int, *, timeout: float | None) -> Received:
        """Wait for the oldest posted buffer on ``tag`` to be filled.

        Raises:
            TransferTimeout: nothing arrived within ``timeout`` seconds (the
                posted buffer stays posted).
            PeerLostError, ProtocolError, ClosedError.
        """

    def repost_and_wait(
        self, tag: int, buf: "torch.Tensor", *, header: bool = False, timeout: float | None
    ) -> Received:
        """Post ``buf`` on ``tag`` again, then wait for the oldest posted buffer on ``tag``.

        What a receiver does every step with double-buffered slots (the slot it
        held goes back, the next one is awaited). The same as :meth:`post_recv`
        then :meth:`wait_recv`, except that a transport may do the post once the
        wait has started (UCX: after the first progress, so a transfer already
        announced by the peer is under way while the post's bookkeeping runs).
        When this returns or raises TransferTimeout, ``buf`` is posted.
        """
        self.post_recv(tag, buf, header=header)
        return self.wait_recv(tag, timeout=timeout)

    @abc.abstractmethod
    def send(
        self,
        tag: int,
        buf: "torch.Tensor",
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> None:
        """Send ``buf`` (flat uint8) as the next message on ``tag``.

        Returns once the bytes are out of ``buf`` (it may be reused). Waits for
        the receiver's credit (a posted buffer) first. ``step``: the message's
        per-tag counter (None: the transport's own, one more than the last).

        Raises:
            TransferTimeout: no credit or not all bytes out within ``timeout``;
                if the timeout hit after the first byte went out, the transport
                is broken (closed) because the stream can no longer be framed.
            PeerLostError, ClosedError.
        """

    def send_two(
        self,
        first: "tuple[int, torch.Tensor, int | None]",
        second: "tuple[int, torch.Tensor, int | None]",
        *,
        timeout: float | None,
    ) -> None:
        """Send two messages, each ``(tag, buf, step)``, in this order, as two :meth:`send` calls would.

        A transport may put both on the wire at once where both credits are there already (TCP: one
        ``sendmsg``); here they are two sends, each within ``timeout``.

        Raises:
            TransferTimeout, PeerLostError, ClosedError: as :meth:`send` (the first may be out when the second
                fails).
        """
        self.send(first[0], first[1], step=first[2], timeout=timeout)
        self.send(second[0], second[1], step=second[2], timeout=timeout)

    def set_spin(self, us: float) -> None:
        """Poll for ``us`` microseconds before a wait sleeps, on transports whose waits can poll (TCP); else
        nothing."""

    def has_credit(self, tag: int) -> bool:
        """Whether a send on ``tag`` would find a posted buffer of the peer right now (never blocks).

        A hint for callers that send in their own thread only when that cannot wait
        (``tensorwire.distributed``); default False: unknown, treat as "would wait".
        """
        return False

    @abc.abstractmethod
    def close(self) -> None:
        """Close the connection. Idempotent; wakes other threads with ClosedError."""

    def forget_buffer(self, buf: "torch.Tensor") -> None:
        """Drop anything cached for ``buf`` after its receive completed.

        For callers that post short-lived buffers once (serve) rather than the
        same slots every step (Link); default: nothing is cached.
        """

    def abort(self) -> None:
        """Close without any goodbye; default: :meth:`close`."""
        self.close()

    @property
    def closed(self) -> bool:  # pragma: no cover - overridden
        return False

    def describe(self) -> str:
        """One line for logs: kind and endpoints."""
        return self.kind

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Listener(abc.ABC):
    """Accepts data-plane connections for any number of pending links.

    A connecting peer presents a nonce it learned over the control plane; a
    connection that presents anything else (or nothing, or garbage, in time)
    is dropped and the listener keeps serving.
    """

    kind: ClassVar[str]

    def __init__(
        self, host: str = "127.0.0.1", *, port: int = 0, peer_timeout: float = 30.0, secret: bytes | None = None
    ) -> None:
        """Bind ``host:port`` (0: any free port; :attr:`address` has the real one) and start accepting.
        ``peer_timeout``: seconds without a sign of life before a connection's peer is declared lost.
        ``secret``: the link secret a dialler must prove it holds (:func:`link_proof`), checked before
        its nonce; ``None``: the nonce alone admits."""

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
    ) -> Transport:
        """Dial a listener of this kind at ``host:port`` and present ``nonce`` (learned over the control plane)
        and the proof of ``secret``, the link secret.

        Raises:
            ConnectTimeout: no connection/answer within ``timeout``.
            AuthError: the listener refused the credential.
            PeerLostError: the connection was refused or reset.
            NotImplementedError: this kind cannot dial out (an in-process transport).
        """
        raise NotImplementedError(f"{cls.__name__} cannot dial out")

    @property
    @abc.abstractmethod
    def address(self) -> tuple[str, int]:
        """(host, port) the listener is bound to (the real port when bound to 0)."""

    @abc.abstractmethod
    def expect(self, nonce: bytes) -> None:
        """Announce a connection that will present ``nonce``."""

    @abc.abstractmethod
    def accept(self, nonce: bytes, *, timeout: float | None) -> Transport:
        """Wait for the connection that presents ``nonce``.

        Raises:
            ConnectTimeout, ClosedError.
        """

    def forget(self, nonce: bytes) -> None:
        """Drop a pending expectation (and any connection already parked for it)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop accepting. Idempotent."""


# -- registry of lazy creators ---------------------------------------------------
# kind -> (listen(host, *, port, **opts) -> Listener, connect(host, port, nonce, *, timeout, **opts) -> Transport)
_REGISTRY: dict[str, tuple[str, str]] = {
    "tcp": ("tensorwire.transport.tcp", "TcpListener"),
    "ucx": ("tensorwire.transport.ucx", "UcxListener"),
}


def register(kind: str, module: str, listener_class: str) -> None:
    """Register a transport kind by module and listener class name (imported lazily)."""
    _REGISTRY[kind] = (module, listener_class)


def get_factory(kind: str) -> type[Listener]:
    """The listener class of a transport kind (its ``connect`` classmethod dials out).

    Raises:
        ConfigError: unknown kind.
        ImportError: the kind's dependency is missing (caller decides whether to fall back).
    """
    import importlib

    try:
        module, cls = _REGISTRY[kind]
    except KeyError:
        raise ConfigError(f"unknown transport {kind!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    factory: type[Listener] = getattr(importlib.import_module(module), cls)
    return factory


def available_kinds() -> list[str]:
    """Kinds whose dependency imports here (ucx needs ucxx)."""
    out = []
    for kind in _REGISTRY:
        try:
            get_factory(kind)
        except ImportError:
            continue
        out.append(kind)
    return out


def env_flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    if v is None:
        return default
    return v.strip().lower() in ("1", "true", "yes", "on")
