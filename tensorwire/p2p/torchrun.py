"""The torchrun environment contract, read once into a typed object, and the bootstrap store.

torchrun (torch.distributed.elastic, checked against torch 2.13) starts every
worker with::

    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT,
    TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_USE_AGENT_STORE ("True" / "False")

:meth:`TorchrunEnv.from_environ` parses them (every missing variable is named
in one :class:`~tensorwire.ConfigError`; a malformed one is named with its
value). :func:`bootstrap_store` returns the ``TCPStore`` tensorwire publishes
addresses in, following exactly what ``torch.distributed`` itself does
(``torch/distributed/rendezvous.py: _create_c10d_store``):

- ``TORCHELASTIC_USE_AGENT_STORE=True`` (the default of ``--standalone`` and of
  ``--rdzv-backend c10d``, and of ``static``): the elastic agent of node 0
  already runs a TCPStore server at ``MASTER_ADDR:MASTER_PORT`` (with c10d it
  is a fresh port on the host node, not the rendezvous endpoint). Every rank
  is a client of it.
- otherwise (e.g. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, etcd): the agent
  only picked a free ``MASTER_PORT`` on node 0 and nothing listens there. Rank
  0 hosts the server *on* ``MASTER_PORT`` with ``multi_tenant=True`` and the
  other ranks are clients — the same server ``init_process_group("env://")``
  would start there, so the two share it (in either order) instead of
  fighting over the port. (Never ``MASTER_PORT + 1``: nobody reserved it.)

Keys live under ``tensorwire/<run id>/<restart count>/`` (:func:`store_prefix`):
the agent's store outlives worker restarts, and a restarted worker must never
read an address published by the worker it replaces. Caveat, shared with
``torch.distributed`` (whose worker store prefix is also keyed by the restart
count): ``TORCHELASTIC_RESTART_COUNT`` is counted per agent, so in a
*multi-node* job whose nodes restarted a different number of times the ranks
disagree on the prefix and :meth:`~tensorwire.Node.link` fails with
:class:`~tensorwire.ConnectTimeout` rather than using a stale address.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Mapping

from tensorwire.errors import ConfigError, ConnectTimeout

__all__ = ["TorchrunEnv", "bootstrap_store", "store_prefix", "REQUIRED_VARS"]

#: The variables :meth:`TorchrunEnv.from_environ` requires.
REQUIRED_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
)
_REQUIRED = REQUIRED_VARS  # backwards-compatible alias

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no", "")


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        raise ConfigError(f"environment variable {name} is not set (is this process started by torchrun?)")
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"environment variable {name}={raw!r} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"environment variable {name}={raw!r} must be <= {maximum}")
    return value


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name)
    if raw is None:
        return False
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not a boolean (torchrun sets 'True' or 'False')")


def _text(env: Mapping[str, str], name: str) -> str:
    raw = env.get(name, "")
    value = raw.strip()
    if not value:
        raise ConfigError(f"environment variable {name} is not set (is this process started by torchrun?)")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise ConfigError(f"environment variable {name}={raw!r} contains whitespace or non-printable characters")
    return value


@dataclasses.dataclass(frozen=True)
class TorchrunEnv:
    """What torchrun tells a worker, validated. Build it with :meth:`from_environ`.

    Attributes:
        rank / world_size: global rank and number of workers.
        local_rank / local_world_size: rank and number of workers on this node.
        group_rank: this node's (agent's) rank; ``group_world_size``: number of
            nodes when torchrun says (``GROUP_WORLD_SIZE``), else ``None``.
        master_addr / master_port: the bootstrap store's address.
        run_id: ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; ``"none"`` unless set).
        restart_count: ``TORCHELASTIC_RESTART_COUNT`` (0 on the first attempt).
        use_agent_store: ``TORCHELASTIC_USE_AGENT_STORE`` (see :func:`bootstrap_store`).
        max_restarts: ``TORCHELASTIC_MAX_RESTARTS`` when set, else ``None``.
    """

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
    group_world_size: int | None = None
    max_restarts: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        if self.local_world_size < 1 or self.local_world_size > self.world_size:
            raise ConfigError(f"LOCAL_WORLD_SIZE={self.local_world_size} must be in 1..WORLD_SIZE={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(f"LOCAL_RANK={self.local_rank} is outside LOCAL_WORLD_SIZE={self.local_world_size}")
        if self.group_rank < 0:
            raise ConfigError(f"GROUP_RANK={self.group_rank} must be >= 0")
        if self.group_world_size is not None and not 0 <= self.group_rank < self.group_world_size:
            raise ConfigError(f"GROUP_RANK={self.group_rank} is outside GROUP_WORLD_SIZE={self.group_world_size}")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"MASTER_PORT={self.master_port} is not a port number (1..65535)")
        if self.restart_count < 0:
            raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={self.restart_count} must be >= 0")
        if not self.master_addr:
            raise ConfigError("MASTER_ADDR is empty")
        if not self.run_id or not self.run_id.isprintable():
            raise ConfigError(f"TORCHELASTIC_RUN_ID={self.run_id!r} must be non-empty and printable")

    @property
    def multi_node(self) -> bool:
        """Whether workers of this job run on more than one node."""
        if self.group_world_size is not None:
            return self.group_world_size > 1
        return self.world_size > self.local_world_size

    @property
    def prefix(self) -> str:
        """The store prefix of this attempt (:func:`store_prefix`)."""
        return store_prefix(self.run_id, self.restart_count)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "TorchrunEnv":
        """Parse the torchrun contract from ``env`` (default ``os.environ``).

        Raises:
            ConfigError: variables are missing (all of them are named) or one
                is malformed (named, with its value).
        """
        env = os.environ if env is None else env
        missing = [k for k in REQUIRED_VARS if not (env.get(k) or "").strip()]
        if missing:
            raise ConfigError(
                f"torchrun environment incomplete: {', '.join(missing)} not set "
                "(start the script with torchrun, or build tw.Node(rank=..., world_size=..., store=...) yourself)"
            )
        gws = env.get("GROUP_WORLD_SIZE")
        maxr = env.get("TORCHELASTIC_MAX_RESTARTS")
        return cls(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK"),
            world_size=_int(env, "WORLD_SIZE", minimum=1),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", minimum=1),
            group_rank=_int(env, "GROUP_RANK"),
            master_addr=_text(env, "MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT", minimum=1, maximum=65535),
            run_id=_text(env, "TORCHELASTIC_RUN_ID"),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT"),
            use_agent_store=_bool(env, "TORCHELASTIC_USE_AGENT_STORE"),
            group_world_size=_int(env, "GROUP_WORLD_SIZE", minimum=1) if gws and gws.strip() else None,
            max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS") if maxr and maxr.strip() else None,
        )


def store_prefix(run_id: str, restart_count: int) -> str:
    """``tensorwire/<run id>/<restart count>/``: a fresh key space per elastic attempt."""
    return f"tensorwire/{run_id}/{restart_count}/"


def bootstrap_store(
    *, master_addr: str, master_port: int, rank: int, world_size: int, use_agent_store: bool | None, timeout: float
) -> Any:
    """The TCPStore to publish addresses in (see the module docstring).

    Args:
        use_agent_store: connect as a client of the agent's store; ``None``:
            read ``TORCHELASTIC_USE_AGENT_STORE`` from the environment.

    Raises:
        ConnectTimeout: the store could not be reached (or, on rank 0 without
            the agent store, hosted) within ``timeout``.
    """
    from torch.distributed import TCPStore

    if use_agent_store is None:
        use_agent_store = _bool(os.environ, "TORCHELASTIC_USE_AGENT_STORE")
    td = timedelta(seconds=timeout)
    try:
        if use_agent_store:
            return TCPStore(master_addr, master_port, None, False, td, wait_for_workers=False)
        return TCPStore(master_addr, master_port, world_size, rank == 0, td, wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, TimeoutError, OSError) as exc:  # torch raises DistStoreError / DistNetworkError
        role = "host" if (rank == 0 and not use_agent_store) else "reach"
        raise ConnectTimeout(
            f"cannot {role} the bootstrap store at {master_addr}:{master_port} "
            f"(TORCHELASTIC_USE_AGENT_STORE={use_agent_store}): {exc}"
        ) from exc
