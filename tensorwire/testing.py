"""Conformance checks that every :class:`~tensorwire.transport.base.Transport` must pass.

Like trio's ``check_two_way_stream``: give :func:`check_transport` a function
that returns a fresh connected pair ``(a, b)`` and it exercises the contract —
FIFO per tag, credits (a send waits for a posted buffer), bit-exact bytes,
buffers prepared once and posted again (``prepare_recv``),
empty messages (sent before their receive was posted and after), shapes carried for dynamic tags, both directions at once,
timeouts, and close/peer-loss errors. The in-memory, TCP and UCX transports
all run it (``tests/transport/test_transport_conformance.py``).

Everything here runs in one process with threads; multi-process behaviour
(peer killed, garbage on the port) is tested separately.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable

from tensorwire.errors import ClosedError, PeerLostError, TensorWireError, TransferTimeout
from tensorwire.transport.base import Transport

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["check_transport", "CHECKS"]

PairMaker = Callable[[], "tuple[Transport, Transport]"]


def _u8(n: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _empty(n: int):
    import torch

    return torch.zeros(n, dtype=torch.uint8)


def _run(fn: Callable[[], None], *, timeout: float = 30.0) -> threading.Thread:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the joiner
            errors.append(exc)

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.errors = errors  # type: ignore[attr-defined]
    th.deadline = time.monotonic() + timeout  # type: ignore[attr-defined]
    return th


def _join(th: threading.Thread) -> None:
    th.join(max(0.0, th.deadline - time.monotonic()))  # type: ignore[attr-defined]
    if th.is_alive():
        raise AssertionError("helper thread did not finish in time (deadlock?)")
    if th.errors:  # type: ignore[attr-defined]
        raise th.errors[0]  # type: ignore[attr-defined]


def check_roundtrip_bytes(make: PairMaker) -> None:
    """Bytes arrive bit-exact, for sizes from 0 to 4 MiB + 1, in both directions."""
    a, b = make()
    try:
        for i, n in enumerate([0, 1, 7, 4096, 65537, (4 << 20) + 1]):
            src = _u8(n, seed=i)
            dst = _empty(n)
            b.post_recv(i, dst)
            a.send(i, src, step=1, timeout=10)
            got = b.wait_recv(i, timeout=10)
            assert got.nbytes == n, f"size {n}: nbytes {got.nbytes}"
            assert bool((dst == src).all()), f"size {n}: bytes differ"
            back = _empty(n)
            a.post_recv(100 + i, back)
            b.send(100 + i, dst, step=1, timeout=10)
            a.wait_recv(100 + i, timeout=10)
            assert bool((back == src).all()), f"size {n}: bytes differ on the way back"
    finally:
        a.close()
        b.close()


def check_fifo_per_tag(make: PairMaker) -> None:
    """Messages on one tag fill posted buffers in order; tags do not block each other."""
    a, b = make()
    try:
        bufs = [_empty(16) for _ in range(3)]
        for buf in bufs:
            b.post_recv(5, buf)
        other = _empty(4)
        b.post_recv(6, other)
        for k in range(3):
            a.send(5, _u8(16, seed=10 + k), step=k + 1, timeout=10)
        a.send(6, _u8(4, seed=99), step=1, timeout=10)
        assert b.wait_recv(6, timeout=10).nbytes == 4
        for k in range(3):
            b.wait_recv(5, timeout=10)
            assert bool((bufs[k] == _u8(16, seed=10 + k)).all()), f"message {k} landed out of order"
    finally:
        a.close()
        b.close()


def check_credit_blocks_sender(make: PairMaker) -> None:
    """A send with no posted buffer waits (TransferTimeout), then succeeds once one is posted."""
    a, b = make()
    try:
        t0 = time.monotonic()
        try:
            a.send(3, _u8(8), step=1, timeout=0.3)
        except TransferTimeout:
            pass
        else:
            raise AssertionError("send without a posted buffer did not wait")
        assert time.monotonic() - t0 >= 0.25, "send gave up before its timeout"
        dst = _empty(8)
        b.post_recv(3, dst)
        th = _run(lambda: a.send(3, _u8(8, seed=3), step=1, timeout=10))
        b.wait_recv(3, timeout=10)
        _join(th)
        assert bool((dst == _u8(8, seed=3)).all())
    finally:
        a.close()
        b.close()


def check_repost_and_wait(make: PairMaker) -> None:
    """repost_and_wait = post, then wait: double-buffered receives keep FIFO order, every byte right;
    on a timeout the buffer stays posted (a later message fills it)."""
    a, b = make()
    try:
        slots = [_empty(4096), _empty(4096)]
        for s in slots:
            b.post_recv(4, s)
        n = 12

        def sender() -> None:
            for k in range(n):
                a.send(4, _u8(4096, seed=200 + k), step=k + 1, timeout=10)

        th = _run(sender)
        held = None
        for k in range(n):
            got = b.wait_recv(4, timeout=10) if held is None else b.repost_and_wait(4, slots[held], timeout=10)
            assert got.nbytes == 4096
            held = k % 2
            assert bool((slots[held] == _u8(4096, seed=200 + k)).all()), f"message {k}: wrong bytes or order"
        _join(th)
        # Nothing more comes: the re-posted buffer is posted even though the wait timed out.
        spare, again = _empty(8), _empty(8)
        b.post_recv(7, spare)
        try:
            b.repost_and_wait(7, again, timeout=0.2)
        except TransferTimeout:
            pass
        else:
            raise AssertionError("repost_and_wait returned with nothing sent")
        a.send(7, _u8(8, seed=1), step=1, timeout=10)
        a.send(7, _u8(8, seed=2), step=2, timeout=10)  # needs the credit of the buffer re-posted above
        assert b.wait_recv(7, timeout=10).nbytes == 8 and b.wait_recv(7, timeout=10).nbytes == 8
        assert bool((spare == _u8(8, seed=1)).all()) and bool((again == _u8(8, seed=2)).all())
    finally:
        a.close()
        b.close()


def check_prepared_buffers(make: PairMaker) -> None:
    """prepare_recv: what it returns is posted again and again in place of the buffer (double-buffered,
    header and plain tags) and fills the buffer itself; posted twice at once it takes two messages."""
    a, b = make()
    try:
        bufs = [_empty(1024), _empty(1024)]
        prep = [b.prepare_recv(x) for x in bufs]
        for p in prep:
            b.post_recv(2, p)
        hbuf = _empty(64)
        hprep = b.prepare_recv(hbuf)
        n = 8

        def sender() -> None:
            for k in range(n):
                a.send(2, _u8(1024, seed=300 + k), step=k + 1, timeout=10)
                a.send(3, _u8(8 * (k + 1), seed=400 + k), shape=(2, 4 * (k + 1)), timeout=10)

        th = _run(sender)
        held = None
        for k in range(n):
            got = b.wait_recv(2, timeout=10) if held is None else b.repost_and_wait(2, prep[held], timeout=10)
            held = k % 2
            assert got.nbytes == 1024 and bool((bufs[held] == _u8(1024, seed=300 + k)).all()), f"message {k}"
            h = b.repost_and_wait(3, hprep, header=True, timeout=10)
            assert h.shape == (2, 4 * (k + 1)) and h.nbytes == 8 * (k + 1), f"header message {k}: {h}"
            assert bool((hbuf[: h.nbytes] == _u8(h.nbytes, seed=400 + k)).all()), f"header message {k}: bytes"
        _join(th)
        # The same prepared buffer posted twice before either is filled: two receives, in order.
        one = _empty(8)
        p1 = b.prepare_recv(one)
        b.post_recv(5, p1)
        b.post_recv(5, p1)
        a.send(5, _u8(8, seed=7), step=1, timeout=10)
        a.send(5, _u8(8, seed=8), step=2, timeout=10)
        assert b.wait_recv(5, timeout=10).nbytes == 8 and b.wait_recv(5, timeout=10).nbytes == 8
        assert bool((one == _u8(8, seed=8)).all())
    finally:
        a.close()
        b.close()


def check_shape_travels(make: PairMaker) -> None:
    """A shape given to send is reported by wait_recv on a header tag."""
    a, b = make()
    try:
        dst = _empty(64)
        b.post_recv(9, dst, header=True)
        a.send(9, _u8(24), step=1, shape=(2, 3), timeout=10)
        got = b.wait_recv(9, timeout=10)
        assert got.nbytes == 24 and got.shape == (2, 3), got
    finally:
        a.close()
        b.close()


def check_both_directions_at_once(make: PairMaker, *, steps: int = 50, nbytes: int = 8 << 20) -> None:
    """Both sides send large messages at the same time, repeatedly: no deadlock, bytes exact."""
    a, b = make()
    try:

        def side(me: Transport, out_tag: int, in_tag: int, seed: int) -> Callable[[], None]:
            def run() -> None:
                bufs = [_empty(nbytes), _empty(nbytes)]
                for buf in bufs:
                    me.post_recv(in_tag, buf)
                src = _u8(nbytes, seed=seed)
                for k in range(steps):
                    src[:8] = k  # mark the step
                    me.send(out_tag, src, step=k + 1, timeout=30)
                    me.wait_recv(in_tag, timeout=30)
                    got = bufs[k % 2]
                    assert int(got[0]) == k % 256, f"step {k}: got step {int(got[0])}"
                    me.post_recv(in_tag, got)

            return run

        ta = _run(side(a, 1, 2, 1), timeout=120)
        tb = _run(side(b, 2, 1, 2), timeout=120)
        _join(ta)
        _join(tb)
    finally:
        a.close()
        b.close()


def check_recv_timeout(make: PairMaker) -> None:
    """wait_recv with nothing sent raises TransferTimeout within about its timeout; the link stays usable."""
    a, b = make()
    try:
        dst = _empty(4)
        b.post_recv(1, dst)
        t0 = time.monotonic()
        try:
            b.wait_recv(1, timeout=0.3)
        except TransferTimeout:
            pass
        else:
            raise AssertionError("wait_recv returned with nothing sent")
        assert 0.25 <= time.monotonic() - t0 < 5
        a.send(1, _u8(4, seed=4), step=1, timeout=10)
        b.wait_recv(1, timeout=10)
        assert bool((dst == _u8(4, seed=4)).all())
    finally:
        a.close()
        b.close()


def check_close_semantics(make: PairMaker) -> None:
    """close() is idempotent; using a closed transport raises ClosedError; the peer sees PeerLostError."""
    a, b = make()
    try:
        dst = _empty(4)
        b.post_recv(1, dst)
        th_errors: list[BaseException] = []

        def waiter() -> None:
            try:
                b.wait_recv(1, timeout=10)
            except TensorWireError as exc:
                th_errors.append(exc)

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        time.sleep(0.1)
        a.close()
        a.close()
        th.join(15)
        assert not th.is_alive(), "peer waiter not woken by close"
        assert th_errors and isinstance(th_errors[0], PeerLostError), th_errors
        try:
            a.send(1, _u8(4), step=1, timeout=1)
        except ClosedError:
            pass
        else:
            raise AssertionError("send on a closed transport did not raise ClosedError")
    finally:
        a.close()
        b.close()


def check_messages_sent_before_close_are_delivered(make: PairMaker) -> None:
    """Messages sent before close() still reach the peer; only waits nothing can satisfy raise PeerLostError.

    Like a TCP stream read up to the peer's goodbye: ``a`` sends (small and
    large, with and without a header) and closes at once; ``b`` looks only
    afterwards. A wait on a tag nothing was sent on raises PeerLostError within
    a few seconds, and that does not lose what had arrived on other tags.
    """
    a, b = make()
    try:
        n_big = (1 << 20) + 3  # large enough for a rendezvous where the transport has one
        small = [_empty(16) for _ in range(3)]
        for buf in small:
            b.post_recv(7, buf)
        big = _empty(n_big + 5)
        b.post_recv(8, big, header=True)
        for k in range(3):
            a.send(7, _u8(16, seed=20 + k), step=k + 1, timeout=10)
        a.send(8, _u8(n_big, seed=30), step=1, shape=(n_big,), timeout=10)
        a.close()
        time.sleep(0.3)  # let the goodbye and the connection teardown reach b first
        b.wait_recv(7, timeout=10)
        assert bool((small[0] == _u8(16, seed=20)).all()), "message 0 sent before close differs"
        t0 = time.monotonic()
        try:
            # Nothing is ever sent on tag 9. (Posted only now: a credit left unread in a
            # closed TCP socket makes it reset the connection.) A transport may refuse the
            # post already, since the peer is gone.
            b.post_recv(9, _empty(4))
            b.wait_recv(9, timeout=10)
        except PeerLostError:
            pass
        else:
            raise AssertionError("wait_recv on a tag nothing was sent on returned after the peer closed")
        assert time.monotonic() - t0 < 5, "the peer's close took too long to surface"
        for k in (1, 2):
            b.wait_recv(7, timeout=10)
            assert bool((small[k] == _u8(16, seed=20 + k)).all()), f"message {k} sent before close differs"
        got = b.wait_recv(8, timeout=10)
        assert got.nbytes == n_big and got.shape == (n_big,), got
        assert bool((big[:n_big] == _u8(n_big, seed=30)).all()), "large message sent before close differs"
        t0 = time.monotonic()
        try:
            b.send(7, _u8(16), step=1, timeout=10)
        except PeerLostError:
            pass
        else:
            raise AssertionError("send to a peer that closed did not raise PeerLostError")
        assert time.monotonic() - t0 < 5, "send to a closed peer took too long to fail"
    finally:
        a.close()
        b.close()


def check_messages_either_side_of_their_post(make: PairMaker) -> None:
    """Messages of no bytes, a few bytes and 1 MiB, each sent before its receive was posted (the send waits for
    the credit, or goes ahead where the transport lets it) and after: every receive completes, bytes exact,
    in order, and the tag goes on."""
    a, b = make()
    try:
        step = 0
        for n in (0, 5, 0, 1 << 20):
            for sent_first in (True, False):
                step += 1
                src, dst = _u8(n, seed=step), _empty(n)
                if not sent_first:
                    b.post_recv(11, dst, header=True)

                def send(src: "torch.Tensor" = src, n: int = n) -> None:
                    a.send(11, src, shape=(n,), timeout=20)

                th = _run(send)
                if sent_first:
                    time.sleep(0.05)  # the send is under way (or its message in) before the receive is posted
                    b.post_recv(11, dst, header=True)
                got = b.wait_recv(11, timeout=20)
                _join(th)
                assert (got.nbytes, got.shape) == (n, (n,)), (n, sent_first, got)
                assert got.step in (None, step), (n, sent_first, got)
                assert bool((dst == src).all()), f"{n} bytes, sent first: {sent_first}: bytes differ"
    finally:
        a.close()
        b.close()


CHECKS: dict[str, Callable[[PairMaker], None]] = {
    "roundtrip_bytes": check_roundtrip_bytes,
    "fifo_per_tag": check_fifo_per_tag,
    "repost_and_wait": check_repost_and_wait,
    "prepared_buffers": check_prepared_buffers,
    "credit_blocks_sender": check_credit_blocks_sender,
    "shape_travels": check_shape_travels,
    "both_directions_at_once": check_both_directions_at_once,
    "recv_timeout": check_recv_timeout,
    "close_semantics": check_close_semantics,
    "messages_sent_before_close_are_delivered": check_messages_sent_before_close_are_delivered,
    "messages_either_side_of_their_post": check_messages_either_side_of_their_post,
}


def check_transport(make: PairMaker) -> None:
    """Run every conformance check against fresh pairs from ``make``."""
    for check in CHECKS.values():
        check(make)
