"""One pair of processes on one host: messages of CUDA tensors as copy-engine copies, rendezvous in shared memory.

A message of a channel (one tag, one direction) meets in an entry of the pair's
:class:`~.region.Region`. Each side *arrives* at the entry when its
``isend``/``irecv`` is called, under the region's process-shared lock, writing
where its bytes are (an IPC handle of the allocation and an offset) and its
signature. Whoever arrives **first** only queues, on its caller's stream, the
write of its "ready" flag (the sender: ``src_ready``, its bytes are final; the
receiver: ``dst_ready``, its tensor may be written). Whoever arrives
**second** knows both addresses, so it queues the copy, on an internal stream
ordered after its caller's stream: a wait for the first side's ready flag, one
``cuMemcpyAsync`` between the two allocations (a push by the sender, a pull by
the receiver; the copy engine, no SM), and the write of ``landed``. So bytes go
straight from the sender's tensor into the receiver's, with no slot and no
host thread waiting, whichever side comes first. ``wait()`` makes the caller's
stream wait for ``landed`` (or ``recv_done`` after a staged receive).

Every GPU wait here is for a flag that the peer already queued (it arrived
first), so no stream ever waits on work that this process has yet to queue.

Memory that legacy IPC cannot export (``cuMem*``/expandable segments) and
non-contiguous tensors go through a staging buffer of plain ``cudaMalloc``
memory: a send copies into it on the caller's stream first; a receive copies
out of it on its internal stream after ``landed`` and then writes ``recv_done``.

The second side checks both signatures before queuing anything; a mismatch
fails the message on both sides (the first side's waiting streams are
released by host writes of their flags) and names both. A watchdog
(:meth:`CePair.check`) releases every waiting stream and fails every pending
operation when the peer dies, closes, or an operation outlives its timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ...cuda import alloc_cuda
from ...errors import ProtocolError, TensorWireError
from ...settings import setting
from .driver import CeDriver
from .exports import Exports
from .watched import PRUNE_AT
from .graphs import CaptureError
from .waits import HostWaits
from .region import (
    DST_READY,
    ERR_MISMATCH,
    FAILED,
    LANDED,
    RECEIVED,
    RECV_DONE,
    SENT,
    SRC_READY,
    STAGED,
    Region,
    pack_block,
    reached,
)

__all__ = ["CePair", "CeOp"]

_NO_HANDLE = bytes(64)
# A sender of a message larger than ``inline_max`` that comes before its receiver waits on the host for the
# receiver to come (``TENSORWIRE_CE_PUSH_WAIT_US``), so that the sender's GPU pushes the bytes instead of the
# receiver's GPU pulling them: a GPU moves ~380 GB/s with its copy engines, but between processes about half that
# each way when it makes the copies of both directions (bench/ce_engines_gpu.py), so each message is best copied by
# the GPU it leaves from. A receiver that has not come by then gets the bytes by a pull.
# Up to TENSORWIRE_CE_INLINE_MAX bytes (4 MiB), a copy whose peer is ready already goes on the caller's stream (a
# copy of 4 MiB over NVLink takes ~12 us; a larger one would hold back the caller's next kernels, so it goes on an
# internal stream).
#: between two processes of one GPU, a copy of more than this many bytes whose peer's stream has not reached its
#: call yet waits for the peer's flag on the host (bounded) rather than on the GPU: a stream of one context waiting
#: on a flag of the other's can hold the GPU for a time slice of its scheduler. Measured in turns on one H200 (two
#: processes, ping-pong): with GPU-side waits up to 4 MiB, 18 of 56 turns of 500 messages at 1-4 MiB ran at ~3 ms a
#: message instead of 30-55 us; with host waits from 512 KiB none did, and the other turns were as fast
#: (bench/results/ce-host-ab-one-gpu_h200_2026-11-30.log). Below it the GPU-side wait stays: a host wait there tied a
#: 64 KiB ping-pong to the GPU's switches between the two contexts (172 us one-way against 56).
ONE_GPU_HOST_WAIT_MIN = 512 << 10


class CeOp:
    """One message of a pair, as its side sees it: complete once ``landed`` (``recv_done``) reached its number."""

    __slots__ = (
        "pair",
        "entry",
        "seq",
        "sending",
        "flag",
        "keep",
        "error",
        "deadline",
        "on_done",
        "_done",
        "what",
        "stream",
        "graph",
        "kernels",
    )

    def __init__(
        self, pair: "CePair", entry: int, seq: int, sending: bool, flag: int, keep: Any, what: Callable[[], str]
    ) -> None:
        self.pair = pair
        self.entry = entry
        self.seq = seq
        self.sending = sending
        self.flag = flag
        self.keep = keep  # what must live until the copy is done (staging buffers, the peer's view)
        self.error: BaseException | None = None
        self.deadline = pair.clock + pair.timeout  # (the watchdog's clock: no system call per message)
        #: the caller's stream when the copy and its flag went on it (a wait on that stream needs no flag wait)
        self.stream = -1
        #: captured in a CUDA graph: 0 no, FIRST / SECOND: which side of the message this one was
        self.graph = 0
        #: captured: its flags written and waited on by kernels (not stream memory operations; see graphs.py)
        self.kernels = False
        self.on_done: Callable[[BaseException | None], None] | None = None
        self._done = False
        self.what = what

    @property
    def flag_device_addr(self) -> int:
        return self.pair.region.device_addr + self.entry + self.flag

    def poll(self) -> bool:
        """Whether the message is complete (or failed): a look at host memory, no CUDA call."""
        if self._done:
            return True
        if self.graph:
            return False  # (a captured message completes on each replay: the host never sees it)
        region = self.pair.region
        # A failure releases the flag too, and an entry is reused only once its flag passed this message's
        # number: while the flag has not reached it, the message is pending -- one read decides the common case.
        if not reached(region.flag(self.entry, self.flag), self.seq):
            return False
        seq, state, _err = region.head(self.entry)
        if seq == self.seq & 0xFFFFFFFF and state & FAILED:
            self._complete(self.pair.failure(self.entry, self.sending, self.what))
        else:
            self._complete(None)
        return True

    def fail(self, exc: BaseException) -> None:
        self._complete(exc)

    def _complete(self, exc: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        self.error = exc
        keep, self.keep = self.keep, None
        if exc is None and keep is not None and keep[1] is not None:
            self.pair._give_stage(keep[1])  # the copy out of (or into) it is over: reuse it
        cb = self.on_done
        # no reference back to the caller's Work from here on: the two are freed as soon as nobody holds them,
        # without waiting for Python's cycle collector
        self.on_done, self.what = None, _over
        if cb is not None:
            cb(exc)


def _over() -> str:
    return "a completed message"


class Channel:
    """One tag in one direction of a pair: where its entries are and how many messages it has had."""

    __slots__ = ("offset", "seq", "graph", "lock", "block_key", "block")

    def __init__(self, offset: int) -> None:
        self.offset = offset
        #: this side's last block, packed (and what it was packed from)
        self.block_key: tuple[Any, ...] = ()
        self.block = b""
        self.seq = 0  # eager messages so far
        self.graph = 0  # captured messages so far
        self.lock = threading.Lock()


class CePair(HostWaits):
    """The copy-engine path between this process and one peer process on the same host.

    Args:
        region: the pair's shared region (made by side 0, attached by side 1).
        rank, peer: the two ranks (for messages).
        timeout: how long a message may wait for the other side (the group's timeout).
        driver: the CUDA calls (default :class:`CeDriver`; the CPU tests pass a simulator).
        mismatch: ``(my words, their words, sending) -> error text or None`` -- whether two signatures fit.
        streams: ``device -> (send stream, recv stream, event, event)`` factory (default: new driver streams).
        stage: ``(nbytes, device) -> tensor`` of exportable memory for staging (default: plain cudaMalloc).
    """

    def __init__(
        self,
        region: Region,
        *,
        rank: int,
        peer: int,
        timeout: float,
        mismatch: Callable[[tuple[int, ...], tuple[int, ...], bool], str | None],
        driver: Any = None,
        exports: Exports | None = None,
        stage: Callable[[int, Any], Any] | None = None,
        peer_timeout: float = 10.0,
    ) -> None:
        self.region = region
        self.rank = rank
        self.peer = peer
        self.timeout = timeout
        self.peer_timeout = peer_timeout
        self.driver = driver if driver is not None else CeDriver.get()
        self._own_exports = exports is None
        self.exports = exports if exports is not None else Exports(self.driver)
        self._mismatch = mismatch
        self._stage = stage
        self._channels: dict[int, Channel] = {}
        self._streams: dict[int, tuple[int, int, int, int]] = {}
        self._pending: list[CeOp] = []
        self._pending_lock = threading.Lock()
        self._prune_at = PRUNE_AT  # (the caller completes and drops what completed at this many: Watched._prune)
        self._pruning = False
        self._registered: set[int] = set()
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._last_beat = (-1, time.monotonic())
        self._staging: dict[tuple[int, int], list[Any]] = {}
        self._graph_entries: list[int] = []  # entries of captured messages (released if the pair fails)
        self._releasers: list[Callable[[], None]] = []
        self._drainers: list[Callable[[], bool]] = []
        self._closed = False
        self._side = region.side
        #: a copy whose peer's stream is already past its call goes on the caller's stream up to this size
        self.inline_max = setting("ce_inline_max")
        self.one_gpu_wait_min = ONE_GPU_HOST_WAIT_MIN  # (one GPU: a copy above it waits for its peer on the host)
        #: diagnostic (bench/profile_ce_host.py --ab-change inline-wait): a second side whose peer's stream has not
        #: reached its call yet also copies on the caller's stream (up to inline_max), after a wait for the peer's
        #: flag there -- no internal stream, but the caller's next kernels wait for the peer. Not for use: it breaks
        #: the rule above (a stream waits only on what the peer queued before), so two ranks that match messages of
        #: two tags in crossed orders deadlock on their GPUs (bench/results/ce-inline-wait-ab_h200x2_2026-11-30.log)
        self.wait_inline = False
        #: diagnostic (--ab-change inline-host-wait): a second side whose peer's stream has not reached its call yet
        #: waits on the host up to this long for it, so that a copy up to inline_max goes on the caller's stream
        self.inline_host_wait_s = 0.0
        #: a large send waits up to this long for its receiver (see the comment at the top)
        self.push_wait_s = setting("ce_push_wait_us") * 1e-6
        #: device -> whether the peer's memory is on that very GPU (:meth:`peer_gpu`, else the first export opened):
        #: one GPU's processes share its copy engines, so which side copies makes no difference and a large send
        #: does not wait for its receiver (a GPU-side wait between their contexts can cost a scheduler time slice)
        self._one_gpu: dict[int, bool] = {}
        #: messages by this side's part: [came first, came second and copied on the caller's stream, came second
        #: and copied on an internal stream, large sends whose receiver came while they waited, large sends whose
        #: receiver did not, large sends that stopped waiting because the peer waited in a send too] (where the host
        #: time goes: bench/profile_ce_host.py prints them)
        self.counts = [0, 0, 0, 0, 0, 0]
        #: how captured messages write and wait on their flags (TENSORWIRE_CE_GRAPH_FLAGS; graphs.py)
        self.graph_flags = setting("ce_graph_flags")
        self._flags_said: set[int] = set()  # (devices whose captured flags' calls were said in the log)
        #: what the set-up probe found (tensorwire.transport.ce.probe; set by whoever ran it)
        self.probe = "not run"
        #: updated by every look of the watchdog (deadlines of new messages are counted from it)
        self.clock = time.monotonic()

    # -- set-up per device ----------------------------------------------------------------------------------
    def _device(self, device: int) -> tuple[int, int, int, int]:
        st = self._streams.get(device)
        if st is None:
            with self._lock:
                st = self._streams.get(device)
                if st is None:
                    d = self.driver
                    d.context(device)
                    if not self._registered:
                        self.region.device_addr = d.register_host(self.region.addr, len(self.region.buf))
                        self._registered.add(device)
                    st = self._streams[device] = (d.new_stream(), d.new_stream(), d.new_event(), d.new_event())
                    if self.graph_flags == "kernel":
                        d.flag_kernels(device)  # (loaded before any capture: a module load may not run in one)
        return st

    # -- the two calls ---------------------------------------------------------------------------------------
    def send(
        self,
        tensor: Any,
        tag: int,
        words: tuple[int, ...],
        nbytes: int,
        stream: int,
        device: int,
        what: Callable[[], str],
    ) -> CeOp:
        return self._message(tensor, tag, words, nbytes, stream, device, what, True)

    def recv(
        self,
        tensor: Any,
        tag: int,
        words: tuple[int, ...],
        nbytes: int,
        stream: int,
        device: int,
        what: Callable[[], str],
    ) -> CeOp:
        return self._message(tensor, tag, words, nbytes, stream, device, what, False)

    def _message(
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
        if self.error is not None:
            raise self.error
        if len(self._pending) >= self._prune_at:
            self._prune()
        d = self.driver
        d.context(device)
        st = self._streams.get(device)
        if st is None:
            if d.capturing(stream):
                raise CaptureError(
                    f"{what()}: the first message of this pair of ranks on cuda:{device} came during CUDA graph "
                    "capture; run the step once before capturing it (a warm-up step, as for NCCL): the pair's "
                    "memory is registered and its streams are made then"
                )
            st = self._device(device)
        if d.capturing(stream):
            return self._captured(tensor, tag, words, nbytes, stream, device, what, sending)
        chan = self._channels.get(2 * tag + (self._side if sending else 1 - self._side)) or self._channel(tag, sending)
        with chan.lock:
            chan.seq += 1
            seq = chan.seq
            r = self.region
            entry = r.entry(chan.offset, seq)
            # Has the peer come to this message already? Its arrival is never taken back, so this side will be
            # the second and make the copy: between its own memory and the peer's export -- its own needs no
            # export then (one driver call fewer), and a contiguous tensor no staging even where legacy IPC cannot
            # export it. (Not come yet: this side exports, and may still turn out second; the export goes unused.)
            eseq, state, _err = r.head(entry)
            second = eseq == seq & 0xFFFFFFFF and state & (RECEIVED if sending else SENT) != 0
            # where this side's bytes are: the tensor itself, or a staging buffer
            staged = None
            addr = 0
            handle, offset = _NO_HANDLE, 0
            if nbytes:
                addr = tensor.data_ptr()
                contiguous = tensor.is_contiguous()
                exp = self.exports.export(addr) if contiguous and not second else None
                if not contiguous or (exp is None and not second):
                    staged = self._take_stage(nbytes, tensor.device)
                    if sending:  # the bytes go into the staging buffer on the caller's stream, before the ready flag
                        d.copy_tensor(stream, _as(staged, tensor), tensor)
                    addr = staged.data_ptr()
                    if not second:
                        exp = self.exports.export(addr)
                        if exp is None:
                            raise TensorWireError(
                                "the staging buffer (plain cudaMalloc) cannot be exported with CUDA IPC"
                            )
                if exp is not None:
                    handle, offset = exp
            unstage = staged is not None and not sending
            if sending and nbytes > self.inline_max and self.push_wait_s > 0 and not self._one_gpu.get(device):
                self._await_receiver(chan, seq)
            key = (words, nbytes, offset, handle)
            if chan.block_key != key:  # (a channel's blocks repeat: packed once)
                chan.block_key, chan.block = key, pack_block(words, nbytes, offset, handle)
            theirs = self._arrive(chan, entry, seq, sending, words, chan.block, unstage, what)
            op = CeOp(self, entry, seq, sending, RECV_DONE if unstage else LANDED, (tensor, staged), what)
            dev = r.device_addr + entry
            if theirs is None:  # first: only say that this side's stream reached the call
                if handle is _NO_HANDLE and nbytes:
                    raise TensorWireError(f"{what()}: came first to a message it saw the peer take (internal)")
                self.counts[0] += 1
                d.write(stream, dev + (SRC_READY if sending else DST_READY), seq)
                if unstage:
                    d.order(st[1], stream, st[3])
                    d.wait(st[1], dev + LANDED, seq)
                    d.copy_tensor(st[1], tensor, _as(staged, tensor))
                    d.write(st[1], dev + RECV_DONE, seq)
                return self._pend(op)
            # second: the copy is this side's to make
            ready = DST_READY if sending else SRC_READY
            # the peer's stream is past its call already (its flag is in host memory): nothing to wait for on the GPU
            peer_past = reached(r.flag(entry, ready), seq)
            if not peer_past and nbytes > self.one_gpu_wait_min and self.push_wait_s > 0 and self._one_gpu.get(device):
                # one GPU, a large copy: a stream of this process waiting for a flag of the peer's behind a copy this
                # long held the GPU from the peer's context for a time slice of its scheduler (~2-3 ms a message);
                # wait (bounded) on the host for the flag instead (ONE_GPU_HOST_WAIT_MIN says where from, and why
                # not for small copies).
                peer_past = self._await_flag(entry, ready, seq, self.push_wait_s)
            elif not peer_past and self.inline_host_wait_s > 0 and nbytes <= self.inline_max:
                peer_past = self._await_flag(entry, ready, seq, self.inline_host_wait_s)
            if (peer_past or self.wait_inline) and (nbytes <= self.inline_max or self._one_gpu.get(device)):
                # so a small copy goes on the caller's stream itself -- no event, no internal stream (any copy between
                # two processes of one GPU: the GPU's own engines and SMs are shared by both anyway, and a second
                # stream's event and flag wait cost more there -- bench/results/ce-gpu_h200_*.md)
                inner = stream
                op.stream = stream
                if not peer_past:
                    d.wait(stream, dev + ready, seq)
                self.counts[1] += 1
            else:
                inner, event = (st[0], st[2]) if sending else (st[1], st[3])
                d.order(inner, stream, event)
                if not peer_past:
                    d.wait(inner, dev + ready, seq)
                self.counts[2] += 1
            if nbytes:
                peer_addr = self.exports.open(device, theirs[1]) + theirs[0]
                if device not in self._one_gpu:
                    self._learn_gpu(device, peer_addr)
                if sending:
                    d.copy(inner, peer_addr, addr, nbytes)
                else:
                    d.copy(inner, addr, peer_addr, nbytes)
            d.write(inner, dev + LANDED, seq)
            if unstage:
                d.copy_tensor(inner, tensor, _as(staged, tensor))
                d.write(inner, dev + RECV_DONE, seq)
        return self._pend(op)

    def order_after(self, op: CeOp, stream: int, device: int) -> None:
        """Make ``stream`` (of ``device``) wait until ``op``'s bytes are in place -- queued, the host never waits.

        Eager: a flag wait (nothing where the copy went on that stream, or the host sees it done). Captured: the
        first side records the wait for ``landed`` and its reset; the second side, on another stream than the
        copy's, an event dependency. A captured message counts as complete once this is recorded.
        """
        d = self.driver
        if op.graph:
            self._order_captured(op, stream, device)
            return
        if stream != op.stream and not op.poll():
            d.context(device)
            d.wait(stream, op.flag_device_addr, op.seq)

    # -- for callers that lay their own protocol on a channel (Link slots: tensorwire.p2p.ce_paths) -------------
    def channel_offset(self, tag: int, sending: bool) -> int:
        """The byte offset in the region of one direction of ``tag``."""
        return self._channel(tag, sending).offset

    def ready(self, device: int) -> None:
        """Set up ``device`` (register the region, make the streams) and make its context current."""
        self.driver.context(device)
        if device not in self._streams:
            self._device(device)

    def peer_gpu(self, device: int, same: bool) -> None:
        """Record whether the peer's memory is on ``device`` itself (known at set-up: before any message)."""
        self._one_gpu[device] = same

    def on_failure(self, release: Callable[[], None]) -> None:
        """Call ``release`` when the pair fails (to let streams waiting on flags of the caller's go on)."""
        self._releasers.append(release)

    def _new_op(self, entry: int, seq: int, sending: bool, flag: int, keep: Any, what: Callable[[], str]) -> CeOp:
        return CeOp(self, entry, seq, sending, flag, keep, what)

    def _pend(self, op: CeOp) -> CeOp:
        with self._pending_lock:
            self._pending.append(op)
        return op

    def _arrive(
        self,
        chan: Channel,
        entry: int,
        seq: int,
        sending: bool,
        words: tuple[int, ...],
        packed: bytes,
        staged: bool,
        what: Callable[[], str],
    ) -> tuple[int, bytes] | None:
        """Take this side's place in the message's entry; returns the peer's ``(offset, handle)`` if it came first.

        ``packed``: this side's block (:func:`~.region.pack_block`).
        """
        r = self.region
        me, them = (SENT, RECEIVED) if sending else (RECEIVED, SENT)
        deadline = 0.0
        s32 = seq & 0xFFFFFFFF
        while True:
            with r.mutex:
                eseq, state, _err = r.head(entry)
                if eseq == s32 and state & them and not state & me:
                    r.write_packed(entry, sending, packed)
                    err = None
                    if not r.same_signature(entry, not sending, packed):
                        err = self._mismatch(words, r.read_block(entry, not sending).words, sending)
                    if err is not None:
                        r.set_head(entry, seq, state | me | FAILED, ERR_MISMATCH)
                        self._release(entry, seq)
                        raise ProtocolError(err)
                    r.set_head(entry, seq, state | me | (STAGED if staged else 0))
                    return r.address(entry, not sending)
                if eseq == s32:
                    raise ProtocolError(f"{what()}: message {seq} was already taken on this side (state {state:#x})")
                if eseq == 0 or self._done(entry, eseq, state):
                    r.write_packed(entry, sending, packed)
                    r.set_head(entry, seq, me | (STAGED if staged else 0))
                    return None
            if self.error is not None:
                raise self.error
            if not deadline:
                deadline = time.monotonic() + self.timeout
            r.wait_free(entry, deadline)  # the peer is ENTRIES messages behind on this channel

    def _learn_gpu(self, device: int, peer_addr: int) -> None:
        try:
            self._one_gpu[device] = self.driver.device_of(peer_addr) == device
        except TensorWireError:  # (unknown: keep the behaviour for two GPUs)
            self._one_gpu[device] = False

    def _done(self, entry: int, eseq: int, state: int) -> bool:
        """Whether the entry's message ``eseq`` is over on both sides (its entry may be reused)."""
        r = self.region
        if state & FAILED:
            return True
        if state & (SENT | RECEIVED) != SENT | RECEIVED:
            return False
        if not reached(r.flag(entry, LANDED), eseq):
            return False
        return not state & STAGED or reached(r.flag(entry, RECV_DONE), eseq)

    def _channel(self, tag: int, sending: bool) -> Channel:
        side = self.region.side if sending else 1 - self.region.side
        key = 2 * tag + side
        chan = self._channels.get(key)
        if chan is None:
            with self._lock:
                chan = self._channels.get(key)
                if chan is None:
                    chan = self._channels[key] = Channel(self.region.channel(key))
        return chan

    # -- staging -----------------------------------------------------------------------------------------
    def _take_stage(self, nbytes: int, device: Any) -> Any:
        free = self._staging.get((device.index, nbytes))
        if free:
            return free.pop()
        if self._stage is None:
            return alloc_cuda(nbytes, device)
        return self._stage(nbytes, device)

    def _give_stage(self, buf: Any) -> None:
        self._staging.setdefault((buf.device.index, buf.numel()), []).append(buf)


def _as(staged: Any, tensor: Any) -> Any:
    """The staging buffer (bytes) seen with the tensor's dtype and shape (contiguous)."""
    return staged[: tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
