"""Who a control-plane caller is, for per-client limits (``--max-sessions-per-client``).

A client is, in this order of preference:

- ``cert:<identity>``: the identity of its client certificate (mTLS), when the
  connection has one: what the CA vouches for;
- ``uid:<n>``: the local user that owns the connecting socket, for a caller on
  the loopback interface (found in ``/proc/net/tcp``, Linux): processes of one
  user on this host are one client, as they can already signal and trace
  each other; different users are different clients;
- ``addr:<ip>``: the caller's IP address otherwise (or when the owner of a
  loopback socket cannot be found).

The bearer token is not an identity: every client holds the same one.
Only the standard library is imported here.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

__all__ = ["client_key", "parse_peer", "loopback_uid"]

log = logging.getLogger(__name__)

_PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"


def parse_peer(peer: str) -> tuple[str, int] | None:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` (gRPC's ``context.peer()``) -> (ip, port); None otherwise."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or not rest:
        return None
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]").split("%", 1)[0]
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host, int(port)


def loopback_uid(peer_port: int, server_port: int | None) -> int | None:
    """The uid owning the established loopback socket whose local port is ``peer_port`` (connected to
    ``server_port`` when given), from ``/proc/net/tcp{,6}``; None when there is none (or no such file)."""
    found: set[int] = set()
    for path in _PROC_TCP:
        try:
            with open(path, encoding="ascii") as f:
                next(f, None)  # the column titles
                for line in f:
                    fields = line.split()
                    if len(fields) < 8 or fields[3] != _ESTABLISHED:
                        continue
                    try:
                        lport = int(fields[1].rsplit(":", 1)[1], 16)
                        rport = int(fields[2].rsplit(":", 1)[1], 16)
                    except (IndexError, ValueError):
                        continue
                    if lport == peer_port and (server_port is None or rport == server_port):
                        found.add(int(fields[7]))
        except OSError:
            continue
    return found.pop() if len(found) == 1 else None


def client_key(context: Any, *, server_port: int | None = None) -> str:
    """The per-client key of a gRPC call (see the module docstring)."""
    try:
        ids = context.peer_identities()
    except Exception:  # noqa: BLE001 - no TLS: no identities
        ids = None
    if ids:
        return "cert:" + b",".join(sorted(bytes(i) for i in ids)).decode("utf-8", "replace")[:256]
    peer = parse_peer(context.peer() or "")
    if peer is None:
        return "peer:" + (context.peer() or "unknown")[:128]
    ip, port = peer
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    if mapped is not None:
        ip, addr = str(mapped), mapped
    if addr.is_loopback:
        uid = loopback_uid(port, server_port)
        if uid is not None:
            return f"uid:{uid}"
    return f"addr:{ip}"
