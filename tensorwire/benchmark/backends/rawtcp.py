"""The floor to compare against: one plain TCP socket, ``sendall`` out of the buffer, ``recv_into`` the
receiver's buffer, a 1-byte ack. No framing, no credits, no threads.

:func:`tune` and :func:`recv_exact` are the socket a fair competitor would write (``TCP_NODELAY``,
``recv_into`` a preallocated buffer with ``MSG_WAITALL``); ``tensorwire demo``'s raw socket path uses these
same two functions, so the demo and ``tensorwire bench`` measure one socket.

CUDA buffers are staged through a pinned host buffer (one D2H before the send,
one H2D after the receive), as any socket would need.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from tensorwire.benchmark.backends.base import PairContext
from tensorwire.benchmark.backends.base import Receiver as _Receiver
from tensorwire.benchmark.backends.base import Sender as _Sender

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Sender", "Receiver", "tune", "recv_exact"]

_ACK = b"\x01"


def tune(sock: socket.socket, timeout: float) -> socket.socket:
    """``TCP_NODELAY`` (a small message leaves at once) and a timeout on every call; returns ``sock``."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    return sock


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Receive exactly ``len(view)`` bytes into ``view`` (``MSG_WAITALL``: one call unless a signal or the
    timeout cuts it short).

    Raises:
        ConnectionError: the peer closed the connection first.
    """
    n = len(view)
    got = sock.recv_into(view, n, socket.MSG_WAITALL)
    while got < n:
        if got == 0:
            raise ConnectionError("the peer closed the connection mid-message")
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("the peer closed the connection mid-message")
        got += k


def _host_buffer(size: int, *, cuda: bool) -> "torch.Tensor":
    import torch

    return torch.empty(size, dtype=torch.uint8, pin_memory=cuda)


class Sender(_Sender):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        port = int(ctx.lookup("rawtcp/port"))
        self.sock = socket.create_connection((ctx.cfg.host, port), timeout=ctx.timeout)
        tune(self.sock, ctx.timeout)
        self.ackbuf = memoryview(bytearray(1))
        self.src: "torch.Tensor | None" = None
        self.stage: "torch.Tensor | None" = None
        self.view: memoryview | None = None

    def open(self, size: int, src: "torch.Tensor") -> None:
        self.src = src
        if src.is_cuda:
            self.stage = _host_buffer(size, cuda=True)
            self.view = memoryview(self.stage.numpy())
        else:
            self.view = memoryview(src.numpy())

    def send(self) -> None:
        if self.stage is not None:
            self.stage.copy_(self.src)
        self.sock.sendall(self.view)  # type: ignore[arg-type]

    def wait_ack(self) -> None:
        recv_exact(self.sock, self.ackbuf)

    def close_size(self) -> None:
        self.src = self.stage = self.view = None

    def close(self) -> None:
        self.sock.close()


class Receiver(_Receiver):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        lst = socket.create_server((ctx.cfg.host, 0))
        lst.settimeout(ctx.timeout)
        ctx.publish("rawtcp/port", str(lst.getsockname()[1]))
        try:
            self.sock, _ = lst.accept()
        finally:
            lst.close()
        tune(self.sock, ctx.timeout)
        self.buf: "torch.Tensor | None" = None
        self.host: "torch.Tensor | None" = None
        self.view: memoryview | None = None

    def open(self, size: int) -> None:
        import torch

        cuda = self.ctx.device.type == "cuda"
        self.host = _host_buffer(size, cuda=cuda)
        self.buf = torch.empty(size, dtype=torch.uint8, device=self.ctx.device) if cuda else self.host
        self.view = memoryview(self.host.numpy())

    def recv(self) -> "torch.Tensor":
        view = self.view
        assert view is not None and self.buf is not None and self.host is not None
        recv_exact(self.sock, view)
        if self.buf is not self.host:
            self.buf.copy_(self.host)
        return self.buf

    def ack(self) -> None:
        self.sock.sendall(_ACK)

    def close_size(self) -> None:
        self.buf = self.host = self.view = None

    def close(self) -> None:
        self.sock.close()
