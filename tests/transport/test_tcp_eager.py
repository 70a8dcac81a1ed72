"""TCP transport: eager messages, credits held back, try_send / finish_send, and the flush-before-blocking registry."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time

import pytest
import torch

from tcp_pairs import tcp_pair

import tensorwire as tw
from tensorwire.transport import tcp
from tensorwire.transport.cma import peer as tcp_cma
from tensorwire.transport.tcp import credits as tcp_credits
from tensorwire.transport.base import new_nonce
from tensorwire.transport.tcp import PartialSend, TcpListener, flush_pending_credits

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def pair():
    lst = TcpListener("127.0.0.1", port=0)
    nonce = new_nonce()
    lst.expect(nonce)
    out = {}
    th = threading.Thread(
        target=lambda: out.setdefault("a", TcpListener.connect("127.0.0.1", lst.address[1], nonce, timeout=10))
    )
    th.start()
    b = lst.accept(nonce, timeout=10)
    th.join(10)
    a = out["a"]
    yield a, b
    a.close()
    b.close()
    lst.close()


def _read_what_came(t: tcp.TcpTransport) -> None:
    """Make ``t`` read its socket (a wait on a tag nothing is sent on)."""
    with pytest.raises(tw.TransferTimeout):
        t.wait_recv(99, timeout=0.3)


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_small_message_goes_before_its_receive_is_posted_and_lands_in_the_buffer_posted_later(pair):
    a, b = pair
    b.offer_eager(slots=2, size=4096)
    _read_what_came(a)  # the offer
    src = _bytes(1000, 1)
    assert a.try_send(1, src, shape=(2, 500)) is True  # no credit: eager
    assert a.try_send(1, _bytes(5000, 2)) is False  # larger than the eager buffers: waits for a credit
    _read_what_came(b)  # the message arrives before any buffer is posted: into an eager buffer
    dst = torch.zeros(1000, dtype=torch.uint8)
    b.post_recv(1, dst, header=True)
    got = b.wait_recv(1, timeout=0)  # there already: copied when the buffer was posted
    assert got.nbytes == 1000 and got.shape == (2, 500) and got.step == 1
    assert torch.equal(dst, src)
    # the credit of that buffer settles the sender's balance; the next message goes with a credit again
    b.post_recv(1, dst)
    src2 = _bytes(3000 // 3, 3)
    a.send(1, src2, timeout=5)
    assert b.wait_recv(1, timeout=5).nbytes == 1000 and torch.equal(dst, src2)


def test_an_eager_message_to_a_posted_buffer_goes_straight_into_it(pair):
    a, b = pair
    b.offer_eager(slots=1, size=4096)
    dst = torch.zeros(64, dtype=torch.uint8)
    b.post_recv(1, dst)  # its credit is held back: the buffer is no larger than an eager buffer
    src = _bytes(64, 4)
    for k in range(20):  # one eager buffer, 20 messages: each one gives it back
        src[0] = k
        a.send(1, src, timeout=5)
        assert b.wait_recv(1, timeout=5).step == k + 1
        assert torch.equal(dst, src)
        b.post_recv(1, dst)


def test_when_the_eager_buffers_are_taken_a_sender_waits_for_one_back(pair):
    a, b = pair
    b.offer_eager(slots=2, size=1024)
    _read_what_came(a)
    msgs = [_bytes(100, 10 + k) for k in range(3)]
    assert a.try_send(5, msgs[0]) is True
    assert a.try_send(5, msgs[1]) is True
    assert a.try_send(5, msgs[2]) is False  # both eager buffers taken, no credit: nothing written
    done = threading.Event()
    th = threading.Thread(target=lambda: (a.send(5, msgs[2], timeout=10), done.set()))
    th.start()
    time.sleep(0.3)
    assert not done.is_set()
    dsts = [torch.zeros(100, dtype=torch.uint8) for _ in range(3)]
    for d in dsts:
        b.post_recv(5, d)
    steps = [b.wait_recv(5, timeout=10).step for _ in range(3)]
    th.join(10)
    assert done.is_set() and steps == [1, 2, 3]
    assert all(torch.equal(d, m) for d, m in zip(dsts, msgs))


def test_a_stashed_eager_message_larger_than_the_buffer_posted_for_it_is_refused(pair):
    a, b = pair
    b.offer_eager(slots=2, size=4096)
    _read_what_came(a)
    assert a.try_send(1, _bytes(100, 5)) is True
    _read_what_came(b)
    b.post_recv(1, torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(tw.ProtocolError, match="sent 100 bytes on tag 1; the slot holds 64"):
        b.wait_recv(1, timeout=5)


def test_a_message_larger_than_the_eager_buffers_gets_a_held_back_credit_within_a_read_slice(pair):
    """A receive of a small buffer keeps its credit back; a peer sending more than fits still gets it (and the
    receiver reports the mismatch) after one read slice without traffic."""
    a, b = pair
    b.offer_eager(slots=2, size=4096)
    b.post_recv(1, torch.zeros(64, dtype=torch.uint8))
    th = threading.Thread(target=lambda: a.send(1, _bytes(100_000, 6), timeout=10), daemon=True)
    th.start()
    t0 = time.monotonic()
    with pytest.raises(tw.ProtocolError, match="sent 100000 bytes on tag 1; the slot holds 64"):
        b.wait_recv(1, timeout=10)
    assert time.monotonic() - t0 < 3 * tcp.TcpTransport.READ_SLICE + 1.0
    th.join(10)


def test_an_eager_offer_is_checked_and_made_once(pair):
    a, b = pair
    with pytest.raises(ValueError):
        b.offer_eager(slots=0, size=10)
    b.offer_eager(slots=1, size=100)
    b.offer_eager(slots=5, size=1000)  # no-op: the peer was told 1 x 100 bytes
    _read_what_came(a)
    assert a.try_send(1, _bytes(100, 8)) is True
    assert a.try_send(1, _bytes(100, 8)) is False
    assert a.try_send(1, _bytes(101, 8)) is False


def test_try_send_writes_what_the_socket_takes_and_finish_send_the_rest(pair):
    a, b = pair
    n = 64 << 20  # more than any socket buffer holds
    dst = torch.zeros(n, dtype=torch.uint8)
    b.post_recv(1, dst)
    flush_pending_credits()  # the big buffer's credit goes now
    _read_what_came(a)
    src = torch.arange(n, dtype=torch.int64).to(torch.uint8)
    partial = a.try_send(1, src)
    assert isinstance(partial, PartialSend)
    assert a.try_send(2, _bytes(10, 7)) is False  # the connection is taken until the frame is whole
    errors: list[BaseException] = []

    def finish() -> None:
        try:
            a.finish_send(partial, timeout=30)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=finish)
    th.start()
    got = b.wait_recv(1, timeout=30)
    th.join(30)
    assert not errors and got.nbytes == n and torch.equal(dst, src)


def test_a_receive_posted_while_credits_are_flushed_stays_registered_for_the_flush_before_blocking(pair):
    """A credit posted while another thread flushes must never be left where no flush before blocking finds it
    (the peer would wait for it until its timeout). Thread switches are forced every microsecond to hit the
    window between the flush's "nothing left" and its removal from the registry."""
    _, b = pair
    bufs = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    lost = 0
    try:
        for i in range(1500):
            go = threading.Barrier(2)
            b.post_recv(1, bufs[(i + 1) % 2])  # something to flush
            post = threading.Thread(target=lambda go=go, buf=bufs[i % 2]: (go.wait(), b.post_recv(1, buf)))
            flush = threading.Thread(target=lambda go=go: (go.wait(), b._flush_credits()))
            post.start()
            flush.start()
            post.join()
            flush.join()
            if b._pending_credits and b not in tcp_credits.PENDING:
                lost += 1
                b._flush_credits()
            with b._lock:
                b._posted[1].clear()
    finally:
        sys.setswitchinterval(old)
    assert lost == 0


def test_only_credits_a_peer_can_do_without_are_held_back(pair):
    a, b = pair
    b.post_recv(1, torch.zeros(0, dtype=torch.uint8))  # no eager offer (a Link, the serve daemon): every credit
    assert b in tcp_credits.URGENT
    b._flush_credits()
    assert b not in tcp_credits.PENDING and b not in tcp_credits.URGENT
    b.offer_eager(slots=1, size=4096)
    b.post_recv(1, torch.zeros(64, dtype=torch.uint8))  # fits an eager buffer, one is free: held back
    assert b in tcp_credits.PENDING and b not in tcp_credits.URGENT
    # Larger than the eager buffers: the peer needs this credit, so it goes at once (with those held back).
    b.post_recv(2, torch.zeros(8192, dtype=torch.uint8))
    assert b not in tcp_credits.PENDING and not b._pending_credits
    _read_what_came(a)
    assert a._credits[1] == 2 and a._credits[2] == 1
    assert a.try_send(3, _bytes(10, 9)) is True  # takes b's only eager buffer (nothing posted on tag 3)
    _read_what_came(b)  # ... where it waits
    b.post_recv(1, torch.zeros(64, dtype=torch.uint8))  # no eager buffer free: the peer may need this credit
    assert b not in tcp_credits.PENDING and not b._pending_credits
    _read_what_came(a)
    assert a._credits[1] == 3


def test_a_credit_the_peer_needs_is_held_back_where_no_eager_offer_was_made(pair):
    """Without an eager offer (a Link, the serve daemon: receives posted ahead of need) a credit waits for
    the next frame going the other way, or for this side to block; it is never sent at the post."""
    a, b = pair
    b.post_recv(1, torch.zeros(8192, dtype=torch.uint8))
    assert b in tcp_credits.URGENT and b._pending_credits[1] == 1
    assert a.try_send(1, _bytes(8192, 1)) is False  # no credit came
    b._flush_credits()
    _read_what_came(a)
    assert a._credits[1] == 1


def test_a_credit_flushed_at_the_post_into_a_full_socket_stays_pending(pair, monkeypatch):
    """The flush at the post never blocks: a socket that takes nothing leaves the credit (and its registration
    for the flush before blocking) as it was."""
    a, b = pair
    b.offer_eager(slots=1, size=64)

    class Full:
        def __init__(self, sock):
            self._sock = sock

        def sendmsg(self, *args):
            raise BlockingIOError

        def __getattr__(self, name):
            return getattr(self._sock, name)

    real = b._sock
    monkeypatch.setattr(b, "_sock", Full(real))
    b.post_recv(1, torch.zeros(8192, dtype=torch.uint8))
    assert b._pending_credits[1] == 1 and b in tcp_credits.URGENT
    monkeypatch.setattr(b, "_sock", real)
    b._flush_credits()
    _read_what_came(a)
    assert a._credits[1] == 1


@pytest.mark.pure_python
def test_a_credit_frame_cut_at_the_post_and_never_finished_breaks_the_connection(pair, monkeypatch):
    """The socket took part of the credit frame at the post and the rest never went out: nothing can follow part
    of a frame, so the connection fails (PeerLostError), as a blocking flush that times out does."""
    a, b = pair
    b.offer_eager(slots=1, size=64)

    class Partial:
        def __init__(self, sock):
            self._sock = sock

        def sendmsg(self, *args):
            return 1  # one byte of the frame

        def __getattr__(self, name):
            return getattr(self._sock, name)

    def stalled(views, deadline):
        raise tw.TransferTimeout("the rest of the frame did not go out")

    monkeypatch.setattr(b, "_sock", Partial(b._sock))
    monkeypatch.setattr(b, "_write", stalled)
    b.post_recv(1, torch.zeros(8192, dtype=torch.uint8))
    assert isinstance(b._error, tw.PeerLostError), b._error


@pytest.fixture()
def linked_pair():
    """A pair that proved a link secret (so it has cross-memory attach, whose probe may still run)."""
    secret = b"s" * 32
    lst = TcpListener("127.0.0.1", port=0, secret=secret)
    a, b = tcp_pair(lst, secret=secret)
    yield a, b
    a.close()
    b.close()
    lst.close()


def test_a_frame_the_socket_refuses_whole_gives_back_its_credits_and_control_frames(linked_pair, monkeypatch):
    """try_send that writes nothing (socket full) leaves the connection as it was: credits, cross-memory
    control frames, the eager buffer and the step all go back, and the next send carries them."""
    a, b = linked_pair
    assert a.cma is not None
    b.offer_eager(slots=1, size=1024)
    _read_what_came(a)
    a.post_recv(7, torch.zeros(8, dtype=torch.uint8))  # a credit a owes b
    owed_ctrl = [(5, 9, 1, 64, bytes(64))]  # a control frame a owes b (as the cross-memory probe queues them)
    a.cma.put_back(list(owed_ctrl))
    queued = a.cma.take_frames()
    a.cma.put_back(queued)

    class Full:
        def __init__(self, sock):
            self._sock = sock

        def sendmsg(self, *args, **kw):
            raise BlockingIOError

        def __getattr__(self, name):
            return getattr(self._sock, name)

    real = a._sock
    monkeypatch.setattr(a, "_sock", Full(real))
    assert a.try_send(1, _bytes(100, 11)) is False
    monkeypatch.setattr(a, "_sock", real)
    assert a._pending_credits[7] == 1 and a._credits[tcp.EAGER_TAG] == 1 and a._send_steps[1] == 0
    assert a.cma.take_frames() == queued  # back, in order
    a.cma.put_back(queued)
    src = _bytes(100, 12)
    assert a.try_send(1, src) is True  # step 1 again, eagerly, with the credit of tag 7
    dst = torch.zeros(100, dtype=torch.uint8)
    b.post_recv(1, dst)
    assert b.wait_recv(1, timeout=5).step == 1 and torch.equal(dst, src)
    assert b._credits[7] == 1


def _settle_probe(a: tcp.TcpTransport, b: tcp.TcpTransport) -> None:
    """Small round trips until both cross-memory probes are done (their frames ride on these)."""
    one, box_a, box_b = (torch.ones(8, dtype=torch.uint8) for _ in range(3))
    for _ in range(6):
        b.post_recv(90, box_b)
        a.post_recv(91, box_a)
        a.send(90, one, timeout=10)
        b.wait_recv(90, timeout=10)
        b.send(91, one, timeout=10)
        a.wait_recv(91, timeout=10)


def test_try_send_copies_a_moderate_message_into_the_announced_buffer_and_leaves_a_long_copy_to_send(
    linked_pair, monkeypatch
):
    monkeypatch.setattr(tcp.TcpTransport, "INLINE_COPY", 256 << 10)
    a, b = linked_pair
    _settle_probe(a, b)
    if not (a.cma is not None and a.cma.sending and b.cma is not None and b.cma.receiving):
        pytest.skip(f"cross-memory attach is not available here ({a.cma and a.cma.state})")
    n = max(a.cma.min_bytes, 100 << 10)
    dst = torch.zeros(n, dtype=torch.uint8)
    b.post_recv(1, dst)  # announced (SLOT), then its credit
    flush_pending_credits()
    _read_what_came(a)
    src = _bytes(n, 13)
    written = a.cma.messages_written
    assert a.try_send(1, src) is True
    assert a.cma.messages_written == written + 1  # copied into b's buffer in this thread
    assert b.wait_recv(1, timeout=5).nbytes == n and torch.equal(dst, src)
    big = torch.zeros(1 << 20, dtype=torch.uint8)
    b.post_recv(2, big)
    flush_pending_credits()
    _read_what_came(a)
    assert a.try_send(2, _bytes(1 << 20, 14)) is False  # more than INLINE_COPY: send()'s (nothing was sent)
    a.send(2, torch.full((1 << 20,), 5, dtype=torch.uint8), timeout=10)
    assert b.wait_recv(2, timeout=10).nbytes == 1 << 20 and bool((big == 5).all())
    assert a.cma.messages_written == written + 2


def test_an_eager_message_larger_than_the_cross_memory_minimum_takes_the_byte_stream(linked_pair):
    """Eager buffers may be larger than the messages cross-memory attach copies. A message sent before its
    credit came goes over the socket even where the peer announced a buffer for its step (a copy into that
    buffer would spend an eager credit the receiver never gives back), and an announcement that arrives
    after its step went out is dropped, not kept."""
    a, b = linked_pair
    _settle_probe(a, b)
    if not (a.cma is not None and a.cma.sending and b.cma is not None and b.cma.receiving):
        pytest.skip(f"cross-memory attach is not available here ({a.cma and a.cma.state})")
    n = max(a.cma.min_bytes, 64 << 10)
    b.offer_eager(slots=2, size=2 * n)
    _read_what_came(a)
    written = a.cma.messages_written
    # A SLOT for step 1 of tag 1 without its credit, naming a decoy: a copy into it would show there.
    decoy = torch.zeros(n, dtype=torch.uint8)
    a.cma.on_frame(tcp_cma.SLOT, 1, 1, n, struct.pack("<Q56x", decoy.data_ptr()))
    src = _bytes(n, 21)
    assert a.try_send(1, src) is True  # eager: no credit on tag 1
    assert a.cma.messages_written == written and not bool(decoy.any())
    dst = torch.zeros(n, dtype=torch.uint8)
    b.post_recv(1, dst)  # announced (SLOT for step 1) and credited after the message came
    assert b.wait_recv(1, timeout=5).step == 1 and torch.equal(dst, src)
    flush_pending_credits()
    _read_what_came(a)  # the late SLOT for step 1 comes in here
    assert not a.cma._slots  # dropped: step 1 went out already
    # With the credit there first, the same size is copied into the posted buffer.
    dst2 = torch.zeros(n, dtype=torch.uint8)
    b.post_recv(1, dst2)
    flush_pending_credits()
    _read_what_came(a)
    src2 = _bytes(n, 22)
    assert a.try_send(1, src2) is True
    assert a.cma.messages_written == written + 1
    assert b.wait_recv(1, timeout=5).step == 2 and torch.equal(dst2, src2)
    assert b._credits[tcp.EAGER_TAG] == 0 and a._credits[tcp.EAGER_TAG] == 2  # every eager buffer is back


def test_a_spinning_reader_polls_first_then_gives_the_core_away_between_polls(monkeypatch):
    """A blocking read on a link that spins polls the socket without yielding for ``YIELD_AFTER``, then yields
    the core between polls (a peer on the same core can answer only then), and never yields for data already
    there. Two ranks on one core: a 4 KiB dist.send/recv round trip took 395 us without the yield, 222 us with it."""
    from tensorwire.transport.tcp import reader as tcp_reader

    calls: list[float] = []
    monkeypatch.setattr(tcp_reader, "_yield", lambda: calls.append(time.perf_counter()))
    a_sock, b_sock = socket.socketpair()
    t = tcp.TcpTransport(a_sock, spin_us=50_000)  # 50 ms: the data comes within it
    try:
        view = memoryview(bytearray(4))
        b_sock.sendall(b"abcd")
        assert t._recv(view, 4, True) == 4 and bytes(view) == b"abcd" and calls == []  # there already
        sender = threading.Timer(0.01, lambda: b_sock.sendall(b"wxyz"))
        t0 = time.perf_counter()
        sender.start()
        assert t._recv(view, 4, True) == 4 and bytes(view) == b"wxyz"
        sender.join()
        assert calls, "the reader never gave the core away while it waited 10 ms"
        assert calls[0] - t0 >= tcp_reader.YIELD_AFTER
    finally:
        t.close()
        b_sock.close()
