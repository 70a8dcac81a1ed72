"""Which transport a link (or a serve session) uses: the rule of ``auto``, shared by both ends.

Transport choice (both sides compute the same answer from both offers):

- ``tcp`` or ``ucx`` asked on either side wins (asked on both and different: error);
- ``auto``: UCX when both sides have it **and** it beats a socket: the peer
  shares this machine and IPC namespace (:func:`host_id`) and UCX runs without
  peer error handling (``TENSORWIRE_UCX_ERROR_HANDLING=none``: it then uses shared
  memory for small messages and cma single-copy rendezvous for large ones; with
  the default ``peer`` it may not, and host memory is faster over the socket
  transport), the link has CUDA specs (zero-copy GPU memory: cuda_ipc / GPUDirect),
  or there is an RDMA network device; TCP otherwise -- between hosts without
  RDMA, UCX runs over TCP too and a plain socket was measured faster.
  ``TENSORWIRE_AUTO_PREFER=ucx`` / ``=tcp`` puts that transport first under auto.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Literal, Mapping, Protocol, Sequence

from tensorwire.errors import ConfigError
from tensorwire.settings import setting

__all__ = [
    "TransportChoice",
    "CHOICES",
    "check_choice",
    "ucx_has_rdma",
    "host_id",
    "auto_preference",
    "same_host",
    "choose_transport",
    "AutoPicks",
    "auto_picks",
    "serve_auto_picks",
]

TransportChoice = Literal["auto", "ucx", "tcp"]


class _Address(Protocol):
    @property
    def kind(self) -> str: ...


class Offer(Protocol):
    """What the choice reads of a side's offer (the control plane's ``LinkOffer`` or the serve session's)."""

    @property
    def transport(self) -> str: ...
    @property
    def host_id(self) -> str: ...
    @property
    def data(self) -> Sequence[_Address]: ...


CHOICES = ("auto", "ucx", "tcp")


def check_choice(transport: str, *, source: str) -> TransportChoice:
    if transport not in CHOICES:
        raise ConfigError(f"{source}: transport must be one of {', '.join(CHOICES)}, got {transport!r}")
    return transport  # type: ignore[return-value]


def ucx_has_rdma() -> bool:
    """Whether UCX here sees an RDMA device (InfiniBand/RoCE). Cheap check of /sys."""
    try:
        return any(os.scandir("/sys/class/infiniband"))
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """Who can share memory with whom: a hash of the kernel boot id and this process's IPC namespace.

    Two processes with the same value run on one machine in one IPC namespace,
    where UCX reaches the peer through shared memory, cma (one copy between
    address spaces) and cuda_ipc -- faster than any socket. Network namespaces
    (and containers started with ``--ipc=host``) share it; separate pods do not.
    """
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/ipc").st_ino))
    except OSError:
        parts.append("")
    if not any(parts):
        return ""  # unknown: never claims to share a host
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def auto_preference(env: "Mapping[str, str] | None" = None) -> str:
    """``TENSORWIRE_AUTO_PREFER``: "" (follow the rule), "ucx" or "tcp" (that transport first under auto).

    Raises:
        ConfigError: any other value.
    """
    pref: str = setting("auto_prefer", env)
    return pref


def same_host(mine: Offer, theirs: Offer) -> bool:
    return bool(mine.host_id) and mine.host_id == theirs.host_id


def carries_cuda(specs_on_cuda: bool, *, hint: bool, mine_has_cuda: bool, theirs_has_cuda: bool) -> bool:
    """Whether a link is chosen as one carrying CUDA tensors (the same answer on both sides).

    ``specs_on_cuda``: a declared spec is on CUDA (both sides see the same specs). ``hint``: the caller
    will send tensors it did not declare and that may be on CUDA (the torch.distributed backend, whose
    links are made before any tensor is seen); it counts only where both sides have CUDA, so a CPU-only
    peer still gets the host-memory choice.
    """
    return specs_on_cuda or (hint and mine_has_cuda and theirs_has_cuda)


def choose_transport(
    mine: Offer,
    theirs: Offer,
    *,
    needs_cuda: bool,
    env: "Mapping[str, str] | None" = None,
    rdma: bool | None = None,
) -> list[str]:
    """Transports to try, in order, for a link between two offers (symmetric).

    ``env``: where the ``TENSORWIRE_*`` settings are read (default: this process's environment);
    ``rdma``: whether there is an RDMA device (default: :func:`ucx_has_rdma`).

    Raises:
        ConfigError: the two sides insist on different transports, or one
            insists on a transport the other cannot use.
    """
    kinds_a = [d.kind for d in mine.data]
    kinds_b = [d.kind for d in theirs.data]
    common = [k for k in kinds_a if k in kinds_b]
    asked = {mine.transport, theirs.transport} - {"auto"}
    if len(asked) > 1:
        raise ConfigError(f"the two sides ask for different transports: {mine.transport!r} and {theirs.transport!r}")
    if asked:
        kind = asked.pop()
        if kind not in common:
            who = "this side" if kind not in kinds_a else "the peer"
            raise ConfigError(f"transport {kind!r} was asked for but {who} cannot use it (available: {common})")
        return [kind]
    pref = auto_preference(env)
    # On one host UCX beats a socket through shared memory and cma, which it uses only without peer error
    # handling (TENSORWIRE_UCX_ERROR_HANDLING=none); with it (the default, so that a peer's death never aborts
    # this process) host memory goes over UCX's own tcp, slower than this package's socket transport.
    same_host_fast = same_host(mine, theirs) and setting("ucx_error_handling", env) == "none"
    rdma_ = ucx_has_rdma() if rdma is None else rdma
    prefer_ucx = "ucx" in common and pref != "tcp" and (needs_cuda or pref == "ucx" or rdma_ or same_host_fast)
    order = ["ucx", "tcp"] if prefer_ucx else ["tcp"]
    return [k for k in order if k in common]


@dataclasses.dataclass(frozen=True)
class _Kind:
    kind: str


@dataclasses.dataclass(frozen=True)
class _SyntheticOffer:
    transport: str
    host_id: str
    data: tuple[_Kind, ...]


@dataclasses.dataclass(frozen=True)
class AutoPicks:
    """What ``auto`` picks for a link between two processes that both have ``kinds``: the first transport
    :func:`choose_transport` would try, for host tensors on this host, host tensors to another host, and
    CUDA tensors (on this host or another). ``tensorwire doctor``, the serve daemon's start-up log and the
    demo print :meth:`describe`; nothing restates the rule."""

    same_host: str
    other_host: str
    cuda: str

    def describe(self, *, cuda: bool = True) -> str:
        """One line; ``cuda`` False leaves CUDA tensors out (a machine without a GPU)."""
        line = f"auto picks {self.same_host} for host tensors between processes of this host, {self.other_host} to other hosts"
        return line + (f", {self.cuda} for CUDA tensors" if cuda else "")


def auto_picks(kinds: Sequence[str], *, env: "Mapping[str, str] | None" = None, rdma: bool | None = None) -> AutoPicks:
    """Run :func:`choose_transport` on offers of two processes with transports ``kinds`` (this machine's,
    :func:`tensorwire.transport.base.available_kinds`) and say what it picks (see :class:`AutoPicks`).

    Raises:
        ConfigError: ``TENSORWIRE_AUTO_PREFER`` or ``TENSORWIRE_UCX_ERROR_HANDLING`` holds a bad value.
    """
    data = tuple(_Kind(k) for k in kinds)
    here = _SyntheticOffer("auto", "this-host", data)

    def first(theirs: _SyntheticOffer, cuda: bool) -> str:
        order = choose_transport(here, theirs, needs_cuda=cuda, env=env, rdma=rdma)
        return order[0] if order else "none"

    return AutoPicks(
        same_host=first(here, False),
        other_host=first(_SyntheticOffer("auto", "other-host", data), False),
        cuda=first(_SyntheticOffer("auto", "other-host", data), True),
    )


def serve_auto_picks(
    listeners: Sequence[str], *, env: "Mapping[str, str] | None" = None, rdma: bool | None = None
) -> AutoPicks:
    """What a ``tensorwire serve`` daemon listening with ``listeners`` gives a client that asks ``auto``.

    Not the links' rule: a daemon's clients are not trusted, so its UCX endpoints handle peer errors and
    offer no shared memory or cma; a client on this host still gets UCX (its tcp between two processes of
    one host), or maps the daemon's shared-memory segments where the daemon keeps its tensors there.
    Remote clients get UCX only with an RDMA device or ``TENSORWIRE_AUTO_PREFER=ucx``.

    Raises:
        ConfigError: ``TENSORWIRE_AUTO_PREFER`` holds a bad value.
    """
    pref = auto_preference(env)
    ucx = "ucx" in listeners
    rdma_ = ucx_has_rdma() if rdma is None else rdma
    remote = "ucx" if ucx and (pref == "ucx" or (pref != "tcp" and rdma_)) else "tcp"
    local = "ucx" if ucx and pref != "tcp" else remote
    return AutoPicks(same_host=local, other_host=remote, cuda=local if ucx else "tcp")
