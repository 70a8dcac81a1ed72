"""A TCP link's reader polls its socket before it sleeps (``TENSORWIRE_TCP_SPIN_US``); the serve daemon's never."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tcp_pairs import tcp_pair

from tensorwire.transport.tcp import TcpListener, TcpTransport

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(60)


def _pair(secret: bytes | None) -> tuple[TcpTransport, TcpTransport, TcpListener]:
    lst = TcpListener("127.0.0.1", port=0, secret=secret)
    return (*tcp_pair(lst, secret=secret), lst)


def test_links_spin_as_configured_and_connections_without_a_secret_never(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_TCP_SPIN_US", "250")
    for secret, expect in ((b"s" * 32, 250e-6), (None, 0.0)):
        a, b, lst = _pair(secret)
        try:
            assert a._spin == pytest.approx(expect) and b._spin == pytest.approx(expect), (secret, a._spin, b._spin)
        finally:
            a.close()
            b.close()
            lst.close()


def _cpu_of_a_wait(spin_us: float) -> tuple[float, float]:
    """(thread CPU seconds, wall seconds) of a receive whose message comes 80 ms after the wait began."""
    s1, s2 = socket.socketpair()
    a, b = TcpTransport(s1, peer="a"), TcpTransport(s2, peer="b", spin_us=spin_us)
    try:
        box = torch.zeros(64, dtype=torch.uint8)
        b.post_recv(1, box)
        msg = torch.ones(64, dtype=torch.uint8)
        sender = threading.Thread(target=lambda: (time.sleep(0.08), a.send(1, msg, timeout=10)))
        sender.start()
        c0, t0 = time.thread_time(), time.perf_counter()
        b.wait_recv(1, timeout=10)
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        sender.join(10)
        assert torch.all(box == 1)
        return cpu, wall
    finally:
        a.close()
        b.close()


def test_a_spinning_reader_polls_instead_of_sleeping():
    """The control (no spin) sleeps in the kernel for the 80 ms: little CPU. With a spin longer than the wait,
    the reader polls all along: its CPU time grows with the wait (on a loaded machine it gets a share of it)."""
    idle_cpu, idle_wall = _cpu_of_a_wait(0.0)
    spin_cpu, spin_wall = _cpu_of_a_wait(2_000_000.0)  # 2 s: longer than the wait
    assert idle_wall > 0.07 and spin_wall > 0.07, (idle_wall, spin_wall)  # both waited for the late message
    assert spin_cpu > idle_cpu + 0.01, (spin_cpu, idle_cpu)


def _spin_of_a_wait(spin_us: float, nbytes: int) -> float:
    """The poll budget the reader used while it waited for a receive of ``nbytes`` (the message comes 20 ms late)."""
    s1, s2 = socket.socketpair()
    a, b = TcpTransport(s1, peer="a"), TcpTransport(s2, peer="b", spin_us=spin_us)
    seen: list[float] = []
    real = b._recv

    def recv(view, n, block):
        if block:
            seen.append(b._rspin)
        return real(view, n, block)

    b._recv = recv  # type: ignore[method-assign]
    try:
        box = torch.zeros(nbytes, dtype=torch.uint8)
        b.post_recv(1, box)
        sender = threading.Thread(
            target=lambda: (time.sleep(0.02), a.send(1, torch.ones(64, dtype=torch.uint8), timeout=10))
        )
        sender.start()
        got = b.wait_recv(1, timeout=10)
        sender.join(10)
        assert got.nbytes == 64 and torch.all(box[:64] == 1)
        assert seen, "the reader never blocked"
        return seen[0]
    finally:
        a.close()
        b.close()


@pytest.mark.pure_python
def test_a_wait_for_a_large_receive_polls_longer_up_to_a_bound():
    """A receive of n bytes polls about as long as the bytes take to come (``SPIN_PER_BYTE``), at most
    ``SPIN_EXTRA_MAX`` longer than the link's spin, and no longer at all past ``SPIN_EXTRA_BYTES`` (a copy
    on several threads); a link that never spins still never does."""
    from tensorwire.transport.tcp.reader import SPIN_EXTRA_BYTES, SPIN_EXTRA_MAX, SPIN_PER_BYTE

    base = 100e-6
    assert _spin_of_a_wait(100.0, 64) == pytest.approx(base + 64 * SPIN_PER_BYTE)
    assert _spin_of_a_wait(100.0, 1 << 20) == pytest.approx(base + (1 << 20) * SPIN_PER_BYTE)
    assert (1 << 20) * SPIN_PER_BYTE > 100e-6  # a 1 MiB cross-memory copy (80-100 us) is covered
    assert _spin_of_a_wait(100.0, SPIN_EXTRA_BYTES) == pytest.approx(base + SPIN_EXTRA_MAX)
    assert _spin_of_a_wait(100.0, SPIN_EXTRA_BYTES + 1) == pytest.approx(base)
    assert _spin_of_a_wait(0.0, 1 << 20) == 0.0
