"""Nothing listening, or the port taken: errors that say so, and only tensorwire's own words."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

import tensorwire as tw
from serve_common import ROOT, clean_env


def _reserved_port() -> socket.socket:
    """A socket bound to a loopback port that does not listen: connections there are refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


@pytest.mark.timeout(60)
def test_a_client_of_an_address_where_nothing_listens_gets_a_connect_error_that_is_a_peer_lost_error():
    with _reserved_port() as s:
        addr = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(tw.ConnectError) as info:
            tw.Client(addr, connect_timeout=5)
    assert isinstance(info.value, tw.PeerLostError)  # handlers of a lost peer still catch it
    msg = str(info.value)
    assert f"no tensorwire daemon reachable at {addr}" in msg
    assert "tensorwire serve" in msg and "Connection refused" in msg


@pytest.mark.timeout(60)
def test_serve_on_a_port_in_use_prints_only_tensorwires_error_and_exits_1():
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "tensorwire", "serve", "--port", str(port)],
            env=clean_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=50,
            stdin=subprocess.DEVNULL,
        )
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [
        f"tensorwire: error: cannot listen on 127.0.0.1:{port}: the port is in use "
        "(another tensorwire serve? pick another --port, or 0 for any)"
    ], r.stderr
    assert r.stdout == ""
