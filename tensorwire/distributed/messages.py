"""What the send and the receive side of a peer channel share: tags, sizes, byte views, the slot pool.

A torch tag ``t`` is transport tag ``t + 1`` (tag 0 carries notices of refused
messages); :func:`wire_view` is what a transport gets for a contiguous tensor,
and :class:`SlotPool` holds the preallocated tensors of messages that cannot
go through the caller's own tensor.
"""

from __future__ import annotations

import collections
import ctypes
import struct
import threading
from typing import TYPE_CHECKING, Any

import torch

from ..buffers import as_bytes
from ..errors import ConfigError
from .signatures import Signature

if TYPE_CHECKING:  # pragma: no cover
    from ..transport.base import Transport

__all__ = [
    "NOTICE_TAG",
    "MAX_TAG",
    "EAGER_SLOTS",
    "UCX_SEND_AHEAD",
    "EAGER_MAX",
    "SLICE",
    "NOTICE",
    "EMPTY",
    "wire_view",
    "host_bytes",
    "SlotPool",
    "check_tag",
]

NOTICE_TAG = 0
#: torch tags map to transport tags 1 .. 2**31 - 1
MAX_TAG = (1 << 31) - 2
#: TCP: each rank lets each peer send this many messages of at most EAGER_MAX bytes before their receive is
#: posted (one buffer of EAGER_SLOTS * EAGER_MAX bytes per peer, set aside when the group is made). A message
#: that waits for its credit instead is queued, and on a 2-core VM that cost more than the socket's extra copy
#: up to 256 KiB: 64 KiB round trips went from 211 to 85 us, 256 KiB from 247 to 121 us
#: (bench/results/archive/distributed_cpu2_2026-11-25-3.md; above EAGER_MAX a message whose credit is there is copied once).
EAGER_SLOTS = 8
EAGER_MAX = 256 * 1024
#: UCX: messages per tag a rank sends before the credit of the receive they go to came (the credit of a receive
#: posted at irecv trails the data of the previous message; see UcxTransport.send_ahead)
UCX_SEND_AHEAD = 2
#: how long a receive waits on its tag before looking at notices (a mismatch refused on the sender)
SLICE = 0.05
NOTICE = struct.Struct("<I")
#: flat byte views of host memory by (address, size), for transports that take bytes (TCP)
_VIEWS: dict[tuple[int, int], memoryview] = {}
_VIEWS_MAX = 4096
EMPTY = memoryview(b"")


def wire_view(t: "Transport", tensor: torch.Tensor) -> Any:
    """What the transport gets for a contiguous tensor: the tensor itself (any-dtype transports) or its bytes.

    The byte view is built from the address alone and reused by (address, size), as the UCX transport
    does for its descriptors: a loop's tensors come back at the same addresses, and making a flat uint8
    view through torch costs tens of microseconds per message. The view references no tensor (the cache
    keeps no memory alive); the work keeps the tensor alive while the transport uses it. Reusing the same
    view object also lets the TCP transport reuse its cached view of a posted buffer.
    """
    if t.any_dtype:
        return tensor
    n = tensor.nbytes
    if n == 0 or tensor.is_cuda:
        return as_bytes(tensor)
    return host_bytes(tensor, n)


def host_bytes(tensor: torch.Tensor, n: int) -> memoryview:
    """The ``n`` bytes of a contiguous host tensor (``n`` > 0), as a cached flat view (see :func:`wire_view`)."""
    key = (tensor.data_ptr(), n)
    mv = _VIEWS.get(key)
    if mv is None:
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        mv = _VIEWS[key] = memoryview((ctypes.c_char * n).from_address(key[0])).cast("B")
    return mv


class SlotPool:
    """Preallocated tensors per (signature, where), taken for a message and given back after it.

    A signature's first message in flight allocates one; later messages reuse it
    (a second one exists only while two are in flight at once).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Signature, str], list[torch.Tensor]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def take(self, sig: Signature, where: str, device: torch.device | None = None) -> torch.Tensor:
        key = (sig, where)
        with self._lock:
            free = self._free[key]
            if free:
                return free.pop()
        dtype = getattr(torch, sig.dtype)
        if where == "pinned":
            return torch.empty(sig.shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        return torch.empty(sig.shape, dtype=dtype, device=device)

    def give(self, sig: Signature, where: str, slot: torch.Tensor) -> None:
        with self._lock:
            self._free[(sig, where)].append(slot)


def check_tag(tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ConfigError(f"backend 'tensorwire' takes tags in [0, {MAX_TAG}], got {tag!r}")
    return tag
