"""Frames of the TCP data plane: the header, the frame types, and the helpers that pack them.

Wire format (little-endian, every frame starts with the same 96-byte header)::

    magic  "TW"        2s   protocol marker; anything else breaks the connection
    type   u8          1 = DATA, 2 = CREDIT, 3 = BYE, 4 = CMA (control), 5 = WRITTEN,
                       6 = EAGER (DATA sent ahead of its credit)
    ndim   u8          dims in use for DATA with a shape (0..8), 255 = no shape; CMA: subtype
    tag    u32         DATA: slot tag
    step   u64         DATA: per-tag message counter (checked: +1 each time)
    nbytes u64         DATA/EAGER: payload bytes that follow; CREDIT of EAGER_TAG: eager buffer size
    ctag   u32         credits granted for this tag ...
    ccount u32         ... this many (any frame type may carry a grant)
    dims   8 x i64     DATA: actual shape (dynamic specs)

DATA is followed by exactly ``nbytes`` payload bytes, received with
``recv_into`` directly into the posted slot buffer (no intermediate copy).
A CMA frame carries a 64-byte body in place of ``dims``; WRITTEN is a DATA
header without payload (:mod:`tensorwire.transport.tcp.transport`).
"""

from __future__ import annotations

import errno
import struct
import time
from typing import Any

from tensorwire.errors import ProtocolError
from tensorwire.transport.base import HEADER_DIMS, NONCE_BYTES, PROOF_BYTES, Received

__all__ = [
    "PROTOCOL_VERSION",
    "FRAME",
    "CMA_FRAME",
    "HEAD",
    "DIMS",
    "DIMS_AT",
    "HELLO_HEAD",
    "HELLO",
    "HELLO_MAGIC",
    "HELLO_OK",
    "DATA",
    "CREDIT",
    "BYE",
    "CMA",
    "WRITTEN",
    "EAGER",
    "EAGER_TAG",
    "READ_AHEAD",
    "NO_SHAPE",
    "MAGIC",
    "ZERO_DIMS",
    "PEER_GONE",
    "Posted",
    "PartialSend",
    "poll_ms",
    "advance",
    "shape_words",
    "host_view",
]

#: v2: the hello carries a proof of the link secret after the nonce. v3: CMA and WRITTEN frames. (EAGER frames
#: go only to a peer that offered eager buffers: no new version.)
PROTOCOL_VERSION = 3
FRAME = struct.Struct("<2sBBIQQII8q")
#: A CMA frame: the same header with a 64-byte body in place of the dims.
CMA_FRAME = struct.Struct("<2sBBIQQII64s")
assert FRAME.size == CMA_FRAME.size == 96
#: the same header in two parts: the fields, then the eight dims (read only when a shape is there)
HEAD = struct.Struct("<2sBBIQQII")
DIMS = struct.Struct("<8q")
DIMS_AT = HEAD.size
#: magic, version, nonce (what every version of the hello starts with: the version is read first) ...
HELLO_HEAD = struct.Struct(f"<8sI{NONCE_BYTES}s")
#: ... then, from v2, the proof of the link secret (zeros without one).
HELLO = struct.Struct(f"<8sI{NONCE_BYTES}s{PROOF_BYTES}s")
HELLO_MAGIC = b"TWHELLO\0"
HELLO_OK = b"TWOK"
DATA, CREDIT, BYE, CMA, WRITTEN, EAGER = 1, 2, 3, 4, 5, 6
#: The pseudo tag on which a receiver grants (and gives back) its eager buffers (transport tags are < 2**31).
EAGER_TAG = 0xFFFFFFFF
#: Bytes the reader takes off the socket at once (header, small payloads and the frames behind them).
READ_AHEAD = 32 * 1024
NO_SHAPE = 255
MAGIC = b"TW"
ZERO_DIMS = (0,) * HEADER_DIMS
PEER_GONE = (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT, errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH)


def poll_ms(deadline: float | None, cap: float = 0.5) -> int:
    """Milliseconds to poll: bounded so closed/broken state is noticed promptly."""
    if deadline is None:
        return int(cap * 1000)
    return max(0, min(int((deadline - time.monotonic()) * 1000) + 1, int(cap * 1000)))


class Posted:
    """A posted receive buffer: its view, and once a message filled it, what came (``result``) -- or, for a
    message that came but could not be put into this buffer, the error its wait raises (``error``; the
    connection stays usable: that message was consumed whole)."""

    __slots__ = ("view", "header", "result", "error")

    def __init__(self, view: memoryview, header: bool) -> None:
        self.view = view
        self.header = header
        self.result: Received | None = None
        self.error: BaseException | None = None


class PartialSend:
    """A frame :meth:`TcpTransport.try_send` began to write but the socket did not take whole.

    The connection's send lock stays held (no other frame may start) until
    :meth:`TcpTransport.finish_send` writes the rest, from any thread.
    """

    __slots__ = ("views", "nbytes")

    def __init__(self, views: list[memoryview], nbytes: int) -> None:
        self.views = views
        self.nbytes = nbytes


def advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of a gather list (in place)."""
    while n:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


def shape_words(shape: tuple[int, ...] | None) -> tuple[int, tuple[int, ...]]:
    """(ndim field, the eight dims) of a frame header."""
    if shape is None:
        return NO_SHAPE, ZERO_DIMS
    if len(shape) > HEADER_DIMS:
        raise ProtocolError(f"rank {len(shape)} exceeds {HEADER_DIMS}")
    if len(shape) == HEADER_DIMS:
        return HEADER_DIMS, tuple(shape)
    return len(shape), tuple(shape) + (0,) * (HEADER_DIMS - len(shape))


def host_view(buf: Any) -> memoryview:
    """Flat byte view of a host buffer (flat uint8 tensor or memoryview), zero-copy."""
    if isinstance(buf, memoryview):
        return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    if buf.numel() == 0:
        return memoryview(bytearray(0))
    if buf.requires_grad:
        buf = buf.detach()
    mv = memoryview(buf.numpy())
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")
