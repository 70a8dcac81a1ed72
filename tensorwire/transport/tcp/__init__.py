"""TCP data plane: plain sockets, fixed-size frame headers, ``recv_into`` the slot.

Every message is one frame (a fixed header, then the payload received straight
into the posted buffer); the receiver grants one credit per posted buffer, and
small messages may go ahead of their credit into eager buffers the receiver
set aside. There is no background thread per connection: whoever waits reads
for everyone. Between processes of one host that proved the link secret, large
messages are written into the receiver's buffer directly (cross-memory attach,
:mod:`tensorwire.transport.cma`). The package, one role per module:

- :mod:`.wire`: the frame header, frame types and hello, and how they are packed;
- :mod:`.connection`: the state of one connection, shared by its roles;
- :mod:`.credits`: flow control -- credits, eager buffers, grants held back until
  a thread is about to block (:func:`flush_pending_credits`);
- :mod:`.frames`: what an incoming frame does -- checked against the credits,
  posted receives, eager buffers and cross-memory announcements of this side;
- :mod:`.reader`: posted receives and the reader role ("caller progresses");
- :mod:`.transport`: sends (:meth:`TcpTransport.send`, :meth:`TcpTransport.try_send`
  and :class:`PartialSend`), close, and :class:`TcpTransport`, the whole connection;
- :mod:`.listener`: :class:`TcpListener` (admission and handshake) and the dialler.
"""

from __future__ import annotations

from tensorwire.transport.tcp.credits import flush_pending_credits
from tensorwire.transport.tcp.listener import TcpListener
from tensorwire.transport.tcp.transport import TcpTransport
from tensorwire.transport.tcp.wire import (
    CMA,
    CMA_FRAME,
    EAGER_TAG,
    FRAME,
    HELLO,
    HELLO_HEAD,
    HELLO_MAGIC,
    NO_SHAPE,
    PROTOCOL_VERSION,
    WRITTEN,
    PartialSend,
)

__all__ = [
    "TcpTransport",
    "TcpListener",
    "PartialSend",
    "flush_pending_credits",
    "FRAME",
    "CMA_FRAME",
    "HELLO",
    "HELLO_HEAD",
    "HELLO_MAGIC",
    "PROTOCOL_VERSION",
    "EAGER_TAG",
    "CMA",
    "WRITTEN",
    "NO_SHAPE",
]
