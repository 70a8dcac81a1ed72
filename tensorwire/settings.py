"""``Settings``: every ``TENSORWIRE_*`` environment variable of the library, read and validated in one place.

One precedence for every setting: **keyword argument > environment variable > default**::

    s = Settings.from_env()                      # os.environ
    s = Settings.from_env({"TENSORWIRE_TIMEOUT": "5"}, peer_timeout=10.0)
    s.timeout, s.peer_timeout                    # 5.0, 10.0

:meth:`Settings.from_env` reads every variable once and raises :class:`~tensorwire.errors.ConfigError`
naming the variable and the value for the first invalid one. :func:`setting` reads one of them
(with the same parser), for code that needs a single value where it is used (a knob read when a
module loads, a policy read when a link is made).

The serve daemon's own flags (``TENSORWIRE_PORT``, ``TENSORWIRE_MAX_BYTES``, ...) belong to
:class:`tensorwire.serve.daemon.config.ServeConfig`, which reads them with the same precedence
(flag > environment > default); ``docs/configuration.md`` lists both, generated from the code:
``python -m tensorwire.configdoc > docs/configuration.md``.

Only the standard library and :mod:`tensorwire.errors` are imported here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from tensorwire.errors import ConfigError

__all__ = [
    "Settings",
    "setting",
    "env_var",
    "parse_size",
    "markdown",
    "PREFIX",
    "DEFAULT_STAGING_CHUNK",
    "INSTALL_VARIABLES",
]

PREFIX = "TENSORWIRE_"
#: The staging chunk of CUDA tensors sent through host memory (part of the wire format: both sides agree).
DEFAULT_STAGING_CHUNK = 2 << 20

_SIZE = re.compile(r"^([0-9]+)\s*(|b|k|m|g|kb|mb|gb|kib|mib|gib)$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


# -- parsers: raw text -> value (ValueError with a reason when the text is not one) -----------------------


def _seconds(raw: str) -> float:
    value = float(raw)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError("must be a finite number of seconds > 0")
    return value


#: a poll longer than a second before sleeping is a unit mistake (nanoseconds?), not a setting
_SPIN_MAX_US = 1_000_000.0


def _microseconds(raw: str) -> float:
    value = float(raw)
    if not (value >= 0 and math.isfinite(value)):  # also rejects nan
        raise ValueError("must be a number of microseconds >= 0")
    if value > _SPIN_MAX_US:
        raise ValueError(f"is more than {_SPIN_MAX_US:.0f} microseconds (one second) of polling before a wait sleeps")
    return value


def parse_size(raw: str) -> int:
    """A size in bytes: ``1048576``, ``4M``, ``512KiB``, ``1g``, ``0`` (suffixes are powers of 1024)."""
    m = _SIZE.match(raw.strip().lower())
    if not m:
        raise ValueError("is not a size in bytes (e.g. 4M, 1048576, 512KiB, 0)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def _switch(raw: str) -> bool:
    text = raw.strip().lower()
    if text in _ON:
        return True
    if text in _OFF:
        return False
    raise ValueError(f"must be one of {', '.join(_ON + _OFF)}")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        text = raw.strip().lower()
        if text not in choices:
            raise ValueError(
                "must be " + ", ".join(repr(c) for c in choices if c) + (" or unset" if "" in choices else "")
            )
        return text

    return parse


def _count(raw: str) -> int:
    value = int(raw.strip())
    if value < 0:
        raise ValueError("must be a whole number >= 0")
    return value


def _every(raw: str) -> int:
    value = int(raw.strip())
    if value < 1:
        raise ValueError("must be a whole number >= 1")
    return value


def _port(raw: str) -> int:
    value = int(raw.strip())
    if not 0 <= value <= 65535:
        raise ValueError("must be a port number in 0..65535")
    return value


def _text(raw: str) -> str:
    return raw.strip()


def _level(raw: str) -> str:
    text = raw.strip().upper()
    if text not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError("must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return text


def _var(parse: Callable[[str], Any], doc: str, default: Any, *, shown: str | None = None, secret: bool = False) -> Any:
    """A settings field read from ``TENSORWIRE_<FIELD NAME>`` with ``parse``; ``doc`` goes into the docs.
    ``secret``: left out of the settings' ``repr`` (it may end up in a log)."""
    return field(default=default, repr=not secret, metadata={"parse": parse, "doc": doc, "shown": shown})


@dataclass(frozen=True)
class Settings:
    """Every library-wide ``TENSORWIRE_*`` setting, validated when built (an invalid one cannot exist).

    Each field ``f`` is read from ``TENSORWIRE_<F>`` (upper case): ``peer_timeout`` from
    ``TENSORWIRE_PEER_TIMEOUT``. A variable that is unset or empty means the default.
    """

    # -- links (tw.init / tw.Node) ---------------------------------------------------------------------
    transport: Literal["auto", "ucx", "tcp"] = _var(
        _choice("auto", "ucx", "tcp"), "Data plane of links and of the serve daemon: `auto`, `ucx` or `tcp`.", "auto"
    )
    auto_prefer: Literal["", "ucx", "tcp"] = _var(
        _choice("", "ucx", "tcp"),
        "Under `auto`, put this transport first (`ucx` or `tcp`); unset follows the rule "
        "(UCX on one host, with CUDA specs or with RDMA, TCP otherwise).",
        "",
        shown="unset",
    )
    host: str | None = _var(
        _text,
        "Address a rank binds and advertises (multi-node jobs); also the serve daemon's bind address.",
        None,
        shown="the torchrun contract's address",
    )
    timeout: float = _var(_seconds, "Default timeout (s) of link negotiation and transfers.", 60.0)
    peer_timeout: float = _var(_seconds, "Seconds without a sign of life after which a peer is declared lost.", 30.0)
    staging_chunk: int = _var(
        parse_size,
        "Chunk (bytes; K/M/G suffixes) of CUDA tensors staged through host memory; 0 = one message. "
        "Both ends of a link must agree.",
        DEFAULT_STAGING_CHUNK,
        shown="2M",
    )
    link_token: str | None = _var(
        _text,
        "Link secret shared by every rank of the job (the links' control plane and data handshakes prove "
        "it). Unset: rank 0's random secret from the rendezvous store. Takes precedence over the store; set it on "
        "every rank or on none.",
        None,
        shown="unset: from the rendezvous store",
        secret=True,
    )
    link_token_file: str | None = _var(
        _text,
        "File holding the link secret (e.g. a mounted Kubernetes Secret); the same as "
        "`TENSORWIRE_LINK_TOKEN` (give one of the two).",
        None,
        shown="unset: from the rendezvous store",
    )
    # -- TCP transport ------------------------------------------------------------------------------------
    tcp_spin_us: float = _var(
        _microseconds,
        "Microseconds a TCP link's reader polls its socket before it sleeps in the kernel (links that proved the "
        "link secret only; serve's connections poll for `TENSORWIRE_SERVE_SPIN_US`). A peer that answers within it is seen "
        "without a wake-up: on a 2-core VM a 4 KiB `dist.send/recv` round trip took 56-135 us with 100-300, "
        "171-238 us with 0. After the first 20 us the reader yields the core between polls (two ranks sharing "
        "one core: 222 us instead of 395). A wait for a receive of n bytes polls longer by about the time they take to "
        "come (0.2 ns per byte, at most 400 us more; up to 2 MiB). At most one second.",
        100.0,
    )
    spin_contended: bool = _var(
        _switch,
        "Whether a polling wait (`TENSORWIRE_TCP_SPIN_US`, `TENSORWIRE_SERVE_SPIN_US`) still polls while its thread "
        "has lately waited for a CPU (more than a tenth of the time, from `/proc/thread-self/schedstat`, looked at "
        "every 20 ms). Off (the default): such a wait sleeps at once, leaving the CPU to the peer that must answer "
        "and to whatever else runs; it polls again once the CPUs are free. On: poll as configured regardless.",
        False,
    )
    cma: Literal["auto", "off"] = _var(
        _choice("auto", "off"),
        "Cross-memory attach on TCP links between processes of one host: the sender copies a large message "
        "straight into the receiver's buffer (`process_vm_writev`, one copy instead of the socket's two). `auto`: "
        "wherever a probe at connection set-up shows it works (links that proved the link secret only; never the "
        "serve daemon's connections); `off`: every byte over the socket.",
        "auto",
    )
    cma_min_bytes: int = _var(
        parse_size,
        "Messages of at least this many bytes (K/M/G suffixes) take cross-memory attach; smaller ones the socket.",
        64 << 10,
        shown="64K",
    )
    cma_threads: int = _var(
        _count,
        "Threads that copy one cross-memory message in pieces of at least 1 MiB; 0: a quarter of the usable CPUs "
        "(affinity mask, cgroup CPU quota), 2 to 4 (1 on one CPU).",
        0,
    )
    serve_spin_us: float = _var(
        _microseconds,
        "Microseconds a `tensorwire serve` TCP data connection polls its socket before it sleeps in the kernel: "
        "the daemon's, waiting for a session's next request, and the client's, waiting for a reply (after the "
        "first 20 us it yields the core between polls). A request answered within it costs no wake-up on either "
        "side: on a 16-core host a remote get_rows of one row took 0.57x the time without, of 2 MiB 0.90-0.94x; "
        "on a 2-core VM 0.82x and 0.85x. 0: never. At most one second.",
        200.0,
    )
    # -- UCX ---------------------------------------------------------------------------------------------
    ucx_spin_us: float = _var(
        _microseconds, "Microseconds a wait polls UCX before it sleeps (at most one second).", 100.0
    )
    ucx_cuda_spin_us: float = _var(_microseconds, "The same for a wait on a transfer of CUDA memory.", 2000.0)
    ucx_error_handling: Literal["none", "peer"] = _var(
        _choice("none", "peer"),
        "`peer` (the default): UCX endpoints handle a peer's death as an error, so a "
        "killed peer never aborts this process; UCX then uses no shared memory or cma (host memory goes over its "
        "tcp; cuda_ipc stays). `none`: cma's single-copy speed between trusted ranks of one host, at the risk of an "
        "abort when a peer dies mid-transfer. The listener tells the dialler its mode.",
        "peer",
    )
    # -- torch.distributed backend ------------------------------------------------------------------------
    cuda_stream_wait: bool = _var(
        _switch,
        "`1` (experimental): `wait()` of a CUDA `isend`/`irecv` of backend `tensorwire` makes the current stream "
        "wait for the bytes without blocking the host (a stream memory operation on a host flag), as NCCL does; "
        "sends and contiguous receives over UCX only (a receive through a slot blocks the host); over UCX some "
        "transfers stalled now and then in this mode on an H100, so it is off by default. `0` (the default): "
        "`wait()` blocks the host until the bytes are in place.",
        False,
        shown="0",
    )
    cuda_path: Literal["auto", "ce", "ucx"] = _var(
        _choice("auto", "ce", "ucx"),
        "How backend `tensorwire` moves CUDA tensors between ranks of one host. `auto` (the default): the "
        "copy-engine path (one-sided copies into the peer's memory, mapped once through CUDA IPC; flags the GPUs "
        "wait on) when both ranks share a host and CUDA, else UCX; `ce`: the copy-engine path or an error; `ucx`: "
        "always UCX (two-sided tag messages).",
        "auto",
    )
    ce_push_wait_us: float = _var(
        _microseconds,
        "On the copy-engine path, microseconds a send of more than `TENSORWIRE_CE_INLINE_MAX` (4 MiB) that comes "
        "before its receive waits on the host for it, so that the sending GPU pushes the bytes (each GPU then copies "
        "what leaves it: both "
        "directions at full speed) instead of the receiving GPU pulling them; 0: never wait. Between two processes "
        "of one GPU no send waits; there it bounds a large copy's host wait for its peer's flag instead.",
        300.0,
    )
    ce_inline_max: int = _var(
        parse_size,
        "On the copy-engine path, the largest copy (K/M/G suffixes) that the side that comes second queues on its "
        "caller's stream when the peer's stream is past its call; larger ones go on an internal stream ordered after "
        "the caller's, so that the caller's next kernels do not wait for the copy (a GPU-side hop the ping-pong pays).",
        4 << 20,
        shown="4M",
    )
    ce_lock_spin_us: float = _var(
        _microseconds,
        "On the copy-engine path, microseconds a side retries the pair's shared lock, found taken by the peer "
        "process, before it sleeps in the kernel for it (the peer holds it for a few microseconds as both sides of "
        "a message arrive; the wake-up of a sleeping thread costs tens of microseconds); 0: sleep at once.",
        50.0,
    )
    ce_graph_flags: Literal["auto", "memop", "kernel"] = _var(
        _choice("auto", "memop", "kernel"),
        "How messages captured in a CUDA graph on the copy-engine path write and wait on their flags. `memop`: "
        "stream memory operations, each costing the host ~2 us at every replay; `kernel`: one-thread kernels "
        "(a replay's host time then grows far less with its messages, but a waiting kernel polls host memory with "
        "one thread: the captured step was 1-10 % slower on two H200s, 2-8x between two processes of one GPU); "
        "`auto` (the default): memory operations.",
        "auto",
    )
    ce_bindings: Literal["auto", "cuda-python", "ctypes"] = _var(
        _choice("auto", "cuda-python", "ctypes"),
        "Which Python bindings make the copy-engine path's per-message CUDA driver calls (the copy, the flag writes "
        "and waits). `cuda-python`: NVIDIA's Cython bindings (`pip install 'tensorwire[cuda13]'`, or `[cuda12]` "
        "for a CUDA 12 driver; a copy's call 0.2-0.7 us shorter than through ctypes on two H200s); `ctypes`: "
        "hand-declared calls into libcuda, nothing to install; `auto` (the default): cuda-python where it is "
        "installed for the driver's CUDA major, else ctypes.",
        "auto",
    )
    # -- observability (links and the torch.distributed backend) ------------------------------------------
    metrics: bool = _var(
        _switch,
        "Count the messages, bytes and latencies of links and of backend `tensorwire` per peer and path "
        "(`tw.metrics()`, the Prometheus endpoint); `0` turns counting off.",
        True,
        shown="1",
    )
    metrics_sample: int = _var(
        _every,
        "Time one message in this many of each route (a link's tensor name; a backend peer, direction and device "
        "type), the first one included, for the call-time and completion histograms; messages, bytes, "
        "completions and errors count every message. `1`: time every message.",
        16,
    )
    metrics_port: int | None = _var(
        _port,
        "Serve the point-to-point metrics in Prometheus' format on this port plus the local rank (under torchrun; "
        "the node's address); `0`: any free port. Unset: no endpoint.",
        None,
        shown="unset: no endpoint",
    )
    log: Literal["", "info"] = _var(
        _choice("", "info"),
        "`info`: each node writes one summary line of its traffic (messages, bytes, paths, fallbacks, errors) when "
        "it closes (`Node.close()`, `destroy_process_group()`), to its logger, or to stderr where logging is not "
        "configured.",
        "",
        shown="unset",
    )
    # -- serve client --------------------------------------------------------------------------------------
    shm_leases: bool = _var(
        _switch, "Shared-memory read leases of the serve client (`0` turns them off).", True, shown="1"
    )
    shm_ahead: bool = _var(
        _switch, "Shared-memory write-ahead grants of the serve client (`0` turns them off).", True, shown="1"
    )
    client_transport: Literal["auto", "ucx", "tcp"] = _var(
        _choice("auto", "ucx", "tcp"), "Data plane of the `tensorwire` client commands (put, get, ls, ...).", "auto"
    )
    client_tls_ca: str | None = _var(
        _text, "CA (PEM) of the daemon's certificate, for the client commands.", None, shown="unset: no TLS"
    )
    client_tls_cert: str | None = _var(
        _text, "Client certificate (PEM) for mTLS, for the client commands.", None, shown="unset"
    )
    client_tls_key: str | None = _var(_text, "Client key (PEM) for mTLS, for the client commands.", None, shown="unset")
    token_file: str | None = _var(
        _text,
        "File holding the bearer token (the daemon requires it of clients; the client commands send it).",
        None,
        shown="unset: no token",
    )
    # -- all commands ----------------------------------------------------------------------------------------
    log_level: str | None = _var(
        _level,
        "Logging level of the `tensorwire` commands (the library itself never configures logging).",
        None,
        shown="WARNING (serve: INFO)",
    )

    def __post_init__(self) -> None:
        # Values given as keywords go through the same checks as the environment's text.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or value == f.default:
                continue
            text = ("1" if value else "0") if isinstance(value, bool) else str(value)
            try:
                parsed = f.metadata["parse"](text)
            except ValueError as exc:
                raise ConfigError(f"{f.name}={value!r}: {exc}") from None
            if not isinstance(value, bool) and isinstance(value, (int, float)):
                parsed = float(value) if isinstance(f.default, float) else int(value)
            object.__setattr__(self, f.name, parsed)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Settings":
        """Settings from keyword arguments, then ``environ`` (default: ``os.environ``), then defaults.

        A keyword argument that is ``None`` counts as not given.

        Raises:
            ConfigError: an unknown keyword, or a variable (or keyword) whose value is invalid; the
                message names it and the value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - names
        if unknown:
            raise ConfigError(f"unknown settings {sorted(unknown)}; known: {', '.join(sorted(names))}")
        values = {name: setting(name, environ) for name in names if overrides.get(name) is None}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def env_var(name: str) -> str:
    """The environment variable of a field: ``peer_timeout`` -> ``TENSORWIRE_PEER_TIMEOUT``."""
    return PREFIX + name.upper()


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting from ``environ`` (default: ``os.environ``), or its default when unset or empty.

    Raises:
        ConfigError: the variable's value is invalid (the message names the variable and the value).
        KeyError: ``name`` is not a field of :class:`Settings`.
    """
    f = _FIELDS[name]
    env = os.environ if environ is None else environ
    raw = env.get(env_var(name), "")
    if not raw.strip():
        return f.default
    try:
        return f.metadata["parse"](raw)
    except ValueError as exc:
        raise ConfigError(f"{env_var(name)}={raw!r}: {exc}") from None


#: Variables read when tensorwire is installed, not at run time: variable -> (default, doc).
INSTALL_VARIABLES: dict[str, tuple[str, str]] = {
    "TENSORWIRE_NATIVE": (
        "`auto`",
        "Compile the hot path (`tensorwire.native.MODULES`) with mypyc: `auto` when a C compiler and Python's "
        "headers are there (pure Python otherwise; never for `pip install -e`), `1` always (the install fails "
        "without them), `0` never. `tensorwire doctor` says which one is installed.",
    ),
}


def markdown(extra: Mapping[str, tuple[str, str]] | None = None) -> str:
    """``docs/configuration.md``: a table of every setting; ``extra`` adds rows (variable -> (default, doc))."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m tensorwire.configdoc > docs/configuration.md`; "
        "tests/core/test_settings.py checks it. -->",
        "",
        "Every setting has one precedence: **keyword argument (or command-line flag) > environment variable > "
        "default**. An unset or empty variable means the default; an invalid value is a `ConfigError` naming the "
        "variable.",
        "",
        "## Library (`tensorwire.settings.Settings`)",
        "",
        "| variable | default | meaning |",
        "| --- | --- | --- |",
    ]
    for f in dataclasses.fields(Settings):
        shown = f.metadata["shown"] or f"`{f.default}`"
        lines.append(f"| `{env_var(f.name)}` | {shown} | {f.metadata['doc']} |")
    lines += [
        "",
        "## Install time (`pip install`, read by `setup.py`)",
        "",
        "| variable | default | meaning |",
        "| --- | --- | --- |",
    ]
    for var, (default, doc) in INSTALL_VARIABLES.items():
        lines.append(f"| `{var}` | {default} | {doc} |")
    if extra:
        lines += [
            "",
            "## The serve daemon (`tensorwire serve`, `ServeConfig`)",
            "",
            "Each flag `--x-y` of `tensorwire serve` can also be set as `TENSORWIRE_X_Y`.",
            "",
            "| variable | default | meaning |",
            "| --- | --- | --- |",
        ]
        for var, (default, doc) in extra.items():
            lines.append(f"| `{var}` | {default} | {doc} |")
    return "\n".join(lines) + "\n"
