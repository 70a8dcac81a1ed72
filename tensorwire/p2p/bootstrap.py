"""``tw.init()``: a :class:`~tensorwire.Node` from the torchrun environment.

::

    import tensorwire as tw

    node = tw.init()                       # under torchrun
    link = node.link(node.rank + 1, send=plan.outputs, recv=plan.grads_of_outputs)

What it does, once per worker:

1. reads the torchrun contract into a :class:`~tensorwire.p2p.torchrun.TorchrunEnv`
   (a missing or malformed variable is a :class:`~tensorwire.ConfigError` naming it);
2. picks the GPU from ``LOCAL_RANK`` when CUDA is present;
3. connects to (or, without the agent store, on rank 0 hosts) the bootstrap
   TCPStore — see :mod:`tensorwire.p2p.torchrun`;
4. binds the control server and the data listeners to the address this node
   is reachable on — ``host=``, else ``TENSORWIRE_HOST``, else the local
   address that routes to ``MASTER_ADDR`` (loopback for single-node runs on
   ``localhost``) — never a wildcard, since the address is also what peers dial;
5. publishes, under ``tensorwire/<run id>/<restart count>/``, the control
   address (``ctrl/<rank>``, used by :meth:`Node.link`) and a JSON record of
   every address of the rank (``addr/<rank>``: control, data plane per
   transport, host, pid, local/group rank) for tools and debugging;
6. takes the job's link secret (``TENSORWIRE_LINK_TOKEN`` /
   ``TENSORWIRE_LINK_TOKEN_FILE``, else ``link/secret`` under the same prefix, written
   once by the first rank): see :mod:`tensorwire.p2p.linkauth`.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
from typing import Any, Mapping

from tensorwire.errors import ConfigError
from tensorwire.settings import setting
from tensorwire.p2p.node import Node
from tensorwire.transport.select import TransportChoice, check_choice
from tensorwire.p2p.torchrun import TorchrunEnv, bootstrap_store, store_prefix
from tensorwire import buffers

__all__ = ["init", "reachable_address", "published_addresses"]

log = logging.getLogger(__name__)


def init(
    *,
    transport: TransportChoice | None = None,
    timeout: float | None = None,
    host: str | None = None,
    peer_timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Node:
    """Build this worker's :class:`Node` from the torchrun contract.

    Args:
        transport: ``"auto"``, ``"tcp"`` or ``"ucx"`` (default: env
            ``TENSORWIRE_TRANSPORT``, else ``"auto"``).
        timeout: bootstrap, negotiation and transfer timeout in seconds
            (default: env ``TENSORWIRE_TIMEOUT``, else 60).
        host: address to bind and advertise (default: env ``TENSORWIRE_HOST``,
            else the address that routes to ``MASTER_ADDR``).
        peer_timeout: how long a silent peer may stay unresponsive before it is
            declared lost (default: env ``TENSORWIRE_PEER_TIMEOUT``, else 30).
        env: the environment to read (default ``os.environ``; for tests).
        **kwargs: passed to :class:`Node` (e.g. ``device=``).

    The returned node has ``node.torchrun`` (the parsed :class:`TorchrunEnv`).

    Raises:
        ConfigError: a torchrun variable is missing or malformed (named in the
            message), a bad TENSORWIRE_* value, or a wildcard/loopback host
            where peers on other nodes could not reach it.
        ConnectTimeout: the bootstrap store is unreachable.
        TransportError: a listener could not bind to the chosen address.
    """
    src: Mapping[str, str] = os.environ if env is None else env
    tr = TorchrunEnv.from_environ(src)
    if transport is None:
        transport = setting("transport", src)
    else:
        transport = check_choice(transport, source="tw.init(transport=...)")
    node_timeout = float(timeout) if timeout is not None else setting("timeout", src)
    if not node_timeout > 0:
        raise ConfigError(f"timeout must be > 0, got {timeout!r}")
    if peer_timeout is None:
        peer_timeout = setting("peer_timeout", src)
    if host is not None:
        bind = _check_host(host, tr, source="tw.init(host=...)")
    elif setting("host", src):
        bind = _check_host(setting("host", src), tr, source="TENSORWIRE_HOST")
    else:
        bind = reachable_address(tr)

    if "device" not in kwargs:
        kwargs["device"] = _pick_device(tr)
    store = bootstrap_store(
        master_addr=tr.master_addr,
        master_port=tr.master_port,
        rank=tr.rank,
        world_size=tr.world_size,
        use_agent_store=tr.use_agent_store,
        timeout=node_timeout,
    )
    prefix = store_prefix(tr.run_id, tr.restart_count)
    node = Node(
        rank=tr.rank,
        world_size=tr.world_size,
        store=store,
        host=bind,
        transport=transport,
        timeout=node_timeout,
        peer_timeout=peer_timeout,
        prefix=prefix,
        **kwargs,
    )
    try:
        record = {
            "rank": tr.rank,
            "local_rank": tr.local_rank,
            "group_rank": tr.group_rank,
            "host": bind,
            "pid": os.getpid(),
            "restart_count": tr.restart_count,
            "control": node.control_address,
            "data": {kind: _join(*lst.address) for kind, lst in node._listeners.items()},
        }
        store.set(prefix + f"addr/{tr.rank}", json.dumps(record, sort_keys=True))
        if tr.restart_count > 0:
            # Hygiene: drop what the previous attempt of this rank published in the agent's long-lived store.
            old = store_prefix(tr.run_id, tr.restart_count - 1)
            keys = [f"ctrl/{tr.rank}", f"addr/{tr.rank}"] + (["link/secret"] if tr.rank == 0 else [])
            for key in keys:
                try:
                    store.delete_key(old + key)
                except Exception:  # noqa: BLE001 - best effort; the prefix already isolates attempts
                    pass
    except BaseException:
        node.close()
        raise
    node.torchrun = tr  # type: ignore[attr-defined]
    log.info(
        "tensorwire: rank %d/%d (local %d, node %d, attempt %d) bound to %s, store prefix %s",
        tr.rank,
        tr.world_size,
        tr.local_rank,
        tr.group_rank,
        tr.restart_count,
        bind,
        prefix,
    )
    return node


def published_addresses(node: Node, rank: int) -> dict[str, Any]:
    """The ``addr/<rank>`` record another rank published through :func:`init` (waits up to the node's timeout)."""
    from datetime import timedelta

    key = node.prefix + f"addr/{rank}"
    node.store.wait([key], timedelta(seconds=node.timeout))
    return json.loads(node.store.get(key).decode())


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _pick_device(tr: TorchrunEnv) -> Any:
    """``cuda:LOCAL_RANK`` (made current) when CUDA is present, else ``None``."""
    if not buffers.cuda_available():  # looked up on the module: tests stand in a CUDA host
        return None
    import torch

    count = torch.cuda.device_count()
    index = tr.local_rank
    if index >= count:
        # e.g. CUDA_VISIBLE_DEVICES narrowed to one GPU per process, or more workers than GPUs.
        if count > 1:
            log.warning(
                "tensorwire: LOCAL_RANK=%d but only %d CUDA devices are visible; using cuda:%d",
                tr.local_rank,
                count,
                tr.local_rank % count,
            )
        index = tr.local_rank % count
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _check_host(host: str, tr: TorchrunEnv, *, source: str) -> str:
    """An address to bind *and advertise*: no wildcard, no loopback in a multi-node job."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        try:  # a host name: resolve it once so peers get an address that does not depend on their resolver
            host = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        except OSError as exc:
            raise ConfigError(f"{source}={host!r} does not resolve: {exc}") from exc
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    if ip.is_unspecified:
        raise ConfigError(
            f"{source}={host!r} is a wildcard address; tensorwire advertises the bound address to "
            "peers, so give the address this node is reachable on"
        )
    if ip.is_loopback and tr.multi_node:
        raise ConfigError(
            f"{source}={host!r} is a loopback address but this job spans several nodes "
            f"(WORLD_SIZE={tr.world_size}, LOCAL_WORLD_SIZE={tr.local_world_size})"
        )
    return host


def reachable_address(tr: TorchrunEnv) -> str:
    """The local address peers reach this worker on: the one that routes to ``MASTER_ADDR``.

    Single-node jobs whose MASTER_ADDR is loopback (``--standalone`` sets
    ``localhost``) get loopback. Otherwise the routing table is asked for the
    source address towards MASTER_ADDR (a UDP ``connect``: no packet is sent).

    Raises:
        ConfigError: MASTER_ADDR does not resolve, or only to loopback in a
            multi-node job (set ``TENSORWIRE_HOST``).
    """
    try:
        infos = socket.getaddrinfo(tr.master_addr, None, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise ConfigError(f"MASTER_ADDR={tr.master_addr!r} does not resolve: {exc}") from exc
    # Prefer IPv4 (what the agent's TCPStore listens on in practice), keep resolver order otherwise.
    infos.sort(key=lambda i: 0 if i[0] == socket.AF_INET else 1)
    family, _, _, _, sockaddr = infos[0]
    if _is_loopback(str(sockaddr[0])):
        if tr.multi_node:
            raise ConfigError(
                f"MASTER_ADDR={tr.master_addr!r} resolves to loopback ({sockaddr[0]}) but the job spans several "
                "nodes: set TENSORWIRE_HOST (or tw.init(host=...)) to this node's address, or give torchrun "
                "--local-addr / --master-addr with a routable address"
            )
        return "127.0.0.1" if family == socket.AF_INET else "::1"
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((sockaddr[0], 9))  # no packet is sent: this only asks the routing table
        except OSError as exc:
            raise ConfigError(
                f"no route to MASTER_ADDR={tr.master_addr!r} ({sockaddr[0]}): {exc}; set TENSORWIRE_HOST"
            ) from exc
        return s.getsockname()[0]
