"""``TLSConfig``: TLS material as file paths, shared by the serve client and the daemon's config."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from tensorwire.errors import ConfigError

__all__ = ["TLSConfig", "check_file"]


def check_file(what: str, path: str | None) -> str | None:
    """``path`` with ``~`` expanded, if it is a readable file (``None`` passes through).

    Raises:
        ConfigError: not a file, or not readable.
    """
    if path is None:
        return None
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise ConfigError(f"{what}: {path!r} is not a file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{what}: {path!r} is not readable")
    return path


@dataclass(frozen=True)
class TLSConfig:
    """TLS material for a client (or a server) as file paths.

    Client: ``ca`` (the CA that signed the server's certificate; default: the
    system roots), and for mTLS ``cert`` + ``key`` (the client's own).
    ``server_name`` overrides the name checked against the server's
    certificate (default: the host of the address).

    Accepts a dict with the same keys through :meth:`coerce`.
    """

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("TLS: cert and key go together (both or neither)")
        for what in ("ca", "cert", "key"):
            object.__setattr__(self, what, check_file(f"TLS {what}", getattr(self, what)))

    @classmethod
    def coerce(cls, value: "TLSConfig | Mapping[str, Any] | bool | None") -> "TLSConfig | None":
        """``None``/``False`` -> no TLS; ``True`` -> TLS with system roots; a dict -> its keys."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - {"ca", "cert", "key", "server_name"}
            if unknown:
                raise ConfigError(f"TLS: unknown keys {sorted(unknown)}; use ca, cert, key, server_name")
            return cls(**{k: (str(v) if v is not None else None) for k, v in value.items()})
        raise ConfigError(f"tls must be a TLSConfig, a dict or None, got {type(value).__name__}")

    def read(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(ca, key, cert) file contents (None where unset)."""

        def rd(p: str | None) -> bytes | None:
            if p is None:
                return None
            with open(p, "rb") as f:
                return f.read()

        return rd(self.ca), rd(self.key), rd(self.cert)
