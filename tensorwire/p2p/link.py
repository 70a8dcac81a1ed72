"""``Link``: a negotiated channel to one peer (made by :meth:`tensorwire.p2p.node.Node.link`).

On the hot path (:meth:`Link.send` / :meth:`Link.recv`) nothing is allocated
(beyond small Python objects), nothing is serialized, and no gRPC call is made.

Receive slots are double-buffered: :meth:`Link.recv` returns the slot tensor,
valid until the next ``recv`` of that name, while the other buffer is already
posted for the next message. So a peer can send message *k+1* while this side
still holds message *k*, and two ranks that each ``send`` then ``recv`` every
step never deadlock. ``Node.link(..., depth=)`` gives a name more slots: with
``depth`` *d* a received slot stays valid until *d - 1* more ``recv`` calls of
that name (a GPipe stage keeps every microbatch's activation in its own slot
through the backward pass, with no copy), and the slots are re-posted in the
order they were received in.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tensorwire import lifecycle
from tensorwire.buffers import Slot
from tensorwire.errors import ClosedError, ConfigError, ShapeMismatchError
from tensorwire.p2p.ce_paths import CeHandle, CeRecv, CeSend
from tensorwire.observe import LinkWatch
from tensorwire.p2p.paths import IsendQueue, RecvPath, SendHandle, SendPath, recv_path, send_path
from tensorwire.p2p.staging import CudaOps, staging_chunk
from tensorwire.spec import TensorSpec
from tensorwire.transport.base import Transport
from tensorwire.transport.tcp import TcpTransport

#: Receives of at most this many bytes (host memory, TCP) may arrive before their slot's credit reached the
#: peer (:meth:`Link._offer_eager`); above it a message's cross-memory copy or its bytes dominate a credit frame.
EAGER_MAX_BYTES = 64 * 1024
#: Eager buffers a link sets aside for them (anonymous memory: resident only once used).
EAGER_SLOTS = 4

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.transport.ce import CePair
    import torch


__all__ = ["Link", "SendHandle", "slot_depths"]

log = logging.getLogger(__name__)


MAX_DEPTH = 64
#: receive slots per name when ``Node.link`` is given no ``depth``: the least that lets a sender run one message ahead
DEFAULT_DEPTH = 2
#: how long closing a link waits for its CUDA messages on the copy-engine path to run (the peer's queued streams
#: wait for them; a close that did not wait would release them with bytes that never came)
CE_LINGER_S = 5.0


def slot_depths(depth: "int | Mapping[str, int] | None", names: Sequence[str]) -> dict[str, int]:
    """``Node.link``'s ``depth`` argument as ``{recv name: slots}`` (validated)."""
    if depth is None:
        return {}
    if isinstance(depth, Mapping):
        unknown = sorted(set(depth) - set(names))
        if unknown:
            raise ConfigError(f"depth names {unknown} are not received on this link (recv: {sorted(names)})")
        items = dict(depth)
    else:
        items = {n: depth for n in names}
    for n, d in items.items():
        if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= MAX_DEPTH:
            raise ConfigError(f"depth for {n!r} must be an int in [2, {MAX_DEPTH}], got {d!r}")
    return items


class Link:
    """A negotiated channel to one peer. Create with :meth:`Node.link`.

    Attributes:
        peer: the peer's rank.
        transport: the chosen transport's kind ("ucx" or "tcp").
        send_specs / recv_specs: the negotiated specs by name.

    **CUDA specs over a host-only transport** (TCP: ``transport.reaches_cuda``
    is False) travel through pinned host slots. For static specs the bytes are
    cut into chunks by :func:`tensorwire.p2p.staging.chunk_plan` (2 MiB, or the whole
    tensor when small; ``TENSORWIRE_STAGING_CHUNK`` changes it and must be the
    same on both sides), each chunk an ordinary message on the spec's tag, and
    the device<->host copies run on per-link copy streams overlapped with the
    socket (:class:`tensorwire.p2p.staging.StagedSender` / ``StagedReceiver``):

    - ``send``: the copy stream waits for the caller's current stream, all
      device->host copies are queued with one event per chunk, and chunk *i*
      goes to the socket as soon as its event completes, while chunk *i+1* is
      being copied. ``isend`` orders after the stream that was current in the
      thread calling ``isend``.
    - ``recv``: every chunk of both host slots is posted as its own receive; each
      chunk's host->device copy is queued as soon as it lands; the copy stream
      first waits for the current stream (work still reading the previous
      message), and the current stream then waits for the copies' event — no
      device or stream synchronize on the receive path. A host slot is posted
      again (at the next ``recv``) only once the copies out of it completed.

    Dynamic CUDA specs over TCP keep the whole-message path (copy, synchronize
    the current stream, one message with the shape in its header).
    """

    def __init__(
        self,
        *,
        node_rank: int,
        peer: int,
        name: str,
        transport: Transport,
        send: Sequence[TensorSpec],
        recv: Sequence[TensorSpec],
        timeout: float,
        device: "torch.device | None",
        depth: Mapping[str, int] | None = None,
        ce: "CePair | None" = None,
        peer_host: str = "",
    ) -> None:
        self.peer = peer
        #: the peer's host identity (:func:`tensorwire.transport.select.host_id`; "" when unknown)
        self.peer_host = peer_host
        self.name = name
        self.rank = node_rank
        self._t = transport
        self.transport = transport.kind
        self._timeout = timeout
        self._closed = False
        self._lock = threading.Lock()
        self._queue = IsendQueue(peer, self._check_open)  # the link's sender thread (isends that wait there)
        self.send_specs = {s.name: s for s in send}
        self.recv_specs = {s.name: s for s in recv}
        # chunked staging (static CUDA specs over a host-only transport): CUDA calls and per-device copy streams
        self._ops: Any = None
        self._chunk: int | None = None
        self._copy_streams: dict[tuple[str, int | None], Any] = {}
        d2h = lambda dev: self._copy_stream(dev, "d2h")  # noqa: E731
        h2d = lambda dev: self._copy_stream(dev, "h2d")  # noqa: E731
        # One prepared path per tensor (tensorwire.p2p.paths): send/recv call it and branch on nothing.
        #: the copy-engine pair to the peer (both on this host, static CUDA specs): those specs go through it
        self.ce = ce
        self._send: dict[str, SendPath | CeSend] = {
            n: CeSend(self.send_specs[n], tag, ce)
            if ce is not None and _ce_spec(self.send_specs[n])
            else send_path(
                self.send_specs[n], tag, transport, self._queue, device=device, staging=self._staging, side=d2h
            )
            for tag, n in enumerate(sorted(self.send_specs))
        }
        self._recv: dict[str, RecvPath | CeRecv] = {
            n: CeRecv(self.recv_specs[n], tag, ce, device=device, depth=(depth or {}).get(n, DEFAULT_DEPTH))
            if ce is not None and _ce_spec(self.recv_specs[n])
            else recv_path(
                self.recv_specs[n],
                tag,
                transport,
                device=device,
                depth=(depth or {}).get(n, DEFAULT_DEPTH),
                staging=self._staging,
                side=h2d,
            )
            for tag, n in enumerate(sorted(self.recv_specs))
        }
        # counts and profiler ranges of send/recv/isend (tensorwire.observe)
        self._watch = LinkWatch(
            peer,
            transport,
            send=self.send_specs,
            recv=self.recv_specs,
            do_send=self._do_send,
            do_recv=self._do_recv,
            do_isend=self._do_isend,
            paths={n: "ce" for n, p in [*self._send.items(), *self._recv.items()] if isinstance(p, (CeSend, CeRecv))},
        )
        self._watch.hold(self.slots())
        self._offer_eager(transport, recv)
        lifecycle.track(self)  # closed at interpreter exit if the script does not (tensorwire.lifecycle)

    @staticmethod
    def _offer_eager(transport: Transport, recv: Sequence[TensorSpec]) -> None:
        """Over TCP, let the peer send a small message without first waiting for its credit.

        A ``recv`` re-posts the slot it handed out last time and then waits; the credit of that slot is owed
        to the peer. Without an eager offer that credit is urgent (the peer may need it to send), so it goes
        out as a frame of its own before this side blocks: a ping-pong then moves four frames per round trip
        and wakes each process twice. With an offer the peer can always send a small message (into the
        posted slot, or an eager buffer when none is posted), so the credit rides on the next frame going
        the other way -- the acknowledgement -- and a round trip is two frames, as over a raw socket.
        """
        offer = getattr(transport, "offer_eager", None)
        if offer is None:
            return
        small = [s.nbytes for s in recv if s.device == "cpu" and 0 < s.nbytes <= EAGER_MAX_BYTES]
        if small:
            offer(slots=EAGER_SLOTS, size=max(small))

    def _staging(self) -> tuple[Any, int]:
        """(CudaOps, chunk) of the chunk-staged specs, made once."""
        if self._ops is None:
            self._chunk = staging_chunk()
            self._ops = CudaOps()
        assert self._chunk is not None
        return self._ops, self._chunk

    @property
    def bytes_sent(self) -> int:
        return sum(p.sent for p in self._send.values())

    @property
    def bytes_received(self) -> int:
        return sum(p.received for p in self._recv.values())

    # -- info -------------------------------------------------------------------
    def __repr__(self) -> str:
        return (
            f"Link(rank {self.rank} <-> {self.peer}, {self.transport}, send={sorted(self.send_specs)}, "
            f"recv={sorted(self.recv_specs)})"
        )

    def depth(self, name: str) -> int:
        """How many ``recv`` calls of ``name`` a returned slot outlives, plus one (2 unless ``depth`` raised it).

        A CUDA spec staged through host memory (TCP) keeps 2: what ``recv`` returns there is its one
        device slot, valid until the next ``recv``.
        """
        return self._recv_path(name).depth

    @property
    def connection(self) -> Transport:
        """The link's data connection. Tags no spec of this link uses are free for a layer that frames its
        own messages on it (``tensorwire.distributed`` makes spec-less links and uses every tag)."""
        return self._t

    def slots(self) -> list[Slot]:
        """Every preallocated slot of this link (for inspection and tests)."""
        out = [p.slot for p in self._send.values() if p.slot is not None]
        for p in self._recv.values():
            out.extend(p.all_slots())
        return out

    def staging_plan(self, name: str) -> tuple[tuple[int, int], ...] | None:
        """The ``((offset, length), ...)`` chunks ``name`` travels in, or None when it is not chunk-staged."""
        p: SendPath | RecvPath | CeSend | CeRecv | None = self._send.get(name) or self._recv.get(name)
        if p is None:
            raise KeyError(name)
        return p.stager.plan if p.stager is not None else None

    def _copy_stream(self, device: "torch.device", kind: str) -> Any:
        """This link's copy stream of ``kind`` ("d2h" for sends, "h2d" for receives) on ``device``, made once."""
        key = (kind, device.index)
        stream = self._copy_streams.get(key)
        if stream is None:
            with self._lock:
                stream = self._copy_streams.get(key)
                if stream is None:
                    stream = self._copy_streams[key] = self._ops.new_stream(device)
        return stream

    # -- send -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"link to rank {self.peer} is closed")

    def _send_path(self, name: str) -> "SendPath | CeSend":
        p = self._send.get(name)
        if p is None:
            raise ShapeMismatchError(f"{name!r} was not declared as sent on this link (declared: {sorted(self._send)})")
        return p

    def send(self, name: str, tensor: "torch.Tensor", *, timeout: float | None = None) -> None:
        """Send ``tensor`` as ``name`` into the peer's preallocated slot.

        Blocks until the bytes are out of ``tensor`` (it may be modified after).
        CUDA tensors: ordered after the work already queued on the current stream.

        Raises:
            ShapeMismatchError: ``tensor`` differs from the negotiated spec (nothing sent).
            TransferTimeout, PeerLostError, ClosedError.
        """
        self._watch.send(name, tensor, timeout)

    def _do_send(self, name: str, tensor: "torch.Tensor", timeout: float | None) -> None:
        if self._queue.pending:
            # isends still queued on the link's thread: this message goes out after them (order per name).
            self._do_isend(name, tensor, timeout).wait()
            return
        if self._closed:
            self._check_open()
        p = self._send.get(name) or self._send_path(name)
        p.send(tensor, self._timeout if timeout is None else timeout)

    def isend(self, name: str, tensor: "torch.Tensor", *, timeout: float | None = None) -> "SendHandle | CeHandle":
        """Start sending; returns a handle whose ``wait()`` returns once the bytes are out.

        The tensor must not be modified before ``wait()`` returns. Validation
        happens here, before anything is queued.

        Over UCX, a static spec with a contiguous tensor is posted once the
        peer has a slot posted for it, and several isends can be in flight at
        once, one per slot the peer has posted (two per name): message *k+1* is
        posted while *k* is still moving. A host tensor is posted right here,
        in the calling thread -- so this call can wait for a credit, up to
        ``timeout`` (TransferTimeout, nothing sent). A CUDA tensor is not waited
        for here at all: an event recorded on the caller's current stream marks
        when its bytes are final, and the link's thread posts it once that
        event has passed -- the caller keeps queueing GPU work meanwhile (a
        missing credit then surfaces as TransferTimeout from ``wait()``); if
        the stream is already past that point and nothing is queued before
        it, it is posted right here, as a host tensor is.
        Otherwise the send runs, in order, on the link's thread.

        Raises:
            ShapeMismatchError: as :meth:`send`, immediately.
            TransferTimeout: (host tensor posted here) no credit within ``timeout``.
        """
        return self._watch.isend(name, tensor, timeout)

    def _do_isend(self, name: str, tensor: "torch.Tensor", timeout: float | None) -> "SendHandle | CeHandle":
        self._check_open()
        return self._send_path(name).isend(tensor, self._timeout if timeout is None else timeout)

    # -- recv -------------------------------------------------------------------
    def _recv_path(self, name: str) -> "RecvPath | CeRecv":
        p = self._recv.get(name)
        if p is None:
            raise ShapeMismatchError(f"{name!r} is not received on this link (declared: {sorted(self._recv)})")
        return p

    def recv(self, name: str, *, out: "torch.Tensor | None" = None, timeout: float | None = None) -> "torch.Tensor":
        """Receive the next message of ``name``.

        Returns the preallocated slot tensor (valid until the next ``recv`` of
        ``name``; its shape is the actual shape for dynamic specs), or, with
        ``out``, copies into ``out`` and returns it. A CUDA slot is ready for
        work queued on the current stream (use on another stream needs that
        stream to wait on the current one).

        Raises:
            TransferTimeout: nothing arrived within ``timeout`` (default: the link's).
            ShapeMismatchError: ``out`` does not fit the received tensor.
            PeerLostError, ProtocolError, ClosedError.
        """
        return self._watch.recv(name, out, timeout)

    def _do_recv(self, name: str, out: "torch.Tensor | None", timeout: float | None) -> "torch.Tensor":
        if self._closed:
            self._check_open()
        p = self._recv.get(name) or self._recv_path(name)
        return p.recv(out, self._timeout if timeout is None else timeout)

    # -- lifecycle --------------------------------------------------------------
    def close(self, *, linger: float | None = None) -> None:
        """Close the data connection and release the slots. Idempotent.

        ``linger``: over TCP, how long to wait for the peer's side of the close (default: the transport's) --
        so that it still reads every message sent before (backend ``tensorwire`` passes a few seconds).
        """
        if self._closed:
            return
        self._closed = True
        self._watch.release()
        self._queue.shutdown()
        try:
            for p in self._recv.values():
                p.close()
            if self.ce is not None:  # (after its CUDA messages ran: the peer's streams wait for them)
                ce_linger = min(self._timeout, CE_LINGER_S) if linger is None else linger
                self.ce.close(ClosedError(f"link to rank {self.peer} is closed"), linger=ce_linger)
        finally:
            if linger is not None and isinstance(self._t, TcpTransport):
                self._t.close(linger=linger)
            else:
                self._t.close()
            self._queue.join()  # the sender thread ends with the transport (an isend under way fails)
            lifecycle.untrack(self)

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ce_spec(spec: TensorSpec) -> bool:
    """Whether a spec goes over the copy-engine path when the link has one: static CUDA specs."""
    return spec.device == "cuda" and not spec.is_dynamic
