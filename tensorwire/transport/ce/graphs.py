"""Messages of a pair captured in CUDA graphs (:class:`Capture`, a part of :class:`~.pair.CePair`).

A message captured in a graph meets its peer in an entry of its own (one per captured message of a channel,
for good), at capture time, on the host. The flags of such an entry hold 0 or 1 and the graph resets each one
after waiting on it, so every replay of both graphs moves the bytes again and nothing in a graph depends on a
number baked in at capture:

- the first side records the write of its ready flag (1);
- the second side records a wait for that flag, its reset (0), the copy on the capturing stream and the write
  of ``landed`` (1);
- the first side's ``wait()`` records a wait for ``landed`` and its reset; the second side's, on another
  stream than the copy's, an event dependency.

The writes and waits are stream memory operations, or one-thread kernels (``TENSORWIRE_CE_GRAPH_FLAGS``,
:meth:`Capture._flag_kernels`): a memory-operation node costs the host ~2 us at every replay of the graph, a
kernel node ~0.01 us, so with kernels a replay's host time grows far less with its messages -- but the step
itself was slower with them (a kernel polls the flag in host memory), so memory operations are the default.

Both ranks must capture the same sequence of messages per tag and direction and replay their graphs alike;
what breaks that and can be seen at capture (another signature, an entry already taken) raises there.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from ...errors import ProtocolError, TensorWireError
from .region import DST_READY, LANDED, RECEIVED, SENT, SRC_READY, Block
from .watched import Watched

if TYPE_CHECKING:  # pragma: no cover
    from .pair import CeOp, Channel

__all__ = ["Capture", "CaptureError", "FIRST", "SECOND"]

log = logging.getLogger(__name__)

FIRST, SECOND = 1, 2  # CeOp.graph: which side of a captured message this one was
_NO_HANDLE = bytes(64)


class CaptureError(TensorWireError):
    """A message cannot be captured into a CUDA graph as it is (the message says what to do: warm up first...)."""


class Capture(Watched):
    """The capture half of :class:`~.pair.CePair` (see the module docstring)."""

    _side: int
    _channels: "dict[int, Channel]"
    _one_gpu: dict[int, bool]
    _flags_said: set[int]
    graph_flags: str
    rank: int

    def _channel(self, tag: int, sending: bool) -> "Channel":
        raise NotImplementedError

    def _device(self, device: int) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def _new_op(self, entry: int, seq: int, sending: bool, flag: int, keep: Any, what: Callable[[], str]) -> "CeOp":
        raise NotImplementedError

    def _captured(
        self,
        tensor: Any,
        tag: int,
        words: tuple[int, ...],
        nbytes: int,
        stream: int,
        device: int,
        what: Callable[[], str],
        sending: bool,
    ) -> CeOp:
        """A message captured into a CUDA graph: its own graph entry, 0/1 flags that the graph resets.

        The two sides meet in the entry at capture time, as eager messages do at call time. What is recorded:
        the first side writes its ready flag (1); the second waits for it, resets it (0), copies on the
        capturing stream and writes ``landed`` (1); the first side's ``wait()`` records a wait for ``landed``
        and its reset. Every replay of both graphs moves the bytes again; nothing in the graph depends on a
        number baked in at capture.
        """
        d = self.driver
        addr, handle, offset = 0, _NO_HANDLE, 0
        if nbytes:
            exp = self.exports.export(tensor.data_ptr()) if tensor.is_contiguous() else None
            if exp is None:
                raise CaptureError(
                    f"{what()}: a tensor captured in a CUDA graph must be contiguous memory that CUDA IPC can export "
                    "(no staging buffer can be allocated during capture)"
                )
            addr = tensor.data_ptr()
            handle, offset = exp
        chan = self._channels.get(2 * tag + (self._side if sending else 1 - self._side)) or self._channel(tag, sending)
        r = self.region
        me, them = (SENT, RECEIVED) if sending else (RECEIVED, SENT)
        with chan.lock:
            chan.graph += 1
            k = chan.graph
            entry = r.graph_entry(chan.offset, k)
            mine = Block(words, nbytes, offset, handle)
            with r.mutex:
                eseq, state, _err = r.head(entry)
                if eseq == k and state & them and not state & me:
                    theirs: Block | None = r.read_block(entry, not sending)
                    assert theirs is not None
                    if theirs.words != mine.words or theirs.nbytes != mine.nbytes:
                        err = self._mismatch(mine.words, theirs.words, sending)
                        if err is not None:
                            raise ProtocolError(f"{err} (captured message {k} of this tag)")
                    r.write_block(entry, sending, mine)
                    r.set_head(entry, k, state | me)
                elif eseq == 0:
                    theirs = None
                    r.write_block(entry, sending, mine)
                    r.set_head(entry, k, me)
                else:
                    raise ProtocolError(
                        f"{what()}: captured message {k} of this tag was already taken (state {state:#x}): the two "
                        "ranks captured different sequences of messages"
                    )
            self._graph_entries.append(entry)
            op = self._new_op(entry, k, sending, LANDED, (tensor, None), what)
            op.kernels = self._flag_kernels(device)
            write, wait_reset = self._flag_calls(device, op.kernels)
            dev = r.device_addr + entry
            if theirs is None:
                op.graph = FIRST
                write(stream, dev + (SRC_READY if sending else DST_READY), 1)
                return op
            op.graph = SECOND
            op.stream = stream
            wait_reset(stream, dev + (DST_READY if sending else SRC_READY), 1)
            if nbytes:
                try:
                    peer_addr = self.exports.open(device, theirs.handle) + theirs.offset
                except TensorWireError as exc:
                    raise CaptureError(f"{what()}: mapping the peer's memory during capture failed: {exc}") from exc
                if sending:
                    d.copy(stream, peer_addr, addr, nbytes)
                else:
                    d.copy(stream, addr, peer_addr, nbytes)
            write(stream, dev + LANDED, 1)
            return op

    def _flag_kernels(self, device: int) -> bool:
        """Whether this message's flags go by kernels (``TENSORWIRE_CE_GRAPH_FLAGS``): a stream memory operation
        captured in a graph costs the host ~2 us at every replay, a kernel ~0.01 us
        (``bench/results/graph-launch-probe_h200_2026-11-29.md``); but the captured step was slower with kernels:
        1-10 % on two H200s, 2-8x between two processes of one GPU, where a polling kernel holds the GPU's time
        slice its peer needs (``bench/results/graph-kernels_h200x2_2026-11-29.md``,
        ``graph-gpu_h200_2026-11-29-2.md``). So only ``kernel`` asks for them; ``auto`` is memory operations."""
        want = self.graph_flags
        one_gpu = self._one_gpu.get(device)
        kernels = want == "kernel" and bool(self.driver.flag_kernels(device))
        if device not in self._flags_said:  # (said once per device: which calls every replay will make)
            self._flags_said.add(device)
            log.info(
                "tensorwire: rank %d <-> rank %d on cuda:%s: captured messages wait on and write their flags by %s "
                "(TENSORWIRE_CE_GRAPH_FLAGS=%s; the peer's memory on %s)",
                self.rank,
                self.peer,
                device,
                "one-thread kernels" if kernels else "stream memory operations",
                want,
                {True: "this GPU", False: "another GPU", None: "a GPU not known yet"}[one_gpu],
            )
        return kernels

    def _flag_calls(self, device: int, kernels: bool) -> tuple[Callable[[int, int, int], None], ...]:
        """``(write, wait_reset)`` of a captured message's flags, each ``(stream, address, value)``: by kernels on
        ``device``, or by stream memory operations."""
        d = self.driver
        if not kernels:
            return d.write, d.wait_reset
        return (
            lambda stream, addr, value: d.kernel_write(device, stream, addr, value),
            lambda stream, addr, value: d.kernel_wait_reset(device, stream, addr, value),
        )

    def _order_captured(self, op: "CeOp", stream: int, device: int) -> None:
        d = self.driver
        d.context(device)
        if op.graph == FIRST:
            self._flag_calls(device, op.kernels)[1](stream, op.flag_device_addr, 1)
        elif stream != op.stream:
            d.order(stream, op.stream, self._device(device)[3])
        op._complete(None)
