"""Errors of ``backend="tensorwire"``: each is both tensorwire's error and torch's ``DistBackendError``.

A torch user catches ``torch.distributed.DistBackendError`` (what a dead NCCL or
gloo group raises); a tensorwire user catches the tensorwire class. Both work::

    DistBackendError (torch)          tensorwire
    ├── PeerLost       ─────────────  PeerLostError     the peer process or its host is gone
    ├── WorkTimeout    ─────────────  TransferTimeout   a Work did not complete within its timeout
    ├── SignatureMismatch ──────────  ShapeMismatchError a message differs from the receive tensor
    ├── ProtocolFailure ────────────  ProtocolError     the peer broke the wire protocol
    └── GroupClosed    ─────────────  ClosedError       the group was shut down or aborted

This module imports torch; it is loaded only with the backend itself.
"""

from __future__ import annotations

from torch.distributed import DistBackendError

from ..errors import ClosedError, PeerLostError, ProtocolError, ShapeMismatchError, TensorWireError, TransferTimeout

__all__ = ["PeerLost", "WorkTimeout", "SignatureMismatch", "ProtocolFailure", "GroupClosed", "translate"]


class PeerLost(PeerLostError, DistBackendError):
    """The peer is gone (killed, connection reset, network cut for longer than TENSORWIRE_PEER_TIMEOUT)."""


class WorkTimeout(TransferTimeout, DistBackendError):
    """A Work did not complete within its timeout (the group's, or the one given to ``wait``)."""


class SignatureMismatch(ShapeMismatchError, DistBackendError):
    """A message's dtype, shape, device or size differs from the tensor it was received into."""


class ProtocolFailure(ProtocolError, DistBackendError):
    """The peer sent something the wire protocol does not allow."""


class GroupClosed(ClosedError, DistBackendError):
    """The process group was shut down, aborted or destroyed."""


def translate(exc: BaseException, context: str) -> BaseException:
    """The backend error for an error from the layers below (already one: returned as is)."""
    if isinstance(exc, DistBackendError):
        return exc
    text = f"{context}: {exc}"
    if isinstance(exc, ShapeMismatchError):
        return SignatureMismatch(text)
    if isinstance(exc, TransferTimeout):
        return WorkTimeout(text)
    if isinstance(exc, ClosedError):
        return GroupClosed(text)
    if isinstance(exc, ProtocolError):
        return ProtocolFailure(text)
    if isinstance(exc, (PeerLostError, TensorWireError, OSError)):
        return PeerLost(text)
    return exc
