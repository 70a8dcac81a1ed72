"""An in-process transport pair with the same semantics as the real ones.

Used by unit tests and by :func:`tensorwire.testing.check_transport` as the
reference implementation of the :class:`~tensorwire.transport.base.Transport`
contract: credits are posted buffers, sends copy into the peer's oldest free
posted buffer, per-tag FIFO order, timeouts, close/abort waking waiters.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Deque

from tensorwire.errors import ClosedError, PeerLostError, ProtocolError, TransferTimeout
from tensorwire.transport.base import Received, Transport

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["MemoryTransport", "memory_pair"]


class _Post:
    __slots__ = ("buf", "result")

    def __init__(self, buf: "torch.Tensor") -> None:
        self.buf = buf
        self.result: Received | None = None


class _Shared:
    def __init__(self) -> None:
        self.cond = threading.Condition()


class MemoryTransport(Transport):
    kind = "memory"
    reaches_cuda = True

    def __init__(self, shared: _Shared) -> None:
        self._s = shared
        self._posted: dict[int, Deque[_Post]] = collections.defaultdict(collections.deque)
        self._steps: dict[int, int] = collections.defaultdict(int)
        self._peer: MemoryTransport | None = None
        self._closed = False
        self._peer_gone = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedError("transport closed")
        if self._peer_gone:
            raise PeerLostError("peer closed the link")

    def post_recv(self, tag: int, buf: "torch.Tensor", *, header: bool = False) -> None:
        with self._s.cond:
            self._check()
            self._posted[tag].append(_Post(buf))
            self._s.cond.notify_all()

    def wait_recv(self, tag: int, *, timeout: float | None) -> Received:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._s.cond:
            while True:
                q = self._posted.get(tag)
                if q and q[0].result is not None:
                    return q.popleft().result  # type: ignore[return-value]
                self._check()
                rem = None if deadline is None else deadline - time.monotonic()
                if rem is not None and rem <= 0:
                    raise TransferTimeout(f"receive on tag {tag} timed out")
                self._s.cond.wait(rem)

    def send(
        self,
        tag: int,
        buf: "torch.Tensor",
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._s.cond:
            while True:
                self._check()
                peer = self._peer
                assert peer is not None
                q = peer._posted.get(tag)
                post = next((p for p in q if p.result is None), None) if q else None
                if post is not None:
                    break
                rem = None if deadline is None else deadline - time.monotonic()
                if rem is not None and rem <= 0:
                    raise TransferTimeout(f"no credit to send on tag {tag}")
                self._s.cond.wait(rem)
            n = buf.numel()
            if n > post.buf.numel():
                raise ProtocolError(f"{n} bytes do not fit the posted {post.buf.numel()}-byte buffer on tag {tag}")
            if n:
                post.buf[:n].copy_(buf)
            self._steps[tag] += 1
            post.result = Received(n, shape, self._steps[tag])
            self._s.cond.notify_all()

    def close(self) -> None:
        with self._s.cond:
            if self._closed:
                return
            self._closed = True
            if self._peer is not None:
                self._peer._peer_gone = True
            self._s.cond.notify_all()


def memory_pair() -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected in-memory transports."""
    shared = _Shared()
    a, b = MemoryTransport(shared), MemoryTransport(shared)
    a._peer, b._peer = b, a
    return a, b
