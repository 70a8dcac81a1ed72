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

import collections
import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tensorwire.buffers import Slot, as_bytes
from tensorwire.cuda import current_stream_idle, sync_current_stream
from tensorwire.errors import (
    ClosedError,
    ConfigError,
    ProtocolError,
    ShapeMismatchError,
    TransferTimeout,
)
from tensorwire.spec import TensorSpec
from tensorwire.transport.base import Transport
from tensorwire.p2p.staging import CudaOps, staging_chunk, StagedSender, chunk_plan, StagedReceiver

if TYPE_CHECKING:  # pragma: no cover
    import torch


__all__ = ["Link", "SendHandle", "slot_depths"]

log = logging.getLogger(__name__)

def torch_uint8() -> "torch.dtype":
    import torch

    return torch.uint8


class SendHandle:
    """Completion handle of :meth:`Link.isend`."""

    __slots__ = ("_future", "_name", "_op", "_t")

    def __init__(self, future: "concurrent.futures.Future[Any] | None", name: str, *, op: Any = None,
                 transport: Transport | None = None) -> None:
        self._future = future
        self._name = name
        self._op = op  # a transport send op (async_send transports): the message is already posted
        self._t = transport

    def done(self) -> bool:
        if self._op is not None:
            return bool(self._op.done())
        assert self._future is not None
        if not self._future.done():
            return False
        if self._t is not None and self._future.exception() is None:
            return bool(self._future.result().done())  # posted by the link's thread: is it out?
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the bytes are out of the tensor given to ``isend``.

        Raises:
            TransferTimeout: not done within ``timeout`` (the send goes on).
            the send's own error (PeerLostError, ...).
        """
        if self._op is not None:
            assert self._t is not None
            self._t.wait_send(self._op, timeout=timeout)  # type: ignore[attr-defined]
            return
        assert self._future is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            op = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():
                raise  # the send's own error (TransferTimeout is a TimeoutError too), not this wait's timeout
            raise TransferTimeout(f"isend of {self._name!r} not complete within {timeout}s") from None
        if self._t is not None:  # the link's thread posted it (CUDA isend): now wait for the bytes to leave
            self._op = op
            self._t.wait_send(op, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))  # type: ignore[attr-defined]


_FREE = object()  # a held slot nobody reads any more (see _RecvState.held)


class _RecvState:
    __slots__ = ("spec", "tag", "slots", "next", "held", "events", "device_slot", "staged", "stager")

    def __init__(self, spec: TensorSpec, tag: int, slots: list[Slot], device_slot: Slot | None,
                 stager: Any = None) -> None:
        self.spec = spec
        self.tag = tag
        self.slots = slots
        self.next = 0
        # Slots handed out and not re-posted yet, oldest first: (index, what to wait for before re-posting).
        # None: the work the caller queued on the current stream (the slot was returned to the caller);
        # an event: recv(out=)'s own copy out of a CUDA slot (recorded after it on the caller's stream);
        # _FREE: nothing (a host copy already done) -- it waits only for its turn (slots are re-posted in
        # the order they were received in: the next message lands in the oldest posted slot).
        self.held: collections.deque[tuple[int, Any]] = collections.deque()
        self.events: list[Any] = [None] * len(slots)  # one reusable CUDA event per slot (recv(out=))
        self.device_slot = device_slot  # CUDA slot the staged host bytes are copied into
        self.staged = device_slot is not None
        # tensorwire.p2p.staging.StagedReceiver for a static CUDA spec over a host-only transport (chunked, overlapped);
        # None: whole-message path (CPU specs, dynamic specs, transports that reach CUDA memory)
        self.stager = stager


class _SendState:
    __slots__ = ("spec", "tag", "slot", "step", "lock", "tdtype", "cdtype", "shape", "nbytes", "stager")

    def __init__(self, spec: TensorSpec, tag: int, slot: Slot, stager: Any = None) -> None:
        self.spec = spec
        self.tag = tag
        self.slot = slot  # staging for non-contiguous input or CUDA data over a host-only transport
        self.step = 0
        self.lock = threading.Lock()
        # for the fast check of a static spec (anything else takes spec.check_tensor)
        self.tdtype = spec.torch_dtype if spec.device == "cpu" and not spec.is_dynamic else None
        self.cdtype = spec.torch_dtype if spec.device == "cuda" and not spec.is_dynamic else None
        self.shape = spec.shape
        self.nbytes = spec.nbytes
        # tensorwire.p2p.staging.StagedSender over ``slot`` for a static CUDA spec over a host-only transport
        self.stager = stager


MAX_DEPTH = 64


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

    def __init__(self, *, node_rank: int, peer: int, name: str, transport: Transport,
                 send: Sequence[TensorSpec], recv: Sequence[TensorSpec], timeout: float,
                 device: "torch.device | None", depth: Mapping[str, int] | None = None) -> None:
        self.peer = peer
        self.name = name
        self.rank = node_rank
        self._t = transport
        self._any_dtype = transport.any_dtype  # sends may pass the tensor itself (no flat uint8 view)
        self._async = transport.async_send and transport.any_dtype  # isend posts in the caller's thread
        self._queued = 0  # isends on the executor not finished yet
        self.transport = transport.kind
        self._timeout = timeout
        self._closed = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        host_only = not transport.reaches_cuda
        self.send_specs = {s.name: s for s in send}
        self.recv_specs = {s.name: s for s in recv}
        # chunked staging (static CUDA specs over a host-only transport): CUDA calls and per-device copy streams
        self._ops: Any = None
        self._copy_streams: dict[tuple[str, int | None], Any] = {}
        chunk: int | None = None
        if host_only and any(s.device == "cuda" and not s.is_dynamic for s in (*send, *recv)):
            self._ops = CudaOps()
            chunk = staging_chunk()
        self._send: dict[str, _SendState] = {}
        for tag, spec in enumerate(sorted(self.send_specs)):
            s = self.send_specs[spec]
            staging_on_host = host_only and s.device == "cuda"
            slot = Slot(s, device=device, host=staging_on_host)
            stager = None
            if staging_on_host and not s.is_dynamic:
                assert chunk is not None
                stager = StagedSender(slot.raw, chunk_plan(s.nbytes, chunk), ops=self._ops)
            self._send[spec] = _SendState(s, tag, slot, stager)
        self._recv: dict[str, _RecvState] = {}
        for tag, spec in enumerate(sorted(self.recv_specs)):
            s = self.recv_specs[spec]
            staged = host_only and s.device == "cuda"
            # depth > 2 only where the slot itself is what recv returns (not through a staging slot)
            n_slots = 2 if staged else (depth or {}).get(spec, 2)
            slots = [Slot(s, device=device, host=staged) for _ in range(n_slots)]
            device_slot = Slot(s, device=device) if staged else None
            rx = None
            if staged and not s.is_dynamic:
                assert chunk is not None and device_slot is not None
                rx = StagedReceiver([sl.raw for sl in slots], device_slot.raw, chunk_plan(s.nbytes, chunk),
                                    ops=self._ops)
            st = _RecvState(s, tag, slots, device_slot, rx)
            self._recv[spec] = st
            if rx is not None:
                rx.post_all(transport, tag)  # both host slots, chunk by chunk
            else:
                for slot in slots:
                    transport.post_recv(tag, slot.raw, header=s.is_dynamic)
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- info -------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"Link(rank {self.rank} <-> {self.peer}, {self.transport}, send={sorted(self.send_specs)}, "
                f"recv={sorted(self.recv_specs)})")

    def depth(self, name: str) -> int:
        """How many ``recv`` calls of ``name`` a returned slot outlives, plus one (2 unless ``depth`` raised it).

        A CUDA spec staged through host memory (TCP) keeps 2: what ``recv`` returns there is its one
        device slot, valid until the next ``recv``.
        """
        st = self._recv.get(name)
        if st is None:
            raise ShapeMismatchError(f"{name!r} is not received on this link (declared: {sorted(self._recv)})")
        return 2 if st.staged else len(st.slots)

    @property
    def connection(self) -> Transport:
        """The link's data connection. Tags no spec of this link uses are free for a layer that frames its
        own messages on it (``tensorwire.distributed`` makes spec-less links and uses every tag)."""
        return self._t

    def slots(self) -> list[Slot]:
        """Every preallocated slot of this link (for inspection and tests)."""
        out = [st.slot for st in self._send.values()]
        for st in self._recv.values():
            out.extend(st.slots)
            if st.device_slot is not None:
                out.append(st.device_slot)
        return out

    def staging_plan(self, name: str) -> tuple[tuple[int, int], ...] | None:
        """The ``((offset, length), ...)`` chunks ``name`` travels in, or None when it is not chunk-staged."""
        st: _SendState | _RecvState | None = self._send.get(name) or self._recv.get(name)
        if st is None:
            raise KeyError(name)
        return st.stager.plan if st.stager is not None else None

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

    def send(self, name: str, tensor: "torch.Tensor", *, timeout: float | None = None) -> None:
        """Send ``tensor`` as ``name`` into the peer's preallocated slot.

        Blocks until the bytes are out of ``tensor`` (it may be modified after).
        CUDA tensors: ordered after the work already queued on the current stream.

        Raises:
            ShapeMismatchError: ``tensor`` differs from the negotiated spec (nothing sent).
            TransferTimeout, PeerLostError, ClosedError.
        """
        if self._queued:
            # isends still queued on the link's thread: this message goes out after them (order per name).
            self.isend(name, tensor, timeout=timeout).wait()
            return
        self._send_impl(name, tensor, timeout, None)

    def _send_impl(self, name: str, tensor: "torch.Tensor", timeout: float | None, stream: Any) -> None:
        """:meth:`send`; ``stream``: the stream a CUDA send orders after (None: the current one)."""
        self._check_open()
        st = self._send.get(name)
        if st is None:
            raise ShapeMismatchError(f"{name!r} was not declared as sent on this link (declared: {sorted(self._send)})")
        if st.tdtype is not None and tensor.dtype is st.tdtype and tensor.shape == st.shape and not tensor.is_cuda:
            # Fast path: static CPU spec, checked without building descriptions.
            if tensor.requires_grad:
                tensor = tensor.detach()
            if tensor.is_contiguous() and tensor.dim():
                with st.lock:  # the step counts only messages that went out (a credit timeout sends nothing)
                    if not st.nbytes:
                        data = st.slot.raw
                    else:
                        data = tensor if self._any_dtype else tensor.view(torch_uint8()).reshape(-1)
                    self._t.send(st.tag, data, step=st.step + 1, timeout=self._timeout if timeout is None else timeout)
                    st.step += 1
                self.bytes_sent += st.nbytes
                return
        elif (st.cdtype is not None and tensor.dtype is st.cdtype and tensor.shape == st.shape and tensor.is_cuda
              and st.slot.is_cuda and st.nbytes and tensor.is_contiguous()):
            # Fast path: static CUDA spec, contiguous, sent straight from device memory. The
            # caller's stream (isend passes the one current in the calling thread) is synchronized
            # first: UCX reads the bytes only after the work queued there is done.
            if tensor.requires_grad:
                tensor = tensor.detach()
            if stream is not None:
                stream.synchronize()
            else:
                sync_current_stream(tensor.device)
            with st.lock:
                self._t.send(st.tag, tensor if self._any_dtype else as_bytes(tensor), step=st.step + 1,
                             timeout=self._timeout if timeout is None else timeout)
                st.step += 1
            self.bytes_sent += st.nbytes
            return
        else:
            st.spec.check_tensor(tensor)
        tensor = tensor.detach()
        shape = tuple(tensor.shape)
        nbytes = tensor.numel() * st.spec.itemsize
        with st.lock:
            if tensor.is_cuda:
                import torch

                if st.stager is not None:
                    self._send_staged(st, tensor, self._timeout if timeout is None else timeout, stream)
                    self.bytes_sent += nbytes
                    return
                # The caller's stream (isend passes the one current in the calling thread): the bytes
                # are read by UCX (device memory) or the socket (pinned staging) only after the work
                # queued there -- and the staging copy, queued on it too -- is done.
                cur = stream if stream is not None else torch.cuda.current_stream(tensor.device)
                if st.slot.is_cuda and tensor.is_contiguous():
                    data = as_bytes(tensor)
                else:
                    with torch.cuda.stream(cur):
                        data = self._stage(st, tensor, shape)
                cur.synchronize()
            elif tensor.is_contiguous():
                data = as_bytes(tensor)
            else:
                data = self._stage(st, tensor, shape)
            self._t.send(st.tag, data[:nbytes] if data.numel() != nbytes else data, step=st.step + 1,
                         shape=shape if st.spec.is_dynamic else None,
                         timeout=self._timeout if timeout is None else timeout)
            st.step += 1
        self.bytes_sent += nbytes

    def _send_staged(self, st: _SendState, tensor: "torch.Tensor", timeout: float, stream: Any) -> None:
        """Chunked, overlapped device->host->socket send of a static CUDA spec (caller holds ``st.lock``)."""
        device = tensor.device
        current = stream if stream is not None else self._ops.current_stream(device)
        if tensor.is_contiguous():
            src = as_bytes(tensor)
        else:
            import torch

            with torch.cuda.stream(current):  # ordered after the writes to ``tensor``; freed after all reads
                src = as_bytes(tensor.contiguous())
        st.step = st.stager.send(self._t, st.tag, src, step=st.step, timeout=timeout, current=current,
                                 side=self._copy_stream(device, "d2h"))

    @staticmethod
    def _stage(st: _SendState, tensor: "torch.Tensor", shape: tuple[int, ...]) -> "torch.Tensor":
        """Copy into the preallocated send slot (no allocation); returns its bytes."""
        view = st.slot.view(shape)
        view.copy_(tensor, non_blocking=view.is_pinned() if not view.is_cuda else True)
        return st.slot.raw

    def isend(self, name: str, tensor: "torch.Tensor", *, timeout: float | None = None) -> SendHandle:
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
        self._check_open()
        st = self._send.get(name)
        if st is None:
            raise ShapeMismatchError(f"{name!r} was not declared as sent on this link (declared: {sorted(self._send)})")
        st.spec.check_tensor(tensor)
        tmo = self._timeout if timeout is None else timeout
        if (self._async and not st.spec.is_dynamic and st.nbytes and tensor.is_contiguous()
                and (not tensor.is_cuda or (st.slot.is_cuda and st.stager is None))):
            # Posted once the receiver's credit is there and completed by the handle: several
            # messages in flight at once, as many as the peer has slots posted -- the next one is
            # posted while the previous one is moving.
            data = tensor.detach() if tensor.requires_grad else tensor
            if tensor.is_cuda and (self._queued or not current_stream_idle(tensor.device)):
                # CUDA: the caller's thread does not wait for its stream. An event recorded on it
                # marks the point after which the bytes are final; the link's thread waits for that
                # event, then posts (in isend order) -- the caller goes on queueing work meanwhile.
                import torch

                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(tensor.device))
                return SendHandle(self._submit(self._post_after_event, st, data, ev, tmo), name, transport=self._t)
            if not self._queued:
                # Nothing queued before it (and, for CUDA, nothing pending on the stream): post right here.
                return SendHandle(None, name, op=self._post(st, data, tmo), transport=self._t)
        # A chunk-staged send runs on the executor thread, whose current stream is not the caller's:
        # capture the caller's now, so the copies order after the work that writes ``tensor``.
        stream = None
        if tensor.is_cuda:  # the executor thread has its own current stream: order after the caller's
            import torch

            stream = torch.cuda.current_stream(tensor.device)
        return SendHandle(self._submit(self._send_impl, name, tensor, timeout, stream), name)

    def _submit(self, fn: Any, *args: Any) -> "concurrent.futures.Future[Any]":
        """Run ``fn`` on the link's sender thread, after every isend queued before it (order on the tag)."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tw-isend-{self.peer}")
            self._queued += 1  # later isends and sends queue behind this one
            fut = self._executor.submit(fn, *args)
        fut.add_done_callback(self._dequeued)
        return fut

    def _post(self, st: _SendState, data: "torch.Tensor", timeout: float) -> Any:
        """Post ``data`` as the next message of ``st`` (waiting only for a credit); returns the send op."""
        with st.lock:
            op = self._t.start_send(st.tag, data, step=st.step + 1, timeout=timeout)  # type: ignore[attr-defined]
            st.step += 1
        self.bytes_sent += st.nbytes
        return op

    def _post_after_event(self, st: _SendState, data: "torch.Tensor", ev: Any, timeout: float) -> Any:
        """(sender thread) Wait for the caller's work on ``data`` (``ev``), then post it; returns the send op."""
        ev.synchronize()  # releases the GIL
        return self._post(st, data, timeout)

    def _dequeued(self, _: Any) -> None:
        with self._lock:
            self._queued -= 1

    # -- recv -------------------------------------------------------------------
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
        self._check_open()
        st = self._recv.get(name)
        if st is None:
            raise ShapeMismatchError(f"{name!r} is not received on this link (declared: {sorted(self._recv)})")
        if st.stager is not None:
            return self._recv_staged(st, name, out, self._timeout if timeout is None else timeout)
        tmo = self._timeout if timeout is None else timeout
        held = st.held
        # Re-post the oldest held slots: those past their validity (at most depth - 2 stay held once
        # this recv returns one more) and any free one at the head of the line.
        keep = len(st.slots) - 2
        last = None
        synced = False
        while held and (len(held) > keep or held[0][1] is _FREE):
            idx_, wait_for = held.popleft()
            raw = st.slots[idx_].raw
            if wait_for is not None and wait_for is not _FREE:
                wait_for.synchronize()  # recv(out=)'s copy out of it, nothing else
            elif wait_for is None and raw.is_cuda and not synced:
                # UCX may write the next message into this slot as soon as it is posted: work the
                # caller queued on the slot (on the current stream) must be finished first.
                sync_current_stream(raw.device)
                synced = True
            if last is not None:
                self._t.post_recv(st.tag, last, header=st.spec.is_dynamic)
            last = raw
        if last is not None:
            # The last slot goes back and the next message is awaited in one call: UCX does the
            # post once the wait has picked up the message already on its way (transport docs).
            got = self._t.repost_and_wait(st.tag, last, header=st.spec.is_dynamic, timeout=tmo)
        else:
            got = self._t.wait_recv(st.tag, timeout=tmo)
        idx = st.next
        st.next = idx + 1 if idx + 1 < len(st.slots) else 0
        slot = st.slots[idx]
        if got.shape is None and not st.spec.is_dynamic:
            # Static spec (the common case): the slot's full typed view, no shape work per message.
            shape = st.spec.shape
            if got.nbytes != slot.nbytes:
                self._release(st, idx)
                raise ProtocolError(f"peer sent {got.nbytes} bytes for {name!r} {shape}, expected {slot.nbytes}")
            view = slot.tensor
        else:
            shape = got.shape if got.shape is not None else st.spec.shape
            try:
                st.spec.check_shape(shape)
            except ShapeMismatchError as exc:
                self._release(st, idx)
                raise ProtocolError(f"peer sent {name!r} with shape {shape}: {exc}") from exc
            view = slot.view(shape)
            expected = view.numel() * st.spec.itemsize
            if got.nbytes != expected:
                self._release(st, idx)
                raise ProtocolError(f"peer sent {got.nbytes} bytes for {name!r} {shape}, expected {expected}")
        self.bytes_received += got.nbytes
        if st.staged:
            assert st.device_slot is not None
            dev_view = st.device_slot.view(shape)
            dev_view.copy_(view, non_blocking=True)
            import torch

            torch.cuda.current_stream(dev_view.device).synchronize()  # host slot is re-posted right away
            self._t.post_recv(st.tag, slot.raw, header=st.spec.is_dynamic)
            view = dev_view
            if out is None:
                return view
        if out is not None:
            if tuple(out.shape) != tuple(view.shape) or out.dtype != view.dtype:
                if not st.staged:
                    held.append((idx, None))
                raise ShapeMismatchError(f"out= for {name!r} is {out.dtype}{list(out.shape)}, received "
                                         f"{view.dtype}{list(view.shape)}")
            out.copy_(view)
            if not st.staged:
                if view.is_cuda:
                    # The copy is queued on the current stream behind whatever the caller queued before:
                    # the slot is held (not re-posted, so UCX cannot write into it) until the copy has
                    # run; the next recv of this name waits for this event, then re-posts it.
                    import torch

                    ev = st.events[idx]
                    if ev is None:
                        ev = st.events[idx] = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(view.device))
                    held.append((idx, ev))
                    return out
                self._release(st, idx)
            return out
        held.append((idx, None))
        return view

    def _release(self, st: _RecvState, idx: int) -> None:
        """Give slot ``idx`` back now if no older slot is still held, else as soon as its turn comes."""
        if st.held:
            st.held.append((idx, _FREE))
        else:
            self._t.post_recv(st.tag, st.slots[idx].raw, header=st.spec.is_dynamic)

    def _recv_staged(self, st: _RecvState, name: str, out: "torch.Tensor | None", timeout: float) -> "torch.Tensor":
        """Chunked, overlapped socket->host->device receive of a static CUDA spec into its device slot."""
        dslot = st.device_slot
        assert dslot is not None
        device = dslot.raw.device
        self.bytes_received += st.stager.recv(self._t, st.tag, timeout=timeout,
                                              current=self._ops.current_stream(device),
                                              side=self._copy_stream(device, "h2d"))
        view = dslot.tensor
        if out is None:
            return view
        if tuple(out.shape) != tuple(view.shape) or out.dtype != view.dtype:
            raise ShapeMismatchError(f"out= for {name!r} is {out.dtype}{list(out.shape)}, received "
                                     f"{view.dtype}{list(view.shape)}")
        out.copy_(view)  # on the current stream, which already waits for the slot's copies
        return out

    # -- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Close the data connection and release the slots. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for st in self._recv.values():
            if st.stager is not None and st.stager.pending is not None:
                try:  # host->device copies still reading a host slot: let them finish before the slots can go
                    st.stager.copied[st.stager.pending].synchronize()
                except Exception:  # noqa: BLE001 - closing must not fail on a broken device
                    pass
        self._t.close()

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
