"""Socket helpers shared by the TCP and UCX transports: dialing with a deadline, tuning a socket.

Both transports open plain TCP sockets (TCP for its data, UCX for its handshake), so
these live below both of them instead of in ``tcp/``.
"""

from __future__ import annotations

import socket
import time

from tensorwire.errors import ConnectTimeout, PeerLostError
from tensorwire.transport.base import remaining as _remaining

__all__ = ["dial", "tune_socket"]


def dial(
    host: str,
    port: int,
    deadline: float | None,
    *,
    retry: tuple[type[OSError], ...] = (ConnectionRefusedError,),
    timeout_without_deadline: float | None = None,
    what: str = "connection to",
) -> socket.socket:
    """Connect to ``host:port``, retrying the ``retry`` errors (a listener not up yet) with
    backoff (50 ms doubling to 1 s) until ``deadline``. Each attempt waits at most what is left
    of the deadline (``timeout_without_deadline`` when there is none).

    Raises:
        ConnectTimeout: retries ran out at the deadline, or an attempt timed out.
        PeerLostError: the name does not resolve, or another socket error.
    """
    delay = 0.05
    while True:
        rem = _remaining(deadline)
        try:
            return socket.create_connection(
                (host, port), timeout=timeout_without_deadline if rem is None else max(0.01, rem)
            )
        except socket.gaierror as exc:
            raise PeerLostError(f"cannot resolve {host}: {exc}") from exc
        except retry as exc:
            rem = _remaining(deadline)
            if rem is not None and rem <= delay:
                raise ConnectTimeout(f"{what} {host}:{port} refused or unreachable until the timeout: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        except (socket.timeout, TimeoutError) as exc:
            raise ConnectTimeout(f"{what} {host}:{port} timed out") from exc
        except OSError as exc:
            raise PeerLostError(f"cannot connect to {host}:{port}: {exc}") from exc


def tune_socket(sock: socket.socket, *, peer_timeout: float) -> None:
    """TCP_NODELAY, keepalive and TCP_USER_TIMEOUT so a dead peer is detected in ~peer_timeout."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(peer_timeout / 3))
    for opt, val in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 2)), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(peer_timeout * 1000))
