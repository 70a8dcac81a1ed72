"""Same-host single-copy transfers for the TCP transport: Linux cross-memory attach (CMA).

Between two processes of one host a TCP byte stream costs two kernel copies
(sender -> socket buffer -> receiver) and runs at the loopback's speed. With
cross-memory attach (``process_vm_writev(2)``) the **sender copies its bytes
straight into the receiver's posted buffer**: one copy, the kernel walking both
address spaces -- the one-sided write into a preallocated receive buffer of
MSRA's design. The TCP connection stays the control channel; large messages
are split into pieces copied by a few threads at once (ctypes releases the GIL
during the call).

The package: :mod:`.peer` speaks the protocol with the peer of one TCP
connection (:class:`CmaPeer`: the probe, announced buffers, the copy of a
message); :mod:`.syscalls` binds what the kernel offers for it
(``process_vm_readv``/``process_vm_writev`` through ctypes, the copy threads,
Yama's ptrace grant).
"""

from __future__ import annotations

from tensorwire.transport.cma.peer import (
    BODY_BYTES,
    HELLO,
    NO,
    READY,
    SLOT,
    TOKEN,
    CmaPeer,
    new_cma_peer,
)
from tensorwire.transport.cma.syscalls import (
    PIECE_MIN,
    address_of,
    common_ancestor,
    copy,
    default_threads,
    grant_ptrace,
    ptrace_scope,
    supported,
)

__all__ = [
    "CmaPeer",
    "new_cma_peer",
    "supported",
    "ptrace_scope",
    "grant_ptrace",
    "common_ancestor",
    "address_of",
    "copy",
    "default_threads",
    "PIECE_MIN",
    "HELLO",
    "READY",
    "TOKEN",
    "NO",
    "SLOT",
    "BODY_BYTES",
]
