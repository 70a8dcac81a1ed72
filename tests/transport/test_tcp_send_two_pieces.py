"""``send_two_pieces``: a reply, then a payload another thread is still writing, put on the wire as its bytes are
ready -- one frame for the peer, bit-exact; without both credits, or with cross-memory attach, the payload is
finished first and the two go as ``send_two``; a failure mid-frame breaks the connection, one before it does not."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorwire.errors import PeerLostError, TensorWireError
from tensorwire.transport.base import Transport

from tcp_pairs import tcp_pair_on_port_0

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    with tcp_pair_on_port_0() as ab:
        yield ab


def _credits_reach(a, b) -> None:
    ping = torch.zeros(1, dtype=torch.uint8)
    a.post_recv(9, ping)
    b.send(9, torch.ones(1, dtype=torch.uint8), timeout=10)
    a.wait_recv(9, timeout=10)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class _Writer:
    """Fills ``out`` from ``src`` piece by piece in a thread of its own; :meth:`ready` yields each piece's end once
    it is written (the way the daemon's helper gathers rows while they are sent)."""

    def __init__(self, src: torch.Tensor, piece: int, fail_at: int | None = None) -> None:
        self.src, self.piece, self.fail_at = src, piece, fail_at
        self.out = torch.zeros_like(src)
        self.ends = [min(len(src), i + piece) for i in range(0, len(src), piece)] or [0]
        self.done = threading.Semaphore(0)
        self.yielded: list[int] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        a = 0
        for end in self.ends:
            self.out[a:end] = self.src[a:end]
            a = end
            self.done.release()

    def ready(self):
        for i, end in enumerate(self.ends):
            if self.fail_at == i:
                raise RuntimeError("the gather failed")
            assert self.done.acquire(timeout=10)
            self.yielded.append(end)
            yield end


@pytest.mark.parametrize("n,piece", [(1 << 20, 64 << 10), (3 << 20, 1 << 20), (100_003, 4096), (4096, 8192), (0, 8)])
def test_the_payload_arrives_whole_as_one_message(pair, n, piece):
    a, b = pair
    reply, src = _bytes(48, 1), _bytes(n, 2)
    got_reply, got = torch.zeros(48, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    b.post_recv(5, got_reply)
    b.post_recv(1, got)
    _credits_reach(a, b)
    w = _Writer(src, piece)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            a.send_two_pieces((5, reply, 1), (1, w.out, 1), w.ready(), timeout=20)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    th = threading.Thread(target=send)  # (MiBs are more than the socket holds: the peer reads meanwhile)
    th.start()
    r5 = b.wait_recv(5, timeout=20)
    r1 = b.wait_recv(1, timeout=20)
    th.join(20)
    assert not errors, errors
    assert (r5.nbytes, r5.step, r1.nbytes, r1.step) == (48, 1, n, 1)
    assert torch.equal(got_reply, reply) and torch.equal(got, src)
    assert w.yielded == w.ends  # every piece was waited for
    # the connection goes on as usual
    b.post_recv(2, d := torch.zeros(5, dtype=torch.uint8))
    a.send(2, torch.full((5,), 7, dtype=torch.uint8), timeout=10)
    assert b.wait_recv(2, timeout=10).nbytes == 5 and bool((d == 7).all())


@pytest.mark.pure_python
def test_pieces_go_out_as_they_are_ready(pair, monkeypatch):
    from tensorwire.transport.tcp.transport import TcpTransport

    a, b = pair
    b.post_recv(5, torch.zeros(8, dtype=torch.uint8))
    b.post_recv(1, got := torch.zeros(40, dtype=torch.uint8))
    _credits_reach(a, b)
    writes: list[int] = []
    real_write = TcpTransport._write

    def write(self, views, deadline):
        writes.append(sum(len(v) for v in views))
        return real_write(self, views, deadline)

    monkeypatch.setattr(TcpTransport, "_write", write)
    src = _bytes(40, 3)
    a.send_two_pieces((5, torch.zeros(8, dtype=torch.uint8), None), (1, src, None), iter([10, 10, 25, 40]), timeout=10)
    frame = writes[0] - 8 - 10  # the first write: both headers, the reply and the first 10 bytes
    assert writes == [frame + 8 + 10, 15, 15], writes
    assert b.wait_recv(1, timeout=10).nbytes == 40 and torch.equal(got, src)


def test_without_both_credits_the_payload_is_finished_first(pair):
    a, b = pair
    reply, src = _bytes(16, 4), _bytes(1 << 20, 5)
    got_reply, got = torch.zeros(16, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    b.post_recv(5, got_reply)  # no receive on tag 1 yet
    w = _Writer(src, 128 << 10)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            a.send_two_pieces((5, reply, None), (1, w.out, None), w.ready(), timeout=20)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    th = threading.Thread(target=send)
    th.start()
    assert b.wait_recv(5, timeout=20).nbytes == 16
    b.post_recv(1, got)
    assert b.wait_recv(1, timeout=20).nbytes == 1 << 20
    th.join(20)
    assert not errors, errors
    assert w.yielded == w.ends and torch.equal(got, src) and torch.equal(got_reply, reply)


def test_a_failure_before_anything_is_out_leaves_the_connection_usable(pair):
    a, b = pair
    b.post_recv(5, torch.zeros(8, dtype=torch.uint8))
    b.post_recv(1, got := torch.zeros(64, dtype=torch.uint8))
    _credits_reach(a, b)
    w = _Writer(_bytes(64, 6), 16, fail_at=0)
    with pytest.raises(RuntimeError, match="the gather failed"):
        a.send_two_pieces((5, torch.zeros(8, dtype=torch.uint8), None), (1, w.out, None), w.ready(), timeout=10)
    src = _bytes(64, 7)
    a.send_two((5, torch.zeros(8, dtype=torch.uint8), None), (1, src, None), timeout=10)
    assert b.wait_recv(5, timeout=10).nbytes == 8
    assert b.wait_recv(1, timeout=10).nbytes == 64 and torch.equal(got, src)


def test_a_failure_mid_frame_breaks_the_connection_on_both_ends(pair):
    a, b = pair
    b.post_recv(5, torch.zeros(8, dtype=torch.uint8))
    b.post_recv(1, torch.zeros(64, dtype=torch.uint8))
    _credits_reach(a, b)
    w = _Writer(_bytes(64, 8), 16, fail_at=2)
    with pytest.raises(RuntimeError, match="the gather failed"):
        a.send_two_pieces((5, torch.zeros(8, dtype=torch.uint8), None), (1, w.out, None), w.ready(), timeout=10)
    assert b.wait_recv(5, timeout=10).nbytes == 8  # the reply was whole
    with pytest.raises(PeerLostError, match="broke off mid-frame"):
        a.send(2, torch.zeros(4, dtype=torch.uint8), timeout=5)
    with pytest.raises(TensorWireError):  # the rows never come whole: the peer sees the connection end
        b.wait_recv(1, timeout=10)


def test_the_base_class_finishes_the_payload_then_sends_two():
    sent: list[tuple[int, int]] = []
    order: list[str] = []

    class Recorder(Transport):
        kind = "recorder"

        def send(self, tag, buf, *, step=None, shape=None, timeout):
            order.append("send")
            sent.append((tag, buf.numel()))

        def post_recv(self, tag, buf, *, header=False):  # pragma: no cover - not called
            raise AssertionError

        def wait_recv(self, tag, *, timeout):  # pragma: no cover - not called
            raise AssertionError

        def close(self):
            pass

        @property
        def closed(self):
            return False

    def ready():
        for end in (3, 9):
            order.append(f"ready {end}")
            yield end

    Recorder().send_two_pieces((5, torch.zeros(3), 1), (1, torch.zeros(9), 2), ready(), timeout=4.0)
    assert order == ["ready 3", "ready 9", "send", "send"] and sent == [(5, 3), (1, 9)]
