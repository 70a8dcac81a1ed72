"""Chunked, overlapped staging of CUDA tensors over transports that cannot reach GPU memory.

**Chunked, overlapped staging** for transports that cannot reach GPU memory
(TCP), wired into :class:`tensorwire.Link` for static CUDA specs:

- :func:`chunk_plan` cuts a tensor's bytes into chunks (``DEFAULT_CHUNK`` =
  2 MiB, at most ``MAX_STAGING_CHUNKS``; the whole tensor when small). Both
  sides compute it from the negotiated spec alone (and the
  ``TENSORWIRE_STAGING_CHUNK`` knob, :func:`staging_chunk`), so the wire carries
  one ordinary header-less message per chunk on the spec's tag: nothing new in
  the transport, and two processes running this code always agree.
- :class:`StagedSender`: all device->host copies are queued at once on a copy
  stream that first waits for the caller's current stream, one event per chunk;
  chunk *i* is handed to ``transport.send`` as soon as its event completes,
  while the copy engine moves chunk *i+1*.
- :class:`StagedReceiver`: each chunk of two pinned host slots is posted as its
  own receive (the transport fills posted buffers per tag in FIFO order). Each
  chunk's host->device copy is queued the moment it lands, so it overlaps the
  socket; the caller's current stream then waits on the copies' event. A host
  slot is re-posted only after the copies out of it completed.

All CUDA calls of the two engines go through a :class:`CudaOps` object, so the
chunk/credit/stream protocol can be checked on a machine without a GPU with a
simulated, deliberately lazy stream model (``tests/test_staging.py``).

Nothing here initializes CUDA at import.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Mapping

from tensorwire.cuda import memcpy_async
from tensorwire.settings import DEFAULT_STAGING_CHUNK, setting
from tensorwire.transport.base import remaining
from tensorwire.errors import ProtocolError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DEFAULT_CHUNK",
    "MAX_STAGING_CHUNKS",
    "STAGING_CHUNK_ENV",
    "chunk_plan",
    "staging_chunk",
    "CudaOps",
    "StagedSender",
    "StagedReceiver",
]

log = logging.getLogger(__name__)

#: Chunk of the overlapped device->host staging (large enough to keep PCIe/NVLink busy, small enough to overlap).
#: 2 MiB: the sweep on 2 x H200 (bench/results/staged-chunks_h200x2_2026-11-23.md) put it first at 16 MiB (0.91x the
#: bound, vs 0.69-0.81x for 1, 4, 8 and 16 MiB chunks) and at 1.06x at 64 MiB.
DEFAULT_CHUNK = DEFAULT_STAGING_CHUNK
#: Most chunks one staged message is cut into: bigger tensors get bigger chunks (bounds per-chunk Python work
#: and the number of posted receive buffers; the pipeline's fill/drain stays below 1/64 of the transfer).
MAX_STAGING_CHUNKS = 64
#: Chunks enlarged to respect MAX_STAGING_CHUNKS are rounded up to this (keeps chunk offsets page-aligned).
STAGING_CHUNK_ALIGN = 64 << 10
#: Environment knob: staging chunk in bytes (suffixes K/M/G, KiB/MiB/GiB); 0 = one message per tensor.
STAGING_CHUNK_ENV = "TENSORWIRE_STAGING_CHUNK"


def chunk_plan(
    nbytes: int, chunk: int = DEFAULT_CHUNK, *, max_chunks: int = MAX_STAGING_CHUNKS
) -> tuple[tuple[int, int], ...]:
    """How a staged message of ``nbytes`` is cut into wire messages: ``((offset, length), ...)``.

    Pure and deterministic: sender and receiver each compute it from the
    negotiated spec's byte size, so the chunk boundaries never travel.

    - ``nbytes <= chunk`` or ``chunk == 0``: one chunk, the whole tensor (a
      zero-byte tensor is still one, empty, message: one send = one receive);
    - otherwise chunks of ``chunk`` bytes and a shorter tail; if that would
      make more than ``max_chunks`` chunks, the chunk grows to
      ``ceil(nbytes / max_chunks)`` rounded up to ``STAGING_CHUNK_ALIGN``.

    Raises:
        ValueError: negative sizes, ``max_chunks < 1``.
    """
    if nbytes < 0 or chunk < 0 or max_chunks < 1:
        raise ValueError(f"chunk_plan({nbytes}, chunk={chunk}, max_chunks={max_chunks}): bad arguments")
    if chunk == 0 or nbytes <= chunk:
        return ((0, nbytes),)
    if -(-nbytes // chunk) > max_chunks:
        chunk = -(-nbytes // max_chunks)
        chunk = -(-chunk // STAGING_CHUNK_ALIGN) * STAGING_CHUNK_ALIGN
    return tuple((off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk))


def staging_chunk(env: Mapping[str, str] | None = None) -> int:
    """The staging chunk in bytes: ``TENSORWIRE_STAGING_CHUNK`` or :data:`DEFAULT_CHUNK`; 0 means unchunked.

    Part of the wire format of staged CUDA specs: both ends of a link must use
    the same value (a difference is detected as a ``ProtocolError`` on the
    first message, never as wrong data).

    Raises:
        ConfigError: not a size (``4194304``, ``4M``, ``512KiB``, ``0``).
    """
    chunk: int = setting("staging_chunk", env)
    return chunk


class CudaOps:
    """The CUDA calls the staging engines make, in one place.

    The engines only ever: create events, record/synchronize them, make a
    stream wait on an event, and queue a copy on a given stream. Tests without
    a GPU substitute an object with the same methods that simulates streams.
    """

    def current_stream(self, device: "torch.device") -> Any:
        import torch

        return torch.cuda.current_stream(device)

    def new_stream(self, device: "torch.device") -> Any:
        import torch

        return torch.cuda.Stream(device=device)

    def new_event(self) -> Any:
        import torch

        # Created once per slot and re-recorded every step (no allocation on the hot path). Timing off: cheaper.
        return torch.cuda.Event()

    def copy(self, dst: "torch.Tensor", src: "torch.Tensor", stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (asynchronous: one side is pinned host memory).

        Contiguous byte-for-byte copies (what the staging engines queue) go to ``cudaMemcpyAsync``
        of the runtime torch loaded, on the stream's raw handle: measured on an H200 host, the
        ``torch.cuda.stream(...)`` + ``copy_`` way costs ~42 us of the calling thread per copy --
        8 copies of 2 MiB chunks put 0.34 ms of host time on a 16 MiB message's receive path.
        Anything else, or a runtime call that fails, takes torch's way.
        """
        memcpy = memcpy_async()
        if (
            memcpy is not None
            and dst.dtype == src.dtype
            and dst.numel() == src.numel()
            and dst.is_contiguous()
            and src.is_contiguous()
        ):
            if memcpy(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), stream):
                return
        import torch

        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)


_DEFAULT_OPS = CudaOps()


def _break(transport: Any, why: str) -> None:
    """The chunk stream of a tag can no longer be framed: close the link so both sides see an error, not wrong data."""
    log.warning("tensorwire: %s; closing the link (the chunk stream on this tag lost its framing)", why)
    try:
        transport.close()
    except Exception:  # noqa: BLE001 - best effort, the original error is what the caller sees
        pass


class StagedSender:
    """Sends one static CUDA tensor over a host-only transport as ``len(plan)`` messages, D2H overlapped with the socket.

    Owns views of the pinned host send slot, cut by the plan, and one event
    per chunk (per device), created once. :meth:`send`:

    1. records an event on the caller's current stream and makes the copy
       stream wait on it (the copies see every write queued before ``send``);
    2. queues all device->host copies on the copy stream, recording chunk *i*'s
       event after its copy;
    3. for each chunk: wait for its event, then ``transport.send`` it (the socket
       sends chunk *i* while the copy engine moves chunk *i+1*).

    Returns after the last chunk is out: every queued copy has completed, so
    the source tensor may be overwritten or freed right away.
    """

    def __init__(self, host: "torch.Tensor", plan: tuple[tuple[int, int], ...], *, ops: Any = None) -> None:
        if not plan or sum(n for _, n in plan) != host.numel():
            raise ValueError(f"plan {plan[:3]}... does not cover the {host.numel()}-byte host slot")
        self.plan = plan
        self.ops = ops or _DEFAULT_OPS
        self.chunks = [host[off : off + n] for off, n in plan]
        # (ordered-after-current event, per-chunk events) per device the tensors come from
        self._events: dict[Any, tuple[Any, list[Any]]] = {}

    def _events_for(self, device: Any) -> tuple[Any, list[Any]]:
        ev = self._events.get(device)
        if ev is None:
            ev = self._events[device] = (self.ops.new_event(), [self.ops.new_event() for _ in self.plan])
        return ev

    def send(
        self,
        transport: Any,
        tag: int,
        src: "torch.Tensor",
        *,
        step: int,
        timeout: float | None,
        current: Any,
        side: Any,
    ) -> int:
        """Send the flat uint8 device tensor ``src``; messages carry steps ``step+1 ...``; returns the last step.

        ``current``: the stream the caller's writes to ``src`` were queued on;
        ``side``: the copy stream. ``timeout`` bounds each chunk's wait (for
        the receiver's credit, then for its bytes to go out), not the whole
        message: a deadline running out half-way would break the message.

        Raises:
            whatever ``transport.send`` raises. If that happens after the first
            chunk went out, the transport is closed first (the peer sees the
            link lost, never a message mixed from two tensors).
        """
        ordered, events = self._events_for(src.device)
        ops = self.ops
        ordered.record(current)
        side.wait_event(ordered)
        for (off, n), chunk, ev in zip(self.plan, self.chunks, events):
            ops.copy(chunk, src[off : off + n], side)
            ev.record(side)
        sent = 0
        try:
            for chunk, ev in zip(self.chunks, events):
                ev.synchronize()
                transport.send(tag, chunk, step=step + sent + 1, timeout=timeout)
                sent += 1
        except BaseException as exc:
            events[-1].synchronize()  # no copy may still read src once we return, even with an error
            if sent:
                _break(transport, f"staged send on tag {tag} failed after {sent}/{len(self.plan)} chunks ({exc!r})")
            raise
        return step + sent


class StagedReceiver:
    """Receives one static CUDA spec over a host-only transport into a device slot, H2D overlapped with the socket.

    Two pinned host slots, each cut by the plan; every chunk is posted as its
    own receive, so the peer may send the next message while this one is
    being copied (Link's receive double-buffering). :meth:`recv`:

    1. re-posts the host slot of the previous message, after waiting for the
       event that ends the copies out of it;
    2. records an event on the caller's current stream and makes the copy
       stream wait on it (work already queued that still reads the device slot
       — the previous message — runs before it is overwritten);
    3. waits for each chunk in turn and queues its host->device copy at once;
    4. records the end of the copies and makes the current stream wait on it,
       so the device slot is ready for any later work on the current stream.

    A :class:`~tensorwire.TransferTimeout` in step 3 loses nothing: the next
    call resumes at the chunk it was waiting for.
    """

    def __init__(
        self,
        hosts: "list[torch.Tensor]",
        device_buf: "torch.Tensor",
        plan: tuple[tuple[int, int], ...],
        *,
        ops: Any = None,
    ) -> None:
        if len(hosts) != 2 or not plan or any(sum(n for _, n in plan) != h.numel() for h in (*hosts, device_buf)):
            raise ValueError("StagedReceiver needs two host slots and a device slot, all covered by the plan")
        self.plan = plan
        self.ops = ops or _DEFAULT_OPS
        self.chunks = [[h[off : off + n] for off, n in plan] for h in hosts]
        self.dev_chunks = [device_buf[off : off + n] for off, n in plan]
        self.copied = [self.ops.new_event(), self.ops.new_event()]  # end of the H2D copies out of host slot i
        self.ordered = self.ops.new_event()  # the current stream's position when a recv started
        self.next = 0  # host slot the next message lands in
        self.pos = 0  # chunks of that message already waited for and copied
        self.pending: int | None = None  # host slot to re-post once its copies are done

    def post(self, transport: Any, tag: int, index: int) -> None:
        """Post every chunk of host slot ``index`` (in plan order: the transport fills them FIFO)."""
        for chunk in self.chunks[index]:
            transport.post_recv(tag, chunk, header=False)

    def post_all(self, transport: Any, tag: int) -> None:
        self.post(transport, tag, 0)
        self.post(transport, tag, 1)

    def recv(self, transport: Any, tag: int, *, timeout: float | None, current: Any, side: Any) -> int:
        """Receive the next message into the device slot; returns its byte count. See the class docstring.

        Raises:
            TransferTimeout: a chunk did not arrive in time (resumable).
            ProtocolError: a chunk's size differs from the plan (the peer cuts
                differently: ``TENSORWIRE_STAGING_CHUNK`` differs); the link is closed.
            PeerLostError, ClosedError.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        ops = self.ops
        if self.pending is not None:
            self.copied[self.pending].synchronize()
            self.post(transport, tag, self.pending)
            self.pending = None
        idx = self.next
        self.ordered.record(current)
        side.wait_event(self.ordered)
        host = self.chunks[idx]
        for i in range(self.pos, len(self.plan)):
            left = remaining(deadline)
            got = transport.wait_recv(tag, timeout=left if left is None else max(0.0, left))
            n = self.plan[i][1]
            if got.nbytes != n:
                msg = (
                    f"staged receive on tag {tag}: chunk {i} of {len(self.plan)} carried {got.nbytes} bytes, "
                    f"expected {n} (is {STAGING_CHUNK_ENV} the same on both sides?)"
                )
                _break(transport, msg)
                raise ProtocolError(msg)
            ops.copy(self.dev_chunks[i], host[i], side)
            self.pos = i + 1
        self.copied[idx].record(side)
        current.wait_event(self.copied[idx])
        self.pending = idx
        self.next = idx ^ 1
        self.pos = 0
        return self.plan[-1][0] + self.plan[-1][1]
