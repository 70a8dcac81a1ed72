"""Hostile input on the TCP data port: bad connections are dropped, good peers keep being served."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
import torch

from tcp_pairs import tcp_pair

import tensorwire as tw
from tensorwire.transport.base import new_nonce
from tensorwire.transport.tcp import FRAME, HELLO, HELLO_HEAD, HELLO_MAGIC, PROTOCOL_VERSION, TcpListener

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def listener():
    lst = TcpListener("127.0.0.1", port=0)
    lst.HELLO_TIMEOUT = 1.0
    yield lst
    lst.close()


def _good_pair(listener):
    return tcp_pair(listener)


def _exchange_ok(listener) -> None:
    a, b = _good_pair(listener)
    try:
        dst = torch.zeros(1000, dtype=torch.uint8)
        b.post_recv(1, dst)
        src = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
        a.send(1, src, timeout=10)
        b.wait_recv(1, timeout=10)
        assert torch.equal(dst, src)
    finally:
        a.close()
        b.close()


def _closed_by_peer(sock: socket.socket, within: float = 5.0) -> bool:
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.mark.parametrize(
    "payload",
    [
        os.urandom(4096),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, b"\x00" * 16, b"\x00" * 16),  # well-formed hello, unknown credential
        HELLO_HEAD.pack(HELLO_MAGIC, PROTOCOL_VERSION + 7, b"\x00" * 16),  # wrong version
        HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, b"\x00" * 16, b"\x00" * 16)[:10],  # truncated hello, then silence
        b"",  # connect and say nothing
    ],
    ids=["random", "http", "bad-credential", "bad-version", "truncated", "silent"],
)
def test_garbage_connections_are_dropped_and_the_listener_keeps_serving(listener, payload):
    before = listener.rejected
    bad = socket.create_connection(listener.address, timeout=5)
    try:
        if payload:
            bad.sendall(payload)
        _exchange_ok(listener)  # served while the bad connection is pending
        assert _closed_by_peer(bad), "listener kept a bad connection open"
    finally:
        bad.close()
    deadline = time.monotonic() + 5
    while listener.rejected == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.rejected == before + 1
    _exchange_ok(listener)


def test_a_wrong_nonce_is_an_auth_error_for_the_dialer(listener):
    with pytest.raises(tw.AuthError):
        TcpListener.connect("127.0.0.1", listener.address[1], new_nonce(), timeout=5)
    _exchange_ok(listener)


@pytest.mark.parametrize("frame", ["bad-magic", "no-credit", "too-long", "truncated"])
def test_garbage_frames_after_the_handshake_break_only_that_connection(listener, frame):
    nonce = new_nonce()
    listener.expect(nonce)
    raw = socket.create_connection(listener.address, timeout=5)
    raw.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, nonce, bytes(16)))
    assert raw.recv(8)[:4] == b"TWOK"
    victim = listener.accept(nonce, timeout=5)
    try:
        victim.post_recv(3, torch.zeros(16, dtype=torch.uint8))
        zeros = (0,) * 8
        if frame == "bad-magic":
            raw.sendall(b"XX" + FRAME.pack(b"TW", 1, 255, 3, 1, 4, 0, 0, *zeros)[2:])
        elif frame == "no-credit":
            raw.sendall(FRAME.pack(b"TW", 1, 255, 9, 1, 4, 0, 0, *zeros) + b"abcd")
        elif frame == "too-long":
            raw.sendall(FRAME.pack(b"TW", 1, 255, 3, 1, 1 << 20, 0, 0, *zeros))
        else:
            raw.sendall(FRAME.pack(b"TW", 1, 255, 3, 1, 16, 0, 0, *zeros) + b"abc")
            raw.close()
        err = tw.PeerLostError if frame == "truncated" else tw.ProtocolError
        with pytest.raises(err):
            victim.wait_recv(3, timeout=5)
    finally:
        victim.close()
        raw.close()
    _exchange_ok(listener)


def test_header_struct_is_fixed_size():
    assert FRAME.size == 96 and struct.calcsize("<8sI16s") == HELLO_HEAD.size
    assert struct.calcsize("<8sI16s16s") == HELLO.size
