"""Peers in processes of their own for the cross-memory attach tests (tests/transport/test_tcp_cma.py).

Each connects to the test's TCP listener with the link secret, settles the probe
(:func:`settle`), then plays its part and reports on a queue.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from tensorwire.transport.base import Transport
from tensorwire.transport.tcp import TcpListener

SECRET = b"cma-test-secret-" * 2
#: Tag of the small messages that carry the probe's frames until it is done.
SETTLE_TAG = 1 << 30


def settle(t: Transport, *, first: bool, rounds: int = 8) -> None:
    """Ping-pong small messages until the probe is done (both sides call it, ``first`` on one).

    The probe's frames travel with the transport's credits and sends, so a few
    round trips complete it; both sides run the same number of rounds."""
    box = torch.zeros(8, dtype=torch.uint8)
    one = torch.ones(8, dtype=torch.uint8)
    for _ in range(rounds):
        if first:
            t.post_recv(SETTLE_TAG + 1, box)
            t.send(SETTLE_TAG, one, timeout=10)
            t.wait_recv(SETTLE_TAG + 1, timeout=10)
        else:
            t.post_recv(SETTLE_TAG, box)
            t.wait_recv(SETTLE_TAG, timeout=10)
            t.send(SETTLE_TAG + 1, one, timeout=10)


def connect(port: int, nonce: bytes) -> Transport:
    return TcpListener.connect("127.0.0.1", port, nonce, timeout=20, secret=SECRET)


def echo(port: int, nonce: bytes, sizes: list[int], result: Any) -> None:
    """Receive one message of each size on tag 1, send it back on tag 2; report the CMA counters."""
    try:
        t = connect(port, nonce)
        settle(t, first=False)
        for n in sizes:
            buf = torch.empty(n, dtype=torch.uint8)
            t.post_recv(1, buf)
            got = t.wait_recv(1, timeout=60)
            assert got.nbytes == n
            t.send(2, buf, timeout=60)
        cma = t.cma  # type: ignore[attr-defined]
        result.put(("ok", cma.state, cma.messages_written, cma.messages_landed))
        t.post_recv(4, torch.zeros(1, dtype=torch.uint8))
        t.wait_recv(4, timeout=30)  # the test's word that it is done: close only then
        t.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result.put(("error", repr(exc)))


def receive_then_die(port: int, nonce: bytes, size: int, result: Any) -> None:
    """Post one large buffer and SIGKILL this process as soon as the peer's copy into it has begun."""
    try:
        t = connect(port, nonce)
        settle(t, first=False)
        buf = torch.zeros(size, dtype=torch.uint8)
        t.post_recv(1, buf)
        t.send(3, torch.ones(1, dtype=torch.uint8), timeout=10)  # the SLOT and credit go with this
        result.put(("posted",))
        deadline = time.monotonic() + 30
        head = buf[: 1 << 12]
        while time.monotonic() < deadline:
            if bool(head.any()):  # the first page changed: the sender is copying right now
                os.kill(os.getpid(), signal.SIGKILL)
        result.put(("error", "the peer never began copying"))
    except BaseException as exc:  # noqa: BLE001
        result.put(("error", repr(exc)))


def send_then_die(port: int, nonce: bytes, size: int, result: Any) -> None:
    """Send one large message through cross-memory attach, SIGKILLing this process half-way through the copy."""
    try:
        t = connect(port, nonce)
        settle(t, first=False)
        cma = t.cma  # type: ignore[attr-defined]
        real = cma.write

        def write_half_then_die(payload: memoryview, slot: tuple[int, int]) -> bool:
            # Half the bytes really land in the peer's buffer; then this process dies mid-message.
            real(payload[: len(payload) // 2], slot)
            os.kill(os.getpid(), signal.SIGKILL)
            return True

        cma.write = write_half_then_die
        src = torch.full((size,), 7, dtype=torch.uint8)
        t.post_recv(3, torch.zeros(1, dtype=torch.uint8))
        t.wait_recv(3, timeout=10)  # the peer posted its buffer: its SLOT came before this
        result.put(("sending",))
        t.send(1, src, timeout=30)
        result.put(("error", "still alive after the copy"))
    except BaseException as exc:  # noqa: BLE001
        result.put(("error", repr(exc)))


def echo_as(uid: int, port: int, nonce: bytes, sizes: list[int], result: Any) -> None:
    """:func:`echo` after dropping to another user: that user may not ptrace the test's process (root)."""
    import encodings.idna  # noqa: F401 - imported later by socket, when this user can no longer read it

    try:
        os.setgid(uid)
        os.setuid(uid)
    except OSError as exc:
        result.put(("error", f"cannot become uid {uid}: {exc}"))
        return
    echo(port, nonce, sizes, result)
