"""Credit flow control of one UCX connection, both ways, and the UCX tag objects of each slot tag.

A receiver grants one 16-byte credit (the buffer's capacity and whether it
wants a header) per buffer it posts; a sender spends one per message and
checks the message against it. Why credits on top of UCX's own matching, and
what they cost: ``docs/transports.md``. Everything here runs with the engine
lock held.
"""

from __future__ import annotations

import collections
from typing import Any, Deque

from tensorwire.transport.ucx._ucxx import Array, Tag, u8, ucx
from tensorwire.transport.ucx.connection import UcxConnection
from tensorwire.transport.ucx.wire import CRED, CREDIT, DATA, HEADER, KIND_SHIFT

__all__ = ["Credits", "Tags"]


class Tags:
    """The six UCX tag objects of one slot tag of one connection, built once (0.4 us each per message otherwise)."""

    __slots__ = ("data_rx", "hdr_rx", "cred_rx", "data_tx", "hdr_tx", "cred_tx")

    def __init__(self, rid: int, peer_rid: int, tag: int) -> None:
        self.data_rx = Tag(rid | (DATA << KIND_SHIFT) | tag)
        self.hdr_rx = Tag(rid | (HEADER << KIND_SHIFT) | tag)
        self.cred_rx = Tag(rid | (CREDIT << KIND_SHIFT) | tag)
        self.data_tx = Tag(peer_rid | (DATA << KIND_SHIFT) | tag)
        self.hdr_tx = Tag(peer_rid | (HEADER << KIND_SHIFT) | tag)
        self.cred_tx = Tag(peer_rid | (CREDIT << KIND_SHIFT) | tag)


class _CreditRx:
    __slots__ = ("req", "buf", "arr")

    def __init__(self) -> None:
        self.req: Any = None
        self.buf = u8(CRED.size)
        self.arr = Array(self.buf)


class Credits:
    """The credits one connection grants its peer and the ones it receives from it and spends."""

    def __init__(self, conn: UcxConnection) -> None:
        self._c = conn
        self._credits: dict[int, Deque[tuple[int, int]]] = collections.defaultdict(collections.deque)
        self._rx: dict[int, _CreditRx] = {}
        self._pool: list[tuple[Any, Any]] = []

    def grant(self, tags: Tags, cap: int, flags: int) -> None:
        """Send one credit; its 16-byte buffer comes from a pool (eager sends usually finish at once)."""
        c = self._c
        pool = self._pool
        cbuf, carr = pool.pop() if pool else (u8(CRED.size), None)
        if carr is None:
            carr = Array(cbuf)
        CRED.pack_into(cbuf, 0, cap, flags)
        req = c._ep.tag_send(carr, tag=tags.cred_tx)
        if req.completed:
            pool.append((cbuf, carr))
        else:
            c._sends.append((req, (cbuf, carr)))
        sends = c._sends
        while sends and sends[0][0].completed:
            sends.popleft()

    def take(self, tag: int, tags: Tags) -> tuple[int, int] | None:
        """A credit of the peer for ``tag`` -- (capacity, flags) -- or None when there is none yet."""
        q = self._credits[tag]
        rx = self._rx.get(tag)
        if rx is None:
            rx = self._rx[tag] = _CreditRx()
        while True:
            if rx.req is None:
                if q:
                    break  # one in hand: the receive for the next is armed after the send (arm)
                rx.req = self._c._ep.tag_recv(rx.arr, tag=tags.cred_rx)
            if not rx.req.completed:
                break
            req, rx.req = rx.req, None
            try:
                req.check_error()
            except ucx.UCXError as exc:
                raise self._c._fail_from(exc, f"waiting for a credit on tag {tag}") from exc
            q.append(CRED.unpack_from(rx.buf))
        return q.popleft() if q else None

    def refund(self, tag: int, credit: tuple[int, int]) -> None:
        """Put a credit back in front (the message it was taken for was refused before sending)."""
        self._credits[tag].appendleft(credit)

    def arm(self, tag: int, tags: Tags) -> None:
        """Keep a receive posted for the next credit on ``tag`` (credits sent meanwhile wait in UCX's queue)."""
        rx = self._rx.get(tag)
        if rx is not None and rx.req is None:
            try:
                rx.req = self._c._ep.tag_recv(rx.arr, tag=tags.cred_rx)
            except ucx.UCXError as exc:
                raise self._c._fail_from(exc, f"waiting for a credit on tag {tag}") from exc

    def posted_requests(self, rid: int) -> list[tuple[int, Any]]:
        """(full tag, request) of the credit receives still posted (``rid``: this side's receiver id, shifted)."""
        return [
            (rid | (CREDIT << KIND_SHIFT) | tag, rx.req)
            for tag, rx in self._rx.items()
            if rx.req is not None and not rx.req.completed
        ]

    def buffers(self) -> Any:
        """What the credit receives' buffers hang on."""
        return dict(self._rx)

    def forget(self) -> None:
        self._rx.clear()
