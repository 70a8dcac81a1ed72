"""What one slot tag of one UCX connection needs on the hot path, made once: :class:`TagState`.

A receiver grants one 16-byte credit (the buffer's capacity and whether it
wants a header) per buffer it posts; a sender spends one per message and
checks the message against it. Why credits on top of UCX's own matching, and
what they cost: ``docs/transports.md``. A tag's state holds its six UCX tag
objects, the receives posted on it, the credits received and not spent yet,
the receive armed for the next one, and the credit messages it sends (one
16-byte buffer per capacity, built once: a tag's buffers usually all have one
size). Everything here is used with the engine lock held.
"""

from __future__ import annotations

import collections
from typing import Any, Deque

from tensorwire.errors import ProtocolError
from tensorwire.transport.base import HEADER_DIMS, Received
from tensorwire.transport.ucx._ucxx import Array, Tag, cancelled, u8
from tensorwire.transport.ucx.wire import CRED, CREDIT, DATA, F_HEADER, HDR, HEADER, KIND_SHIFT, NO_SHAPE

__all__ = ["Post", "TagState"]

#: Credit messages a tag keeps built, one per (capacity, flags); more are rare (a serve client's parts).
MAX_GRANTS = 16
#: Header buffers a tag keeps for the headers it sends (one is enough while each goes out at once).
MAX_HEADERS_IN_FLIGHT = 4
_NO_DIMS = (0,) * HEADER_DIMS


class Post:
    """A receive buffer (what UCX writes into, built once) and, while it is posted on a tag, its receives.

    :meth:`UcxTransport.prepare_recv <tensorwire.transport.ucx.endpoint.UcxTransport.prepare_recv>`
    makes one per slot for good, and posting it again reuses it (no descriptor, no object per message);
    a plain buffer gets a fresh one per post. ``busy``: posted and not consumed yet.
    """

    __slots__ = ("req", "keep", "arr", "cap", "hreq", "hbuf", "harr", "busy")

    def __init__(self, keep: Any, arr: Any, cap: int) -> None:
        self.keep = keep
        self.arr = arr
        self.cap = cap
        self.req: Any = None  # None: posted after the peer left, filled only from UCX's unexpected queue
        self.hreq: Any = None
        self.hbuf: Any = None
        self.harr: Any = None
        self.busy = False


class TagState:
    """One slot tag of one connection: UCX tags, posted receives, credits both ways, the send counter."""

    __slots__ = (
        "tag",
        "data_rx",
        "hdr_rx",
        "cred_rx",
        "data_tx",
        "hdr_tx",
        "cred_tx",
        "posted",
        "credits",
        "cred_req",
        "cred_buf",
        "cred_arr",
        "grants",
        "hfree",
        "hsend",
        "step",
        "ahead",
        "checked",
    )

    def __init__(self, rid: int, peer_rid: int, tag: int) -> None:
        self.tag = tag
        # The six UCX tag objects, built once (0.4 us each per message otherwise).
        self.data_rx = Tag(rid | (DATA << KIND_SHIFT) | tag)
        self.hdr_rx = Tag(rid | (HEADER << KIND_SHIFT) | tag)
        self.cred_rx = Tag(rid | (CREDIT << KIND_SHIFT) | tag)
        self.data_tx = Tag(peer_rid | (DATA << KIND_SHIFT) | tag)
        self.hdr_tx = Tag(peer_rid | (HEADER << KIND_SHIFT) | tag)
        self.cred_tx = Tag(peer_rid | (CREDIT << KIND_SHIFT) | tag)
        self.posted: Deque[Post] = collections.deque()  # receives posted on this tag, oldest first
        self.credits: Deque[tuple[int, int]] = collections.deque()  # the peer's, received, not spent
        self.cred_req: Any = None  # the receive armed for the peer's next credit
        self.cred_buf = u8(CRED.size)
        self.cred_arr = Array(self.cred_buf)
        self.grants: dict[tuple[int, bool], tuple[Any, Any]] = {}  # (capacity, header) -> credit message
        self.hfree: list[tuple[Any, Any]] = []  # header receive buffers free for the next post
        self.hsend: list[list[Any]] = []  # [buffer, ucxx Array, its last send] of the headers this side sends
        self.step = 0  # messages sent on this tag
        # send-ahead (UcxTransport.send_ahead): byte counts of messages sent before their credit came, oldest
        # first (each settled by the next credit to arrive), and the (bytes, shape) the last credit admitted
        self.ahead: Deque[int] = collections.deque()
        self.checked: tuple[int, tuple[int, ...] | None] | None = None

    def grant_message(self, cap: int, header: bool) -> tuple[Any, Any]:
        """The credit message for a buffer of ``cap`` bytes (buffer, ucxx Array), built once per size."""
        g = self.grants.get((cap, header))
        if g is None:
            if len(self.grants) >= MAX_GRANTS:
                self.grants.clear()  # (messages in flight keep their buffers referenced)
            buf = u8(CRED.size)
            CRED.pack_into(buf, 0, cap, F_HEADER if header else 0)
            g = self.grants[(cap, header)] = (buf, Array(buf))
        return g

    def header_buffer(self) -> tuple[Any, Any]:
        """A header receive buffer (buffer, ucxx Array): a free one, or a new one the first times."""
        if self.hfree:
            return self.hfree.pop()
        hbuf = u8(HDR.size)
        return hbuf, Array(hbuf)

    def take_credit(self, ep: Any) -> tuple[int, int] | None:
        """The peer's next credit for this tag that has arrived -- (capacity, flags) -- or None.

        Raises:
            ucx.UCXError: from UCX (the caller translates it).
        """
        r = self.cred_req
        if r is None:
            r = self.cred_req = ep.tag_recv(self.cred_arr, tag=self.cred_rx)
        if not r.completed:
            return None
        self.cred_req = None  # armed again after the message it is spent on (UcxTransport._try_post)
        r.check_error()
        return CRED.unpack_from(self.cred_buf)

    def post_message(
        self,
        ep: Any,
        credit: tuple[int, int],
        keep: Any,
        arr: Any,
        n: int,
        step: int | None,
        shape: tuple[int, ...] | None,
        reqs: list[Any],
    ) -> None:
        """Spend ``credit``: post the header (if the receiver wants one) and the payload, appending
        (request, what it reads) to ``reqs``.

        Raises:
            ProtocolError: ``n`` bytes do not fit the credit's buffer (the credit is kept, nothing sent).
            ucx.UCXError: from UCX (the caller translates it).
        """
        cap, flags = credit
        if n != cap and (n > cap or not flags & F_HEADER):
            self.credits.appendleft(credit)  # kept: nothing was sent
            raise ProtocolError(
                f"{n} bytes do not fit the peer's {cap}-byte buffer on tag {self.tag}"
                + ("" if flags & F_HEADER else " (a tag without header takes exactly its buffer's size)")
            )
        s = self.step = self.step + 1
        if flags & F_HEADER:
            h = self.header_to_send(s if step is None else step, n, shape)
            hreq = h[2] = ep.tag_send(h[1], tag=self.hdr_tx)
            reqs.append((hreq, h))
        reqs.append((ep.tag_send(arr, tag=self.data_tx), (keep, arr)))

    def settle_ahead(self, credit: tuple[int, int]) -> None:
        """The credit of the oldest message sent ahead has come: check that message against it.

        Raises:
            ProtocolError: the message did not fit the buffer the peer posted for it (the peer changed the
                size it receives on this tag after a message of this size and shape had been admitted).
        """
        sent = self.ahead.popleft()
        cap, flags = credit
        if sent != cap and (sent > cap or not flags & F_HEADER):
            raise ProtocolError(
                f"{sent} bytes sent ahead of their credit on tag {self.tag} do not fit the {cap}-byte buffer "
                "the peer posted for them"
            )

    def header_to_send(self, step: int, nbytes: int, shape: tuple[int, ...] | None) -> list[Any]:
        """[buffer, ucxx Array, last send] holding the header of the next message.

        The buffer is one whose last send completed (a header is eager: usually the first), a new one the
        first times, or an unkept one if all are still in flight.
        """
        for h in self.hsend:
            r = h[2]
            if r is None or r.completed:
                break
        else:
            hbuf = u8(HDR.size)
            h = [hbuf, Array(hbuf), None]
            if len(self.hsend) < MAX_HEADERS_IN_FLIGHT:
                self.hsend.append(h)
        if shape is None:
            HDR.pack_into(h[0], 0, step, nbytes, NO_SHAPE, *_NO_DIMS)
        else:
            dims = tuple(int(d) for d in shape) + (0,) * (HEADER_DIMS - len(shape))
            HDR.pack_into(h[0], 0, step, nbytes, len(shape), *dims)
        return h

    def read_header(self, p: Post) -> Received:
        """What the header received with ``p`` says (its buffer goes back to the free list).

        Raises:
            ProtocolError: more bytes announced than ``p`` holds, or a bad rank.
        """
        step, nbytes, ndim, *dims = HDR.unpack_from(p.hbuf)
        self.hfree.append((p.hbuf, p.harr))
        if nbytes > p.cap:
            raise ProtocolError(f"{nbytes} bytes announced for a {p.cap}-byte slot on tag {self.tag}")
        if ndim == NO_SHAPE:
            return Received(nbytes, None, step)
        if ndim > HEADER_DIMS:
            raise ProtocolError(f"bad ndim {ndim} on tag {self.tag}")
        return Received(nbytes, tuple(dims[:ndim]), step)

    def salvage(self, worker: Any, rid: int, p: Post) -> None:
        """The peer is gone: refill a receive of ``p`` UCX cancelled (or never posted) from the unexpected queue.

        Raises:
            ucx.UCXError: from UCX (the caller translates it).
        """
        for kind, attr, arr in ((DATA, "req", p.arr), (HEADER, "hreq", p.harr)):
            if arr is None or not cancelled(getattr(p, attr)):
                continue
            probe = worker.tag_probe(Tag(rid | (kind << KIND_SHIFT) | self.tag), remove=True)
            if probe.matched:
                setattr(p, attr, worker.tag_recv_with_handle(arr, probe))

    def posted_requests(self, rid: int) -> list[tuple[int, Any]]:
        """(full tag, request) of this tag's receives still posted (``rid``: this side's id, shifted)."""
        out: list[tuple[int, Any]] = []
        for p in self.posted:
            if p.req is not None and not p.req.completed:
                out.append((rid | (DATA << KIND_SHIFT) | self.tag, p.req))
            if p.hreq is not None and not p.hreq.completed:
                out.append((rid | (HEADER << KIND_SHIFT) | self.tag, p.hreq))
        if self.cred_req is not None and not self.cred_req.completed:
            out.append((rid | (CREDIT << KIND_SHIFT) | self.tag, self.cred_req))
        return out
