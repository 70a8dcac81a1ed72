"""``tw.init()``: a :class:`~tensorwire.Node` from the torchrun environment."""

from __future__ import annotations

import logging
import os
from typing import Any

from .errors import ConfigError
from .node import Node, TransportChoice
from .torchrun import TorchrunEnv, bootstrap_store, store_prefix

__all__ = ["init"]

log = logging.getLogger(__name__)


def init(*, transport: TransportChoice | None = None, timeout: float | None = None, host: str | None = None,
         peer_timeout: float | None = None, env: dict[str, str] | None = None, **kwargs: Any) -> Node:
    """Build this worker's :class:`Node` from the torchrun contract.

    Reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
    MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID and
    TORCHELASTIC_RESTART_COUNT once; bootstraps through torch's TCPStore under
    a prefix keyed by run id and restart count; binds listeners to ``host``
    (default: env ``TENSORWIRE_HOST``, else the address the node is reachable
    on: MASTER_ADDR's interface for loopback runs, this host's address
    otherwise); picks the GPU from LOCAL_RANK when CUDA is present.

    Raises:
        ConfigError: a torchrun variable is missing or malformed (named in the message).
        ConnectTimeout: the bootstrap store is unreachable.
    """
    tr = TorchrunEnv.from_environ(env)
    node_timeout = timeout if timeout is not None else float(os.environ.get("TENSORWIRE_TIMEOUT", "60"))
    bind = host or os.environ.get("TENSORWIRE_HOST") or _reachable_address(tr.master_addr)
    device = None
    from .buffers import cuda_available

    if cuda_available():
        import torch

        torch.cuda.set_device(tr.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    store = bootstrap_store(master_addr=tr.master_addr, master_port=tr.master_port, rank=tr.rank,
                            world_size=tr.world_size, use_agent_store=tr.use_agent_store, timeout=node_timeout)
    node = Node(rank=tr.rank, world_size=tr.world_size, store=store, host=bind, transport=transport,
                timeout=node_timeout, peer_timeout=peer_timeout, prefix=store_prefix(tr.run_id, tr.restart_count),
                device=device, **kwargs)
    node.torchrun = tr  # type: ignore[attr-defined]
    return node


def _reachable_address(master_addr: str) -> str:
    """The local address peers can reach this process on: the one that routes to MASTER_ADDR."""
    import socket

    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError(f"MASTER_ADDR={master_addr!r} does not resolve: {exc}") from exc
    family, _, _, _, sockaddr = infos[0]
    if sockaddr[0].startswith("127.") or sockaddr[0] == "::1":
        return "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((sockaddr[0], 9))  # no packet is sent: this only asks the routing table
        return s.getsockname()[0]
