"""What the serve clients share: the stat records they return and the daemon address syntax."""

from __future__ import annotations

from dataclasses import dataclass

from tensorwire.errors import ConfigError
from tensorwire.serve.protocol.common import DEFAULT_PORT
from tensorwire.serve.protocol.layout import ShardLayout
from tensorwire.spec import TensorSpec

__all__ = ["TensorStat", "SnapshotInfo", "parse_address"]


@dataclass(frozen=True)
class TensorStat:
    """What the store holds under a name."""

    spec: TensorSpec
    #: Incremented by every put and row update; 0 = declared, no data yet.
    version: int
    #: Bytes of one version.
    nbytes: int
    #: Set when the tensor is one shard of a table sharded by rows (see tensorwire.serve.protocol.layout).
    layout: ShardLayout | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def bytes(self) -> int:
        """Alias of :attr:`nbytes`."""
        return self.nbytes


@dataclass(frozen=True)
class SnapshotInfo:
    path: str
    tensors: int
    nbytes: int
    seconds: float


def parse_address(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port``, ``host`` (port 7100), optionally ``grpc://``-prefixed."""
    if not isinstance(address, str) or not address.strip():
        raise ConfigError(f"address must be 'host:port', got {address!r}")
    a = address.strip()
    for scheme in ("grpc://", "tensorwire://", "tw://"):
        if a.startswith(scheme):
            a = a[len(scheme) :]
    if a.startswith("["):
        host, _, rest = a[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    elif a.count(":") == 1:
        host, port_s = a.split(":")
    else:
        host, port_s = a, ""
    if not host:
        raise ConfigError(f"address {address!r} has no host")
    try:
        port = int(port_s) if port_s else DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"address {address!r}: port must be a number") from None
    if not 0 < port < 65536:
        raise ConfigError(f"address {address!r}: port out of range")
    return host, port


# -- receive buffers ------------------------------------------------------------------------------
