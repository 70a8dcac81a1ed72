"""Admission of unauthenticated data connections: deadlines and caps that never starve real clients.

A data listener accepts TCP connections from anyone who can reach its port,
and learns only from the first bytes (the hello, with the nonce handed out
over the authenticated control plane) whether a connection belongs to a
client. Until then the connection is *pending*. :class:`PendingTable` bounds
what pending connections can cost:

- each has a deadline (``hello_timeout`` after it was accepted); past it, it
  is dropped;
- at most ``per_peer`` are pending from one peer address, and at most
  ``total`` from all peers together.

When a new connection would exceed a cap, the table does not refuse the new
connection: it *evicts* the oldest pending connection of the peer address
that holds the most (for the per-peer cap: of the new connection's own
address). A real client sends its hello right after it connects, so it is
pending for a round trip; an attacker's idle connection is pending until it
is evicted or times out. Evicting the oldest therefore hits idle connections
first, and evicting from the heaviest address means a flood from one address
never pushes out the pending connections of another. An evicted connection
is told ``BUSY`` (the listener's reply names it), so a real client that was
evicted retries with backoff instead of reporting a bad credential.

Pure bookkeeping: no sockets, no threads, no clock of its own (callers pass
``now``), so it is tested without a network.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Generic, Hashable, Iterator, TypeVar

__all__ = ["AdmissionLimits", "PendingTable"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds on a listener's pending (not yet authenticated) connections.

    Attributes:
        hello_timeout: seconds a connection may take to present its hello.
        total: pending connections at most, from all peers.
        per_peer: pending connections at most from one peer address.
    """

    hello_timeout: float = 3.0
    total: int = 512
    per_peer: int = 64

    def __post_init__(self) -> None:
        if not self.hello_timeout > 0:
            raise ValueError(f"hello_timeout must be positive, got {self.hello_timeout!r}")
        for name in ("total", "per_peer"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclass
class _Peer(Generic[K]):
    keys: "collections.OrderedDict[K, float]" = field(default_factory=collections.OrderedDict)


class PendingTable(Generic[K]):
    """Pending connections by key (e.g. a file descriptor) and peer address. See the module docstring."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._peers: dict[str, _Peer[K]] = {}
        self._addr: dict[K, str] = {}
        #: Connections evicted for load and connections dropped at their deadline, since creation.
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._addr)

    def __contains__(self, key: object) -> bool:
        return key in self._addr

    def pending_from(self, addr: str) -> int:
        p = self._peers.get(addr)
        return len(p.keys) if p is not None else 0

    def add(self, key: K, addr: str, now: float, *, timeout: float | None = None) -> list[K]:
        """Admit ``key`` from ``addr`` until ``now + timeout`` (default: ``hello_timeout``); returns the keys
        evicted to make room (the caller tells them BUSY)."""
        out: list[K] = []
        peer = self._peers.get(addr)
        if peer is not None and len(peer.keys) >= self.limits.per_peer:
            out.append(self._evict_oldest(addr))
        while len(self._addr) >= self.limits.total:
            heaviest = max(self._peers, key=lambda a: len(self._peers[a].keys))
            out.append(self._evict_oldest(heaviest))
        peer = self._peers.setdefault(addr, _Peer())
        peer.keys[key] = now + (self.limits.hello_timeout if timeout is None else timeout)
        self._addr[key] = addr
        self.evicted += len(out)
        return out

    def remove(self, key: K) -> bool:
        """Forget ``key`` (its hello arrived, or it closed). False: it was not pending."""
        addr = self._addr.pop(key, None)
        if addr is None:
            return False
        peer = self._peers[addr]
        del peer.keys[key]
        if not peer.keys:
            del self._peers[addr]
        return True

    def expired_keys(self, now: float) -> list[K]:
        """Remove and return the keys whose deadline has passed."""
        out = [k for peer in self._peers.values() for k, dl in peer.keys.items() if dl <= now]
        for k in out:
            self.remove(k)
        self.expired += len(out)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of a pending key (each peer's oldest is its earliest)."""
        firsts = [next(iter(p.keys.values())) for p in self._peers.values()]
        return min(firsts) if firsts else None

    def keys(self) -> Iterator[K]:
        return iter(list(self._addr))

    def _evict_oldest(self, addr: str) -> K:
        peer = self._peers[addr]
        key = next(iter(peer.keys))
        self.remove(key)
        return key
