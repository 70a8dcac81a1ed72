"""``ServeConfig``: everything ``tensorwire serve`` needs, validated once.

The daemon is built in three layers, as uvicorn is: this frozen config
(validated in its constructor, so an invalid one cannot exist), the
:class:`~tensorwire.serve.daemon.server.Server` that runs it, and a thin CLI
(:mod:`tensorwire.serve.cli`) that turns flags and ``TENSORWIRE_*``
environment variables into a config.

Precedence for every setting: command-line flag > environment variable >
default. Only the standard library is imported here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any, Mapping

from tensorwire.errors import ConfigError
from tensorwire.serve.protocol.common import DEFAULT_PORT
from tensorwire.serve.protocol.tls import TLSConfig
from tensorwire.serve.protocol.tls import check_file as _check_file

__all__ = [
    "ServeConfig",
    "TLSConfig",
    "parse_size",
    "format_size",
    "is_loopback",
    "ENV_PREFIX",
    "env_name",
    "DEFAULT_PORT",
]

ENV_PREFIX = "TENSORWIRE_"
TRANSPORTS = ("auto", "ucx", "tcp")

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    # single letters are binary, as in `docker --memory`
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """Parse a byte size: ``64GiB``, ``500MB``, ``1.5g``, ``4096`` (plain bytes).

    Decimal units (kB, MB, GB, TB) are powers of 1000; binary ones (KiB, MiB,
    GiB, TiB, and the single letters k/m/g/t) powers of 1024. Case-insensitive.

    Raises:
        ConfigError: not a size, or not positive.
    """
    if isinstance(text, bool):
        raise ConfigError(f"not a size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"not a size: {text!r} (use plain bytes or a unit: kB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"size must be positive, got {text!r}")
    return value


def format_size(n: int | float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def is_loopback(host: str) -> bool:
    """Whether ``host`` only ever listens on the loopback interface.

    Literal addresses are checked directly; names are resolved and count as
    loopback only if every address they resolve to is. Wildcards
    (``0.0.0.0``, ``::``, ``""``) are not loopback.
    """
    h = host.strip().strip("[]")
    if h in ("", "*"):
        return False
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None)
    except OSError:
        return False
    addrs = {str(info[4][0]) for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs)


def _default_max_bytes() -> int:
    """Half of physical memory (each tensor costs twice its size: double buffer)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 8 << 30


@dataclass(frozen=True)
class ServeConfig:
    """Configuration of ``tensorwire serve``. Validated in the constructor.

    Attributes:
        host: address the control plane, data plane and metrics bind to.
            Anything but loopback needs a token, TLS, or ``insecure=True``.
        port: gRPC control port (0 = any free port; the real one is logged
            and reported on the ready line).
        data_port: data-plane listener port (0 = any free port).
        transport: ``auto`` (UCX listener when it imports and a loopback
            self-test connects, else TCP with a WARNING; the default for
            clients is UCX only with an RDMA device), ``ucx`` or ``tcp``.
        max_bytes: limit on what tensors reserve (each reserves twice its
            bytes: the current version and a staging slot). Default: half of
            physical memory.
        token_file: file holding the bearer token every control call must
            present (whitespace stripped).
        tls_cert, tls_key: server certificate and key (PEM) for TLS.
        tls_ca: CA whose client certificates are required (mTLS).
        insecure: allow a non-loopback bind without any authentication.
        metrics_port: Prometheus endpoint port (None = off, 0 = any).
        snapshot_dir: write the store there (safetensors) on shutdown and on
            demand; restore it on start.
        ready_file: write the ready JSON (bound ports) to this file atomically.
        drain_timeout: seconds in-flight transfers get to finish on shutdown.
        session_idle_timeout: sessions idle this long are closed.
        max_sessions: concurrent client sessions.
        max_sessions_per_client: concurrent sessions one client may hold (a
            client: its certificate identity under mTLS, else the local user
            for a caller on loopback, else its IP address; see
            :mod:`tensorwire.serve.daemon.peers`), so that one client cannot
            take every session. Capped at ``max_sessions``.
        workers: gRPC handler threads.
        hello_timeout: seconds a data connection may take to present its hello.
        max_pending_connections: data connections without a hello, at most (the oldest of the
            address holding the most is evicted with BUSY to admit a new one).
        max_pending_per_peer: the same, from one peer address.
        max_waiting_calls: gRPC handler threads that may wait for other clients' transfers at
            once, each for at most half a second (0 = workers // 4); the others answer at once.
        shm: keep slots in shared memory under ``/dev/shm`` so that clients on
            this host (same ``/dev/shm``, same uid) move bytes with one memcpy
            instead of the socket; clients elsewhere use the data connection.
            Off: ordinary memory, socket only.
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    data_port: int = 0
    transport: str = "auto"
    max_bytes: int = field(default_factory=_default_max_bytes)
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    insecure: bool = False
    metrics_port: int | None = None
    snapshot_dir: str | None = None
    ready_file: str | None = None
    drain_timeout: float = 10.0
    session_idle_timeout: float = 3600.0
    max_sessions: int = 256
    max_sessions_per_client: int = 64
    workers: int = 32
    hello_timeout: float = 3.0
    max_pending_connections: int = 512
    max_pending_per_peer: int = 64
    max_waiting_calls: int = 0
    shm: bool = True

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        if not isinstance(self.host, str) or not self.host.strip():
            raise ConfigError("host must be a non-empty address")
        set_("host", self.host.strip())
        for name in ("port", "data_port"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
                raise ConfigError(f"{name} must be an integer in 0..65535, got {v!r}")
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool)
            or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise ConfigError(f"metrics_port must be an integer in 0..65535, got {self.metrics_port!r}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        set_("max_bytes", parse_size(self.max_bytes))
        set_("token_file", _check_file("token file", self.token_file))
        if self.token_file is not None and not self._read_token():
            raise ConfigError(f"token file {self.token_file!r} is empty")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together (both or neither)")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ConfigError("--tls-ca (client certificates) needs --tls-cert and --tls-key")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            set_(name, _check_file(name.replace("_", "-"), getattr(self, name)))
        if self.snapshot_dir is not None:
            d = os.path.abspath(os.path.expanduser(str(self.snapshot_dir)))
            if os.path.exists(d) and not os.path.isdir(d):
                raise ConfigError(f"snapshot dir {d!r} exists and is not a directory")
            if not os.path.isdir(os.path.dirname(d) or "/"):
                raise ConfigError(f"snapshot dir {d!r}: its parent does not exist")
            set_("snapshot_dir", d)
        for name in ("drain_timeout", "session_idle_timeout", "hello_timeout"):
            v = float(getattr(self, name))
            if not v > 0:
                raise ConfigError(f"{name} must be positive, got {v}")
            set_(name, v)
        for name in (
            "max_sessions",
            "max_sessions_per_client",
            "workers",
            "max_pending_connections",
            "max_pending_per_peer",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        v = self.max_waiting_calls
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"max_waiting_calls must be a non-negative integer, got {v!r}")
        set_("max_sessions_per_client", min(self.max_sessions_per_client, self.max_sessions))
        set_("insecure", bool(self.insecure))
        set_("shm", bool(self.shm))
        if not is_loopback(self.host) and not (self.token_file or self.tls_cert or self.insecure):
            raise ConfigError(
                f"refusing to bind {self.host!r}, which is not a loopback address, without authentication: "
                "pass --token-file, or --tls-cert/--tls-key (with --tls-ca for client certificates), "
                "or --insecure if this network is trusted"
            )

    # -- derived -------------------------------------------------------------
    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def mtls(self) -> bool:
        return self.tls_ca is not None

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def _read_token(self) -> str:
        assert self.token_file is not None
        with open(self.token_file, encoding="utf-8") as f:
            return f.read().strip()

    def load_token(self) -> str | None:
        """The bearer token (read from ``token_file`` now), or None."""
        return self._read_token() if self.token_file else None

    def replace(self, **changes: Any) -> "ServeConfig":
        return dataclasses.replace(self, **changes)

    # -- sources ---------------------------------------------------------------
    @classmethod
    def resolve(cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> "ServeConfig":
        """Build a config from flags (None = not given), then ``TENSORWIRE_*``, then defaults.

        Raises:
            ConfigError: an invalid value, naming where it came from.
        """
        flags = dict(flags or {})
        environ = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = flags.get(f.name)
            if value is not None:
                kwargs[f.name] = value
                continue
            raw = environ.get(env_name(f.name))
            if raw is None or raw == "":
                continue
            try:
                kwargs[f.name] = _from_env(f.name, raw)
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"{env_name(f.name)}={raw!r}: {exc}") from exc
        return cls(**kwargs)


def env_name(field_name: str) -> str:
    """``data_port`` -> ``TENSORWIRE_DATA_PORT``."""
    return ENV_PREFIX + field_name.upper()


_INT_FIELDS = {
    "port",
    "data_port",
    "metrics_port",
    "max_sessions",
    "max_sessions_per_client",
    "workers",
    "max_pending_connections",
    "max_pending_per_peer",
    "max_waiting_calls",
}
_FLOAT_FIELDS = {"drain_timeout", "session_idle_timeout", "hello_timeout"}
_BOOL_FIELDS = {"insecure", "shm"}


def _from_env(name: str, raw: str) -> Any:
    if name in _INT_FIELDS:
        return int(raw)
    if name in _FLOAT_FIELDS:
        return float(raw)
    if name in _BOOL_FIELDS:
        v = raw.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected 1/0, true/false, yes/no or on/off")
    return raw
