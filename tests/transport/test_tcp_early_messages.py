"""TCP transport: a message completes its receive whether it came before the receive was posted or after.

Across hosts, a peer's message often arrives before the receiver posts the buffer it is for (into an eager
buffer, copied when the buffer is posted): every size, every kind of buffer (a tensor, a writable byte view, the
read-only empty view a receive of no bytes may post), both orders. A buffer that can never be written is refused
when it is posted, and a message that cannot be put into its buffer fails that receive alone: the connection and
every other message on it go on.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tcp_pairs import tcp_pair

import tensorwire as tw
from tensorwire.transport.tcp import TcpListener, TcpTransport

pytestmark = pytest.mark.timeout(60)

EAGER = 4096
#: empty, one byte, an eager buffer's size exactly, one byte more (waits for its credit), a large one
SIZES = [0, 1, EAGER, EAGER + 1, (1 << 20) + 3]


@pytest.fixture()
def pair():
    lst = TcpListener("127.0.0.1", port=0)
    a, b = tcp_pair(lst)
    b.offer_eager(slots=2, size=EAGER)
    _read_what_came(a)  # the offer
    yield a, b
    a.close()
    b.close()
    lst.close()


def _read_what_came(t: TcpTransport) -> None:
    """Make ``t`` read its socket (a wait on a tag nothing is sent on)."""
    with pytest.raises(tw.TransferTimeout):
        t.wait_recv(99, timeout=0.2)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _buffer(n: int, into: str):
    """(what is posted, a function reading back what landed in it)."""
    if into == "tensor":
        t = torch.full((n,), 7, dtype=torch.uint8)
        return t, lambda: t.clone()
    if n == 0:
        mv = memoryview(b"")  # read-only: what a receive of no bytes may post
    else:
        mv = memoryview(bytearray(b"\x07" * n))
    return mv, lambda: torch.frombuffer(bytearray(mv), dtype=torch.uint8) if n else torch.zeros(0, dtype=torch.uint8)


def _send_in_thread(a: TcpTransport, tag: int, src: torch.Tensor, shape: tuple[int, ...]) -> threading.Thread:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            a.send(tag, src, shape=shape, timeout=20)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.errors = errors  # type: ignore[attr-defined]
    th.start()
    return th


def _join(th: threading.Thread) -> None:
    th.join(20)
    assert not th.is_alive(), "the send did not finish"
    if th.errors:  # type: ignore[attr-defined]
        raise th.errors[0]  # type: ignore[attr-defined]


@pytest.mark.parametrize("into", ["tensor", "view"])
@pytest.mark.parametrize("order", ["sent_first", "posted_first"])
@pytest.mark.parametrize("n", SIZES)
def test_every_size_completes_its_receive_whether_sent_before_or_after_it_was_posted(pair, n, order, into):
    a, b = pair
    for step in (1, 2, 3):  # the same tag again: nothing was left behind by the message before
        src = _bytes(n, seed=step)
        buf, landed = _buffer(n, into)
        if order == "sent_first":
            th = _send_in_thread(a, 1, src, (n, 1))
            _read_what_came(b)  # a small message lands in an eager buffer before any receive is posted
            b.post_recv(1, buf, header=True)
        else:
            b.post_recv(1, buf, header=True)
            th = _send_in_thread(a, 1, src, (n, 1))
        got = b.wait_recv(1, timeout=20)
        _join(th)
        assert (got.nbytes, got.shape, got.step) == (n, (n, 1), step)
        assert torch.equal(landed(), src)
    # the connection goes on both ways
    back = torch.zeros(3, dtype=torch.uint8)
    a.post_recv(2, back)
    b.send(2, _bytes(3, seed=9), timeout=10)
    assert a.wait_recv(2, timeout=10).nbytes == 3 and torch.equal(back, _bytes(3, seed=9))


def test_empty_messages_that_came_early_complete_read_only_empty_receives_in_order(pair):
    a, b = pair
    # two empty messages and a small one, all before any receive is posted (the two eager buffers, then a credit)
    assert a.try_send(1, torch.zeros(0, dtype=torch.uint8), shape=(0, 4)) is True
    assert a.try_send(1, torch.zeros(0, dtype=torch.uint8), shape=(0,)) is True
    _read_what_came(b)
    empty = memoryview(b"")
    b.post_recv(1, empty, header=True)
    b.post_recv(1, empty, header=True)  # the same read-only view twice (a shared constant)
    small = torch.zeros(5, dtype=torch.uint8)
    b.post_recv(1, small, header=True)
    a.send(1, _bytes(5, seed=3), shape=(5,), timeout=10)
    assert [b.wait_recv(1, timeout=10) for _ in range(3)] == [
        tw.transport.base.Received(0, (0, 4), 1),
        tw.transport.base.Received(0, (0,), 2),
        tw.transport.base.Received(5, (5,), 3),
    ]
    assert torch.equal(small, _bytes(5, seed=3))


@pytest.mark.parametrize("kind", ["read_only", "released"])
def test_a_buffer_that_cannot_be_written_is_refused_at_post_and_its_message_waits_for_the_next_one(pair, kind):
    a, b = pair
    src = _bytes(64, seed=4)
    assert a.try_send(1, src, shape=(64,)) is True
    _read_what_came(b)  # the message waits in an eager buffer
    if kind == "read_only":
        bad = memoryview(bytes(64))
    else:
        bad = memoryview(bytearray(64))
        bad.release()
    with pytest.raises(tw.ConfigError, match="tag 1"):
        b.post_recv(1, bad, header=True)
    good = torch.zeros(64, dtype=torch.uint8)
    b.post_recv(1, good, header=True)
    got = b.wait_recv(1, timeout=5)
    assert (got.nbytes, got.step) == (64, 1) and torch.equal(good, src)


def test_a_posted_view_released_by_its_owner_is_refused_when_posted_again(pair):
    a, b = pair
    mv = memoryview(bytearray(8))
    b.post_recv(1, mv)
    a.send(1, _bytes(8, seed=5), timeout=5)
    assert b.wait_recv(1, timeout=5).nbytes == 8
    mv.release()  # the transport still holds its view of this object: posting it again must not use it
    with pytest.raises(tw.ConfigError, match="cannot be used"):
        b.post_recv(1, mv)
    fresh = torch.zeros(8, dtype=torch.uint8)
    b.post_recv(1, fresh)
    a.send(1, _bytes(8, seed=6), timeout=5)
    assert b.wait_recv(1, timeout=5).step == 2 and torch.equal(fresh, _bytes(8, seed=6))


class _Unwritable:
    """A byte view whose writes fail (what a bug in the copy of an early message would do)."""

    readonly = False

    def __init__(self, n: int) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, key: slice) -> memoryview:
        return memoryview(bytearray(self._n))[key]

    def __setitem__(self, key: slice, value: object) -> None:
        raise RuntimeError("copy refused")


@pytest.mark.pure_python
def test_a_copy_that_fails_fails_that_receive_alone_and_the_connection_goes_on(pair):
    a, b = pair
    assert a.try_send(1, _bytes(16, seed=7), shape=(16,)) is True
    assert a.try_send(3, _bytes(4, seed=8), shape=(4,)) is True  # another tag's message, also early
    _read_what_came(b)
    key = object()
    b._views[id(key)] = (key, _Unwritable(16))  # the view the transport made of this buffer
    b.post_recv(1, key, header=True)
    with pytest.raises(tw.TransportError, match="could not be copied") as info:
        b.wait_recv(1, timeout=5)
    assert isinstance(info.value.__cause__, RuntimeError)
    other = torch.zeros(4, dtype=torch.uint8)
    b.post_recv(3, other, header=True)
    assert b.wait_recv(3, timeout=5).nbytes == 4 and torch.equal(other, _bytes(4, seed=8))
    nxt = torch.zeros(16, dtype=torch.uint8)  # the next message on the failed receive's tag is the next one
    b.post_recv(1, nxt, header=True)
    a.send(1, _bytes(16, seed=9), shape=(16,), timeout=5)
    got = b.wait_recv(1, timeout=5)
    assert got.step == 2 and torch.equal(nxt, _bytes(16, seed=9))
