"""Prepared send and receive paths: one object per negotiated tensor of a :class:`~tensorwire.Link`.

When a link is negotiated, :func:`send_path` and :func:`recv_path` pick, once
per spec, the object its messages will go through, and give it everything the
hot path needs (slots, the transport's bound methods, tag, fast-check fields,
CUDA copy streams for staging). ``Link.send`` / ``recv`` / ``isend`` call it
without branching on the kind of tensor or transport:

- :class:`HostSend`: a static host spec, checked by identity and shape, sent from the caller's tensor;
- :class:`CudaSend`: a static CUDA spec over a transport that reaches device memory (UCX): the current
  stream is synchronized, then the tensor goes; ``isend`` posts after an event;
- :class:`StagedSend`: a static CUDA spec over a host-only transport (TCP): chunked, overlapped
  device->host->socket;
- :class:`SendPath`: anything else (dynamic shapes, a tensor that needs the staging slot): the general
  send, also the fallback of the three above;
- :class:`SlotRecv`: slots the transport fills directly (host, or CUDA over UCX), any depth;
  :class:`WholeStagedRecv`: a dynamic CUDA spec over a host-only transport (host slot, then one copy);
  :class:`StagedRecv`: a static one (chunked, overlapped socket->host->device).

Messages carry the transport's own per-tag step counter (every send of a tag
goes through one path, so no step is kept here): the fast paths hold no lock.
The general and staged sends share a staging slot and keep a lock for it. A
receive path has its slots described for the transport once
(``Transport.prepare_recv``: over UCX, their descriptors and receive records),
so a re-post builds nothing. ``isend``'s handle and the link's sender thread:
:mod:`tensorwire.p2p.isend`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tensorwire.buffers import Slot, as_bytes
from tensorwire.cuda import current_stream_idle, sync_current_stream
from tensorwire.errors import ProtocolError, ShapeMismatchError
from tensorwire.p2p.isend import IsendQueue, SendHandle
from tensorwire.p2p.staging import StagedReceiver, StagedSender, chunk_plan
from tensorwire.spec import TensorSpec
from tensorwire.transport.base import Transport

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "CudaSend",
    "HostSend",
    "IsendQueue",
    "RecvPath",
    "SendHandle",
    "SendPath",
    "SlotRecv",
    "StagedRecv",
    "StagedSend",
    "WholeStagedRecv",
    "recv_path",
    "send_path",
]


def _uint8() -> torch.dtype:
    import torch

    return torch.uint8


# -- send ----------------------------------------------------------------------------


class SendPath:
    """The general send of one spec (and the fallback of the specialised paths)."""

    stager: Any = None

    def __init__(self, spec: TensorSpec, tag: int, slot: Slot, transport: Transport, queue: IsendQueue) -> None:
        self.spec = spec
        self.name = spec.name
        self.tag = tag
        self.slot = slot  # staging for non-contiguous input or CUDA data over a host-only transport
        self.nbytes = spec.nbytes
        self.shape = spec.shape
        self.dtype = spec.torch_dtype
        self.sent = 0  # bytes sent through this path
        self._t = transport
        self._send = transport.send
        self._q = queue
        self._lock = threading.Lock()  # the staging slot (and a stager's events) serve one send at a time
        # isend may post in the caller's thread (transport.start_send): a static spec of a transport that
        # takes any contiguous tensor and posts asynchronously
        self._postable = bool(transport.async_send and transport.any_dtype and not spec.is_dynamic and spec.nbytes)

    def send(self, tensor: torch.Tensor, timeout: float, stream: Any = None) -> None:
        """``Link.send``; ``stream``: the stream a CUDA send orders after (None: the current one)."""
        self._send_general(tensor, timeout, stream)

    def _send_general(self, tensor: torch.Tensor, timeout: float, stream: Any) -> None:
        spec = self.spec
        spec.check_tensor(tensor)
        tensor = tensor.detach()
        shape = tuple(tensor.shape)
        nbytes = tensor.numel() * spec.itemsize
        with self._lock:
            if tensor.is_cuda:
                import torch

                # The caller's stream (isend passes the one current in the calling thread): the bytes
                # are read by UCX (device memory) or the socket (pinned staging) only after the work
                # queued there -- and the staging copy, queued on it too -- is done.
                cur = stream if stream is not None else torch.cuda.current_stream(tensor.device)
                if self.slot.is_cuda and tensor.is_contiguous():
                    data = as_bytes(tensor)
                else:
                    with torch.cuda.stream(cur):
                        data = self._stage(tensor, shape)
                cur.synchronize()
            elif tensor.is_contiguous():
                data = as_bytes(tensor)
            else:
                data = self._stage(tensor, shape)
            self._send(
                self.tag,
                data[:nbytes] if data.numel() != nbytes else data,
                shape=shape if spec.is_dynamic else None,
                timeout=timeout,
            )
        self.sent += nbytes

    def _stage(self, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """Copy into the preallocated send slot (no allocation); returns its bytes."""
        view = self.slot.view(shape)
        view.copy_(tensor, non_blocking=view.is_pinned() if not view.is_cuda else True)
        return self.slot.raw

    # -- isend -----------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, timeout: float) -> SendHandle:
        """``Link.isend`` (after the link's checks); see its docstring."""
        self.spec.check_tensor(tensor)
        if self._postable and tensor.is_contiguous():
            handle = self._isend_posted(tensor, timeout)
            if handle is not None:
                return handle
        return self._isend_queued(tensor, timeout)

    def _isend_posted(self, tensor: torch.Tensor, timeout: float) -> SendHandle | None:
        """Post in the caller's thread when nothing is queued before it (None: not postable here)."""
        if tensor.is_cuda:
            return None
        if self._q.pending:
            return None
        data = tensor.detach() if tensor.requires_grad else tensor
        return SendHandle(None, self.name, op=self._post(data, timeout), transport=self._t)

    def _isend_queued(self, tensor: torch.Tensor, timeout: float) -> SendHandle:
        # A send on the executor thread, whose current stream is not the caller's: capture the caller's
        # now, so the copies order after the work that writes ``tensor``.
        stream = None
        if tensor.is_cuda:
            import torch

            stream = torch.cuda.current_stream(tensor.device)
        return SendHandle(self._q.submit(self._send_queued, tensor, timeout, stream), self.name)

    def _send_queued(self, tensor: torch.Tensor, timeout: float, stream: Any) -> None:
        self._q.check_open()
        self.send(tensor, timeout, stream)

    def _post(self, data: torch.Tensor, timeout: float) -> Any:
        """Post ``data`` as the next message (waiting only for a credit); returns the send op."""
        op = self._t.start_send(self.tag, data, timeout=timeout)
        self.sent += self.nbytes
        return op

    def _post_after_event(self, data: torch.Tensor, ev: Any, timeout: float) -> Any:
        """(sender thread) Wait for the caller's work on ``data`` (``ev``), then post it; returns the send op."""
        ev.synchronize()  # releases the GIL
        return self._post(data, timeout)


class HostSend(SendPath):
    """A static host spec: the tensor itself goes to the transport (no flat view over UCX)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._whole = self._t.any_dtype  # the transport takes the tensor as it is
        self._empty = self.slot.raw if not self.nbytes else None
        self._fast = bool(self.shape)  # a 0-d tensor takes the general path

    def send(self, tensor: torch.Tensor, timeout: float, stream: Any = None) -> None:
        if self._fast and tensor.dtype is self.dtype and not tensor.is_cuda and tensor.shape == self.shape:
            if tensor.requires_grad:
                tensor = tensor.detach()
            if tensor.is_contiguous():
                if self._empty is not None:
                    data = self._empty
                else:
                    data = tensor if self._whole else tensor.view(_uint8()).reshape(-1)
                self._send(self.tag, data, timeout=timeout)
                self.sent += self.nbytes
                return
        self._send_general(tensor, timeout, stream)


class CudaSend(SendPath):
    """A static CUDA spec over a transport that reaches device memory: sent straight from the tensor."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._whole = self._t.any_dtype

    def send(self, tensor: torch.Tensor, timeout: float, stream: Any = None) -> None:
        if (
            tensor.dtype is self.dtype
            and tensor.shape == self.shape
            and tensor.is_cuda
            and self.nbytes
            and tensor.is_contiguous()
        ):
            # The caller's stream (isend passes the one current in the calling thread) is synchronized
            # first: the transport reads the bytes only after the work queued there is done.
            if tensor.requires_grad:
                tensor = tensor.detach()
            if stream is not None:
                stream.synchronize()
            else:
                sync_current_stream(tensor.device)
            self._send(self.tag, tensor if self._whole else as_bytes(tensor), timeout=timeout)
            self.sent += self.nbytes
            return
        self._send_general(tensor, timeout, stream)

    def _isend_posted(self, tensor: torch.Tensor, timeout: float) -> SendHandle | None:
        data = tensor.detach() if tensor.requires_grad else tensor
        if not tensor.is_cuda:
            return super()._isend_posted(tensor, timeout)
        if self._q.pending or not current_stream_idle(tensor.device):
            # The caller's thread does not wait for its stream. An event recorded on it marks the point
            # after which the bytes are final; the link's thread waits for that event, then posts (in
            # isend order) -- the caller goes on queueing work meanwhile.
            import torch

            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(tensor.device))
            return SendHandle(self._q.submit(self._post_after_event, data, ev, timeout), self.name, transport=self._t)
        # Nothing queued before it and nothing pending on the stream: post right here.
        return SendHandle(None, self.name, op=self._post(data, timeout), transport=self._t)


class StagedSend(SendPath):
    """A static CUDA spec over a host-only transport: chunked device->host->socket (see ``Link``)."""

    def __init__(self, *args: Any, stager: Any, ops: Any, side: Callable[[torch.device], Any]) -> None:
        super().__init__(*args)
        self.stager = stager
        self._ops = ops
        self._side = side  # device -> this link's d2h copy stream
        self._step = 0  # the stager numbers its chunks (the transport checks them)
        self._postable = False

    def send(self, tensor: torch.Tensor, timeout: float, stream: Any = None) -> None:
        self.spec.check_tensor(tensor)
        tensor = tensor.detach()
        if not tensor.is_cuda:  # pragma: no cover - check_tensor requires a CUDA tensor here
            self._send_general(tensor, timeout, stream)
            return
        with self._lock:
            device = tensor.device
            current = stream if stream is not None else self._ops.current_stream(device)
            if tensor.is_contiguous():
                src = as_bytes(tensor)
            else:
                import torch

                with torch.cuda.stream(current):  # ordered after the writes to ``tensor``; freed after all reads
                    src = as_bytes(tensor.contiguous())
            self._step = self.stager.send(
                self._t, self.tag, src, step=self._step, timeout=timeout, current=current, side=self._side(device)
            )
        self.sent += self.nbytes


def send_path(
    spec: TensorSpec,
    tag: int,
    transport: Transport,
    queue: IsendQueue,
    *,
    device: Any,
    staging: Callable[[], tuple[Any, int]],
    side: Callable[[torch.device], Any],
) -> SendPath:
    """The send path of ``spec`` over ``transport`` (its slot allocated here).

    ``staging()`` gives (CudaOps, chunk) for chunk-staged specs; ``side(device)`` the link's d2h copy stream.
    """
    host_only = not transport.reaches_cuda
    on_host = host_only and spec.device == "cuda"
    slot = Slot(spec, device=device, host=on_host)
    args = (spec, tag, slot, transport, queue)
    if spec.is_dynamic:
        return SendPath(*args)
    if spec.device != "cuda":
        return HostSend(*args)
    if not on_host:
        return CudaSend(*args)
    ops, chunk = staging()
    return StagedSend(*args, stager=StagedSender(slot.raw, chunk_plan(spec.nbytes, chunk), ops=ops), ops=ops, side=side)


# -- receive -------------------------------------------------------------------------

_FREE = object()  # a held slot nobody reads any more (see SlotRecv.held)


class SlotRecv:
    """Receives one spec into slots the transport fills directly (host slots, or CUDA slots over UCX).

    ``recv`` returns a slot (valid until ``depth - 1`` more ``recv`` calls) or
    copies into ``out``; slots are re-posted in the order they were received in.
    """

    stager: Any = None

    def __init__(self, spec: TensorSpec, tag: int, slots: list[Slot], transport: Transport) -> None:
        self.spec = spec
        self.name = spec.name
        self.tag = tag
        self.slots = slots
        self.depth = len(slots)
        self.received = 0  # bytes received through this path
        self.next = 0
        # Slots handed out and not re-posted yet, oldest first: (index, what to wait for before re-posting).
        # None: the work the caller queued on the current stream (the slot was returned to the caller);
        # an event: recv(out=)'s own copy out of a CUDA slot (recorded after it on the caller's stream);
        # _FREE: nothing (a host copy already done) -- it waits only for its turn (slots are re-posted in
        # the order they were received in: the next message lands in the oldest posted slot).
        self.held: collections.deque[tuple[int, Any]] = collections.deque()
        self.events: list[Any] = [None] * len(slots)  # one reusable CUDA event per slot (recv(out=))
        self._keep = len(slots) - 2  # slots that stay held once a recv returns one more
        self._nbytes = spec.nbytes
        self._raws = [s.raw for s in slots]
        self._bufs = [transport.prepare_recv(r) for r in self._raws]  # what post/repost take
        self._cuda = bool(slots[0].raw.is_cuda)
        self._header = spec.is_dynamic
        self._static = not spec.is_dynamic
        self._post = transport.post_recv
        self._repost_and_wait = transport.repost_and_wait
        self._wait = transport.wait_recv

    def post_all(self) -> None:
        for buf in self._bufs:
            self._post(self.tag, buf, header=self._header)

    def all_slots(self) -> list[Slot]:
        return list(self.slots)

    def close(self) -> None:
        """Before the transport closes (nothing to finish here)."""

    def recv(self, out: torch.Tensor | None, timeout: float) -> torch.Tensor:
        held = self.held
        tag = self.tag
        if held:
            # Re-post the oldest held slots: those past their validity (at most depth - 2 stay held once
            # this recv returns one more) and any free one at the head of the line.
            keep = self._keep
            last = None
            synced = False
            while held and (len(held) > keep or held[0][1] is _FREE):
                idx_, wait_for = held.popleft()
                if wait_for is None:
                    if self._cuda and not synced:
                        # UCX may write the next message into this slot as soon as it is posted: work the
                        # caller queued on the slot (on the current stream) must be finished first.
                        sync_current_stream(self._raws[idx_].device)
                        synced = True
                elif wait_for is not _FREE:
                    wait_for.synchronize()  # recv(out=)'s copy out of it, nothing else
                if last is not None:
                    self._post(tag, last, header=self._header)
                last = self._bufs[idx_]
            if last is not None:
                # The last slot goes back and the next message is awaited in one call: the transport
                # may do the post once the wait has started (transport docs).
                got = self._repost_and_wait(tag, last, header=self._header, timeout=timeout)
            else:
                got = self._wait(tag, timeout=timeout)
        else:
            got = self._wait(tag, timeout=timeout)
        idx = self.next
        self.next = idx + 1 if idx + 1 < self.depth else 0
        slot = self.slots[idx]
        if got.shape is None and self._static:
            # Static spec (the common case): the slot's full typed view, no shape work per message.
            if got.nbytes != self._nbytes:
                self._release(idx)
                raise ProtocolError(
                    f"peer sent {got.nbytes} bytes for {self.name!r} {self.spec.shape}, expected {slot.nbytes}"
                )
            self.received += got.nbytes
            return self._deliver(idx, slot.tensor, self.spec.shape, out)
        shape = got.shape if got.shape is not None else self.spec.shape
        try:
            self.spec.check_shape(shape)
        except ShapeMismatchError as exc:
            self._release(idx)
            raise ProtocolError(f"peer sent {self.name!r} with shape {shape}: {exc}") from exc
        view = slot.view(shape)
        expected = view.numel() * self.spec.itemsize
        if got.nbytes != expected:
            self._release(idx)
            raise ProtocolError(f"peer sent {got.nbytes} bytes for {self.name!r} {shape}, expected {expected}")
        self.received += got.nbytes
        return self._deliver(idx, view, shape, out)

    def _deliver(self, idx: int, view: torch.Tensor, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            self.held.append((idx, None))
            return view
        if tuple(out.shape) != tuple(view.shape) or out.dtype != view.dtype:
            self.held.append((idx, None))
            raise _out_mismatch(self.name, out, view)
        out.copy_(view)
        if view.is_cuda:
            # The copy is queued on the current stream behind whatever the caller queued before: the
            # slot is held (not re-posted, so UCX cannot write into it) until the copy has run; the next
            # recv of this name waits for this event, then re-posts it.
            import torch

            ev = self.events[idx]
            if ev is None:
                ev = self.events[idx] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(view.device))
            self.held.append((idx, ev))
            return out
        self._release(idx)
        return out

    def _release(self, idx: int) -> None:
        """Give slot ``idx`` back now if no older slot is still held, else as soon as its turn comes."""
        if self.held:
            self.held.append((idx, _FREE))
        else:
            self._post(self.tag, self._bufs[idx], header=self._header)


def _out_mismatch(name: str, out: torch.Tensor, view: torch.Tensor) -> ShapeMismatchError:
    return ShapeMismatchError(
        f"out= for {name!r} is {out.dtype}{list(out.shape)}, received {view.dtype}{list(view.shape)}"
    )


class WholeStagedRecv(SlotRecv):
    """A dynamic CUDA spec over a host-only transport: two host slots, one copy into the device slot."""

    def __init__(self, spec: TensorSpec, tag: int, slots: list[Slot], transport: Transport, device_slot: Slot) -> None:
        super().__init__(spec, tag, slots, transport)
        self.device_slot = device_slot

    def all_slots(self) -> list[Slot]:
        return [*self.slots, self.device_slot]

    def _deliver(self, idx: int, view: torch.Tensor, shape: tuple[int, ...], out: torch.Tensor | None) -> torch.Tensor:
        import torch

        dev_view = self.device_slot.view(shape)
        dev_view.copy_(view, non_blocking=True)
        torch.cuda.current_stream(dev_view.device).synchronize()  # host slot is re-posted right away
        self._post(self.tag, self._bufs[idx], header=self._header)
        if out is None:
            return dev_view
        if tuple(out.shape) != tuple(dev_view.shape) or out.dtype != dev_view.dtype:
            raise _out_mismatch(self.name, out, dev_view)
        out.copy_(dev_view)
        return out


class StagedRecv:
    """A static CUDA spec over a host-only transport: chunked, overlapped socket->host->device (see ``Link``)."""

    depth = 2  # what recv returns is the one device slot, valid until the next recv

    def __init__(
        self,
        spec: TensorSpec,
        tag: int,
        slots: list[Slot],
        transport: Transport,
        device_slot: Slot,
        *,
        stager: Any,
        ops: Any,
        side: Callable[[torch.device], Any],
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.tag = tag
        self.slots = slots
        self.device_slot = device_slot
        self.stager = stager
        self.received = 0
        self._t = transport
        self._ops = ops
        self._side = side  # device -> this link's h2d copy stream
        self._device = device_slot.raw.device

    def post_all(self) -> None:
        self.stager.post_all(self._t, self.tag)  # both host slots, chunk by chunk

    def all_slots(self) -> list[Slot]:
        return [*self.slots, self.device_slot]

    def close(self) -> None:
        stager = self.stager
        if stager.pending is not None:
            try:  # host->device copies still reading a host slot: let them finish before the slots can go
                stager.copied[stager.pending].synchronize()
            except Exception:  # noqa: BLE001 - closing must not fail on a broken device
                pass

    def recv(self, out: torch.Tensor | None, timeout: float) -> torch.Tensor:
        device = self._device
        self.received += self.stager.recv(
            self._t, self.tag, timeout=timeout, current=self._ops.current_stream(device), side=self._side(device)
        )
        view = self.device_slot.tensor
        if out is None:
            return view
        if tuple(out.shape) != tuple(view.shape) or out.dtype != view.dtype:
            raise _out_mismatch(self.name, out, view)
        out.copy_(view)  # on the current stream, which already waits for the slot's copies
        return out


RecvPath = SlotRecv | StagedRecv


def recv_path(
    spec: TensorSpec,
    tag: int,
    transport: Transport,
    *,
    device: Any,
    depth: int,
    staging: Callable[[], tuple[Any, int]],
    side: Callable[[torch.device], Any],
) -> RecvPath:
    """The receive path of ``spec`` over ``transport``: its slots allocated and posted here.

    ``depth``: slots when the transport fills them directly (2 when staged through host memory).
    """
    staged = not transport.reaches_cuda and spec.device == "cuda"
    slots = [Slot(spec, device=device, host=staged) for _ in range(2 if staged else depth)]
    path: RecvPath
    if not staged:
        path = SlotRecv(spec, tag, slots, transport)
    elif spec.is_dynamic:
        path = WholeStagedRecv(spec, tag, slots, transport, Slot(spec, device=device))
    else:
        ops, chunk = staging()
        device_slot = Slot(spec, device=device)
        rx = StagedReceiver([sl.raw for sl in slots], device_slot.raw, chunk_plan(spec.nbytes, chunk), ops=ops)
        path = StagedRecv(spec, tag, slots, transport, device_slot, stager=rx, ops=ops, side=side)
    path.post_all()
    return path
