"""Send and receive paths of a :class:`~tensorwire.Link` over the copy-engine path (CUDA specs, one host).

Where both ranks of a link share a host and can take the copy-engine path
(:mod:`tensorwire.transport.ce`), every static CUDA spec goes through these
instead of UCX. The receiver's ``depth`` slots of a spec are exported when the
link is made (their IPC handles written into the pair's shared region, one
entry of the spec's channel each, the first entry's head saying how many) and
mapped once by the sender, so a message needs no rendezvous: message ``m``
goes into slot ``m % depth``.

- ``send``: on the caller's stream, a wait until the receiver freed that slot
  (its ``free`` flag reached ``m - depth``; no wait where the host sees the flag
  there already), one copy-engine copy into it, and a
  write of ``m`` into its ``full`` flag -- queued, the host never waits; the
  caller's later work on that stream runs after the copy (the tensor may be
  modified after ``send`` returns, as the API promises).
- ``recv``: on the caller's stream, a write of ``free = m - depth + 1`` (the
  slot of message ``m - depth + 1`` may be overwritten from now on: the API
  promises a slot only until ``depth - 1`` more receives) and a wait until
  ``full`` reached ``m`` (one driver call for both; no wait where the host sees
  ``full`` there already); returns slot ``m % depth``.

Both sides may be up to ``depth`` messages ahead of each other (a send goes
before its receive is called, as over UCX). The shapes were agreed when the
link was negotiated; ``send`` checks its tensor against the spec on the host
before anything is queued. The pair's watchdog releases both flags when the
peer is lost. Messages of a link are not captured in CUDA graphs (the
numbers are baked into the stream work): capture raises.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from tensorwire.buffers import Slot
from tensorwire.cuda import current_raw_stream
from tensorwire.errors import ShapeMismatchError, TransferTimeout
from tensorwire.spec import TensorSpec
from tensorwire.transport.select import host_id
from tensorwire.transport.ce import CaptureError, CePair, Watchdog, capable, exchange_region
from tensorwire.transport.ce.region import DST_READY, ENTRIES, ENTRY, LANDED, RECEIVED, Block, reached

__all__ = ["CeSend", "CeRecv", "CeHandle", "link_pair"]

log = logging.getLogger(__name__)


def link_pair(
    store: Any,
    key: str,
    *,
    rank: int,
    peer: int,
    peer_host: str,
    timeout: float,
    link_timeout: float,
    watchdog: Watchdog,
) -> CePair | None:
    """The copy-engine pair of a link with static CUDA specs, where both ranks share this host and can take it
    (both sides agree over ``store`` under ``key``); None where either cannot. Added to ``watchdog``."""
    why = capable() if peer_host == host_id() else "rank on another host"
    region = exchange_region(store, key, lower=rank < peer, why_not=why, timeout=timeout)
    if region is None:
        log.info(
            "tensorwire: link rank %d <-> %d: CUDA specs over the data connection (%s)",
            rank,
            peer,
            why or "the peer cannot take the copy-engine path",
        )
        return None
    pair = CePair(
        region,
        rank=rank,
        peer=peer,
        timeout=link_timeout,
        mismatch=lambda mine, theirs, sending: f"signature words differ: {mine} vs {theirs}",
        peer_timeout=max(5.0, min(link_timeout, 30.0)),
    )
    watchdog.add(pair)
    return pair


_FREE, _FULL = DST_READY, LANDED  # the two flag words of a slot channel (in its first entry)


class CeHandle:
    """What :meth:`CeSend.isend` returns: the copy is queued on the caller's stream already."""

    __slots__ = ()

    def watch(self, flow: Any, t0: int) -> None:
        """(tensorwire.observe) The host's part is over when ``isend`` returns: count it complete now."""
        flow.completed(t0)

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        """(nothing to wait for on the host: the caller's stream runs its later work after the copy)"""


class _Channel:
    """One spec of a link on the pair's region: its first entry holds the flags, entries 0..depth-1 the slots."""

    def __init__(self, pair: CePair, tag: int, sending: bool) -> None:
        self.pair = pair
        self.region = pair.region
        self.offset = pair.channel_offset(tag, sending)
        self.flags = self.offset  # the channel's first entry: its flag words and head serve the whole channel
        self.count = 0
        pair.on_failure(self._release)
        pair.on_drain(self._idle)

    def _idle(self) -> bool:
        """Every message so far is in the receiver's slot (the sender's copies ran; the receiver's came)."""
        return reached(self.region.flag(self.flags, _FULL), self.count)

    def _release(self) -> None:  # the peer is lost: let both streams go on
        self.region.release(self.flags, _FREE, self.count + ENTRIES)
        self.region.release(self.flags, _FULL, self.count + ENTRIES)

    def prepare(self, device: int, stream: int, what: Callable[[], str]) -> None:
        """Before a message on ``stream``: the device set up and current, the pair not failed, no capture.
        (``what()``: the message's description, made only for an error: ~0.2 us a message on the 2-core VM.)"""
        self.pair.ready(device)
        if self.pair.error is not None:
            raise self.pair.error
        if self.pair.driver.capturing(stream):
            raise CaptureError(f"{what()}: Link messages are not captured in CUDA graphs; use backend 'tensorwire'")


class CeSend:
    """A static CUDA spec sent over the copy-engine path (see the module docstring)."""

    slot = None
    stager = None

    def __init__(self, spec: TensorSpec, tag: int, pair: CePair) -> None:
        self.spec = spec
        self.depth = 0  # the receiver's slots (it publishes how many: read on the first send)
        self.sent = 0  # bytes sent through this path
        self._chan = _Channel(pair, tag, True)
        self._shape = torch.Size(spec.shape)
        self._dtype = spec.torch_dtype
        self._slots: list[int] = []  # the receiver's slots, mapped here (on the first send)

    def _map(self, device: int, timeout: float) -> None:
        """Map the receiver's slots (published when it made its side of the link)."""
        r = self._chan.region
        deadline = time.monotonic() + timeout
        while True:
            seq, state, _err = r.head(self._chan.flags)
            if state & RECEIVED and seq > 0:
                self.depth = seq
                break
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{self._what()}: the receiver did not publish its slots within {timeout:.3g} s")
            time.sleep(0.0005)
        exports = self._chan.pair.exports
        for i in range(self.depth):
            block = r.read_block(self._chan.offset + i * ENTRY, False)
            # (an empty spec's slots have no memory to map: nothing is ever copied into them)
            self._slots.append(exports.open(device, block.handle) + block.offset if self.spec.nbytes else 0)

    def _what(self) -> str:
        return f"send of {self.spec.name!r} to rank {self._chan.pair.peer} (copy engine)"

    def send(self, tensor: torch.Tensor, timeout: float, stream: Any = None) -> None:
        if tensor.shape != self._shape or tensor.dtype != self._dtype or not tensor.is_cuda:
            raise ShapeMismatchError(
                f"send of {self.spec.name!r}: {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} does not match "
                f"the negotiated spec {tuple(self._shape)} {self._dtype} on cuda (nothing sent)"
            )
        device = _index(tensor)
        raw = current_raw_stream(device)
        chan = self._chan
        chan.prepare(device, raw, self._what)
        if not self._slots:
            self._map(device, timeout)
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()  # (on the caller's stream, in order before the copy)
        m = chan.count = chan.count + 1
        d = chan.pair.driver
        flags = chan.region.device_addr + chan.flags
        if not reached(chan.region.flag(chan.flags, _FREE), m - self.depth):
            d.wait(raw, flags + _FREE, m - self.depth)  # the slot of message m - depth was freed
        # (else the receiver's stream is past that write already, as the host sees: a GPU wait would be met at
        # once, and costs a driver call)
        nbytes = self.spec.nbytes
        if nbytes:
            d.copy(raw, self._slots[(m - 1) % self.depth], tensor.data_ptr(), nbytes)
        d.write(raw, flags + _FULL, m)
        self.sent += nbytes

    def isend(self, tensor: torch.Tensor, timeout: float) -> CeHandle:
        self.send(tensor, timeout)
        return CeHandle()


class CeRecv:
    """A static CUDA spec received over the copy-engine path into ``depth`` slots, in turn."""

    stager = None

    def __init__(self, spec: TensorSpec, tag: int, pair: CePair, *, device: Any, depth: int) -> None:
        self.spec = spec
        self.depth = depth
        self.received = 0  # bytes received through this path
        self.slots = [Slot(spec, device=device) for _ in range(depth)]
        self._chan = _Channel(pair, tag, False)
        # publish the slots: one block per slot in entries 1..depth, then the channel's head says how many
        r = self._chan.region
        for i, slot in enumerate(self.slots):
            handle, offset = b"\0" * 64, 0
            if spec.nbytes:
                exp = pair.exports.export(slot.tensor.data_ptr())
                if exp is None:
                    raise ShapeMismatchError(f"recv of {spec.name!r}: its slot cannot be exported with CUDA IPC")
                handle, offset = exp
            r.write_block(self._chan.offset + i * ENTRY, False, Block((0,) * 8, spec.nbytes, offset, handle))
        r.set_head(self._chan.flags, depth, RECEIVED)

    def _what(self) -> str:
        return f"recv of {self.spec.name!r} from rank {self._chan.pair.peer} (copy engine)"

    def all_slots(self) -> list[Slot]:
        return list(self.slots)

    def post_all(self) -> None:
        """(nothing to post: the sender writes into the slots directly)"""

    def close(self) -> None:
        self.slots = []

    def recv(self, out: torch.Tensor | None, timeout: float) -> torch.Tensor:
        chan = self._chan
        m = chan.count + 1
        slot = self.slots[(m - 1) % self.depth].tensor
        device = _index(slot)
        raw = current_raw_stream(device)
        chan.prepare(device, raw, self._what)
        chan.count = m
        d = chan.pair.driver
        flags = chan.region.device_addr + chan.flags
        # free the slot of message m - depth + 1 (work queued before reads it no more); then wait for message m,
        # in the same driver call -- unless the host sees it in place already (the copy ran: nothing to wait for)
        if reached(chan.region.flag(chan.flags, _FULL), m):
            d.write(raw, flags + _FREE, m - self.depth + 1)
        else:
            d.write_wait(raw, flags + _FREE, m - self.depth + 1, flags + _FULL, m)
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


def _index(tensor: torch.Tensor) -> int:
    """The index of ``tensor``'s device (a CUDA tensor always has one; the CPU tests' simulated memory: 0)."""
    index = tensor.device.index
    return 0 if index is None else index
