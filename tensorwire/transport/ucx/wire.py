"""What travels between two UCX transports: the tag layout, the small messages and the handshake.

Tag layout (64-bit UCX tags; matching is per *worker*, not per endpoint, and
one worker serves every connection of the process)::

    63 ........ 33 | 32 31 | 30 ........ 0
    receiver's id  | kind  | slot tag (0 <= tag < 2**31)

    kind 0 DATA    payload, received straight into the posted buffer
    kind 1 HEADER  88-byte header (step, nbytes, shape) for header tags
    kind 2 CREDIT  16-byte credit (capacity, flags) from receiver to sender
    kind 3 CTRL    8-byte goodbye (BYE) or its answer (ACK), slot tag 0

The receiver's id is a 31-bit number the *receiving* process assigns to the
connection and tells its peer in the handshake, so two connections of one
process never match each other's messages.

Handshake, over the listener's TCP socket: :data:`HELLO` then the dialler's
UCX worker address; :data:`REPLY` then the listener's (or ``REPLY_NO``, then
close). The whole protocol is described in ``docs/transports.md``.
"""

from __future__ import annotations

import struct

from tensorwire.errors import ConfigError
from tensorwire.transport.base import HEADER_DIMS, NONCE_BYTES, PROOF_BYTES

#: Version of this data protocol, in the hello and its reply: peers of different versions refuse each other.
PROTOCOL_VERSION = 3

DATA, HEADER, CREDIT, CTRL = 0, 1, 2, 3
TAG_BITS = 31
KIND_SHIFT = 31
RID_SHIFT = 33
RID_MASK = (1 << 31) - 1
MAX_TAG = 1 << TAG_BITS

#: magic, version, client receiver id, nonce, proof of the link secret (zeros without one), address length
HELLO = struct.Struct(f"<8sII{NONCE_BYTES}s{PROOF_BYTES}sI")
REPLY = struct.Struct("<8sIIII")  # magic, version, server receiver id, flags (R_*), address length
#: REPLY flag: the listener made its endpoint with UCX peer error handling; the dialler must too.
R_PEER_ERRORS = 1
MAX_ADDRESS = 1 << 16  # UCX worker addresses are a few hundred bytes to a few KiB
HELLO_MAGIC = b"TWUCXHI\0"
REPLY_OK = b"TWUCXOK\0"
REPLY_NO = b"TWUCXNO\0"
HDR = struct.Struct(f"<QQB7x{HEADER_DIMS}q")  # step, nbytes, ndim (255: none), dims
CRED = struct.Struct("<QI4x")  # capacity, flags
F_HEADER = 1
NO_SHAPE = 255
BYE = b"TWUCXBYE"
ACK = b"TWUCXACK"  # answer to BYE: everything sent before the goodbye has been received here
assert HELLO.size == 52 and REPLY.size == 24 and HDR.size == 88 and CRED.size == 16


def check_tag(tag: int) -> int:
    """``tag`` if it is a valid slot tag.

    Raises:
        ConfigError: out of ``[0, 2**31)``.
    """
    if not 0 <= tag < MAX_TAG:
        raise ConfigError(f"tag {tag} out of range [0, 2**31)")
    return tag
