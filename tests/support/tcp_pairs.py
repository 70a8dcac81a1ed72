"""A connected pair of TCP transports through a real listener (its admission, hello and, with a secret, the
link proof)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from tensorwire.transport.base import new_nonce
from tensorwire.transport.tcp import TcpListener, TcpTransport


def tcp_pair(listener: TcpListener, *, secret: bytes | None = None) -> tuple[TcpTransport, TcpTransport]:
    """(the dialled end, the accepted end) of one new connection to ``listener``; ``secret``: the link secret
    the dialler proves (``None``: the nonce alone)."""
    nonce = new_nonce()
    listener.expect(nonce)
    out: dict[str, TcpTransport] = {}
    th = threading.Thread(
        target=lambda: out.setdefault(
            "c", TcpListener.connect("127.0.0.1", listener.address[1], nonce, timeout=10, secret=secret)
        )
    )
    th.start()
    server = listener.accept(nonce, timeout=10)
    th.join(10)
    return out["c"], server


@contextlib.contextmanager
def tcp_pair_on_port_0() -> Iterator[tuple[TcpTransport, TcpTransport]]:
    """:func:`tcp_pair` through a listener of its own on port 0; all three closed after the block."""
    listener = TcpListener("127.0.0.1", port=0)
    a, b = tcp_pair(listener)
    try:
        yield a, b
    finally:
        a.close()
        b.close()
        listener.close()
