"""``tensorwire serve`` and the helpers ``ls``, ``get``, ``put``.

Thin: flags and ``TENSORWIRE_*`` variables become a :class:`ServeConfig` (or a
:class:`~tensorwire.serve.client.client.Client`), everything else lives in the package.
Nothing heavy is imported at module level (``tensorwire --help`` stays fast).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

from tensorwire.settings import Settings, setting

__all__ = ["register", "main"]

ENV_NOTE = (
    "Every flag can also be set with an environment variable TENSORWIRE_<FLAG>\n"
    "(dashes as underscores: TENSORWIRE_PORT=7200, TENSORWIRE_TOKEN_FILE=/etc/tensorwire/token,\n"
    "TENSORWIRE_INSECURE=1). Precedence: command-line flag > environment variable > default."
)

CLIENT_ENV_NOTE = (
    "Environment: TENSORWIRE_TOKEN_FILE, TENSORWIRE_CLIENT_TLS_CA, TENSORWIRE_CLIENT_TLS_CERT,\n"
    "TENSORWIRE_CLIENT_TLS_KEY, TENSORWIRE_CLIENT_TRANSPORT (a flag wins over its variable)."
)


def _h(text: str, env: str, default: Any = None) -> str:
    d = f"default {default}; " if default is not None else ""
    return f"{text} ({d}env {env})"


def register(subparsers: Any) -> None:
    """Add ``serve``, ``ls``, ``get`` and ``put`` to the ``tensorwire`` command line."""
    fmt = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser(
        "serve",
        help="run the tensor store daemon",
        description="Run the tensorwire tensor store: a gRPC control plane and a UCX/TCP data plane.\n\n" + ENV_NOTE,
        formatter_class=fmt,
    )
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    ls = subparsers.add_parser(
        "ls", help="list the tensors of a daemon", description=CLIENT_ENV_NOTE, formatter_class=fmt
    )
    ls.add_argument("address", help="host:port of the daemon")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _client_arguments(ls)
    ls.set_defaults(func=cmd_ls)

    g = subparsers.add_parser(
        "get", help="download a tensor to a .safetensors file", description=CLIENT_ENV_NOTE, formatter_class=fmt
    )
    g.add_argument("address", help="host:port of the daemon")
    g.add_argument("name", help="tensor name")
    g.add_argument("-o", "--output", required=True, help="file to write (safetensors; written atomically)")
    _client_arguments(g)
    g.set_defaults(func=cmd_get)

    u = subparsers.add_parser(
        "put", help="upload a tensor from a .safetensors file", description=CLIENT_ENV_NOTE, formatter_class=fmt
    )
    u.add_argument("address", help="host:port of the daemon")
    u.add_argument("name", help="tensor name in the store")
    u.add_argument("file", help="a .safetensors file")
    u.add_argument("--key", help="tensor of the file to upload (default: NAME, or the file's only tensor)")
    _client_arguments(u)
    u.set_defaults(func=cmd_put)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from tensorwire.serve.daemon.config import DEFAULT_PORT

    E = "TENSORWIRE_"
    p.add_argument(
        "--host",
        default=None,
        help=_h("address to bind; non-loopback needs auth or --insecure", E + "HOST", "127.0.0.1"),
    )
    p.add_argument(
        "--port", type=int, default=None, help=_h("gRPC control port, 0 = any free port", E + "PORT", DEFAULT_PORT)
    )
    p.add_argument(
        "--data-port", type=int, default=None, help=_h("data-plane port, 0 = any free port", E + "DATA_PORT", 0)
    )
    p.add_argument(
        "--transport",
        choices=("auto", "ucx", "tcp"),
        default=None,
        help=_h(
            "data plane: auto = UCX where it beats a socket (RDMA device), else TCP; UCX unusable = TCP with a warning",
            E + "TRANSPORT",
            "auto",
        ),
    )
    p.add_argument(
        "--max-bytes",
        default=None,
        metavar="SIZE",
        help=_h(
            "memory tensors may reserve (each reserves 2x: double buffer); e.g. 64GiB, 500MB, 1048576",
            E + "MAX_BYTES",
            "half of RAM",
        ),
    )
    p.add_argument(
        "--token-file",
        default=None,
        metavar="F",
        help=_h("file with the bearer token clients must present", E + "TOKEN_FILE"),
    )
    p.add_argument("--tls-cert", default=None, metavar="F", help=_h("server certificate (PEM) for TLS", E + "TLS_CERT"))
    p.add_argument("--tls-key", default=None, metavar="F", help=_h("server private key (PEM)", E + "TLS_KEY"))
    p.add_argument(
        "--tls-ca",
        default=None,
        metavar="F",
        help=_h("require client certificates signed by this CA (mTLS)", E + "TLS_CA"),
    )
    p.add_argument(
        "--insecure",
        action="store_const",
        const=True,
        default=None,
        help=_h("allow a non-loopback bind without authentication", E + "INSECURE=1", "off"),
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="N",
        help=_h("serve Prometheus metrics on this port", E + "METRICS_PORT", "off"),
    )
    p.add_argument(
        "--snapshot-dir",
        default=None,
        metavar="DIR",
        help=_h(
            "snapshot the store here (safetensors) on shutdown and on demand; restored on start", E + "SNAPSHOT_DIR"
        ),
    )
    p.add_argument(
        "--ready-file",
        default=None,
        metavar="F",
        help=_h("write the ready line (JSON with the bound ports) to F", E + "READY_FILE"),
    )
    p.add_argument(
        "--max-sessions-per-client",
        type=int,
        default=None,
        metavar="N",
        help=_h(
            "sessions one client may hold at once (a client: its certificate under mTLS, else its local user "
            "on loopback, else its IP address)",
            E + "MAX_SESSIONS_PER_CLIENT",
            64,
        ),
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="S",
        help=_h("seconds in-flight transfers get on shutdown", E + "DRAIN_TIMEOUT", 10),
    )
    p.add_argument(
        "--hello-timeout",
        type=float,
        default=None,
        metavar="S",
        help=_h("seconds a data connection may take to present its credential", E + "HELLO_TIMEOUT", 3),
    )
    p.add_argument(
        "--max-pending-connections",
        type=int,
        default=None,
        metavar="N",
        help=_h(
            "data connections without a credential yet, at most (the oldest is evicted)",
            E + "MAX_PENDING_CONNECTIONS",
            512,
        ),
    )
    p.add_argument(
        "--max-pending-per-peer",
        type=int,
        default=None,
        metavar="N",
        help=_h("the same, from one peer address", E + "MAX_PENDING_PER_PEER", 64),
    )
    p.add_argument(
        "--max-waiting-calls",
        type=int,
        default=None,
        metavar="N",
        help=_h(
            "control-plane threads that may wait for other clients' transfers (0 = workers/4)",
            E + "MAX_WAITING_CALLS",
            0,
        ),
    )
    p.add_argument(
        "--shm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_h(
            "keep tensors in /dev/shm so that clients on this host copy them directly (one memcpy, no socket); "
            "--no-shm: ordinary memory, data connection only",
            E + "SHM=0|1",
            "on",
        ),
    )


_SERVE_FLAGS = (
    "host",
    "port",
    "data_port",
    "transport",
    "max_bytes",
    "token_file",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "insecure",
    "metrics_port",
    "snapshot_dir",
    "ready_file",
    "drain_timeout",
    "shm",
    "max_sessions_per_client",
    "hello_timeout",
    "max_pending_connections",
    "max_pending_per_peer",
    "max_waiting_calls",
)


def config_from_args(args: argparse.Namespace, environ: Any = None) -> Any:
    from tensorwire.serve.daemon.config import ServeConfig

    flags = {k: getattr(args, k, None) for k in _SERVE_FLAGS}
    return ServeConfig.resolve(flags, environ)


def _intra_op_threads() -> None:
    """The daemon's torch intra-op threads: one below 8 usable CPUs, a quarter of them (at most 8) from 8, unless
    OMP_NUM_THREADS says otherwise (:mod:`tensorwire.serve.daemon.threads` says why; the server logs the number)."""
    from tensorwire.serve.daemon.threads import intra_op_threads

    n = intra_op_threads()
    if n is not None:
        import torch

        torch.set_num_threads(n)


def cmd_serve(args: argparse.Namespace) -> int:
    """The daemon: configures logging (INFO unless told otherwise), runs until signalled."""
    from tensorwire.serve.daemon.threads import wait_policy

    wait_policy()  # (before torch is imported: its OpenMP runtime reads it when loaded)
    config = config_from_args(args)
    if getattr(args, "log_level", None) is None and not setting("log_level"):
        logging.getLogger("tensorwire").setLevel(logging.INFO)
    _intra_op_threads()
    from tensorwire.serve.daemon.server import Server

    return Server(config).serve_forever()


# -- client helpers -----------------------------------------------------------------------------------


def _client_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--token-file", default=None, metavar="F", help="file with the bearer token (env TENSORWIRE_TOKEN_FILE)"
    )
    p.add_argument(
        "--tls-ca", default=None, metavar="F", help="CA of the server certificate (env TENSORWIRE_CLIENT_TLS_CA)"
    )
    p.add_argument(
        "--tls-cert", default=None, metavar="F", help="client certificate for mTLS (env TENSORWIRE_CLIENT_TLS_CERT)"
    )
    p.add_argument("--tls-key", default=None, metavar="F", help="client key for mTLS (env TENSORWIRE_CLIENT_TLS_KEY)")
    p.add_argument("--tls", action="store_true", help="use TLS with the system roots (implied by --tls-*)")
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "ucx", "tcp"),
        default=None,
        help="data plane (default auto: shared memory with a daemon on this host, else UCX/TCP; "
        "env TENSORWIRE_CLIENT_TRANSPORT)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per operation (default 300)")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is not a terminal")


def _open_client(args: argparse.Namespace) -> Any:
    from tensorwire.serve.client.client import Client
    from tensorwire.errors import ConfigError

    env = Settings.from_env(
        token_file=args.token_file,
        client_tls_ca=args.tls_ca,
        client_tls_cert=args.tls_cert,
        client_tls_key=args.tls_key,
        client_transport=args.transport,
    )
    token = None
    token_file = env.token_file
    if token_file:
        try:
            with open(os.path.expanduser(token_file), encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"token file {token_file!r}: {exc.strerror}") from exc
        if not token:
            raise ConfigError(f"token file {token_file!r} is empty")
    tls: Any = None
    ca, cert, key = env.client_tls_ca, env.client_tls_cert, env.client_tls_key
    if ca or cert or key:
        tls = {"ca": ca, "cert": cert, "key": key}
    elif args.tls:
        tls = True
    transport = env.client_transport
    return Client(args.address, token=token, tls=tls, transport=transport, timeout=args.timeout, name="tensorwire-cli")


class Progress:
    """A one-line progress bar on stderr, redrawn by a thread polling ``moved()``."""

    def __init__(self, label: str, total: int, moved: Callable[[], int], *, enabled: bool) -> None:
        self.label = label
        self.total = max(1, total)
        self._moved = moved
        self.enabled = enabled
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Progress":
        if self.enabled:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _render(self, done: int, final: bool = False) -> None:
        from tensorwire.serve.daemon.config import format_size

        done = min(done, self.total)
        frac = done / self.total
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        dt = max(time.monotonic() - self._t0, 1e-6)
        rate = done / dt
        line = f"\r{self.label} [{bar}] {frac * 100:5.1f}% {format_size(done)}/{format_size(self.total)} {format_size(rate)}/s {dt:5.1f}s"
        sys.stderr.write(line + ("\n" if final else ""))
        sys.stderr.flush()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._render(self._moved())
            except Exception:  # noqa: BLE001 - a progress bar never breaks a transfer
                pass

    def __exit__(self, exc_type: Any, *rest: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
            self._render(self.total if exc_type is None else self._moved(), final=True)


def _progress_enabled(args: argparse.Namespace, nbytes: int) -> bool:
    return bool(args.progress) or (sys.stderr.isatty() and nbytes >= (16 << 20))


def cmd_ls(args: argparse.Namespace) -> int:
    import json

    from tensorwire.serve.daemon.config import format_size

    with _open_client(args) as c:
        stats = c.stats()
    if args.json:
        print(
            json.dumps(
                {
                    n: {"dtype": s.spec.dtype, "shape": list(s.spec.shape), "version": s.version, "nbytes": s.nbytes}
                    for n, s in stats.items()
                },
                indent=2,
            )
        )
        return 0
    rows = [("NAME", "DTYPE", "SHAPE", "VERSION", "SIZE")]
    for n, s in stats.items():
        rows.append((n, s.spec.dtype, "x".join(map(str, s.spec.shape)) or "()", str(s.version), format_size(s.nbytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    from tensorwire.serve.daemon.snapshot import write_safetensors

    with _open_client(args) as c:
        st = c.stat(args.name)
        start = c.bytes_moved()
        with Progress(
            f"get {args.name}", st.nbytes, lambda: c.bytes_moved() - start, enabled=_progress_enabled(args, st.nbytes)
        ):
            t = c.get(args.name)
        from tensorwire.buffers import as_bytes

        spec = st.spec if tuple(t.shape) == st.spec.shape else st.spec.__class__(args.name, tuple(t.shape), t.dtype)
        write_safetensors(args.output, [(spec, as_bytes(t))])
    print(f"{args.name}: {spec.describe()} -> {args.output}", file=sys.stderr)
    return 0


def cmd_put(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from tensorwire.errors import ConfigError, NotFoundError
    from tensorwire.serve.daemon.snapshot import read_safetensors_specs

    try:
        specs, _ = read_safetensors_specs(args.file)
    except OSError as exc:
        raise ConfigError(f"{args.file}: {exc.strerror or exc}") from exc
    except Exception as exc:
        raise ConfigError(f"{args.file} is not a readable safetensors file: {exc}") from exc
    keys = [k for _, k in specs]
    key = args.key or (args.name if args.name in keys else (keys[0] if len(keys) == 1 else None))
    if key is None or key not in keys:
        raise NotFoundError(f"{args.file}: pick a tensor with --key (it holds: {', '.join(keys) or 'nothing'})")
    with safe_open(args.file, framework="pt") as f:
        tensor = f.get_tensor(key)
    nbytes = tensor.numel() * tensor.element_size()
    with _open_client(args) as c:
        # TCP counts sent bytes when a send completes: the bar jumps at the end of each transfer.
        start = c.bytes_moved()
        with Progress(
            f"put {args.name}", nbytes, lambda: c.bytes_moved() - start, enabled=_progress_enabled(args, nbytes)
        ):
            st = c.put(args.name, tensor)
    print(f"{args.name}: {st.spec.describe()} version {st.version}", file=sys.stderr)
    return 0


def main(argv: Any = None) -> int:
    """``python -m tensorwire.serve [serve flags]``: the daemon without the rest of the CLI."""
    from tensorwire import errors

    parser = argparse.ArgumentParser(
        prog="python -m tensorwire.serve",
        description="Run the tensorwire daemon.\n\n" + ENV_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR; env TENSORWIRE_LOG_LEVEL"
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    level = (args.log_level or setting("log_level") or "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return cmd_serve(args)
    except KeyboardInterrupt:
        return 130
    except errors.TensorWireError as exc:
        print(f"tensorwire: error: {exc}", file=sys.stderr)
        return 1
