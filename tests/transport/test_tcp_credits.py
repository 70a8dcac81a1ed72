"""TCP flow control: a credit granted while a send holds the connection still reaches the peer.

The regression behind a rare pipeline deadlock (four stages, ``isend`` from the link's
sender thread while the main thread posts and waits for receives): a receive posted
during another thread's large send leaves its credit pending; the thread that then
blocks on a read could not flush it (the connection was busy writing) and never
tried again, while the peer waited for exactly that credit before sending what the
reader waited for.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch

from tensorwire.transport.base import new_nonce
from tensorwire.transport.tcp import TcpListener

pytestmark = pytest.mark.timeout(240)

BIG = 32 << 20  # far more than the socket buffers: the send holds the connection until the peer reads


def _peer_process(port: int, nonce: bytes, go, result) -> None:
    """The peer, in a process of its own (credits still pending in one process are flushed by any of
    its threads that blocks, so a peer thread in the test's process would hide the bug)."""
    try:
        y = TcpListener.connect("127.0.0.1", port, nonce, timeout=10)
        big_dst = torch.zeros(BIG, dtype=torch.uint8)
        y.post_recv(1, big_dst)  # grants the big message's credit ...
        y.send(0, torch.zeros(4, dtype=torch.uint8), timeout=10)  # ... which rides to x here
        if not go.wait(60):
            raise TimeoutError("no go")
        y.send(2, torch.full((8,), 2, dtype=torch.uint8), timeout=25)  # needs x's credit for tag 2
        y.send(3, torch.full((8,), 3, dtype=torch.uint8), timeout=25)
        y.wait_recv(1, timeout=25)
        ok = bool((big_dst == 7).all())
        y.close()
        result.put("ok" if ok else "wrong bytes")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result.put(repr(exc))


def test_a_credit_posted_during_a_send_reaches_the_peer():
    # spawn, not fork: a child forked after an earlier test ran a parallel torch operation in this
    # process hangs in torch's inherited thread pool (its first torch.zeros never returns).
    ctx = mp.get_context("spawn")
    go, result = ctx.Event(), ctx.Queue()
    lst = TcpListener("127.0.0.1", port=0)
    nonce = new_nonce()
    lst.expect(nonce)
    proc = ctx.Process(target=_peer_process, args=(lst.address[1], nonce, go, result), daemon=True)
    proc.start()
    errors: list[BaseException] = []
    x = None
    try:
        x = lst.accept(nonce, timeout=90)  # a spawned peer imports torch first
        got = torch.zeros(4, dtype=torch.uint8)
        x.post_recv(0, got)
        x.wait_recv(0, timeout=10)

        def run(fn):
            def wrapped():
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    errors.append(exc)

            th = threading.Thread(target=wrapped, daemon=True)
            th.start()
            return th

        # x's sender thread: a send that holds x's connection until the peer starts reading.
        big_src = torch.full((BIG,), 7, dtype=torch.uint8)
        sender = run(lambda: x.send(1, big_src, timeout=30))
        time.sleep(0.3)
        # x's main thread posts two receives while that send is on the wire, then waits for the second.
        small2 = torch.zeros(8, dtype=torch.uint8)
        small3 = torch.zeros(8, dtype=torch.uint8)
        x.post_recv(2, small2)
        x.post_recv(3, small3)
        waiter = run(lambda: x.wait_recv(3, timeout=30))
        time.sleep(0.3)
        go.set()
        for th in (sender, waiter):
            th.join(30)
            assert not th.is_alive()
        assert result.get(timeout=45) == "ok"
        assert not errors, errors
        x.wait_recv(2, timeout=1)
        assert torch.equal(small2, torch.full((8,), 2, dtype=torch.uint8))
        assert torch.equal(small3, torch.full((8,), 3, dtype=torch.uint8))
    finally:
        if x is not None:
            x.close()
        lst.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
