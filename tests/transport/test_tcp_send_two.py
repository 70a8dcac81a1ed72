"""``send_two``: a reply and the payload behind it in one write where both credits are there, else two sends --
either way the peer receives both, in order, at their steps."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorwire.transport.base import Transport

from tcp_pairs import tcp_pair_on_port_0

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    with tcp_pair_on_port_0() as ab:
        yield ab


def _credits_reach(a, b) -> None:
    """Have ``a`` read the credits ``b`` granted: they ride ahead of a message ``b`` sends it."""
    ping = torch.zeros(1, dtype=torch.uint8)
    a.post_recv(9, ping)
    b.send(9, torch.ones(1, dtype=torch.uint8), timeout=10)
    a.wait_recv(9, timeout=10)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", [0, 1, 512, 3 << 20])
def test_both_credits_there_both_arrive_in_order(pair, n):
    a, b = pair
    reply, payload = _bytes(64, 1), _bytes(n, 2)
    got_reply, got_payload = torch.zeros(64, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    b.post_recv(5, got_reply)
    b.post_recv(1, got_payload)
    _credits_reach(a, b)
    assert a.has_credit(5) and a.has_credit(1)  # so the two go in one write
    sent = a.bytes_sent
    done: list[BaseException] = []

    def send() -> None:
        try:
            a.send_two((5, reply, 1), (1, payload, 1), timeout=20)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            done.append(exc)

    th = threading.Thread(target=send)  # (3 MiB is more than the socket holds: the peer reads meanwhile)
    th.start()
    r1 = b.wait_recv(1, timeout=20)
    r5 = b.wait_recv(5, timeout=20)
    th.join(20)
    assert not done, done
    assert (r5.nbytes, r5.step, r1.nbytes, r1.step) == (64, 1, n, 1)
    assert torch.equal(got_reply, reply) and torch.equal(got_payload, payload)
    assert a.bytes_sent - sent == 64 + n


@pytest.mark.pure_python
def test_with_both_credits_there_it_is_one_write(pair, monkeypatch):
    from tensorwire.transport.tcp.transport import TcpTransport

    a, b = pair
    d5, d1 = torch.zeros(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    b.post_recv(5, d5)
    b.post_recv(1, d1)
    _credits_reach(a, b)
    writes: list[int] = []
    real_write = TcpTransport._write

    def write(self, views, deadline):
        writes.append(len(views))
        return real_write(self, views, deadline)

    def no_send(*args, **kwargs):
        raise AssertionError("send() called: not one write")

    monkeypatch.setattr(TcpTransport, "_write", write)
    monkeypatch.setattr(TcpTransport, "send", no_send)
    a.send_two(
        (5, torch.full((8,), 5, dtype=torch.uint8), None),
        (1, torch.full((16,), 1, dtype=torch.uint8), None),
        timeout=10,
    )
    assert writes == [4]  # two headers, two payloads
    assert b.wait_recv(1, timeout=10).nbytes == 16 and b.wait_recv(5, timeout=10).nbytes == 8
    assert bool((d5 == 5).all()) and bool((d1 == 1).all())


def test_without_the_second_credit_the_first_goes_at_once(pair):
    a, b = pair
    reply, payload = _bytes(64, 3), _bytes(1 << 20, 4)
    got_reply, got_payload = torch.zeros(64, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    b.post_recv(5, got_reply)
    errors: list[BaseException] = []

    def send() -> None:
        try:
            a.send_two((5, reply, None), (1, payload, None), timeout=20)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    th = threading.Thread(target=send)
    th.start()
    assert b.wait_recv(5, timeout=20).nbytes == 64  # out before the payload's credit exists
    assert torch.equal(got_reply, reply)
    b.post_recv(1, got_payload)  # now the payload may come
    assert b.wait_recv(1, timeout=20).nbytes == 1 << 20
    th.join(20)
    assert not errors, errors
    assert torch.equal(got_payload, payload)


def test_two_messages_on_one_tag_keep_their_order(pair):
    a, b = pair
    first, second = _bytes(100, 5), _bytes(200, 6)
    d1, d2 = torch.zeros(100, dtype=torch.uint8), torch.zeros(200, dtype=torch.uint8)
    b.post_recv(2, d1)
    b.post_recv(2, d2)
    _credits_reach(a, b)
    a.send_two((2, first, None), (2, second, None), timeout=20)
    assert b.wait_recv(2, timeout=20).nbytes == 100
    assert b.wait_recv(2, timeout=20).nbytes == 200
    assert torch.equal(d1, first) and torch.equal(d2, second)


def test_the_base_class_sends_them_one_after_the_other():
    sent: list[tuple[int, int, int | None, float | None]] = []

    class Recorder(Transport):
        kind = "recorder"

        def send(self, tag, buf, *, step=None, shape=None, timeout):
            sent.append((tag, buf.numel(), step, timeout))

        def post_recv(self, tag, buf, *, header=False):  # pragma: no cover - not called
            raise AssertionError

        def wait_recv(self, tag, *, timeout):  # pragma: no cover - not called
            raise AssertionError

        def close(self):
            pass

        @property
        def closed(self):
            return False

    Recorder().send_two((5, torch.zeros(3), 1), (1, torch.zeros(9), 2), timeout=4.0)
    assert sent == [(5, 3, 1, 4.0), (1, 9, 2, 4.0)]


def test_spin_is_set_per_connection(pair):
    a, b = pair
    assert a.spin_us == 0.0  # a connection without the link secret never polls ...
    a.set_spin(150)
    assert a.spin_us == pytest.approx(150)  # ... unless told to (the serve client's TENSORWIRE_SERVE_SPIN_US)
    a.set_spin(-5)
    assert a.spin_us == 0.0
    b.post_recv(1, got := torch.zeros(8, dtype=torch.uint8))
    a.set_spin(150)
    a.send(1, torch.full((8,), 9, dtype=torch.uint8), timeout=10)
    assert b.wait_recv(1, timeout=10).nbytes == 8 and bool((got == 9).all())
