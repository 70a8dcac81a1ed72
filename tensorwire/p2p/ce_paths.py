"""Send and receive paths of a :class:`~tensorwire.Link` over the copy-engine path (CUDA specs, one host).

Where both ranks of a link share a host and can take the copy-engine path
(:mod:`tensorwire.transport.ce`), every static CUDA spec goes through these
instead of UCX: ``send`` queues the message on the caller's stream (a flag
write, or a copy-engine copy straight into the receiver's slot and a flag
write) and makes that stream wait until the bytes are out -- the host never
waits; ``recv`` hands out the next of the spec's ``depth`` slots, into which
the peer's bytes land, and makes the current stream wait for them. The shapes
were agreed when the link was negotiated; each call checks its tensor against
the spec on the host before anything is queued.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorwire.buffers import Slot
from tensorwire.cuda import current_raw_stream
from tensorwire.errors import ShapeMismatchError
from tensorwire.spec import TensorSpec
from tensorwire.transport.ce import CeOp, CePair

__all__ = ["CeSend", "CeRecv", "words_of"]


def words_of(spec: TensorSpec) -> tuple[int, ...]:
    """The signature words of a spec's messages (both sides derive them from the negotiated spec)."""
    return (spec.nbytes, *spec.shape[:7], *([0] * (7 - min(7, len(spec.shape)))))[:8]


def _after(op: CeOp, device: int) -> None:
    """Make the current stream of ``device`` wait until ``op``'s bytes are in place (no host wait)."""
    op.pair.order_after(op, current_raw_stream(device), device)


class CeHandle:
    """What :meth:`CeSend.isend` returns: ``wait()`` orders the current stream after the send (host: no wait)."""

    __slots__ = ("_op", "_device")

    def __init__(self, op: CeOp, device: int) -> None:
        self._op = op
        self._device = device

    def done(self) -> bool:
        if self._op.poll() and self._op.error is not None:
            raise self._op.error
        return self._op._done

    def wait(self, timeout: float | None = None) -> None:
        if self._op.error is not None:
            raise self._op.error
        _after(self._op, self._device)


class CeSend:
    """A static CUDA spec sent over the copy-engine path (see the module docstring)."""

    slot = None
    stager = None

    def __init__(self, spec: TensorSpec, tag: int, pair: CePair) -> None:
        self.spec = spec
        self.tag = tag
        self.pair = pair
        self.words = words_of(spec)
        self.sent = 0  # bytes sent through this path
        self._shape = torch.Size(spec.shape)
        self._dtype = spec.torch_dtype

    def _post(self, tensor: torch.Tensor) -> tuple[CeOp, int]:
        if tensor.shape != self._shape or tensor.dtype != self._dtype or not tensor.is_cuda:
            raise ShapeMismatchError(
                f"send of {self.spec.name!r}: {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} does not match "
                f"the negotiated spec {tuple(self._shape)} {self._dtype} on cuda (nothing sent)"
            )
        device = tensor.device.index
        op = self.pair.send(
            tensor, self.tag, self.words, self.spec.nbytes, current_raw_stream(device), device, self._what
        )
        self.sent += self.spec.nbytes
        return op, device

    def _what(self) -> str:
        return f"send of {self.spec.name!r} to rank {self.pair.peer} (copy engine)"

    def send(self, tensor: torch.Tensor, timeout: float, stream: Any = None) -> None:
        op, device = self._post(tensor)
        _after(op, device)

    def isend(self, tensor: torch.Tensor, timeout: float) -> CeHandle:
        op, device = self._post(tensor)
        return CeHandle(op, device)


class CeRecv:
    """A static CUDA spec received over the copy-engine path into ``depth`` slots, in turn."""

    stager = None

    def __init__(self, spec: TensorSpec, tag: int, pair: CePair, *, device: Any, depth: int) -> None:
        self.spec = spec
        self.tag = tag
        self.pair = pair
        self.words = words_of(spec)
        self.slots = [Slot(spec, device=device) for _ in range(depth)]
        self.depth = depth
        self.received = 0  # bytes received through this path
        self._next = 0

    def _what(self) -> str:
        return f"recv of {self.spec.name!r} from rank {self.pair.peer} (copy engine)"

    def all_slots(self) -> list[Slot]:
        return list(self.slots)

    def post_all(self) -> None:
        """(nothing to post: a receive meets its message in the pair's shared region)"""

    def close(self) -> None:
        self.slots = []

    def recv(self, out: torch.Tensor | None, timeout: float) -> torch.Tensor:
        slot = self.slots[self._next].tensor
        self._next = (self._next + 1) % len(self.slots)
        device = slot.device.index
        op = self.pair.recv(
            slot, self.tag, self.words, self.spec.nbytes, current_raw_stream(device), device, self._what
        )
        if op.error is not None:
            raise op.error
        _after(op, device)
        self.received += self.spec.nbytes
        if out is None:
            return slot
        if out.shape != slot.shape or out.dtype != slot.dtype:
            raise ShapeMismatchError(
                f"recv of {self.spec.name!r}: out= is {tuple(out.shape)} {out.dtype}, the message "
                f"{tuple(slot.shape)} {slot.dtype}"
            )
        out.copy_(slot)
        return out
