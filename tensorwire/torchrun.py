"""The torchrun environment contract, read once into a typed object, and the bootstrap store.

torchrun (torch.distributed.elastic) starts each worker with::

    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
    MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT
    (and TORCHELASTIC_USE_AGENT_STORE when the agent hosts the TCPStore)

:func:`TorchrunEnv.from_environ` parses them (a missing or malformed variable
is a :class:`~tensorwire.ConfigError` naming it). :func:`bootstrap_store`
returns the ``TCPStore`` tensorwire publishes addresses in: a client of the
agent's store when ``TORCHELASTIC_USE_AGENT_STORE=True``, otherwise one hosted
by rank 0 on ``MASTER_ADDR:MASTER_PORT + 1`` — never the port torch.distributed
itself may use for its own store. Keys live under
``tensorwire/<run id>/<restart count>/`` because ranks are not stable across
elastic restarts.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Mapping

from .errors import ConfigError, ConnectTimeout

__all__ = ["TorchrunEnv", "bootstrap_store", "store_prefix"]

_REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        raise ConfigError(f"environment variable {name} is not set (is this process started by torchrun?)")
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={value} must be >= {minimum}")
    return value


@dataclasses.dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells a worker, validated."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int
    use_agent_store: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(f"LOCAL_RANK={self.local_rank} is outside LOCAL_WORLD_SIZE={self.local_world_size}")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"MASTER_PORT={self.master_port} is not a port number")

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "TorchrunEnv":
        """Parse the torchrun contract from ``env`` (default ``os.environ``).

        Raises:
            ConfigError: a variable is missing or malformed; the message names it.
        """
        env = os.environ if env is None else env
        missing = [k for k in _REQUIRED if not env.get(k)]
        if missing:
            raise ConfigError(
                f"torchrun environment incomplete: {', '.join(missing)} not set "
                "(start the script with torchrun, or build tw.Node(rank=..., world_size=..., store=...) yourself)"
            )
        return cls(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK"),
            world_size=_int(env, "WORLD_SIZE", minimum=1),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", minimum=1),
            group_rank=_int(env, "GROUP_RANK"),
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT", minimum=1),
            run_id=env["TORCHELASTIC_RUN_ID"],
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT"),
            use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"),
        )


def store_prefix(run_id: str, restart_count: int) -> str:
    return f"tensorwire/{run_id}/{restart_count}/"


def bootstrap_store(
    *, master_addr: str, master_port: int, rank: int, world_size: int, use_agent_store: bool, timeout: float
) -> Any:
    """The TCPStore to publish addresses in (see the module docstring).

    Raises:
        ConnectTimeout: the store could not be reached within ``timeout``.
    """
    from torch.distributed import TCPStore

    try:
        if use_agent_store:
            return TCPStore(master_addr, master_port, world_size, False, timedelta(seconds=timeout))
        return TCPStore(master_addr, master_port + 1, world_size, rank == 0, timedelta(seconds=timeout),
                        wait_for_workers=False)
    except (RuntimeError, TimeoutError) as exc:
        raise ConnectTimeout(f"cannot reach the bootstrap store at {master_addr}:{master_port}: {exc}") from exc
