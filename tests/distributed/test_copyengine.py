"""The copy-engine path's protocol (tensorwire.transport.ce) against a stream simulator, on CPU.

Two CePair objects in one process, each with its own mapping of one region, play the two ranks of a pair;
their streams are the simulator's (tests/support/ce_sim.py). Every test checks the bytes that arrived, and
that no simulated stream was left waiting on a flag.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from tensorwire.errors import PeerLostError, ProtocolError, TransferTimeout
from tensorwire.transport.ce import CePair, DriverError, Region
from tensorwire.transport.ce.pair import CeOp
from tensorwire.transport.ce.watched import PRUNE_AT
from tensorwire.transport.ce.region import ENTRIES

from ce_sim import SimDriver

pytestmark = pytest.mark.timeout(60)


def _words(t: torch.Tensor) -> tuple[int, ...]:
    return (len(t.shape) << 16 | t.element_size(), *t.shape, *([0] * (7 - len(t.shape))))


def _mismatch(mine: tuple[int, ...], theirs: tuple[int, ...], sending: bool) -> str | None:
    return None if mine == theirs else f"signatures differ: {mine} vs {theirs}"


class Pair:
    """Both sides of one pair over the simulator: side a (rank 0) and side b (rank 1)."""

    def __init__(self, tmp: str, *, timeout: float = 10.0) -> None:
        self.sim = SimDriver()
        ra = Region.create(tmp)
        rb = Region.attach(ra.path)
        stage = lambda n, dev: self.sim.alloc(n)  # noqa: E731
        self.a = CePair(ra, rank=0, peer=1, timeout=timeout, driver=self.sim, mismatch=_mismatch, stage=stage)
        self.b = CePair(rb, rank=1, peer=0, timeout=timeout, driver=self.sim, mismatch=_mismatch, stage=stage)
        self.sa = self.sim.new_stream()  # the callers' current streams
        self.sb = self.sim.new_stream()

    def tensor(self, shape: tuple[int, ...], *, fill: int | None = None, exportable: bool = True) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        t = self.sim.alloc(n * 4, exportable=exportable).view(torch.float32).view(shape)
        if fill is not None:
            t.copy_(torch.arange(n, dtype=torch.float32).view(shape) + fill)
        return t

    def send(self, t: torch.Tensor, tag: int = 1, *, side: str = "a"):
        pair, stream = (self.a, self.sa) if side == "a" else (self.b, self.sb)
        return pair.send(t, tag, _words(t), t.numel() * t.element_size(), stream, 0, lambda: "isend")

    def recv(self, t: torch.Tensor, tag: int = 1, *, side: str = "b"):
        pair, stream = (self.b, self.sb) if side == "b" else (self.a, self.sa)
        return pair.recv(t, tag, _words(t), t.numel() * t.element_size(), stream, 0, lambda: "irecv")

    def settle(self, *ops) -> None:
        for s in self.sim.streams.values():
            assert s.drain(), "a simulated stream never finished its work"
        for s in self.sim.streams.values():
            assert not s.hung, "a simulated stream waited on a flag that never came"
        for op in ops:
            assert op.poll(), f"message {op.seq} not complete after every stream finished"

    def close(self) -> None:
        self.a.close(PeerLostError("test over"))
        self.b.close(PeerLostError("test over"))
        self.sim.stop()


@pytest.fixture
def pair(tmp_path):
    p = Pair(str(tmp_path))
    yield p
    p.close()


def test_the_largest_copy_on_the_callers_stream_is_a_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_CE_INLINE_MAX", "1M")
    p = Pair(str(tmp_path))
    try:
        assert p.a.inline_max == p.b.inline_max == 1 << 20
    finally:
        p.close()
    monkeypatch.delenv("TENSORWIRE_CE_INLINE_MAX")
    p = Pair(str(tmp_path))
    try:
        assert p.a.inline_max == 4 << 20  # (the default)
    finally:
        p.close()


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "internal-stream"])
@pytest.mark.parametrize("first", ["sender", "receiver"])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (1 << 18,)])
def test_bytes_arrive_whichever_side_comes_first(pair, first, shape, inline):
    src = pair.tensor(shape, fill=7)
    dst = pair.tensor(shape, fill=-1)
    if not inline:  # every copy through an internal stream after a GPU wait for the peer's ready flag
        pair.a.inline_max = pair.b.inline_max = -1
    if first == "sender":
        s = pair.send(src)
        pair.settle()  # (its ready flag is written: the receiver, second, finds the peer ready)
        r = pair.recv(dst)
    else:
        r = pair.recv(dst)
        pair.settle()
        s = pair.send(src)
    second = r if first == "sender" else s
    assert (second.stream != -1) == inline  # which way the second side's copy went
    pair.settle(s, r)
    assert torch.equal(dst, src)
    assert s.error is None and r.error is None


@pytest.mark.parametrize("first", ["sender", "receiver"])
def test_wait_inline_copies_on_the_callers_stream_after_a_wait_for_a_peer_not_yet_there(pair, first):
    """With ``wait_inline`` (a diagnostic), a second side whose peer's stream has not reached its call yet waits for
    the peer's flag on its caller's stream and copies there: the bytes arrive once the peer's stream goes on."""
    pair.a.wait_inline = pair.b.wait_inline = True
    src = pair.tensor((1 << 12,), fill=3)
    dst = pair.tensor((1 << 12,), fill=-1)
    # the first side's stream is held back by a gate of its own, so its ready flag is not written yet
    gate = pair.sim.alloc(4)
    held = pair.sa if first == "sender" else pair.sb
    pair.sim.wait(held, gate.data_ptr(), 1)
    if first == "sender":
        s = pair.send(src)
        r = pair.recv(dst)
        second = r
    else:
        r = pair.recv(dst)
        s = pair.send(src)
        second = s
    assert second.stream != -1  # the copy went on the caller's stream, behind a wait for the peer's flag
    assert not pair.sim.streams[held].drain(0.3)  # (held at its gate: the first side's flag is not written)
    assert not torch.equal(dst, src)  # (so nothing moved: the copy waits on the caller's stream for that flag)
    gate.view(torch.int32)[0] = 1
    pair.settle(s, r)
    assert torch.equal(dst, src)
    assert s.error is None and r.error is None


def test_a_large_send_waits_for_its_receiver_and_pushes_the_bytes_itself(pair):
    """Above inline_max, a sender that comes first waits (a bounded host wait) for the receiver, so that the copy is
    the sender's -- a push, on the sender's GPU -- not the receiver's pull."""
    pair.a.inline_max = pair.b.inline_max = 64  # (bytes: every message below is "large")
    pair.a.push_wait_s = 5.0
    src = pair.tensor((256,), fill=3)
    dst = pair.tensor((256,), fill=-1)
    box: dict = {}
    sender = threading.Thread(target=lambda: box.setdefault("s", pair.send(src)))
    sender.start()
    time.sleep(0.05)  # the sender is waiting, not yet in the entry: the receiver comes first
    assert "s" not in box
    r = pair.recv(dst)
    sender.join(timeout=10)
    s = box["s"]
    pair.settle(s, r)
    assert torch.equal(dst, src)
    assert pair.a.counts[3] == 1 and pair.a.counts[4] == 0  # the receiver came while the sender waited
    assert pair.a.counts[0] == 0 and pair.b.counts[0] == 1  # ... so the sender came second: the copy was its own
    assert pair.b.counts[1] + pair.b.counts[2] == 0


def test_large_sends_both_ways_at_once_stop_waiting_for_each_other(pair):
    """An exchange -- each side ``isend``s a large tensor, then ``irecv``s the peer's -- must not hold both senders
    for the whole wait: neither receiver can come before its own send returns. Each sees the other waiting, both
    stop at once, and each receiver pulls (so each GPU still makes one copy)."""
    pair.a.inline_max = pair.b.inline_max = 64
    pair.a.push_wait_s = pair.b.push_wait_s = 5.0
    src_a, src_b = pair.tensor((256,), fill=3), pair.tensor((256,), fill=7)
    dst_a, dst_b = pair.tensor((256,), fill=-1), pair.tensor((256,), fill=-1)
    box: dict = {}

    def exchange(side: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        t0 = time.monotonic()
        s = pair.send(src, side=side)
        box[f"{side} waited"] = time.monotonic() - t0
        r = pair.recv(dst, side=side)
        box[side] = (s, r)

    threads = [
        threading.Thread(target=exchange, args=("a", src_a, dst_a)),
        threading.Thread(target=exchange, args=("b", src_b, dst_b)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert box["a waited"] < 2.0 and box["b waited"] < 2.0, box  # (5 s each before: the whole wait)
    pair.settle(*box["a"], *box["b"])
    assert torch.equal(dst_a, src_b) and torch.equal(dst_b, src_a)  # (what each side received)
    # At least one stopped because the other waited; the other stopped for the same reason, or found its receiver
    # already there (the first to stop may reach its receive before the other's next look: threads of one process
    # here). Nobody waited its time out.
    assert pair.a.counts[5] + pair.b.counts[5] >= 1
    assert pair.a.counts[5] + pair.a.counts[3] == 1 and pair.b.counts[5] + pair.b.counts[3] == 1
    assert pair.a.counts[4] + pair.b.counts[4] == 0
    # and the words say nobody waits any more: a later lone large send waits for its receiver as before
    box.clear()
    later = threading.Thread(target=lambda: box.setdefault("s", pair.send(src_a)))
    later.start()
    time.sleep(0.05)
    assert "s" not in box  # still waiting for its receiver
    r = pair.recv(dst_b)
    later.join(timeout=10)
    pair.settle(box["s"], r)
    assert pair.a.counts[3] + pair.a.counts[5] == 2 and pair.a.counts[4] == 0  # (it pushed after its wait)


def test_a_large_send_to_a_peer_on_the_same_gpu_does_not_wait_for_its_receiver(pair):
    """Two processes on one GPU share its copy engines: once a side has seen that the peer's memory is on its own
    GPU, its large sends go on at once (a GPU-side wait between two contexts of one GPU can cost a time slice)."""
    pair.a.inline_max = pair.b.inline_max = 64
    pair.a.push_wait_s = 5.0
    pair.sim.peer_device = 0  # (the callers' device is 0: the peer's memory is "on this GPU")
    src = pair.tensor((256,), fill=2)
    s0 = pair.send(src, side="b")
    r0 = pair.recv(pair.tensor((256,), fill=-1), side="a")  # side a comes second: it opens an export of b's
    pair.settle(s0, r0)
    assert pair.a._one_gpu == {0: True}
    t0 = time.monotonic()
    s = pair.send(src)  # no receiver yet, and no wait: it comes first
    assert time.monotonic() - t0 < 1.0
    assert pair.a.counts[3] == 0 and pair.a.counts[4] == 0
    dst = pair.tensor((256,), fill=-1)
    r = pair.recv(dst)
    pair.settle(s, r)
    assert torch.equal(dst, src)


def test_a_large_send_whose_receiver_does_not_come_goes_on_after_its_wait(pair):
    pair.a.inline_max = pair.b.inline_max = 64
    pair.a.push_wait_s = 0.02
    src = pair.tensor((256,), fill=5)
    dst = pair.tensor((256,), fill=-1)
    t0 = time.monotonic()
    s = pair.send(src)
    waited = time.monotonic() - t0
    assert 0.02 <= waited < 2.0
    assert pair.a.counts[4] == 1 and pair.a.counts[0] == 1  # came first after all: the receiver pulls
    r = pair.recv(dst)
    pair.settle(s, r)
    assert torch.equal(dst, src)
    assert pair.b.counts[1] + pair.b.counts[2] == 1
    small = pair.tensor((8,), fill=1)  # at most inline_max bytes: no wait at all
    t0 = time.monotonic()
    s2 = pair.send(small)
    assert time.monotonic() - t0 < 0.02 and pair.a.counts[4] == 1
    r2 = pair.recv(pair.tensor((8,), fill=-1))
    pair.settle(s2, r2)


def test_a_hundred_messages_reuse_the_entries_in_order(pair):
    n = 3 * ENTRIES + 5
    srcs = [pair.tensor((64,), fill=i) for i in range(n)]
    dsts = [pair.tensor((64,), fill=-1) for _ in range(n)]
    ops = []
    for i in range(n):
        order = [lambda i=i: pair.send(srcs[i]), lambda i=i: pair.recv(dsts[i])]
        if i % 3 == 0:
            order.reverse()
        ops += [f() for f in order]
        if i % 10 == 9:
            pair.settle()
    pair.settle(*ops)
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_completed_messages_leave_the_pending_list_without_the_watchdog(pair):
    """The callers themselves complete and drop what completed (here no watchdog runs at all): the list stays
    short, so neither a watchdog's look nor Python's oldest generation ever holds thousands of messages."""
    src, dst = pair.tensor((16,), fill=1), pair.tensor((16,), fill=0)
    for i in range(300):
        ops = [pair.send(src), pair.recv(dst)]
        if i % 8 == 7:
            pair.settle(*ops)
    assert len(pair.a._pending) <= 2 * PRUNE_AT and len(pair.b._pending) <= 2 * PRUNE_AT
    pair.settle()
    assert torch.equal(dst, src)


@pytest.mark.pure_python  # (a stand-in for a class that tensorwire.native compiles)
def test_a_completed_message_holds_no_reference_to_its_caller():
    """Once complete, a message lets go of its callback and its description (both bound to the caller's Work):
    the two are freed when their last holder drops them, not by the cycle collector."""

    class Caller:
        def __init__(self) -> None:
            self.got: list = []

        def done(self, exc) -> None:
            self.got.append(exc)

        def what(self) -> str:
            return "isend"

    pair = SimpleNamespace(clock=0.0, timeout=10.0)
    caller = Caller()
    op = CeOp(pair, 0, 1, True, 0, None, caller.what)  # type: ignore[arg-type]
    op.on_done = caller.done
    ref = weakref.ref(caller)
    gc.disable()
    try:
        op.fail(None)  # type: ignore[arg-type]  (completes it, no error: as poll() does)
        assert caller.got == [None]
        del caller
        assert ref() is None  # freed at once: the message kept nothing of it
        assert op.on_done is None and op.what() == "a completed message"
    finally:
        gc.enable()


def test_a_callback_that_sends_from_the_watchdogs_look_does_not_deadlock(pair):
    """The watchdog's look completes messages too: a Work's callback that sends again from there must not wait
    for the pending list's lock that the look holds."""
    src, dst = pair.tensor((16,), fill=4), pair.tensor((16,), fill=0)
    later: list = []
    first = pair.send(src)
    first.on_done = lambda exc: later.append(pair.send(src))
    r = pair.recv(dst)
    for s in pair.sim.streams.values():
        assert s.drain()  # (its flag came; nobody has looked yet)
    look = threading.Thread(target=pair.a.check, args=(time.monotonic(),), daemon=True)
    look.start()
    look.join(10)
    assert not look.is_alive(), "the watchdog's look deadlocked in a Work's callback"
    assert len(later) == 1 and first.poll()
    pair.settle(first, r, later[0], pair.recv(dst))
    assert torch.equal(dst, src)


def test_a_callback_that_sends_while_the_list_is_looked_at_does_not_deadlock(pair):
    src, dst = pair.tensor((16,), fill=3), pair.tensor((16,), fill=0)
    later: list = []
    first = pair.send(src)
    first.on_done = lambda exc: later.append(pair.send(src))  # (a Work's future callback that sends again)
    r = pair.recv(dst)
    for s in pair.sim.streams.values():
        assert s.drain()  # (its flag came; nobody has looked yet)
    pair.a._prune_at = 1  # the next send looks at the list: completing `first` sends from inside the look
    outer = pair.send(src)
    assert len(later) == 1 and first.poll()
    ops = [first, r, outer, later[0], pair.recv(dst), pair.recv(dst)]
    pair.settle(*ops)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "internal-stream"])
def test_both_directions_and_tags_from_threads_in_random_orders(pair, inline):
    if not inline:
        pair.a.inline_max = pair.b.inline_max = -1
    n = 40
    rnd = random.Random(5)
    plan = {
        (side, tag): [pair.tensor((rnd.randint(1, 300),), fill=100 * tag + i) for i in range(n)]
        for side in "ab"
        for tag in (1, 2)
    }
    outs = {k: [torch.zeros_like(t) for t in v] for k, v in plan.items()}
    for k, v in outs.items():  # receive tensors must be allocations the simulator knows
        outs[k] = [pair.tensor(tuple(t.shape), fill=0) for t in v]
    ops = []
    lock = threading.Lock()
    errors = []

    def run(side: str) -> None:
        other = "b" if side == "a" else "a"
        r = random.Random(side)
        steps = [("send", tag, i) for tag in (1, 2) for i in range(n)] + [
            ("recv", tag, i) for tag in (1, 2) for i in range(n)
        ]
        # per tag and direction the calls keep their order; everything else is shuffled
        r.shuffle(steps)
        steps.sort(key=lambda s: s[2])
        try:
            for kind, tag, i in steps:
                if kind == "send":
                    op = pair.send(plan[(side, tag)][i], tag, side=side)
                else:
                    op = pair.recv(outs[(other, tag)][i], tag, side=side)
                with lock:
                    ops.append(op)
                if r.random() < 0.05:
                    time.sleep(0.001)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    pair.settle(*ops)
    for k in plan:
        for s, d in zip(plan[k], outs[k]):
            assert torch.equal(s, d), k


def test_a_shape_mismatch_fails_both_sides_and_releases_the_first_ones_stream(pair):
    r = pair.recv(pair.tensor((4, 4), fill=0))
    with pytest.raises(ProtocolError, match="signatures differ"):
        pair.send(pair.tensor((4, 5), fill=1))
    # the receiver came first: its stream waits on "landed" at wait() -- make it wait, then it must go on
    pair.sim.wait(pair.sb, r.flag_device_addr, r.seq)
    pair.settle()
    assert r.poll() and isinstance(r.error, ProtocolError)
    assert "signatures differ" in str(r.error)


def test_non_exportable_and_non_contiguous_memory_go_through_staging(pair):
    src = pair.tensor((32, 8), fill=3, exportable=False)
    big = pair.tensor((8, 64))
    big.zero_()
    dst = big[:, :32].t()  # (32, 8), not contiguous
    assert not dst.is_contiguous()
    s = pair.send(src)
    r = pair.recv(dst)
    pair.settle(s, r)
    assert torch.equal(dst, src)
    assert torch.equal(big[:, 32:], torch.zeros(8, 32))  # nothing written outside the view
    # and the other order, the receiver first (its copy out of staging waits on "landed")
    dst2 = pair.tensor((8, 64), fill=0)[:, :32].t()
    r = pair.recv(dst2)
    s = pair.send(src)
    pair.settle(s, r)
    assert torch.equal(dst2, src)


def test_the_side_that_comes_second_copies_from_its_own_memory_without_exporting_it(pair):
    """Its own memory is local to its copy: no export call, and no staging where legacy IPC cannot export it."""
    exports: list[int] = []
    real = pair.sim.export

    def export(base: int) -> bytes:
        exports.append(base)
        return real(base)

    pair.sim.export = export
    src = pair.tensor((16, 4), fill=5)
    dst = pair.tensor((16, 4), fill=0, exportable=False)  # (expandable-segment memory, say)
    s = pair.send(src)  # first: its bytes must be reachable by the peer -> exported
    r = pair.recv(dst)  # second: pulls into its own tensor, which needs no export
    pair.settle(s, r)
    assert torch.equal(dst, src)
    assert exports == [pair.sim.allocation(src.data_ptr())[0]]
    assert pair.b.counts[0] == 0 and pair.b.counts[1] + pair.b.counts[2] == 1
    assert not r.keep or r.keep[1] is None  # no staging buffer was taken
    # the other order: the unexportable receiver first has to stage (the sender pushes into an export)
    dst2 = pair.tensor((16, 4), fill=0, exportable=False)
    r = pair.recv(dst2)
    s = pair.send(src)
    pair.settle(s, r)
    assert torch.equal(dst2, src)
    base2 = pair.sim.allocation(dst2.data_ptr())[0]
    assert exports[1] == base2 and len(exports) == 3  # its tensor refused, then the staging buffer's export


def test_a_message_whose_peer_never_comes_times_out_and_releases_streams(tmp_path):
    p = Pair(str(tmp_path), timeout=0.2)
    try:
        r = p.recv(p.tensor((16,), fill=0))
        p.sim.wait(p.sb, r.flag_device_addr, r.seq)  # the receiver's stream waits for the bytes
        time.sleep(0.3)
        lost = p.b.check(time.monotonic())
        assert isinstance(lost, TransferTimeout)
        p.settle()  # released: no stream hangs
        assert isinstance(r.error, TransferTimeout)
        with pytest.raises(TransferTimeout):  # the pair is failed: the next call raises
            p.recv(p.tensor((16,), fill=0))
    finally:
        p.close()


def test_a_peer_that_closes_fails_pending_messages(pair):
    s = pair.send(pair.tensor((16,), fill=1))
    pair.sim.wait(pair.sa, s.flag_device_addr, s.seq)
    pair.b.region.mark_closed()
    lost = pair.a.check(time.monotonic())
    assert isinstance(lost, PeerLostError) and "closed" in str(lost)
    pair.settle()
    assert isinstance(s.error, PeerLostError)


@pytest.mark.parametrize("linger", [5.0, 0.0], ids=["closed-with-linger", "aborted"])
def test_a_side_closed_right_after_its_last_send_lets_that_message_land(pair, linger):
    """A script's last ``isend`` returns long before its copy ran (here: behind a gate on the sender's stream);
    closing with a linger waits for it, so the receiver gets the bytes; an abort fails the receiver instead."""
    gate = pair.sim.alloc(4)
    pair.sim.wait(pair.sa, gate.data_ptr(), 1)  # "a long kernel" queued before the send
    src, dst = pair.tensor((256,), fill=3), pair.tensor((256,), fill=-1)
    s = pair.send(src)
    r = pair.recv(dst)
    closer = threading.Thread(target=pair.a.close, args=(PeerLostError("shut down"), linger))
    t0 = time.monotonic()
    closer.start()
    time.sleep(0.2)
    gate.view(torch.int32)[0] = 1  # the kernel ends
    closer.join(10)
    assert not closer.is_alive()
    pair.b.check(time.monotonic())  # the receiver's watchdog sees the sender closed
    pair.settle()
    if linger:
        assert time.monotonic() - t0 >= 0.2  # the close waited for the copy
        assert s.error is None and r.poll() and r.error is None
        assert torch.equal(dst, src)
    else:
        assert isinstance(r.error, PeerLostError)  # released without the bytes


def test_a_peer_without_heartbeat_is_lost(tmp_path):
    p = Pair(str(tmp_path))
    p.a.peer_timeout = 0.1
    try:
        assert p.a.check(time.monotonic()) is None
        time.sleep(0.15)
        lost = p.a.check(time.monotonic())
        assert isinstance(lost, PeerLostError) and "sign of life" in str(lost)
    finally:
        p.close()


def test_bad_set_up_data_is_refused(tmp_path):
    bad = tmp_path / "not-a-region"
    bad.write_bytes(b"x" * 100)
    with pytest.raises(ProtocolError, match="not a tensorwire copy-engine region"):
        Region.attach(str(bad))
    trunc = tmp_path / "tensorwire-ce-truncated"
    trunc.write_bytes(b"\0" * 4096)
    with pytest.raises(ProtocolError, match="bytes, not"):
        Region.attach(str(trunc))
    forged = tmp_path / "tensorwire-ce-forged"
    ra = Region.create(str(tmp_path))
    forged.write_bytes(bytes(os.path.getsize(ra.path)))  # the right size, no magic
    ra.close()
    with pytest.raises(ProtocolError, match="not a copy-engine region"):
        Region.attach(str(forged))
    sim = SimDriver()
    with pytest.raises(DriverError, match="64 bytes"):
        sim.open(b"\1" * 10)
    with pytest.raises(DriverError, match="no such export"):
        sim.open(b"\7" * 64)


def test_region_file_is_private_and_gone_once_attached(tmp_path):
    ra = Region.create(str(tmp_path))
    assert os.stat(ra.path).st_mode & 0o777 == 0o600
    rb = Region.attach(ra.path)
    assert not os.path.exists(ra.path)
    rb.close()
    ra.close()


_MUTEX_IN_THREADS = """
import sys, threading, time
from tensorwire.transport.ce import Region
ra = Region.create(sys.argv[1]); rb = Region.attach(ra.path)
held = threading.Event(); order = []
def first():
    with ra.mutex:
        held.set()
        time.sleep(0.2)  # (sleeping hands the GIL to the other thread, which then finds the lock taken)
        order.append("first")
t = threading.Thread(target=first); t.start(); held.wait()
with rb.mutex:
    order.append("second")
t.join(); rb.close(); ra.close()
print(",".join(order))
"""


def test_two_threads_of_one_process_take_the_region_lock_in_turn(tmp_path):
    """The pair's lock is shared between processes, but threads of one process take it too: a thread that finds it
    taken must not wait with the GIL held, or the holder can never go on to unlock it (it once hung the tests)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _MUTEX_IN_THREADS, str(tmp_path)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "first,second"


def test_a_dead_or_zombie_peer_process_is_seen_at_once(tmp_path):
    import subprocess
    import sys

    from tensorwire.transport.ce.region import process_alive as _alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while _alive(child.pid) and time.monotonic() < deadline:  # exited, not reaped yet: a zombie
        time.sleep(0.01)
    assert not _alive(child.pid)
    child.wait()
    assert not _alive(child.pid)
    assert _alive(os.getpid())


# -- CUDA graph capture (the flag-reset protocol) ------------------------------------------------------------


def _captured_step(pair: Pair, act, grad_in, grad_out, act_in):
    """One two-stage step as both sides capture it: a -> b activations, b -> a gradients, every op waited."""
    sim = pair.sim
    sim.capture_begin(pair.sa)
    sim.capture_begin(pair.sb)
    s1 = pair.send(act, side="a")
    r1 = pair.recv(act_in, side="b")
    pair.b.order_after(r1, pair.sb, 0)
    s2 = pair.send(grad_out, 2, side="b")
    r2 = pair.recv(grad_in, 2, side="a")
    pair.a.order_after(r2, pair.sa, 0)
    pair.a.order_after(s1, pair.sa, 0)
    pair.b.order_after(s2, pair.sb, 0)
    return sim.capture_end(pair.sa), sim.capture_end(pair.sb)


@pytest.mark.parametrize(
    "flags, one_gpu, kernels",
    [
        ("memop", False, 0),
        ("kernel", True, 8),
        ("kernel", False, 8),
        ("auto", False, 0),
        ("auto", True, 0),
        ("auto", None, 0),
    ],
    ids=["memop", "kernel-one-gpu", "kernel-two-gpus", "auto-two-gpus", "auto-one-gpu", "auto-not-known"],
)
def test_a_captured_step_moves_the_bytes_again_on_every_replay(pair, flags, one_gpu, kernels):
    act, grad_in = pair.tensor((64,), fill=0), pair.tensor((64,), fill=0)
    grad_out, act_in = pair.tensor((64,), fill=0), pair.tensor((64,), fill=0)
    # warm-up (eager) step: sets the pair's device up, as torch's capture rules ask
    ops = [pair.send(act), pair.recv(act_in)]
    pair.settle(*ops)
    for side in (pair.a, pair.b):  # how the flags go (TENSORWIRE_CE_GRAPH_FLAGS), and where the peer's memory is
        side.graph_flags = flags
        side._one_gpu.clear()
        if one_gpu is not None:
            side._one_gpu.update(dict.fromkeys(side._streams, one_gpu))
    ga, gb = _captured_step(pair, act, grad_in, grad_out, act_in)
    assert pair.sim.copies == 1  # capture recorded the copies; it ran none
    # two messages, each: the first side's flag write and its wait(), the second side's wait and write
    assert pair.sim.kernel_ops == kernels
    for i in range(100):
        act.fill_(float(i))
        grad_out.fill_(float(-i))
        pair.sim.replay(pair.sb, gb)  # the sides replay in either order
        pair.sim.replay(pair.sa, ga)
        pair.settle()
        assert torch.equal(act_in, act), i
        assert torch.equal(grad_in, grad_out), i
    # eager messages still go between replays
    s, r = pair.send(act), pair.recv(act_in)
    pair.settle(s, r)


def test_first_message_during_capture_says_warm_up_first(pair):
    from tensorwire.transport.ce import CaptureError

    pair.sim.capture_begin(pair.sa)
    with pytest.raises(CaptureError, match="warm-up"):
        pair.send(pair.tensor((8,), fill=1))
    pair.sim.capture_end(pair.sa)


def test_captured_sequences_that_differ_are_refused_at_capture(pair):
    pair.settle(pair.send(pair.tensor((8,), fill=1)), pair.recv(pair.tensor((8,))))
    pair.sim.capture_begin(pair.sa)
    pair.sim.capture_begin(pair.sb)
    pair.send(pair.tensor((8,), fill=1))
    with pytest.raises(ProtocolError, match="captured message 1"):
        pair.recv(pair.tensor((9,)))
    pair.sim.capture_end(pair.sa)
    pair.sim.capture_end(pair.sb)


@pytest.mark.parametrize("flags", ["memop", "kernel"])
def test_a_lost_peer_releases_a_replay_waiting_on_it(pair, flags):
    act, act_in = pair.tensor((16,), fill=1), pair.tensor((16,))
    pair.settle(pair.send(act), pair.recv(act_in))
    pair.b.graph_flags = flags  # (a waiting flag kernel reads the same host word the watchdog writes)
    pair.sim.capture_begin(pair.sb)
    r = pair.recv(act_in, side="b")
    pair.b.order_after(r, pair.sb, 0)
    gb = pair.sim.capture_end(pair.sb)
    pair.sim.replay(pair.sb, gb)  # the peer never replays its half
    pair.b.fail(PeerLostError("rank 0 died"))
    pair.settle()  # released: no stream hangs
    assert pair.sim.kernel_ops == (2 if flags == "kernel" else 0)  # its ready flag, its wait for landed


def test_the_parts_messages_played_show_in_tw_metrics_and_prometheus(pair):
    from prometheus_client.parser import text_string_to_metric_families

    from tensorwire import observe

    observe.reset()
    # (as distributed/copyengine.py does for a group's pairs: each side counts where tw.metrics() reads)
    pair.a.counts = observe.ce_counts(1)
    pair.b.counts = observe.ce_counts(0)
    src, dst = pair.tensor((16,), fill=1), pair.tensor((16,), fill=-1)
    ops = []
    for _ in range(3):  # the sender first, then the receiver -- second, its peer's flag set: on its own stream
        ops.append(pair.send(src))
        pair.settle()
        ops.append(pair.recv(dst))
    pair.settle(*ops)
    parts = {e["peer"]: e for e in observe.metrics()["ce"]}
    assert parts["1"]["first"] == 3 and parts["1"]["second_inline"] == 0  # side a (rank 0) sent, came first
    assert parts["0"]["first"] == 0 and parts["0"]["second_inline"] == 3  # side b (rank 1) copied each one
    assert set(observe.CE_PARTS) <= set(parts["0"])
    families = {f.name: f for f in text_string_to_metric_families(observe.render().decode())}
    samples = {(s.labels["peer"], s.labels["part"]): s.value for s in families["tensorwire_p2p_ce_messages"].samples}
    assert samples[("0", "second_inline")] == 3 and samples[("1", "first")] == 3
    assert families["tensorwire_p2p_ce_messages"].type == "counter"
    line = observe.summary(0)
    assert "copy engine ->0: first 0, second 3 (0 on an internal stream)" in line, line
    assert "copy engine ->1: first 3, second 0" in line, line
    observe.reset()  # zeroed in place: the pairs go on counting into the same lists
    assert observe.metrics()["ce"] == []
    op_s = pair.send(src)
    pair.settle()
    op_r = pair.recv(dst)
    pair.settle(op_s, op_r)
    assert {e["peer"]: e["first"] for e in observe.metrics()["ce"]} == {"1": 1, "0": 0}
    observe.reset()


def test_set_up_words_say_whether_two_ranks_share_a_gpu():
    from tensorwire.distributed.copyengine import same_gpu

    uuid = "GPU-8f0c2a51-1b2c-4d5e-8f90-0123456789ab"
    assert same_gpu(f"0:{uuid}", f"1:{uuid}") is True  # (indices differ under CUDA_VISIBLE_DEVICES: the UUID counts)
    assert same_gpu(f"0:{uuid}", "0:GPU-other") is False
    for a, b in ((f"0:{uuid}", "-"), ("-", "-"), ("0:", f"0:{uuid}")):
        assert same_gpu(a, b) is None, (a, b)  # no GPU chosen, or a torch without UUIDs: not known


def test_the_captured_flags_calls_are_said_once_per_gpu_with_where_the_peer_is(pair, caplog):
    ops = [pair.send(pair.tensor((8,), fill=1)), pair.recv(pair.tensor((8,)))]
    pair.settle(*ops)
    side = pair.a
    (device,) = side._streams
    side._one_gpu.clear()
    side._flags_said.clear()
    side.peer_gpu(device, False)  # (what the set-up's exchange of GPU UUIDs records for two GPUs)
    with caplog.at_level(logging.INFO, logger="tensorwire.transport.ce.graphs"):
        side.graph_flags = "auto"
        assert side._flag_kernels(device) is False  # auto: memory operations, also between two GPUs
        side.graph_flags = "kernel"
        assert side._flag_kernels(device) is True
    said = [r.getMessage() for r in caplog.records if "captured messages" in r.getMessage()]
    assert len(said) == 1, said
    assert "stream memory operations" in said[0] and "FLAGS=auto" in said[0] and "another GPU" in said[0], said


@pytest.mark.pure_python  # (a stand-in for a class that tensorwire.native compiles)
def test_the_default_stream_is_never_asked_whether_it_is_captured():
    """CUDA cannot capture the legacy default stream (torch's default): the driver answers False for it without a
    call; any other stream is asked (and a driver error there is raised, not taken for "not capturing")."""
    import ctypes

    from tensorwire.transport.ce.driver import CeDriver

    asked: list[int] = []

    def is_capturing(stream, status):
        asked.append(stream)
        ctypes.cast(status, ctypes.POINTER(ctypes.c_int)).contents.value = 1 if stream == 7 else 0
        return 0 if stream != 9 else 901  # (901: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)

    drv = CeDriver.__new__(CeDriver)  # (no libcuda here: only what capturing() uses)
    drv._tls = threading.local()
    drv._is_capturing = is_capturing
    drv._error_name = None
    assert drv.capturing(0) is False
    assert asked == []
    assert drv.capturing(5) is False and drv.capturing(7) is True
    assert asked == [5, 7]
    with pytest.raises(DriverError, match="cuStreamIsCapturing"):
        drv.capturing(9)


@pytest.mark.pure_python  # (a stand-in for a class that tensorwire.native compiles)
@pytest.mark.parametrize("refused", [False, True], ids=["batched", "batch-refused"])
def test_write_then_wait_is_one_batch_in_that_order_or_two_calls_where_refused(refused):
    """A Link's receive frees a slot and waits for its message in one cuStreamBatchMemOp: the write first, then
    the wait (>=); a driver that refuses the batch gets the two calls, and is not asked for a batch again."""
    import ctypes

    from tensorwire.transport.ce import driver as drv_mod
    from tensorwire.transport.ce.driver import CeDriver

    batches: list[list[tuple[int, int, int, int]]] = []
    single: list[tuple[str, int, int, int]] = []

    def batch(stream, count, ops, flags):
        arr = ctypes.cast(ops, ctypes.POINTER(drv_mod.MemOp))
        batches.append([(arr[i].operation, arr[i].address, arr[i].value, arr[i].flags) for i in range(count)])
        return 1 if refused else 0  # (1: CUDA_ERROR_INVALID_VALUE)

    drv = CeDriver.__new__(CeDriver)  # (no libcuda here: only what write_wait() uses)
    drv._batch = batch
    drv._error_name = None
    drv._calls = None  # (the per-message calls through ctypes: no cuda-python bindings)
    drv._write = lambda stream, addr, value, flags: single.append(("write", stream, addr, value)) or 0
    drv._wait = lambda stream, addr, value, flags: single.append(("wait", stream, addr, value)) or 0
    drv.write_wait(5, 0x1000, 7, 0x2000, (1 << 32) + 9)
    assert batches == [
        [
            (drv_mod._CU_STREAM_MEM_OP_WRITE_VALUE_32, 0x1000, 7, drv_mod._CU_STREAM_WRITE_VALUE_DEFAULT),
            (drv_mod._CU_STREAM_MEM_OP_WAIT_VALUE_32, 0x2000, 9, drv_mod._CU_STREAM_WAIT_VALUE_GEQ),
        ]
    ]
    if refused:
        assert single == [("write", 5, 0x1000, 7), ("wait", 5, 0x2000, 9)]
        drv.write_wait(5, 0x1000, 8, 0x2000, 10)
        assert len(batches) == 1 and single[2:] == [("write", 5, 0x1000, 8), ("wait", 5, 0x2000, 10)]
    else:
        assert single == []


@pytest.mark.pure_python  # (a stand-in for a class that tensorwire.native compiles)
@pytest.mark.parametrize("refused", [False, True], ids=["batched", "batch-refused"])
def test_wait_then_reset_is_one_batch_in_that_order_or_two_calls_where_refused(refused):
    """A captured message's wait for its flag and the flag's reset: one batch, the wait (>=) first, then the write
    of 0; two calls where the driver refuses the batch."""
    import ctypes

    from tensorwire.transport.ce import driver as drv_mod
    from tensorwire.transport.ce.driver import CeDriver

    batches: list[list[tuple[int, int, int, int]]] = []
    single: list[tuple[str, int, int, int]] = []

    def batch(stream, count, ops, flags):
        arr = ctypes.cast(ops, ctypes.POINTER(drv_mod.MemOp))
        batches.append([(arr[i].operation, arr[i].address, arr[i].value, arr[i].flags) for i in range(count)])
        return 1 if refused else 0

    drv = CeDriver.__new__(CeDriver)  # (no libcuda here: only what wait_reset() uses)
    drv._batch = batch
    drv._error_name = None
    drv._calls = None  # (the per-message calls through ctypes: no cuda-python bindings)
    drv._write = lambda stream, addr, value, flags: single.append(("write", stream, addr, value)) or 0
    drv._wait = lambda stream, addr, value, flags: single.append(("wait", stream, addr, value)) or 0
    drv.wait_reset(3, 0x3000, 1)
    assert batches == [
        [
            (drv_mod._CU_STREAM_MEM_OP_WAIT_VALUE_32, 0x3000, 1, drv_mod._CU_STREAM_WAIT_VALUE_GEQ),
            (drv_mod._CU_STREAM_MEM_OP_WRITE_VALUE_32, 0x3000, 0, drv_mod._CU_STREAM_WRITE_VALUE_DEFAULT),
        ]
    ]
    assert single == ([("wait", 3, 0x3000, 1), ("write", 3, 0x3000, 0)] if refused else [])


def test_a_lock_held_by_the_peer_is_retried_before_sleeping_and_counted(tmp_path):
    """The pair's shared lock, held by the other side for a moment: taken by retrying within the spin budget
    (no sleep); held longer than the budget: this side sleeps for it. Each wait is counted."""
    ra = Region.create(str(tmp_path))
    rb = Region.attach(ra.path)
    try:
        # (the holder is another thread with its own mapping, as the peer process would be: a pthread mutex is
        # held per thread, and the other mapping's _Mutex does not know that this process holds it)
        held = threading.Event()
        release = threading.Event()

        def holder():
            with ra.mutex:
                held.set()
                release.wait(10)

        for hold_s, spin_us, slept in ((0.002, 200_000.0, 0), (0.05, 1_000.0, 1)):
            rb.mutex.spin_ns = int(spin_us * 1000)
            before = (rb.mutex.contended, rb.mutex.slept)
            held.clear()
            release.clear()
            th = threading.Thread(target=holder)
            th.start()
            assert held.wait(10)
            threading.Timer(hold_s, release.set).start()
            t0 = time.monotonic()
            with rb.mutex:
                waited = time.monotonic() - t0
            th.join(10)
            assert (rb.mutex.contended - before[0], rb.mutex.slept - before[1]) == (1, slept)
            assert waited >= hold_s * 0.5
        assert rb.mutex.wait_ns > 0
    finally:
        rb.close()
        ra.close()


@pytest.mark.parametrize("large", [True, False], ids=["above-threshold", "below-threshold"])
def test_one_gpu_a_copy_above_the_threshold_waits_for_its_peer_on_the_host(pair, large):
    """Between two processes of one GPU, a copy above ``one_gpu_wait_min`` whose peer's stream has not reached its
    call waits for the peer's flag on the host (then copies on the caller's stream); a smaller one waits on the GPU
    (an internal stream ordered after the flag). Either way the bytes arrive."""
    warm = [pair.send(pair.tensor((4,), fill=0)), pair.recv(pair.tensor((4,)))]
    pair.settle(*warm)
    for side in (pair.a, pair.b):
        side._one_gpu.update(dict.fromkeys(side._streams, True))
        side.one_gpu_wait_min = 512  # (bytes)
        side.push_wait_s = 5.0
    gate = threading.Event()
    pair.sim.streams[pair.sb].put(lambda: gate.wait(5))  # the receiver's stream has not reached its call yet
    n = 256 if large else 64  # floats: 1 KiB or 256 bytes
    dst = pair.tensor((n,), fill=-1)
    r = pair.recv(dst)  # side b comes first: its ready flag is queued behind the gate
    timer = threading.Timer(0.1, gate.set)
    timer.start()
    try:
        before = list(pair.a.counts)
        t0 = time.monotonic()
        src = pair.tensor((n,), fill=3)
        s = pair.send(src)  # side a comes second
        waited = time.monotonic() - t0
    finally:
        gate.set()
        timer.cancel()
    pair.settle(s, r)
    assert torch.equal(dst, src)
    inline, queued = pair.a.counts[1] - before[1], pair.a.counts[2] - before[2]
    if large:
        assert waited >= 0.05 and (inline, queued) == (1, 0)  # waited for the flag, then copied on its own stream
    else:
        assert waited < 0.05 and (inline, queued) == (0, 1)  # no host wait: a GPU-side wait on an internal stream
