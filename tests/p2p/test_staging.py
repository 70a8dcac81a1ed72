"""CPU checks of the chunk-staged GPU path (no GPU needed).

- :func:`tensorwire.p2p.staging.chunk_plan` and :func:`tensorwire.p2p.staging.staging_chunk` (pure Python);
- the staging engines (:class:`~tensorwire.p2p.staging.StagedSender` / :class:`~tensorwire.p2p.staging.StagedReceiver`)
  over a real TCP transport pair, with their CUDA calls replaced by a *lazy* stream simulator: queued work
  runs only when something waits for it, as late as the recorded dependencies allow. A missing stream
  wait or event synchronize in the engines then shows up as wrong bytes here, as it would on a GPU under
  load (the two "mutant" tests check that the simulator does catch such omissions).

The engines' real CUDA calls and the Link wiring are exercised by ``tests/p2p/test_gpu.py`` on a GPU host.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tensorwire.errors import ConfigError, ProtocolError, TransferTimeout, TensorWireError  # noqa: E402
from tensorwire.p2p.staging import (  # noqa: E402
    DEFAULT_CHUNK,
    MAX_STAGING_CHUNKS,
    STAGING_CHUNK_ALIGN,
    STAGING_CHUNK_ENV,
    StagedReceiver,
    StagedSender,
    chunk_plan,
    staging_chunk,
)
from tensorwire.transport.base import new_nonce  # noqa: E402
from tensorwire.transport.tcp import TcpListener  # noqa: E402

# -- chunk plan ------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_chunk_plan_examples():
    MiB = 1 << 20
    assert chunk_plan(0) == ((0, 0),)  # an empty tensor is still one (empty) message
    assert chunk_plan(1) == ((0, 1),)
    four = 4 * MiB
    assert chunk_plan(4 * MiB, four) == ((0, 4 * MiB),)  # exactly one chunk: whole tensor
    assert chunk_plan(4 * MiB + 1, four) == ((0, 4 * MiB), (4 * MiB, 1))
    assert chunk_plan(10 * MiB, four) == ((0, 4 * MiB), (4 * MiB, 4 * MiB), (8 * MiB, 2 * MiB))
    assert chunk_plan(256 * MiB, four) == tuple((i * 4 * MiB, 4 * MiB) for i in range(64))
    # the default (2 MiB): 8 chunks at 16 MiB; at 256 MiB the 64-chunk cap makes them 4 MiB
    assert chunk_plan(16 * MiB) == tuple((i * 2 * MiB, 2 * MiB) for i in range(8))
    assert chunk_plan(256 * MiB) == tuple((i * 4 * MiB, 4 * MiB) for i in range(64))
    # above 64 chunks the chunk grows (aligned) instead of the count
    big = chunk_plan(1 << 30)
    assert len(big) == 64 and big[0] == (0, 16 * MiB)
    odd = chunk_plan(256 * MiB + 3)
    assert len(odd) <= MAX_STAGING_CHUNKS and odd[0][1] % STAGING_CHUNK_ALIGN == 0
    assert odd[-1][0] + odd[-1][1] == 256 * MiB + 3
    # chunk 0: unchunked (the pre-chunking wire format)
    assert chunk_plan(100 * MiB, 0) == ((0, 100 * MiB),)
    assert chunk_plan(10, 3) == ((0, 3), (3, 3), (6, 3), (9, 1))
    assert chunk_plan(10, 3, max_chunks=1) == ((0, 10),)
    assert DEFAULT_CHUNK == 2 * MiB


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args", [(-1, 4), (10, -1), (10, 4, 0)])
def test_chunk_plan_rejects_bad_arguments(args):
    n, chunk, *rest = args
    with pytest.raises(ValueError):
        chunk_plan(n, chunk, max_chunks=rest[0] if rest else MAX_STAGING_CHUNKS)


@pytest.mark.timeout(120)
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(n=st.integers(0, 1 << 40), chunk=st.integers(0, 1 << 30), max_chunks=st.integers(1, 300))
def test_chunk_plan_properties(n, chunk, max_chunks):
    plan = chunk_plan(n, chunk, max_chunks=max_chunks)
    assert plan == chunk_plan(n, chunk, max_chunks=max_chunks)  # deterministic: both sides agree
    # contiguous cover of [0, n), in order
    assert plan[0][0] == 0
    for (o1, l1), (o2, _) in zip(plan, plan[1:]):
        assert o2 == o1 + l1
    assert plan[-1][0] + plan[-1][1] == n
    assert 1 <= len(plan) <= max_chunks
    if n == 0 or chunk == 0 or n <= chunk:
        assert plan == ((0, n),)
        return
    sizes = [length for _, length in plan]
    assert all(s > 0 for s in sizes)
    assert len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]  # equal chunks, shorter tail
    if sizes[0] != chunk:  # grown to respect max_chunks (to an aligned size, or to the whole tensor)
        assert sizes[0] > chunk and -(-n // chunk) > max_chunks
        assert sizes[0] % STAGING_CHUNK_ALIGN == 0 or len(plan) == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "raw,want",
    [
        (None, DEFAULT_CHUNK),
        ("", DEFAULT_CHUNK),
        ("0", 0),
        ("1048576", 1 << 20),
        ("4M", 4 << 20),
        ("512KiB", 512 << 10),
        ("1g", 1 << 30),
        (" 2 MB ", 2 << 20),
        ("7b", 7),
    ],
)
def test_staging_chunk_from_environment(raw, want):
    env = {} if raw is None else {STAGING_CHUNK_ENV: raw}
    assert staging_chunk(env) == want


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raw", ["-1", "four", "4X", "1.5M", "M"])
def test_staging_chunk_rejects_garbage(raw):
    with pytest.raises(ConfigError, match=STAGING_CHUNK_ENV):
        staging_chunk({STAGING_CHUNK_ENV: raw})


# -- a lazy simulation of CUDA streams --------------------------------------------------------------


class LazyStream:
    """A simulated stream: queued work runs only when someone waits for it, in queue order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[Callable[[], None]] = []
        self.done = 0

    def enqueue(self, fn: Callable[[], None]) -> None:
        self.ops.append(fn)

    def run_until(self, n: int) -> None:
        while self.done < n:
            fn = self.ops[self.done]
            self.done += 1
            fn()

    def flush(self) -> None:
        self.run_until(len(self.ops))

    def wait_event(self, ev: "LazyEvent") -> None:
        if ev.stream is None:
            return
        src, pos = ev.stream, ev.pos  # captured now, like cudaStreamWaitEvent
        self.enqueue(lambda: src.run_until(pos))


class LazyEvent:
    def __init__(self) -> None:
        self.stream: LazyStream | None = None
        self.pos = 0

    def record(self, stream: LazyStream) -> None:
        self.stream, self.pos = stream, len(stream.ops)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.pos)

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.pos


class LazyOps:
    """Stands in for :class:`tensorwire.p2p.staging.CudaOps` (what the engines call)."""

    def __init__(self) -> None:
        self.copies = 0
        self.events = 0

    def current_stream(self, device: Any) -> LazyStream:  # pragma: no cover - the tests pass streams explicitly
        raise AssertionError("engines get their streams from the caller")

    def new_stream(self, device: Any) -> LazyStream:
        return LazyStream("side")

    def new_event(self) -> LazyEvent:
        self.events += 1
        return LazyEvent()

    def copy(self, dst: Any, src: Any, stream: LazyStream) -> None:
        self.copies += 1
        stream.enqueue(lambda: dst.copy_(src))


class NoWaitStream(LazyStream):
    """Mutant: ignores stream->event waits (an engine that forgot them would behave like this)."""

    def wait_event(self, ev: LazyEvent) -> None:
        pass


class NoSyncEvent(LazyEvent):
    """Mutant: synchronize returns at once (an engine that forgot to wait for its copies)."""

    def synchronize(self) -> None:
        pass


# -- the engines over a real TCP transport pair ------------------------------------------------------


@pytest.fixture(scope="module")
def listener():
    lst = TcpListener("127.0.0.1", port=0)
    yield lst
    lst.close()


@pytest.fixture
def pair(listener):
    nonce = new_nonce()
    listener.expect(nonce)
    out: dict[str, Any] = {}
    th = threading.Thread(
        target=lambda: out.setdefault("c", TcpListener.connect("127.0.0.1", listener.address[1], nonce, timeout=20))
    )
    th.start()
    server = listener.accept(nonce, timeout=20)
    th.join(20)
    client = out["c"]
    yield client, server
    client.close()
    server.close()


def _pattern(n: int, seed: int) -> "torch.Tensor":
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


class Side:
    """One process's end: its current stream, copy stream and ops."""

    def __init__(self, ops: LazyOps | None = None, stream_cls: type = LazyStream) -> None:
        self.ops = ops or LazyOps()
        self.current = stream_cls("current")
        self.side = stream_cls("side")


def _run_sender(tx: Any, specs: list[tuple[int, tuple]], steps: int, side: Side, errors: list) -> None:
    """For each step and tag: a 'kernel' queued on the current stream writes the tensor; send right away;
    then overwrite the tensor on the host at once (bytes must be out of it when send returns)."""
    try:
        senders = []
        for tag, (n, plan) in enumerate(specs):
            host = torch.zeros(n, dtype=torch.uint8)
            senders.append((tag, StagedSender(host, plan, ops=side.ops), torch.zeros(n, dtype=torch.uint8), [0]))
        for k in range(steps):
            for tag, sender, src, step in senders:
                want = _pattern(src.numel(), 1000 * tag + k)
                side.current.enqueue(lambda src=src, want=want: src.copy_(want))
                step[0] = sender.send(tx, tag, src, step=step[0], timeout=20, current=side.current, side=side.side)
                src.fill_(0xEE)  # "the tensor may be modified after send"
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def _receive_all(
    rx_t: Any, specs: list[tuple[int, tuple]], steps: int, side: Side, *, defer_reads: bool = True
) -> dict[tuple[int, int], "torch.Tensor"]:
    """Receive every message; each one is read by work queued on the current stream (run late)."""
    receivers = []
    for tag, (n, plan) in enumerate(specs):
        hosts = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
        dev = torch.zeros(n, dtype=torch.uint8)
        r = StagedReceiver(hosts, dev, plan, ops=side.ops)
        r.post_all(rx_t, tag)
        receivers.append((tag, r, dev))
    seen: dict[tuple[int, int], torch.Tensor] = {}
    for k in range(steps):
        for tag, r, dev in receivers:
            got = r.recv(rx_t, tag, timeout=20, current=side.current, side=side.side)
            assert got == dev.numel()
            side.current.enqueue(lambda tag=tag, k=k, dev=dev: seen.__setitem__((tag, k), dev.clone()))
            if not defer_reads:
                side.current.flush()
    side.current.flush()
    return seen


def _check(seen: dict, specs: list, steps: int) -> list[tuple[int, int]]:
    bad = []
    for tag, (n, _) in enumerate(specs):
        for k in range(steps):
            if not torch.equal(seen[(tag, k)], _pattern(n, 1000 * tag + k)):
                bad.append((tag, k))
    return bad


SIZES = [0, 1, 4095, 4096, 4097, 3 * 4096 + 123, 64 * 4096 + 1, 200_003]


def _specs(chunk: int = 4096) -> list[tuple[int, tuple]]:
    return [(n, chunk_plan(n, chunk)) for n in SIZES]


def _exchange(pair, specs, steps, send_side: Side, recv_side: Side, **kw) -> list:
    tx, rx = pair
    errors: list = []
    th = threading.Thread(target=_run_sender, args=(tx, specs, steps, send_side, errors), daemon=True)
    th.start()
    try:
        seen = _receive_all(rx, specs, steps, recv_side, **kw)
    finally:
        th.join(30)
    assert not errors, errors
    return _check(seen, specs, steps)


@pytest.mark.timeout(120)
def test_engines_bit_exact_over_tcp_with_late_running_streams(pair):
    specs = _specs()
    assert [len(p) for _, p in specs] == [1, 1, 1, 1, 2, 4, 5, 49]  # single, tail, capped-and-aligned cases
    send_side, recv_side = Side(), Side()
    assert _exchange(pair, specs, 6, send_side, recv_side) == []
    # nothing allocated per step: one event per chunk (+1) per sender, three per receiver, all made up front
    assert send_side.ops.events == sum(len(p) + 1 for _, p in specs)
    assert recv_side.ops.events == 3 * len(specs)
    assert recv_side.ops.copies == 6 * sum(len(p) for _, p in specs)


@pytest.mark.timeout(120)
def test_engines_bit_exact_when_each_message_is_consumed_at_once(pair):
    assert _exchange(pair, _specs(), 4, Side(), Side(), defer_reads=False) == []


@pytest.mark.timeout(120)
def test_unchunked_plan_is_the_same_protocol_with_one_message(pair):
    specs = [(n, chunk_plan(n, 0)) for n in SIZES]
    assert all(len(p) == 1 for _, p in specs)
    assert _exchange(pair, specs, 3, Side(), Side()) == []


@pytest.mark.timeout(120)
def test_simulator_catches_a_receiver_without_stream_waits(pair):
    """Mutant receiver streams (waits ignored): the late reads see later messages -> wrong bytes."""
    bad = _exchange(pair, _specs(), 4, Side(), Side(stream_cls=NoWaitStream))
    assert bad, "the lazy stream model should expose missing stream ordering"


@pytest.mark.timeout(120)
def test_simulator_catches_a_sender_that_does_not_wait_for_its_copies(pair):
    class NoSyncOps(LazyOps):
        def new_event(self) -> LazyEvent:
            self.events += 1
            return NoSyncEvent()

    bad = _exchange(pair, _specs(), 3, Side(ops=NoSyncOps()), Side())
    assert bad, "the lazy stream model should expose chunks sent before their copy ran"


@pytest.mark.timeout(60)
def test_receive_timing_out_mid_message_resumes_at_the_next_chunk(pair):
    tx, rx = pair
    n, plan = 5 * 4096 + 7, chunk_plan(5 * 4096 + 7, 4096)
    side = Side()
    hosts = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
    dev = torch.zeros(n, dtype=torch.uint8)
    r = StagedReceiver(hosts, dev, plan, ops=side.ops)
    r.post_all(rx, 3)
    msgs = [_pattern(n, 1), _pattern(n, 2)]
    step = 0
    for off, length in plan[:2]:  # only the first two chunks of message 1
        step += 1
        tx.send(3, msgs[0][off : off + length], step=step, timeout=10)
    with pytest.raises(TransferTimeout):
        r.recv(rx, 3, timeout=0.5, current=side.current, side=side.side)
    assert r.pos == 2
    for off, length in plan[2:]:
        step += 1
        tx.send(3, msgs[0][off : off + length], step=step, timeout=10)
    r.recv(rx, 3, timeout=10, current=side.current, side=side.side)
    side.current.flush()
    assert torch.equal(dev, msgs[0])
    for off, length in plan:
        step += 1
        tx.send(3, msgs[1][off : off + length], step=step, timeout=10)
    r.recv(rx, 3, timeout=10, current=side.current, side=side.side)
    side.current.flush()
    assert torch.equal(dev, msgs[1])


def _mismatched_chunks(pair, send_chunk: int, recv_chunk: int):
    """A receiver posted for ``recv_chunk`` chunks and a sender (in a thread) cutting ``send_chunk`` ones."""
    tx, rx = pair
    n = 4 * 4096
    side_s, side_r = Side(), Side()
    sender = StagedSender(torch.zeros(n, dtype=torch.uint8), chunk_plan(n, send_chunk), ops=side_s.ops)
    r = StagedReceiver(
        [torch.zeros(n, dtype=torch.uint8) for _ in range(2)],
        torch.zeros(n, dtype=torch.uint8),
        chunk_plan(n, recv_chunk),
        ops=side_r.ops,
    )
    r.post_all(rx, 0)
    errors: list = []

    def send() -> None:
        try:
            sender.send(tx, 0, _pattern(n, 5), step=0, timeout=5, current=side_s.current, side=side_s.side)
        except TensorWireError as exc:
            errors.append(exc)

    th = threading.Thread(target=send, daemon=True)
    th.start()
    return rx, r, side_r, th


@pytest.mark.timeout(60)
def test_different_chunking_on_the_two_sides_is_a_protocol_error_never_wrong_data(pair):
    rx, r, side_r, th = _mismatched_chunks(pair, 4096, 8192)
    with pytest.raises(ProtocolError, match=STAGING_CHUNK_ENV):
        r.recv(rx, 0, timeout=10, current=side_r.current, side=side_r.side)
    th.join(20)
    assert rx.closed  # framing is lost: the link is closed rather than misread


@pytest.mark.timeout(60)
def test_larger_chunks_than_posted_buffers_are_refused_by_the_transport(pair):
    rx, r, side_r, th = _mismatched_chunks(pair, 8192, 4096)
    with pytest.raises(ProtocolError):
        r.recv(rx, 0, timeout=10, current=side_r.current, side=side_r.side)
    th.join(20)


class FlakyTransport:
    """Accepts ``ok`` sends, then raises TransferTimeout; records close()."""

    def __init__(self, ok: int) -> None:
        self.ok = ok
        self.sent: list[int] = []
        self.closed = False

    def send(self, tag: int, buf: Any, *, step: int, timeout: float | None, shape: Any = None) -> None:
        if len(self.sent) >= self.ok:
            raise TransferTimeout("no credit")
        self.sent.append(step)

    def close(self) -> None:
        self.closed = True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ok,closes", [(0, False), (1, True), (3, True)])
def test_a_send_failing_after_its_first_chunk_closes_the_transport(ok, closes):
    n = 4 * 4096 + 1
    side = Side()
    sender = StagedSender(torch.zeros(n, dtype=torch.uint8), chunk_plan(n, 4096), ops=side.ops)
    t = FlakyTransport(ok)
    with pytest.raises(TransferTimeout):
        sender.send(t, 0, torch.ones(n, dtype=torch.uint8), step=10, timeout=1, current=side.current, side=side.side)
    assert t.sent == list(range(11, 11 + ok))
    assert t.closed is closes
    assert side.side.done == len(side.side.ops)  # every queued copy ran before send returned


@pytest.mark.timeout(30)
def test_send_returns_the_last_step_and_numbers_chunks_consecutively():
    n = 3 * 4096
    side = Side()
    sender = StagedSender(torch.zeros(n, dtype=torch.uint8), chunk_plan(n, 4096), ops=side.ops)
    t = FlakyTransport(100)
    assert (
        sender.send(t, 0, torch.ones(n, dtype=torch.uint8), step=0, timeout=1, current=side.current, side=side.side)
        == 3
    )
    assert (
        sender.send(t, 0, torch.ones(n, dtype=torch.uint8), step=3, timeout=1, current=side.current, side=side.side)
        == 6
    )
    assert t.sent == [1, 2, 3, 4, 5, 6]


@pytest.mark.timeout(30)
def test_engines_refuse_plans_that_do_not_cover_their_slots():
    with pytest.raises(ValueError):
        StagedSender(torch.zeros(10, dtype=torch.uint8), chunk_plan(9, 4), ops=LazyOps())
    with pytest.raises(ValueError):
        StagedReceiver(
            [torch.zeros(10, dtype=torch.uint8)] * 2,
            torch.zeros(11, dtype=torch.uint8),
            chunk_plan(10, 4),
            ops=LazyOps(),
        )
