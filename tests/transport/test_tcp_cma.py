"""Cross-memory attach on TCP links between processes of one host (tensorwire.transport.cma).

What must hold: exact bytes at every size (the byte stream below the threshold, one copy above it);
the transport contract unchanged; a probe that fails leaves the byte stream, with one log line; a
peer killed mid-copy is a PeerLostError on the survivor, never a crash and never a half-written
message delivered; a peer cannot make the receiver deliver into a buffer, or a length, it did not
announce; connections without the link secret (the serve daemon's) never take part.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import multiprocessing as mp
import os
import time

import pytest
import torch

import cma_workers as W
from tcp_pairs import tcp_pair
from tensorwire.errors import PeerLostError, ProtocolError, TransportError
from tensorwire.testing import CHECKS
from tensorwire.transport import cma as C
from tensorwire.transport.cma import peer as CP
from tensorwire.transport.cma import syscalls as CS
from tensorwire.transport.base import new_nonce
from tensorwire.transport.tcp import CMA, CMA_FRAME, FRAME, NO_SHAPE, WRITTEN, TcpListener, TcpTransport

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not C.supported(), reason="no cross-memory attach on this platform"),
]

_ZERO_DIMS = (0,) * 8


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The large tensors here are made and compared with one torch thread: a process whose torch thread
    pool has started cannot fork safely, and later tests of this process fork their peers."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def listener():
    lst = TcpListener("127.0.0.1", port=0, secret=W.SECRET)
    yield lst
    lst.close()


def _pair(lst: TcpListener, *, secret: bytes | None = W.SECRET) -> tuple[TcpTransport, TcpTransport]:
    return tcp_pair(lst, secret=secret)


def _settle(a: TcpTransport, b: TcpTransport, rounds: int = 6) -> None:
    """Small round trips in one thread until both probes are done (their frames ride on these)."""
    box_a, box_b = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    one = torch.ones(8, dtype=torch.uint8)
    for _ in range(rounds):
        b.post_recv(W.SETTLE_TAG, box_b)
        a.post_recv(W.SETTLE_TAG + 1, box_a)
        a.send(W.SETTLE_TAG, one, timeout=10)
        b.wait_recv(W.SETTLE_TAG, timeout=10)
        b.send(W.SETTLE_TAG + 1, one, timeout=10)
        a.wait_recv(W.SETTLE_TAG + 1, timeout=10)


def _spawn() -> mp.context.BaseContext:
    # Not fork: a child forked after this process ran a large torch operation can hang in torch's
    # thread pool (inherited half-initialised).
    return mp.get_context("spawn")


def _stop(proc: mp.process.BaseProcess) -> None:
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


# -- the contract ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tcp_with_cma_passes_the_transport_contract(check, listener, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", "1")  # every non-empty message that can, goes by CMA
    made: list[TcpTransport] = []

    def make():
        a, b = _pair(listener)
        _settle(a, b)
        assert a.cma is not None and b.cma is not None
        assert a.cma.state == b.cma.state == "on", (a.cma.state, b.cma.state)
        assert a.cma.sending and a.cma.receiving and b.cma.sending and b.cma.receiving
        made.extend((a, b))
        return a, b

    CHECKS[check](make)
    written = sum(t.cma.messages_written for t in made)  # type: ignore[union-attr]
    landed = sum(t.cma.messages_landed for t in made)  # type: ignore[union-attr]
    if check != "close_semantics":  # that check sends nothing before it closes
        assert written > 0, "no message went by cross-memory attach: the check proved nothing about it"
    assert landed == written


# -- data between two processes --------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_bytes_exact_around_the_threshold_and_at_256_mib_both_ways(listener, monkeypatch):
    threshold = 64 << 10
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", str(threshold))
    monkeypatch.setenv("TENSORWIRE_CMA_THREADS", "2")  # the 256 MiB copies run in two pieces at once
    sizes = [threshold - 1, threshold, threshold + 1, (1 << 20) + 3, 256 << 20]
    ctx = _spawn()
    result = ctx.Queue()
    nonce = new_nonce()
    listener.expect(nonce)
    proc = ctx.Process(target=W.echo, args=(listener.address[1], nonce, sizes, result), daemon=True)
    proc.start()
    try:
        t = listener.accept(nonce, timeout=20)
        W.settle(t, first=True)
        assert t.cma is not None and t.cma.state == "on", t.cma and t.cma.state
        for i, n in enumerate(sizes):
            g = torch.Generator().manual_seed(i)
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            back = torch.zeros(n, dtype=torch.uint8)
            t.post_recv(2, back)
            t.send(1, src, timeout=60)
            got = t.wait_recv(2, timeout=60)
            assert got.nbytes == n
            assert torch.equal(back, src), f"{n} bytes came back different"
        status = result.get(timeout=30)
        assert status[0] == "ok", status
        big = sum(1 for n in sizes if n >= threshold)
        # Every message at or above the threshold went by one copy, both ways; the one below by the stream.
        assert t.cma.messages_written == big, t.cma.messages_written
        assert t.cma.messages_landed == big
        assert status[2] == big and status[3] == big, status
        t.send(4, torch.ones(1, dtype=torch.uint8), timeout=10)
        t.close()
    finally:
        _stop(proc)
    assert proc.exitcode == 0


# -- fallback ------------------------------------------------------------------------------------------


class _RefusingLibc:
    """process_vm_readv / writev as a seccomp filter or Yama would answer them: EPERM."""

    def __init__(self, real) -> None:
        self.prctl = real.prctl

    @staticmethod
    def _refuse(*args) -> int:
        ctypes.set_errno(errno.EPERM)
        return -1

    readv = writev = _refuse


def test_a_failed_probe_leaves_the_byte_stream_with_one_log_line(listener, monkeypatch, caplog):
    real = CS.load_libc()
    monkeypatch.setattr(CS, "_LIBC", _RefusingLibc(real))
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", "1")
    caplog.set_level(logging.WARNING, logger="tensorwire.transport.cma")
    a, b = _pair(listener)
    try:
        _settle(a, b)
        assert a.cma is not None and b.cma is not None
        assert a.cma.state.startswith("off") and b.cma.state.startswith("off"), (a.cma.state, b.cma.state)
        lines = [r for r in caplog.records if "not allowed here" in r.getMessage()]
        assert len(lines) == 2, [r.getMessage() for r in caplog.records]  # one per side of the link
        src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        b.post_recv(1, dst)
        a.send(1, src, timeout=10)
        b.wait_recv(1, timeout=10)
        assert torch.equal(dst, src)
        assert a.cma.messages_written == b.cma.messages_written == 0
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(120)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the peer as another user")
def test_a_peer_of_another_user_streams_its_way_and_is_written_into(listener, monkeypatch):
    """A real refusal: a process of another user may not ptrace this one (root), so its probe fails and
    its messages take the byte stream; root may write into it, so the other direction copies once."""
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", "64K")
    sizes = [1 << 20, (4 << 20) + 1]
    ctx = _spawn()
    result = ctx.Queue()
    nonce = new_nonce()
    listener.expect(nonce)
    proc = ctx.Process(target=W.echo_as, args=(65534, listener.address[1], nonce, sizes, result), daemon=True)
    proc.start()
    try:
        t = listener.accept(nonce, timeout=20)
        W.settle(t, first=True)
        assert t.cma is not None and t.cma.state == "on"
        assert t.cma.sending and not t.cma.receiving  # root writes into it; it may not write into root
        for i, n in enumerate(sizes):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
            back = torch.zeros(n, dtype=torch.uint8)
            t.post_recv(2, back)
            t.send(1, src, timeout=30)
            t.wait_recv(2, timeout=30)
            assert torch.equal(back, src), f"{n} bytes came back different"
        status = result.get(timeout=30)
        assert status[0] == "ok", status
        assert t.cma.messages_written == len(sizes) and t.cma.messages_landed == 0
        assert status[2] == 0 and status[3] == len(sizes), status  # the peer streamed, and received copies
        t.send(4, torch.ones(1, dtype=torch.uint8), timeout=10)
        t.close()
    finally:
        _stop(proc)
    assert proc.exitcode == 0


def test_cma_off_never_probes_and_streams(listener, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_CMA", "off")
    a, b = _pair(listener)
    try:
        _settle(a, b)
        assert a.cma is not None and a.cma.state == "off: TENSORWIRE_CMA=off"
        assert b.cma is not None and b.cma.state.startswith("off")
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        b.post_recv(1, dst)
        a.send(1, src, timeout=10)
        b.wait_recv(1, timeout=10)
        assert torch.equal(dst, src) and a.cma.messages_written == 0
    finally:
        a.close()
        b.close()


def test_a_peer_that_withdraws_its_permission_gets_the_stream(listener, monkeypatch):
    """EPERM on a message's copy (the peer changed its ptracer): that message and the later ones stream."""
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", "1")
    a, b = _pair(listener)
    try:
        _settle(a, b)
        assert a.cma is not None and a.cma.sending
        before = a.cma.messages_written
        monkeypatch.setattr(CS, "_LIBC", _RefusingLibc(CS.load_libc()))
        for k in range(2):
            src = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8)
            dst = torch.zeros_like(src)
            b.post_recv(1, dst)
            a.send(1, src, timeout=10)
            b.wait_recv(1, timeout=10)
            assert torch.equal(dst, src), f"message {k}"
        assert not a.cma.sending and a.cma.messages_written == before
    finally:
        a.close()
        b.close()


# -- a peer killed mid-copy ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_receiver_killed_mid_copy_is_peer_lost_on_the_sender(listener):
    size = 256 << 20
    ctx = _spawn()
    result = ctx.Queue()
    nonce = new_nonce()
    listener.expect(nonce)
    proc = ctx.Process(target=W.receive_then_die, args=(listener.address[1], nonce, size, result), daemon=True)
    proc.start()
    t = None
    try:
        t = listener.accept(nonce, timeout=20)
        W.settle(t, first=True)
        assert t.cma is not None and t.cma.sending
        t.post_recv(3, torch.zeros(1, dtype=torch.uint8))
        t.wait_recv(3, timeout=20)  # the peer's buffer is posted (its SLOT came first)
        src = torch.full((size,), 5, dtype=torch.uint8)
        t0 = time.monotonic()
        with pytest.raises(PeerLostError):
            t.send(1, src, timeout=30)  # the copy itself, or the WRITTEN frame after it
            t.post_recv(5, torch.zeros(1, dtype=torch.uint8))
            t.wait_recv(5, timeout=30)  # if the copy finished into the dying process: the next wait
        assert time.monotonic() - t0 < 20
        proc.join(10)
        assert proc.exitcode == -9, proc.exitcode  # it died by its own SIGKILL, mid-copy
    finally:
        if t is not None:
            t.close()
        _stop(proc)


@pytest.mark.timeout(120)
def test_sender_killed_mid_copy_never_delivers_the_half_written_message(listener):
    size = 64 << 20
    ctx = _spawn()
    result = ctx.Queue()
    nonce = new_nonce()
    listener.expect(nonce)
    proc = ctx.Process(target=W.send_then_die, args=(listener.address[1], nonce, size, result), daemon=True)
    proc.start()
    t = None
    try:
        t = listener.accept(nonce, timeout=20)
        W.settle(t, first=True)
        assert t.cma is not None and t.cma.receiving
        dst = torch.zeros(size, dtype=torch.uint8)
        t.post_recv(1, dst)
        t.send(3, torch.ones(1, dtype=torch.uint8), timeout=10)
        with pytest.raises(PeerLostError):
            t.wait_recv(1, timeout=30)
        proc.join(10)
        assert proc.exitcode == -9, (proc.exitcode, result.get(timeout=1) if not result.empty() else None)
        # Half the bytes are there (the copy really ran), but the message was never delivered.
        assert int(dst[0]) == 7 and int(dst[-1]) == 0
        assert t.cma.messages_landed == 0
    finally:
        if t is not None:
            t.close()
        _stop(proc)


# -- forged frames ---------------------------------------------------------------------------------------


def _inject(t: TcpTransport, frame: bytes) -> None:
    """Write a frame on ``t``'s socket as a peer that breaks the protocol would."""
    with t._send_lock:
        t._sock.sendall(frame)


def test_written_without_an_announced_buffer_is_refused(listener, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", "64K")
    a, b = _pair(listener)
    try:
        _settle(a, b)
        dst = torch.zeros(1024, dtype=torch.uint8)  # below the threshold: never announced
        b.post_recv(1, dst)
        _inject(a, FRAME.pack(b"TW", WRITTEN, NO_SHAPE, 1, 1, 1024, 0, 0, *_ZERO_DIMS))
        with pytest.raises(ProtocolError, match="no buffer was announced"):
            b.wait_recv(1, timeout=10)
        assert b.cma is not None and b.cma.messages_landed == 0
    finally:
        a.close()
        b.close()


def test_written_longer_than_the_announced_buffer_is_refused(listener, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", "1")
    a, b = _pair(listener)
    try:
        _settle(a, b)
        dst = torch.zeros(4096, dtype=torch.uint8)
        b.post_recv(1, dst)
        _inject(a, FRAME.pack(b"TW", WRITTEN, NO_SHAPE, 1, 1, 1 << 20, 0, 0, *_ZERO_DIMS))
        with pytest.raises(ProtocolError, match="slot holds 4096"):
            b.wait_recv(1, timeout=10)
    finally:
        a.close()
        b.close()


def _forge_slot(t: TcpTransport, tag: int, step: int, addr: int, length: int) -> None:
    _inject(t, CMA_FRAME.pack(b"TW", CMA, C.SLOT, tag, step, length, 0, 0, CP._SLOT_BODY.pack(addr)))


def test_a_message_longer_than_the_announced_buffer_is_not_written(listener, monkeypatch):
    """The peer announces 16 bytes for a step: the sender never writes a 1 MiB message there."""
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", "64K")
    a, b = _pair(listener)
    try:
        _settle(a, b)
        assert a.cma is not None and a.cma.sending
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        # b announces the real buffer; the forged SLOT for the same step arrives after it and replaces it
        b.post_recv(1, dst)
        tiny = ctypes.create_string_buffer(16)
        b._flush_credits()
        _forge_slot(b, 1, 1, ctypes.addressof(tiny), 16)
        a.post_recv(9, torch.zeros(1, dtype=torch.uint8))
        b.send(9, torch.ones(1, dtype=torch.uint8), timeout=5)
        a.wait_recv(9, timeout=5)  # a has read both SLOTs by now: the forged one replaced the real one
        assert a.cma._slots.get((1, 1)) == (ctypes.addressof(tiny), 16)
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
        a.send(1, src, timeout=10)
        b.wait_recv(1, timeout=10)
        assert torch.equal(dst, src)  # delivered whole, by the byte stream
        assert a.cma.messages_written == 0 and bytes(tiny.raw) == bytes(16)
    finally:
        a.close()
        b.close()


def test_a_forged_address_outside_the_peer_memory_fails_cleanly(listener, monkeypatch):
    """A SLOT naming an unmapped address: the copy fails (EFAULT), the link breaks with TransportError."""
    monkeypatch.setenv("TENSORWIRE_CMA_MIN_BYTES", "4K")
    a, b = _pair(listener)
    try:
        _settle(a, b)
        assert a.cma is not None and a.cma.sending
        b.post_recv(1, torch.zeros(1 << 16, dtype=torch.uint8))
        b._flush_credits()
        _forge_slot(b, 1, 1, 4096, 1 << 16)  # page 1 is never mapped
        a.post_recv(9, torch.zeros(1, dtype=torch.uint8))
        b.send(9, torch.ones(1, dtype=torch.uint8), timeout=5)
        a.wait_recv(9, timeout=5)
        assert a.cma._slots.get((1, 1)) == (4096, 1 << 16)
        with pytest.raises(TransportError, match="Bad address"):
            a.send(1, torch.ones(1 << 16, dtype=torch.uint8), timeout=10)
        with pytest.raises(TransportError):
            a.send(2, torch.ones(8, dtype=torch.uint8), timeout=1)  # the connection is broken now
    finally:
        a.close()
        b.close()


def test_connections_without_the_link_secret_refuse_cma_frames():
    """The serve daemon's listeners take no secret: no probe, and a CMA frame breaks the connection."""
    lst = TcpListener("127.0.0.1", port=0)
    try:
        a, b = _pair(lst, secret=None)
        try:
            assert a.cma is None and b.cma is None
            b.post_recv(1, torch.zeros(8, dtype=torch.uint8))
            _inject(a, CMA_FRAME.pack(b"TW", CMA, C.HELLO, 0, os.getpid(), 4096, 0, 0, bytes(64)))
            with pytest.raises(ProtocolError, match="without a link secret"):
                b.wait_recv(1, timeout=10)
        finally:
            a.close()
            b.close()
    finally:
        lst.close()


# -- the copy itself --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [C.PIECE_MIN - 1, 3 * C.PIECE_MIN + 123, (4 << 20) + 4097])
def test_a_copy_in_pieces_is_exact(n):
    libc = CS.load_libc()
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    C.copy(libc.writev, os.getpid(), src.data_ptr(), dst.data_ptr(), n, threads=3)
    assert torch.equal(dst, src)


def test_a_failed_piece_fails_the_copy_after_every_piece_finished():
    """The third piece's target is unmapped: the copy raises EFAULT, and only once no thread still copies."""
    libc = CS.load_libc()
    n = 4 * C.PIECE_MIN
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    calls: list[int] = []

    def writev(pid, liov, lcnt, riov, rcnt, flags):
        remote = riov._obj.iov_base
        calls.append(remote)
        if remote - dst.data_ptr() >= 2 * C.PIECE_MIN and remote - dst.data_ptr() < 3 * C.PIECE_MIN:
            riov._obj.iov_base = 4096  # a page that is never mapped
        return libc.writev(pid, liov, lcnt, riov, rcnt, flags)

    with pytest.raises(OSError) as info:
        C.copy(writev, os.getpid(), src.data_ptr(), dst.data_ptr(), n, threads=4)
    assert info.value.errno == errno.EFAULT
    assert len(calls) >= 4
    assert int(dst[: 2 * C.PIECE_MIN].sum()) == 2 * C.PIECE_MIN  # the other pieces were copied, whole
    assert int(dst[3 * C.PIECE_MIN :].sum()) == C.PIECE_MIN


# -- Yama --------------------------------------------------------------------------------------------------


def test_yama_grant_names_the_peer_then_the_nearest_common_ancestor(monkeypatch):
    monkeypatch.setattr(CS, "_GRANTED_PEERS", set())
    monkeypatch.setattr(CS, "_GRANTED", None)
    monkeypatch.setattr(CS, "_GRANT_PID", os.getpid())
    tree = {101: [101, 50, 10, 1], 102: [102, 50, 10, 1], 201: [201, 60, 10, 1], 301: [301, 1]}
    calls: list[int] = []

    def prctl(pid: int) -> int:
        calls.append(pid)
        return 0

    grant = lambda p: C.grant_ptrace(p, scope=1, prctl=prctl, ancestry=lambda q: tree.get(q, []))  # noqa: E731
    assert grant(101) is None and calls == [101]  # one peer: that peer only
    assert grant(101) is None and calls == [101]  # again: nothing to do
    assert grant(102) is None and calls == [101, 50]  # a sibling: their launcher
    assert grant(201) is None and calls == [101, 50, 10]  # a cousin: widened, never narrowed
    assert "gone" in (grant(999) or "")  # a peer that no longer exists is not granted
    assert C.grant_ptrace(555, scope=0, prctl=prctl) is None and calls == [101, 50, 10]  # scope 0: nothing


def test_yama_grant_reports_a_refused_prctl(monkeypatch):
    monkeypatch.setattr(CS, "_GRANTED_PEERS", set())
    monkeypatch.setattr(CS, "_GRANTED", None)
    monkeypatch.setattr(CS, "_GRANT_PID", os.getpid())
    why = C.grant_ptrace(7, scope=1, prctl=lambda pid: errno.EINVAL, ancestry=lambda q: [q, 1])
    assert why is not None and "PR_SET_PTRACER" in why


def test_common_ancestor():
    assert C.common_ancestor([[5, 3, 1], [6, 3, 1]]) == 3
    assert C.common_ancestor([[5, 3, 1]]) == 5
    assert C.common_ancestor([[5, 3], [6, 4]]) is None
    assert C.common_ancestor([]) is None
