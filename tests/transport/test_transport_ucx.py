"""UCX transport: the shared conformance checks plus multi-process behaviour.

Runs over whatever UCX finds here (tcp + shared memory on a plain host).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("ucxx")

from tensorwire.errors import ClosedError, ConnectTimeout, PeerLostError, TransferTimeout
from tensorwire.testing import CHECKS
from tensorwire.transport.base import new_nonce
from tensorwire.transport.ucx import UcxListener, UcxTransport

_SPAWN = mp.get_context("spawn")


@pytest.fixture(scope="module")
def listener():
    lst = UcxListener()
    yield lst
    lst.close()


def _pair(lst: UcxListener) -> tuple[UcxTransport, UcxTransport]:
    """Connect in a thread while accepting here: (dialling side, accepting side)."""
    nonce = new_nonce()
    lst.expect(nonce)
    box: list = []

    def dial() -> None:
        try:
            box.append(UcxListener.connect("127.0.0.1", lst.address[1], nonce, timeout=10))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box.append(exc)

    th = threading.Thread(target=dial, daemon=True)
    th.start()
    server = lst.accept(nonce, timeout=10)
    th.join(10)
    assert box, "connect did not return"
    if isinstance(box[0], BaseException):
        server.close()
        raise box[0]
    return box[0], server


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(CHECKS))
def test_conformance(listener: UcxListener, name: str) -> None:
    CHECKS[name](lambda: _pair(listener))


@pytest.mark.timeout(30)
def test_kind_and_import_contract(listener: UcxListener) -> None:
    from tensorwire.transport.base import get_factory

    assert get_factory("ucx") is UcxListener
    a, b = _pair(listener)
    try:
        assert a.kind == b.kind == "ucx" and UcxTransport.reaches_cuda
        assert "ucx" in a.describe()
    finally:
        a.close()
        b.close()
    assert a.closed and b.closed


@pytest.mark.timeout(30)
def test_import_leaves_environment_alone() -> None:
    import subprocess
    import sys

    code = (
        "import os; before = dict(os.environ); import tensorwire.transport.ucx; "
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
        "from tensorwire.transport.ucx.engine import ENGINES; assert not ENGINES; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.timeout(60)
def test_missing_ucxx_is_an_import_error() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['ucxx'] = None\n"
        "try:\n    import tensorwire.transport.ucx\nexcept ImportError:\n    pass\n"
        "else:\n    raise SystemExit('imported without ucxx')\n"
        "from tensorwire.transport.base import available_kinds; assert 'ucx' not in available_kinds(); print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.timeout(30)
def test_wrong_size_on_headerless_tag_is_refused_before_sending(listener: UcxListener) -> None:
    import torch

    from tensorwire.errors import ProtocolError

    a, b = _pair(listener)
    try:
        dst = torch.zeros(16, dtype=torch.uint8)
        b.post_recv(2, dst)
        with pytest.raises(ProtocolError):
            a.send(2, torch.ones(8, dtype=torch.uint8), step=1, timeout=5)
        src = torch.arange(16, dtype=torch.uint8)
        a.send(2, src, step=1, timeout=5)  # the credit was kept
        assert b.wait_recv(2, timeout=5).nbytes == 16
        assert bool((dst == src).all())
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_close_wakes_local_waiter_with_closed_error(listener: UcxListener) -> None:
    import torch

    a, b = _pair(listener)
    try:
        b.post_recv(1, torch.zeros(4, dtype=torch.uint8))
        errs: list = []
        th = threading.Thread(target=lambda: _catch(errs, lambda: b.wait_recv(1, timeout=20)), daemon=True)
        th.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        b.close()
        th.join(5)
        assert not th.is_alive() and time.monotonic() - t0 < 3
        assert errs and isinstance(errs[0], ClosedError), errs
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(120)
def test_many_links_many_threads_share_one_worker(listener: UcxListener) -> None:
    """Several links, each used by two threads per side at once: no deadlock, no cross-talk."""
    import torch

    pairs = [_pair(listener) for _ in range(3)]
    errs: list = []

    def side(me: UcxTransport, out_tag: int, in_tag: int, size: int, seed: int) -> None:
        bufs = [torch.zeros(size, dtype=torch.uint8) for _ in range(2)]
        for b in bufs:
            me.post_recv(in_tag, b)
        src = torch.full((size,), seed, dtype=torch.uint8)
        for k in range(150):
            src[:1] = k % 256
            me.send(out_tag, src, step=k + 1, timeout=30)
            me.wait_recv(in_tag, timeout=30)
            got = bufs[k % 2]
            assert int(got[0]) == k % 256 and int(got[-1]) == (seed ^ 1), (k, int(got[0]), int(got[-1]))
            me.post_recv(in_tag, got)

    threads = []
    try:
        for i, (a, b) in enumerate(pairs):
            for size, (ta, tb) in ((64, (1, 2)), (300_000, (3, 4))):
                seed = 2 * (4 * i + ta)  # a sends seed, b sends seed ^ 1: each side checks the other's
                threads.append(
                    threading.Thread(
                        target=_catch,
                        args=(errs, lambda a=a, ta=ta, tb=tb, size=size, seed=seed: side(a, ta, tb, size, seed)),
                        daemon=True,
                    )
                )
                threads.append(
                    threading.Thread(
                        target=_catch,
                        args=(errs, lambda b=b, ta=ta, tb=tb, size=size, seed=seed: side(b, tb, ta, size, seed ^ 1)),
                        daemon=True,
                    )
                )
        for th in threads:
            th.start()
        for th in threads:
            th.join(90)
        assert not any(th.is_alive() for th in threads), "deadlock"
        assert not errs, errs[:3]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


@pytest.mark.timeout(30)
def test_idle_wait_does_not_spin(listener: UcxListener) -> None:
    import torch

    a, b = _pair(listener)
    try:
        b.post_recv(1, torch.zeros(4, dtype=torch.uint8))
        c0 = time.thread_time()
        with pytest.raises(TransferTimeout):
            b.wait_recv(1, timeout=1.0)
        assert time.thread_time() - c0 < 0.3, "a waiting thread burnt its core"
    finally:
        a.close()
        b.close()


def _catch(errs: list, fn) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        errs.append(exc)


# -- multi-process -----------------------------------------------------------------------


def _data(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _peer_main(role: str, q_out, q_in, nonce: bytes) -> None:
    """Child process: 'server' listens on port 0 and reports it; then exchanges, or idles for a kill."""
    import torch

    from tensorwire.transport.ucx import UcxListener

    if role.startswith("server"):
        lst = UcxListener()
        lst.expect(nonce)
        q_out.put(lst.address[1])
        t = lst.accept(nonce, timeout=30)
    else:
        port = q_in.get(timeout=30)
        t = UcxListener.connect("127.0.0.1", port, nonce, timeout=30)
    if role.endswith("idle"):
        q_out.put("ready")
        time.sleep(120)  # killed by the test
        return
    sizes = [0, 1, 4096, 65537, (3 << 20) + 5]
    for i, n in enumerate(sizes):
        buf = torch.zeros(n, dtype=torch.uint8)
        t.post_recv(10 + i, buf)
        got = t.wait_recv(10 + i, timeout=30)
        assert got.nbytes == n
        t.send(20 + i, buf, step=1, timeout=30)  # echo back
    dyn = torch.zeros(1024, dtype=torch.uint8)
    t.post_recv(30, dyn, header=True)
    got = t.wait_recv(30, timeout=30)
    t.send(31, torch.tensor(list(got.shape) + [got.nbytes], dtype=torch.int64).view(torch.uint8), step=1, timeout=30)
    q_out.put("done")
    q_in.get(timeout=30)
    t.close()


def _kill(p) -> None:
    if p.is_alive():
        p.kill()
    p.join(10)


@pytest.mark.timeout(120)
def test_two_processes_bit_exact() -> None:
    import torch

    nonce = new_nonce()
    q_out, q_in = _SPAWN.Queue(), _SPAWN.Queue()
    p = _SPAWN.Process(target=_peer_main, args=("server", q_out, q_in, nonce), daemon=True)
    p.start()
    t = None
    try:
        port = q_out.get(timeout=60)
        t = UcxListener.connect("127.0.0.1", port, nonce, timeout=30)
        sizes = [0, 1, 4096, 65537, (3 << 20) + 5]
        for i, n in enumerate(sizes):
            src = _data(n, seed=i)
            back = torch.zeros(n, dtype=torch.uint8)
            t.post_recv(20 + i, back)
            t.send(10 + i, src, step=1, timeout=30)
            assert t.wait_recv(20 + i, timeout=30).nbytes == n
            assert torch.equal(back, src), f"size {n}: bytes differ"
        meta = torch.zeros(32, dtype=torch.uint8)
        t.post_recv(31, meta)
        t.send(30, _data(24, 7), step=1, shape=(2, 3, 4), timeout=30)
        t.wait_recv(31, timeout=30)
        assert meta.view(torch.int64).tolist() == [2, 3, 4, 24]
        assert q_out.get(timeout=30) == "done"
        q_in.put("bye")
        p.join(30)
        assert p.exitcode == 0
    finally:
        if t is not None:
            t.close()
        _kill(p)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pending", ["wait_recv", "send"])
def test_sigkilled_peer_surfaces_as_peer_lost(pending: str) -> None:
    import torch

    nonce = new_nonce()
    q_out, q_in = _SPAWN.Queue(), _SPAWN.Queue()
    lst = UcxListener()
    lst.expect(nonce)
    p = _SPAWN.Process(target=_peer_main, args=("client-idle", q_out, q_in, nonce), daemon=True)
    p.start()
    t = None
    try:
        q_in.put(lst.address[1])
        t = lst.accept(nonce, timeout=30)
        assert q_out.get(timeout=30) == "ready"
        errs: list = []
        if pending == "wait_recv":
            t.post_recv(1, torch.zeros(64, dtype=torch.uint8))
            op = lambda: t.wait_recv(1, timeout=30)  # noqa: E731
        else:
            op = lambda: t.send(1, torch.zeros(64, dtype=torch.uint8), step=1, timeout=30)  # noqa: E731 - no credit: waits
        th = threading.Thread(target=_catch, args=(errs, op), daemon=True)
        th.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        th.join(20)
        assert not th.is_alive(), "survivor hung after the peer was killed"
        assert errs and isinstance(errs[0], PeerLostError), errs
        assert time.monotonic() - t0 < 15
        with pytest.raises(PeerLostError):
            t.post_recv(2, torch.zeros(4, dtype=torch.uint8))
    finally:
        if t is not None:
            t.close()
        lst.close()
        _kill(p)


def _bad_client(port: int, mode: str, q) -> None:
    from tensorwire.errors import TensorWireError
    from tensorwire.transport.ucx import UcxListener

    try:
        UcxListener.connect("127.0.0.1", port, b"\x00" * 16, timeout=10)
        q.put("connected?!")
    except TensorWireError as exc:
        q.put(type(exc).__name__)


@pytest.mark.timeout(90)
def test_garbage_and_wrong_nonce_are_dropped_listener_keeps_serving() -> None:
    import torch

    from tensorwire.transport import ucx as U

    lst = UcxListener()
    port = lst.address[1]
    good = new_nonce()
    lst.expect(good)
    socks = []
    procs = []
    t = None
    try:
        # raw garbage on the listener's port, and a hello-shaped message with a wrong magic
        bad_magic = U.HELLO.pack(b"NOTTWUCX", U.PROTOCOL_VERSION, 1, b"\0" * 16, b"\0" * 16, 8) + b"\0" * 8
        for payload in (os.urandom(512), b"\0" * 4096, b"GET / HTTP/1.0\r\n\r\n", bad_magic):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(payload)
            socks.append(s)
        # a real peer with a wrong nonce, in another process: refused with AuthError
        q = _SPAWN.Queue()
        bad = _SPAWN.Process(target=_bad_client, args=(port, "wrong", q), daemon=True)
        bad.start()
        procs.append(bad)
        assert q.get(timeout=60) == "AuthError"
        # a silent connection (connects, never says hello)
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(silent)
        # the good peer still gets through
        nonce_box: list = []
        th = threading.Thread(
            target=_catch,
            args=(nonce_box, lambda: nonce_box.append(UcxListener.connect("127.0.0.1", port, good, timeout=10))),
            daemon=True,
        )
        th.start()
        t = lst.accept(good, timeout=15)
        th.join(10)
        client = nonce_box[0]
        assert isinstance(client, UcxTransport), nonce_box
        dst = torch.zeros(8, dtype=torch.uint8)
        t.post_recv(1, dst)
        client.send(1, torch.arange(8, dtype=torch.uint8), step=1, timeout=5)
        t.wait_recv(1, timeout=5)
        assert dst.tolist() == list(range(8))
        client.close()
        # the silent connection is dropped after HELLO_TIMEOUT: the listener closes it
        silent.settimeout(lst.HELLO_TIMEOUT + 10)
        assert silent.recv(16) == b""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and lst.rejected < 6:
            time.sleep(0.1)
        assert lst.rejected >= 6, lst.rejected  # 3 garbage + bad magic + wrong nonce + silent
        with pytest.raises(ConnectTimeout):
            lst.accept(new_nonce(), timeout=0.3)
    finally:
        for s in socks:
            s.close()
        if t is not None:
            t.close()
        lst.close()
        for p in procs:
            _kill(p)


@pytest.mark.timeout(30)
def test_connect_to_nothing_times_out() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t0 = time.monotonic()
    with pytest.raises(ConnectTimeout):
        UcxListener.connect("127.0.0.1", port, new_nonce(), timeout=1.0)
    assert time.monotonic() - t0 < 5


@pytest.mark.timeout(30)
def test_listener_close_wakes_accept() -> None:
    lst = UcxListener()
    errs: list = []
    th = threading.Thread(target=_catch, args=(errs, lambda: lst.accept(new_nonce(), timeout=20)), daemon=True)
    th.start()
    time.sleep(0.3)
    lst.close()
    lst.close()
    th.join(5)
    assert not th.is_alive() and errs and isinstance(errs[0], ClosedError), errs


def _burst_main(q_out, q_in, nonce: bytes) -> None:
    """Child: send one large message, then (when told) small ones, close and exit at once."""

    from tensorwire.transport.ucx import UcxListener

    port = q_in.get(timeout=30)
    t = UcxListener.connect("127.0.0.1", port, nonce, timeout=30)
    big = (3 << 20) + 5
    t.send(2, _data(big, 50), step=1, shape=(big,), timeout=30)
    q_out.put("big sent")
    assert q_in.get(timeout=30) == "go"
    for k in range(8):
        t.send(1, _data(64, 60 + k), step=k + 1, timeout=30)
    q_out.put("sent")
    t.close()
    q_out.put("closed")


@pytest.mark.timeout(90)
def test_messages_sent_before_peer_closes_survive_a_lagging_receiver() -> None:
    """The peer sends while this process does not progress UCX, then closes before this
    process looks; everything it sent is still delivered, the slots can be re-posted meanwhile,
    and only a wait nothing can satisfy raises PeerLostError."""
    import torch

    nonce = new_nonce()
    q_out, q_in = _SPAWN.Queue(), _SPAWN.Queue()
    lst = UcxListener()
    lst.expect(nonce)
    p = _SPAWN.Process(target=_burst_main, args=(q_out, q_in, nonce), daemon=True)
    p.start()
    t = None
    try:
        q_in.put(lst.address[1])
        t = lst.accept(nonce, timeout=30)
        big = torch.zeros((3 << 20) + 5, dtype=torch.uint8)
        t.post_recv(2, big, header=True)
        slots = [torch.zeros(64, dtype=torch.uint8) for _ in range(8)]
        for s in slots:
            t.post_recv(1, s)
        assert q_out.get(timeout=30) == "big sent"
        with t._eng.op():  # white box: this process makes no UCX progress while the peer sends
            q_in.put("go")
            assert q_out.get(timeout=30) == "sent"
            time.sleep(0.2)
        assert q_out.get(timeout=30) == "closed"  # (its close waits for our ACK: the ticker answers)
        p.join(30)
        got = t.wait_recv(2, timeout=10)
        assert got.nbytes == big.numel() and got.shape == (big.numel(),)
        assert torch.equal(big, _data(big.numel(), 50))
        for k in range(8):
            t.wait_recv(1, timeout=10)
            assert torch.equal(slots[k], _data(64, 60 + k)), f"message {k} differs"
            t.post_recv(1, slots[k])  # re-posting after the peer's goodbye is not an error (like TCP)
        t0 = time.monotonic()
        with pytest.raises(PeerLostError):
            t.wait_recv(1, timeout=10)
        assert time.monotonic() - t0 < 5
        with pytest.raises(PeerLostError):
            t.send(1, torch.zeros(4, dtype=torch.uint8), step=1, timeout=5)
    finally:
        if t is not None:
            t.close()
        lst.close()
        _kill(p)


@pytest.mark.timeout(60)
def test_lost_liveness_connection_means_peer_lost_even_with_the_ucx_endpoint_up(listener: UcxListener) -> None:
    """Endpoints have no UCX error handling (shared memory/cma stay usable): the TCP liveness
    connection is what tells a vanished peer (process killed: EOF; cable cut: keepalive)."""
    import torch

    a, b = _pair(listener)
    try:
        buf = torch.zeros(16, dtype=torch.uint8)
        b.post_recv(3, buf)
        a.send(3, torch.ones(16, dtype=torch.uint8), step=1, timeout=5)
        b.wait_recv(3, timeout=5)
        b.post_recv(4, torch.zeros(64, dtype=torch.uint8), header=True)  # still posted when the peer goes
        with a._eng.op():
            a._drop_liveness()  # what the kernel does to the peer's socket when its process dies
        t0 = time.monotonic()
        with pytest.raises(PeerLostError):
            b.wait_recv(3, timeout=20)
        assert time.monotonic() - t0 < 10
        with pytest.raises(PeerLostError):
            b.send(3, torch.ones(16, dtype=torch.uint8), step=2, timeout=5)
        posted = [p for st in b._st.values() for p in st.posted]
        b.abort()
        # torn down without the peer: no receive is left posted into our buffers
        assert posted and all(p.req is None or p.req.completed for p in posted)
        assert all(p.hreq is None or p.hreq.completed for p in posted)
        assert b._ctrl_req is None or b._ctrl_req.completed
    finally:
        a.abort()
        b.abort()


def test_error_handling_mode_is_validated(monkeypatch) -> None:
    from tensorwire.errors import ConfigError
    from tensorwire.transport.ucx.engine import error_handling

    monkeypatch.setenv("TENSORWIRE_UCX_ERROR_HANDLING", "sometimes")
    with pytest.raises(ConfigError, match="TENSORWIRE_UCX_ERROR_HANDLING"):
        error_handling()
    monkeypatch.setenv("TENSORWIRE_UCX_ERROR_HANDLING", "peer")
    assert error_handling() is True
    monkeypatch.setenv("TENSORWIRE_UCX_ERROR_HANDLING", "none")
    assert error_handling() is False
    monkeypatch.delenv("TENSORWIRE_UCX_ERROR_HANDLING")
    assert error_handling() is True  # default: a peer's death is an error, never an abort


def test_buffer_descriptors_are_reused_and_keep_no_tensor_alive() -> None:
    import gc
    import weakref

    import torch

    from tensorwire.transport.ucx.engine import as_array

    t = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    keep, arr, n = as_array(t, writable=True)
    assert n == t.numel() and arr.ptr == t.data_ptr() and arr.nbytes == n and not arr.readonly
    keep2, arr2, _ = as_array(t, writable=False)
    assert arr2 is arr and keep2 is t  # same address and size: the same descriptor
    ref = weakref.ref(t.untyped_storage())
    del t, keep, keep2
    gc.collect()
    assert ref() is None  # the cached descriptor does not hold the memory
    empty = torch.empty(0, dtype=torch.uint8)
    assert as_array(empty, writable=True)[2] == 0


@pytest.mark.timeout(30)
def test_a_receive_posted_before_close_is_not_returned_after_it(listener: UcxListener) -> None:
    """close() releases this side's posted receives (completes them empty): they must not be
    mistaken for messages by a later wait."""
    import torch

    a, b = _pair(listener)
    try:
        b.post_recv(1, torch.zeros(4, dtype=torch.uint8))
        b.close()
        with pytest.raises(ClosedError):
            b.wait_recv(1, timeout=2)
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_warm_tag_builds_no_header_or_credit_buffer_per_message(listener: UcxListener) -> None:
    """Steady state on a header tag: the receiver's header buffers come back after each message, its
    credit message for a buffer size is built once, and the sender's header buffer is reused once its
    send completed -- while every message still arrives whole, with its shape."""
    import torch

    a, b = _pair(listener)
    try:
        slots = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
        for s in slots:
            b.post_recv(5, s, header=True)
        header_buffers: set[int] = set()
        held = None
        for k in range(60):
            n = 8 + k % 5
            a.send(5, torch.full((n,), k, dtype=torch.uint8), shape=(n,), timeout=10)
            got = (
                b.wait_recv(5, timeout=10)
                if held is None
                else b.repost_and_wait(5, slots[held], header=True, timeout=10)
            )
            held = k % 2
            assert got.nbytes == n and got.shape == (n,), (k, got)
            assert bool((slots[held][:n] == k).all()), f"message {k}: wrong bytes"
            header_buffers.update(id(p.hbuf) for p in b._st[5].posted)
        assert len(header_buffers) <= 3, len(header_buffers)  # two posted, one back in the free list
        assert len(b._st[5].grants) == 1  # one buffer size: one credit message, built once
        assert len(a._st[5].hsend) == 1  # send() returns once the header is out: its buffer is free again
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_send_ahead_only_for_an_admitted_size_and_shape_and_at_most_send_ahead_per_tag(listener) -> None:
    """``send_ahead`` (backend "tensorwire" sets it): a message whose size and shape a credit admitted before on
    its tag goes without waiting for its own credit, at most ``send_ahead`` of them; the receiver gets them in
    order once it posts; a receive posted smaller afterwards is an error on both sides."""
    import torch

    from tensorwire.errors import ProtocolError, TensorWireError

    a, b = _pair(listener)
    try:
        a.send_ahead = b.send_ahead = 2
        tag = 7
        msgs = [torch.full((64,), i, dtype=torch.uint8) for i in range(4)]
        with pytest.raises(TransferTimeout):  # nothing admitted yet: the first message waits for its credit
            a.send(tag, msgs[0], shape=(8, 8), timeout=0.2)
        buf = torch.zeros(64, dtype=torch.uint8)
        b.post_recv(tag, buf, header=True)
        a.send(tag, msgs[0], shape=(8, 8), timeout=5)
        got = b.wait_recv(tag, timeout=5)
        assert got.nbytes == 64 and got.shape == (8, 8) and torch.equal(buf, msgs[0])
        a.send(tag, msgs[1], shape=(8, 8), timeout=5)  # no receive posted: ahead
        a.send(tag, msgs[2], shape=(8, 8), timeout=5)
        with pytest.raises(TransferTimeout):  # a third would exceed send_ahead
            a.send(tag, msgs[3], shape=(8, 8), timeout=0.2)
        with pytest.raises(TransferTimeout):  # another shape was never admitted: it waits for a credit
            a.send(tag, msgs[3], shape=(4, 16), timeout=0.2)
        for i in (1, 2):
            out = torch.zeros(64, dtype=torch.uint8)
            b.post_recv(tag, out, header=True)
            got = b.wait_recv(tag, timeout=5)
            assert got.shape == (8, 8) and torch.equal(out, msgs[i]), (i, out[:4])
        a.send(tag, msgs[3], shape=(8, 8), timeout=5)  # ahead again (the two credits settled the debts)
        small = torch.zeros(32, dtype=torch.uint8)
        b.post_recv(tag, small, header=True)  # the receiver changed its size after the fact
        with pytest.raises(TensorWireError):
            b.wait_recv(tag, timeout=5)
        with pytest.raises(TensorWireError) as info:  # the sender learns it from the credit that comes back
            a.send(tag, msgs[0], shape=(4, 16), timeout=5)
        assert isinstance(info.value, ProtocolError) and "sent ahead" in str(info.value), info.value
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_without_send_ahead_every_message_waits_for_its_credit(listener) -> None:
    import torch

    a, b = _pair(listener)
    try:
        x = torch.ones(64, dtype=torch.uint8)
        buf = torch.zeros(64, dtype=torch.uint8)
        b.post_recv(3, buf, header=True)
        a.send(3, x, shape=(64,), timeout=5)
        b.wait_recv(3, timeout=5)
        with pytest.raises(TransferTimeout):
            a.send(3, x, shape=(64,), timeout=0.2)
    finally:
        a.close()
        b.close()
