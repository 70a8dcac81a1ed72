"""``Node`` (one per process) and ``Link`` (a negotiated channel to one peer).

A :class:`Node` owns the process's control server, its data-plane listeners
and its handle on the bootstrap store. :meth:`Node.link` negotiates a
:class:`Link` with a peer rank: both sides declare what they send and what they
expect to receive, the declarations are checked against each other (a
difference fails on both sides with :class:`~tensorwire.ShapeMismatchError`),
a transport is chosen, the data connection is made, and every slot is
allocated — once.

What a link does once made (slots, depth, the hot path) is described in
:mod:`tensorwire.p2p.link`; which transport it uses, in :mod:`tensorwire.transport.select`.
If UCX is chosen but cannot connect, the link falls back to TCP with a WARNING.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from tensorwire import lifecycle
from tensorwire.buffers import cuda_available, cuda_in_use
from tensorwire.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    ConnectTimeout,
    PeerLostError,
    ProtocolError,
    ShapeMismatchError,
    TensorWireError,
    TransportError,
)
from tensorwire.observe import log_summary, note_fallback, note_negotiated, start_endpoint
from tensorwire.settings import Settings, setting
from tensorwire.spec import TensorSpec, check_same_specs
from tensorwire.p2p.link import Link, slot_depths
from tensorwire.p2p.linkauth import SECRET_KEY, resolve_link_secret
from tensorwire.transport.base import Listener, Transport, get_factory, new_nonce
from tensorwire.p2p.ce_paths import link_pair
from tensorwire.transport.ce import Watchdog
from tensorwire.transport.select import TransportChoice, carries_cuda, check_choice, choose_transport, host_id
from tensorwire.p2p.torchrun import bootstrap_store

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.p2p.control import LinkOffer

__all__ = ["Node", "DEFAULT_TIMEOUT", "DEFAULT_PEER_TIMEOUT"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT: float = Settings.timeout
DEFAULT_PEER_TIMEOUT: float = Settings.peer_timeout


class Node:
    """One per process: control server, data listeners, bootstrap store.

    Args:
        rank, world_size: this process's rank and the number of ranks.
        store: a ``torch.distributed.Store`` (e.g. ``TCPStore``) shared by all
            ranks, used to publish and look up control addresses. ``None``:
            built from MASTER_ADDR/MASTER_PORT: a client of torchrun's agent store
            when TORCHELASTIC_USE_AGENT_STORE=True, else hosted by rank 0 on
            MASTER_PORT (multi-tenant, shared with torch.distributed).
        host: address to bind listeners to and to advertise to peers.
        transport: ``"auto"`` (default; env ``TENSORWIRE_TRANSPORT``), ``"ucx"`` or ``"tcp"``.
        timeout: default timeout (s) for negotiation and transfers (env ``TENSORWIRE_TIMEOUT``).
        peer_timeout: how long an unresponsive peer may stay silent before it
            is declared lost (env ``TENSORWIRE_PEER_TIMEOUT``).
        prefix: store key prefix (``tw.init`` keys it by run id and restart count).
        device: CUDA device for CUDA slots (default: the current device).
        link_secret: the secret every rank of the job holds (at least 16 bytes or
            characters); default: ``TENSORWIRE_LINK_TOKEN`` / ``TENSORWIRE_LINK_TOKEN_FILE``,
            else a random one written once into ``store`` under the prefix. Links
            are negotiated and connected only with processes that prove it
            (:mod:`tensorwire.p2p.linkauth`).

    Raises:
        ConfigError: bad arguments or environment.
        ConnectTimeout: the store did not answer in time.
        TransportError: a listener or the control server could not bind.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store: Any = None,
        host: str = "127.0.0.1",
        transport: TransportChoice | None = None,
        timeout: float | None = None,
        peer_timeout: float | None = None,
        prefix: str = "tensorwire/default/0/",
        device: "torch.device | str | None" = None,
        link_secret: bytes | str | None = None,
    ) -> None:
        if not isinstance(rank, int) or not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        if transport is None:
            transport = setting("transport")
        self.transport = check_choice(transport, source="Node(transport=...)")
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.timeout = float(timeout) if timeout is not None else setting("timeout")
        self.peer_timeout = float(peer_timeout) if peer_timeout is not None else setting("peer_timeout")
        self.prefix = prefix
        self.device = device
        self._closed = False
        self._links: list[Link] = []
        self._ce_links: dict[tuple[int, str], int] = {}  # links with a copy-engine pair made, per (peer, name)
        self._ce_watchdog = Watchdog(f"tw-ce-watchdog-{rank}")  # (its thread starts with the first pair)
        self._owns_store = False
        if store is None:
            store = self._store_from_env()
        self.store = store
        self._listeners: dict[str, Listener] = {}
        from tensorwire.p2p.control import ControlServer

        try:
            self._secret = resolve_link_secret(
                store=store, key=self._key(SECRET_KEY), explicit=link_secret, timeout=self.timeout
            )
        except BaseException:
            self.close()
            raise
        self._control = ControlServer(host, secret=self._secret)
        try:
            self._open_listeners()
            self.store.set(self._key(f"ctrl/{rank}"), self._control.address)
            start_endpoint(host)  # TENSORWIRE_METRICS_PORT: the process's Prometheus endpoint (once)
        except BaseException:
            self.close()
            raise
        log.info(
            "tensorwire node rank %d/%d: control %s, data %s",
            rank,
            world_size,
            self._control.address,
            ", ".join(f"{k}://{h}:{p}" for k, (h, p) in ((k, v.address) for k, v in self._listeners.items())),
        )
        lifecycle.track(self)  # closed at interpreter exit if the script does not (tensorwire.lifecycle)

    def _key(self, suffix: str) -> str:
        return self.prefix + suffix

    def _store_from_env(self) -> Any:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise ConfigError("Node(store=None) needs MASTER_ADDR and MASTER_PORT in the environment, or pass store=")
        try:
            port_n = int(port)
        except ValueError:
            raise ConfigError(f"MASTER_PORT={port!r} is not a port number") from None
        self._owns_store = True
        return bootstrap_store(
            master_addr=addr,
            master_port=port_n,
            rank=self.rank,
            world_size=self.world_size,
            use_agent_store=None,
            timeout=self.timeout,
        )

    def _open_listeners(self) -> None:
        kinds = ["tcp"] if self.transport == "tcp" else (["ucx"] if self.transport == "ucx" else ["ucx", "tcp"])
        for kind in kinds:
            try:
                factory = get_factory(kind)
                self._listeners[kind] = factory(self.host, port=0, peer_timeout=self.peer_timeout, secret=self._secret)
            except ImportError as exc:
                if self.transport == kind:
                    raise ConfigError(f"transport {kind!r} requested but unavailable: {exc}") from exc
                note_fallback("any", kind, "tcp", f"{kind}_unavailable")
                log.warning(
                    "tensorwire: %s transport unavailable (%s); links from rank %d will use TCP", kind, exc, self.rank
                )
            except TensorWireError:
                raise
            except Exception as exc:
                if self.transport == kind:
                    raise TransportError(f"cannot start the {kind} listener: {exc}") from exc
                note_fallback("any", kind, "tcp", f"{kind}_listener_failed")
                log.warning("tensorwire: %s listener failed to start (%s); falling back to TCP", kind, exc)

    @property
    def control_address(self) -> str:
        return self._control.address

    def link(
        self,
        peer: int,
        *,
        send: Iterable[TensorSpec] = (),
        recv: Iterable[TensorSpec] = (),
        timeout: float | None = None,
        name: str = "default",
        depth: "int | Mapping[str, int] | None" = None,
        cuda_hint: bool = False,
    ) -> Link:
        """Negotiate a link with ``peer``; both ranks must call this with mirrored specs.

        Args:
            peer: the other rank.
            send: specs this side will send (the peer must list them in its ``recv``).
            recv: specs this side expects (the peer must list them in its ``send``).
            timeout: for negotiation and connection (default: the node's).
            name: distinguishes several links between the same two ranks.
            depth: receive slots per received name (an int for all, or ``{name: n}``; default 2,
                at least 2, at most 64): a slot returned by ``recv`` stays valid until ``depth - 1``
                more ``recv`` calls of its name. Local to this side (the peer's credits follow the
                slots posted); costs ``depth`` x the tensor's bytes. See :meth:`Link.depth`.
            cuda_hint: the link will also carry undeclared tensors that may be on CUDA (the
                torch.distributed backend): where both sides have CUDA and have initialized it
                already, the transport is chosen as for CUDA specs (UCX, whose CUDA paths move
                device memory without staging). Both sides must pass the same value.

        Raises:
            ShapeMismatchError: the declarations differ (raised on both sides;
                names the tensor and both specs).
            ConnectTimeout: the peer did not show up in time.
            ConfigError: bad arguments or incompatible transport requests.
        """
        if self._closed:
            raise ClosedError("node is closed")
        if not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise ConfigError(f"peer must be another rank in [0, {self.world_size}), got {peer!r}")
        send_l, recv_l = list(send), list(recv)
        for s in send_l + recv_l:
            if not isinstance(s, TensorSpec):
                raise ConfigError(f"send/recv take TensorSpec objects, got {type(s).__name__}")
        for label, specs in (("send", send_l), ("recv", recv_l)):
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise ConfigError(f"duplicate names in {label}: {sorted(n for n in names if names.count(n) > 1)}")
        depths = slot_depths(depth, [s.name for s in recv_l])
        if any(s.device == "cuda" for s in send_l + recv_l) and not cuda_available():
            raise ConfigError("CUDA specs given but CUDA is not available in this process")
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        from tensorwire.p2p import control

        nonce = new_nonce()
        mine = control.make_offer(
            run_id=self.prefix,
            from_rank=self.rank,
            to_rank=peer,
            link_name=name,
            send=send_l,
            recv=recv_l,
            data={k: lst.address for k, lst in self._listeners.items()},
            transport=self.transport,
            nonce=nonce,
            # with cuda_hint, a side counts as a CUDA side only once it uses CUDA (a GPU job sets its
            # device before making its group); a CPU job on a GPU host keeps the host-memory choice
            has_cuda=cuda_available() and (not cuda_hint or cuda_in_use()),
            host_id=host_id(),
        )
        for lst in self._listeners.values():
            lst.expect(nonce)
        self._control.declare(mine)
        try:
            peer_addr = self._lookup(peer, deadline)
            theirs = control.negotiate(
                peer_addr, mine, timeout=max(0.1, deadline - time.monotonic()), secret=self._secret
            )
            if theirs.run_id != mine.run_id:
                raise ProtocolError(f"rank {peer} belongs to run {theirs.run_id!r}, this rank to {mine.run_id!r}")
            peer_send, peer_recv = control.offer_specs(theirs)
            errors = []
            for a, b, what in (
                (send_l, peer_recv, f"rank {self.rank} sends -> rank {peer} receives"),
                (peer_send, recv_l, f"rank {peer} sends -> rank {self.rank} receives"),
            ):
                try:
                    check_same_specs(a, b, what=what)
                except ShapeMismatchError as exc:
                    errors.append(str(exc))
            if errors:
                # The peer must see the same mismatch: let it fetch our declaration before we go.
                self._control.wait_served(peer, name, max(0.0, min(10.0, deadline - time.monotonic())))
                raise ShapeMismatchError("; ".join(errors))
            needs_cuda = carries_cuda(
                any(s.device == "cuda" for s in send_l + recv_l),
                hint=cuda_hint,
                mine_has_cuda=mine.has_cuda,
                theirs_has_cuda=theirs.has_cuda,
            )
            order = choose_transport(mine, theirs, needs_cuda=needs_cuda)
            if not order:
                raise ConfigError(f"no transport in common with rank {peer}")
            if self.transport == "auto" and order[0] != "ucx" and (needs_cuda or setting("auto_prefer") == "ucx"):
                # auto wanted UCX here (CUDA tensors, or TENSORWIRE_AUTO_PREFER=ucx): say why it is not there
                if "ucx" not in self._listeners:
                    why = "ucx_unavailable_here"
                elif theirs.transport != "auto":
                    why = f"peer_asked_{theirs.transport}"
                else:
                    why = "ucx_unavailable_at_peer"
                note_fallback(peer, "ucx", order[0], why)
            transport = self._connect(order, mine, theirs, deadline)
        finally:
            for lst in self._listeners.values():
                lst.forget(nonce)
        ce = None
        if not cuda_hint and any(s.device == "cuda" and not s.is_dynamic for s in send_l + recv_l):
            # (a group of backend "tensorwire" sets up its own pairs: cuda_hint)
            count = self._ce_links[(peer, name)] = self._ce_links.get((peer, name), 0) + 1
            try:
                ce = link_pair(
                    self.store,
                    self._key(f"ce/{min(self.rank, peer)}-{max(self.rank, peer)}/{name}/{count}"),
                    rank=self.rank,
                    peer=peer,
                    peer_host=theirs.host_id,
                    timeout=max(0.1, deadline - time.monotonic()),
                    link_timeout=self.timeout,
                    watchdog=self._ce_watchdog,
                )
            except BaseException:
                transport.abort()
                raise
        try:
            link = Link(
                node_rank=self.rank,
                peer=peer,
                name=name,
                transport=transport,
                send=send_l,
                recv=recv_l,
                timeout=self.timeout,
                device=self.device,
                depth=depths,
                ce=ce,
                peer_host=theirs.host_id,
            )
        except BaseException:
            if ce is not None:
                ce.close(ClosedError("the link could not be made"))
            transport.abort()
            raise
        self._links.append(link)
        note_negotiated(peer, transport.kind)
        log.info(
            "tensorwire: link rank %d <-> %d (%s) over %s: %d send, %d recv slots",
            self.rank,
            peer,
            name,
            transport.describe(),
            len(send_l),
            len(recv_l),
        )
        return link

    def _lookup(self, peer: int, deadline: float) -> str:
        from datetime import timedelta

        key = self._key(f"ctrl/{peer}")
        try:
            self.store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            return self.store.get(key).decode()
        except (RuntimeError, TimeoutError) as exc:  # torch raises DistStoreError (a RuntimeError)
            raise ConnectTimeout(f"rank {peer} did not publish its control address in time: {exc}") from exc

    def _connect(self, order: list[str], mine: "LinkOffer", theirs: "LinkOffer", deadline: float) -> Transport:
        """Lower rank dials, higher rank accepts; under auto, UCX failure falls back to TCP loudly."""
        dial = self.rank < theirs.from_rank
        last: BaseException | None = None
        if not dial:
            # Accept whichever transport the dialer manages to connect on.
            kinds = [k for k in order if k in self._listeners]
            while time.monotonic() < deadline:
                for kind in kinds:
                    try:
                        t = self._listeners[kind].accept(mine.nonce, timeout=0.05)
                    except ConnectTimeout:
                        continue
                    if kind != order[0]:
                        note_fallback(theirs.from_rank, order[0], kind, "peer_could_not_connect")
                        log.warning(
                            "tensorwire: link with rank %d fell back to %s (peer could not connect over %s)",
                            theirs.from_rank,
                            kind,
                            order[0],
                        )
                    return t
            raise ConnectTimeout(f"rank {theirs.from_rank} did not connect a data channel in time")
        addrs = {d.kind: d for d in theirs.data}
        for i, kind in enumerate(order):
            addr = addrs[kind]
            try:
                factory = get_factory(kind)
                per_try = (
                    max(0.1, deadline - time.monotonic())
                    if i == len(order) - 1
                    else min(10.0, max(0.1, deadline - time.monotonic()))
                )
                return factory.connect(
                    addr.host,
                    addr.port,
                    theirs.nonce,
                    timeout=per_try,
                    peer_timeout=self.peer_timeout,
                    secret=self._secret,
                )
            except AuthError:
                raise  # the peer does not hold our secret: no other transport will do better
            except (TensorWireError, ImportError, OSError) as exc:
                last = exc
                if i + 1 < len(order):
                    note_fallback(theirs.from_rank, kind, order[i + 1], "connect_failed")
                    log.warning(
                        "tensorwire: %s connection to rank %d at %s:%d failed (%s); falling back to %s",
                        kind,
                        theirs.from_rank,
                        addr.host,
                        addr.port,
                        exc,
                        order[i + 1],
                    )
        assert last is not None
        if isinstance(last, TensorWireError):
            raise last
        raise PeerLostError(f"cannot connect to rank {theirs.from_rank}: {last}") from last

    def close(self) -> None:
        """Close every link, the listeners and the control server. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for link in self._links:
                link.close()
            self._ce_watchdog.close()
            for lst in self._listeners.values():
                lst.close()
        finally:
            if hasattr(self, "_control"):
                self._control.close()
            lifecycle.untrack(self)
        log_summary(self.rank)  # TENSORWIRE_LOG=info: one line of this process's traffic

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Node(rank={self.rank}, world_size={self.world_size}, transport={self.transport!r})"
