"""``Server``: runs a :class:`~tensorwire.serve.daemon.config.ServeConfig`.

``start()`` restores the snapshot (if any), opens the data listener(s), the
gRPC control plane (token interceptor, TLS, small message limits, health),
and the metrics endpoint, then logs where everything listens. ``stop()``
drains: health goes NOT_SERVING, new work is refused, in-flight transfers get
``drain_timeout`` seconds, the snapshot is written, and everything closes.
``serve_forever()`` does both around SIGTERM/SIGINT (a second SIGINT exits
at once) and prints the ready line (JSON with the bound ports) on stdout.

Exit codes of ``serve_forever()`` (and so of ``tensorwire serve``):
:data:`EXIT_OK` after a clean drain (and a written snapshot, with
``--snapshot-dir``); :data:`EXIT_SNAPSHOT_FAILED` when the shutdown snapshot
could not be written (what was put since the last good snapshot is lost; that
snapshot is whole); :data:`EXIT_SNAPSHOT_UNREADABLE` when the daemon refused
to start because the snapshot it should restore is unreadable or corrupt (the
file is left as it is); 1 for any other error, 130 after a second signal.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any

from tensorwire.errors import ConfigError, SnapshotError
from tensorwire.serve.daemon.config import ServeConfig, format_size
from tensorwire.serve.protocol.common import MAX_MESSAGE_BYTES, SERVICE
from tensorwire.transport.base import new_nonce, get_factory
from tensorwire.transport.select import auto_preference, serve_auto_picks, ucx_has_rdma
from tensorwire.transport.admission import AdmissionLimits
from tensorwire.transport.tcp import TcpListener
from tensorwire.serve.daemon.metrics import Metrics
from tensorwire.serve.daemon.snapshot import restore_snapshot
from tensorwire.serve.daemon.store import Store
from tensorwire.serve.daemon.shm import Registry, unlink_all
from tensorwire.serve.protocol.shm import ShmError
from tensorwire.serve.daemon.limits import raise_nofile
from tensorwire.serve.daemon.threads import describe as describe_threads
from tensorwire import native

if TYPE_CHECKING:  # pragma: no cover
    import grpc

    from tensorwire.transport.base import Listener
    from tensorwire.serve.daemon.service import StoreService

__all__ = ["Server", "choose_listeners", "EXIT_OK", "EXIT_SNAPSHOT_FAILED", "EXIT_SNAPSHOT_UNREADABLE"]

#: A clean drain; with ``--snapshot-dir``, the shutdown snapshot was written.
EXIT_OK = 0
#: The shutdown snapshot failed (disk full, I/O error): the previous snapshot is whole, what came after is lost.
EXIT_SNAPSHOT_FAILED = 3
#: Refused to start: the snapshot to restore is unreadable or fails its checksums (kept for inspection).
EXIT_SNAPSHOT_UNREADABLE = 4

log = logging.getLogger("tensorwire.serve")

_WILDCARDS = ("0.0.0.0", "::", "")


def check_port_free(host: str, port: int) -> None:
    """Raise ConfigError, naming the address and the reason, if the control port cannot be bound now.

    Checked with a socket of our own before gRPC binds it: gRPC logs its own line ("Failed to add port
    to server ...") to stderr before it fails, and the user should read tensorwire's error alone. Port 0
    (any free port) always binds. gRPC's listener has SO_REUSEADDR and no SO_REUSEPORT; so has this one.
    """
    if not port:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {_hostport(host, port)}: {host!r} does not resolve ({exc})") from exc
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    why = "the port is in use (another tensorwire serve? pick another --port, or 0 for any)"
                elif exc.errno == errno.EADDRNOTAVAIL:
                    why = "that is not an address of this host"
                elif exc.errno == errno.EACCES:
                    why = "permission denied (ports below 1024 need privileges)"
                else:
                    why = exc.strerror or str(exc)
                raise ConfigError(f"cannot listen on {_hostport(host, port)}: {why}") from exc


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _self_test(factory: Any, listener: "Listener", host: str, timeout: float = 5.0) -> None:
    """Connect to ``listener`` over loopback and accept: proves the transport works here."""
    nonce = new_nonce()
    listener.expect(nonce)
    lhost, port = listener.address
    dial = "127.0.0.1" if lhost in _WILDCARDS else lhost
    out: dict[str, Any] = {}

    def dial_out() -> None:
        try:
            out["t"] = factory.connect(dial, port, nonce, timeout=timeout)
        except BaseException as exc:  # noqa: BLE001
            out["e"] = exc

    th = threading.Thread(target=dial_out, daemon=True)
    th.start()
    try:
        accepted = listener.accept(nonce, timeout=timeout)
        accepted.close()
    finally:
        th.join(timeout)
        if "t" in out:
            out["t"].close()
    if "e" in out:
        raise out["e"]


def choose_listeners(config: ServeConfig) -> tuple[dict[str, "Listener"], str]:
    """Open the data listener(s) for ``config.transport``. Returns ({kind: listener}, primary kind).

    ``auto``: both listeners when UCX imports and a loopback self-test connects
    (otherwise TCP alone, with a WARNING); clients asking ``auto`` get UCX when
    they share this machine and IPC namespace (shared memory, cma, cuda_ipc),
    or with an RDMA device (or TENSORWIRE_AUTO_PREFER=ucx), and TCP otherwise
    — the same rule as links (tensorwire.transport.select.choose_transport).
    ``ucx``: UCX or a ConfigError. ``tcp``: TCP only.
    """
    listeners: dict[str, "Listener"] = {}
    if config.transport in ("auto", "ucx"):
        listener = None
        try:
            factory = get_factory("ucx")
            # Clients are not trusted: no shared-memory / cma / cuda_ipc transport, UCX peer error
            # handling on every endpoint, worker addresses unpacked in a sandbox first (transport.ucx).
            listener = factory(config.host, port=config.data_port, untrusted=True)  # type: ignore[call-arg]  # UcxListener only
            _self_test(factory, listener, config.host)
            listeners["ucx"] = listener
        except Exception as exc:
            if listener is not None:
                try:
                    listener.close()
                except Exception:  # noqa: BLE001
                    pass
            if config.transport == "ucx":
                raise ConfigError(f"--transport ucx: UCX is not usable here: {exc}") from exc
            log.warning("transport auto: UCX is not usable here (%s: %s); using TCP", type(exc).__name__, exc)
    if config.transport != "ucx":
        port = config.data_port
        if listeners and port:
            port += 1  # the UCX listener took data_port
        elif listeners:
            port = 0
        try:
            limits = AdmissionLimits(
                hello_timeout=config.hello_timeout,
                total=config.max_pending_connections,
                per_peer=config.max_pending_per_peer,
            )
            listeners["tcp"] = TcpListener(config.host, port=port, limits=limits)
        except OSError as exc:
            for lst in listeners.values():
                lst.close()
            raise ConfigError(f"cannot listen for data on {_hostport(config.host, port)}: {exc}") from exc
    primary = "ucx" if "ucx" in listeners and (config.transport == "ucx" or _ucx_first()) else "tcp"
    if config.transport == "auto":
        picks = serve_auto_picks(list(listeners))
        log.info(
            "transport auto: %s for clients on this host (untrusted: UCX with peer error handling, no shared "
            "memory or cma; shared-memory segments where --shm keeps tensors there), %s for remote ones",
            picks.same_host,
            picks.other_host,
        )
    return listeners, primary


def _ucx_first() -> bool:
    """Under auto, UCX is the default only where it beats a socket: an RDMA device, or when asked."""
    pref = auto_preference()
    return pref == "ucx" or (pref != "tcp" and ucx_has_rdma())


class Server:
    """The tensorwire serve daemon (see the module docstring).

    Usable as a context manager (``start`` / ``stop``).
    """

    def __init__(self, config: ServeConfig) -> None:
        if not isinstance(config, ServeConfig):
            raise ConfigError("Server needs a ServeConfig")
        self.config = config
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.service: "StoreService | None" = None
        self.restored = 0
        self._grpc: "grpc.Server | None" = None
        self._health: Any = None
        self._listeners: dict[str, "Listener"] = {}
        self._primary = ""
        self._metrics: Any = None
        self._started = False
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self._store: Any = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> "Server":
        import grpc
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from tensorwire.v1 import store_pb2_grpc
        from tensorwire.serve.daemon.auth import TokenAuthInterceptor
        from tensorwire.serve.daemon.service import StoreService

        import torch

        cfg = self.config
        if self._started:
            raise ConfigError("server already started")
        self._started = True
        torch.empty(1).zero_()  # load torch now: "ready" means the first request is not slow

        nofile = raise_nofile()  # floods meet the listeners' caps, which answer, before the kernel's
        log.debug("file descriptor limit: %d", nofile)
        token = cfg.load_token()
        if cfg.token_file:
            mode = os.stat(cfg.token_file).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                log.warning("token file %s is readable by group/others; chmod 600 it", cfg.token_file)
        if not cfg.loopback and cfg.tls and not cfg.mtls and not token:
            log.warning(
                "TLS without --tls-ca or a token: the connection is encrypted but clients are not authenticated"
            )
        if not cfg.loopback and cfg.insecure and not (token or cfg.tls):
            log.warning("--insecure: serving %s without any authentication", cfg.host)

        self._metrics = metrics = Metrics()
        shm = None
        if cfg.shm:
            try:
                shm = Registry(on_change=metrics.shm_changed)
            except ShmError as exc:
                log.warning("shared memory is not usable here (%s); clients on this host use the data connection", exc)
        self._store = store = Store(cfg.max_bytes, metrics, shm=shm)
        try:
            if cfg.snapshot_dir:
                os.makedirs(cfg.snapshot_dir, exist_ok=True)
                self.restored = restore_snapshot(store, cfg.snapshot_dir)
            check_port_free(cfg.host, cfg.port)  # (before anything else binds or logs)
            self._listeners, self._primary = choose_listeners(cfg)
        except BaseException:
            store.close()
            raise
        try:
            service = StoreService(cfg, store, self._listeners, self._primary, metrics)
            self.service = service
            interceptors = [TokenAuthInterceptor(token, metrics)] if token else []
            options = [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ]
            server = grpc.server(
                futures.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="tensorwire-rpc"),
                interceptors=interceptors,
                options=options,
                maximum_concurrent_rpcs=cfg.workers * 8,
            )
            store_pb2_grpc.add_StoreServicer_to_server(service, server)
            self._health = health.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
            addr = _hostport(cfg.host, cfg.port)
            if cfg.tls:
                with open(cfg.tls_key, "rb") as f:  # type: ignore[arg-type]
                    key = f.read()
                with open(cfg.tls_cert, "rb") as f:  # type: ignore[arg-type]
                    cert = f.read()
                ca = None
                if cfg.tls_ca:
                    with open(cfg.tls_ca, "rb") as f:
                        ca = f.read()
                creds = grpc.ssl_server_credentials(
                    [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
                )
                add = lambda: server.add_secure_port(addr, creds)  # noqa: E731
            else:
                add = lambda: server.add_insecure_port(addr)  # noqa: E731
            try:
                port = add()
            except RuntimeError as exc:  # grpc's "Failed to bind"
                raise ConfigError(
                    f"cannot listen on {addr}: the port is in use, or not an address of this host"
                ) from exc
            if not port:
                raise ConfigError(f"cannot listen on {addr} (in use, or not an address of this host)")
            self.port = port
            service.port = port
            server.start()
            self._grpc = server
            for svc in ("", SERVICE):
                self._health.set(svc, health_pb2.HealthCheckResponse.SERVING)
            if cfg.metrics_port is not None:
                try:
                    self.metrics_port = metrics.serve(cfg.host, cfg.metrics_port)
                except OSError as exc:
                    raise ConfigError(
                        f"cannot serve metrics on {_hostport(cfg.host, cfg.metrics_port)}: {exc}"
                    ) from exc
        except BaseException:
            self._teardown()
            raise
        self._reaper = threading.Thread(target=self._reap_loop, name="tensorwire-reaper", daemon=True)
        self._reaper.start()
        self._log_ready(token is not None)
        return self

    def _log_ready(self, has_token: bool) -> None:
        cfg = self.config
        sec = "mTLS" if cfg.mtls else ("TLS" if cfg.tls else "plaintext")
        auth = "token" if has_token else ("client certificates" if cfg.mtls else "none")
        log.info("control plane (gRPC, %s, auth: %s) listening on %s", sec, auth, _hostport(cfg.host, self.port or 0))
        picks = serve_auto_picks(list(self._listeners)) if cfg.transport == "auto" else None
        for kind, lst in self._listeners.items():
            h, p = lst.address
            who = (
                []
                if picks is None
                else ["this host"] * (kind == picks.same_host) + ["remote"] * (kind == picks.other_host)
            )
            log.info(
                "data plane: %s listening on %s (%s)",
                kind,
                _hostport(h, p),
                f"auto: {' and '.join(who)} clients"
                if who
                else ("every client" if len(self._listeners) == 1 else "clients that ask for it"),
            )
        log.info("transport: %s (asked for %s)", self._primary, cfg.transport)
        log.info("%s", describe_threads())
        log.info("hot path: %s (tensorwire.native)", native.summary())
        if self._store is not None and self._store.shm is not None:
            log.info(
                "shared memory: tensors in %s/%s-*; clients on this host that map them copy directly",
                self._store.shm.directory,
                self._store.shm.prefix,
            )
        elif cfg.shm is False:
            log.info("shared memory: off (--no-shm)")
        if cfg.tls:
            log.info(
                "note: TLS covers the control plane; data connections are authenticated by a per-session nonce, not encrypted"
            )
        if self.metrics_port is not None:
            log.info("metrics on http://%s/metrics", _hostport(cfg.host, self.metrics_port))
        log.info(
            "store: max %s reserved (tensors reserve 2x: double buffer); snapshot dir %s%s",
            format_size(cfg.max_bytes),
            cfg.snapshot_dir or "(none)",
            f", restored {self.restored} tensors" if cfg.snapshot_dir else "",
        )

    def ready_info(self) -> dict[str, Any]:
        """What the ready line says: bound ports and transports."""
        cfg = self.config
        return {
            "event": "ready",
            "pid": os.getpid(),
            "host": cfg.host,
            "port": self.port,
            "control": _hostport(cfg.host, self.port or 0),
            "transport": self._primary,
            "data": [{"kind": k, "host": lst.address[0], "port": lst.address[1]} for k, lst in self._listeners.items()],
            "metrics_port": self.metrics_port,
            "tls": cfg.tls,
            "mtls": cfg.mtls,
            "token": bool(cfg.token_file),
            "snapshot_dir": cfg.snapshot_dir,
            "restored": self.restored,
            "shm": self._store is not None and self._store.shm is not None,
        }

    @property
    def address(self) -> str:
        """``host:port`` of the control plane (loopback when bound to a wildcard)."""
        host = self.config.host
        if host in _WILDCARDS:
            host = "127.0.0.1"
        return _hostport(host, self.port or 0)

    def _reap_loop(self) -> None:
        while not self._stopped.wait(5.0):
            svc = self.service
            if svc is not None:
                try:
                    svc.reap(self.config.session_idle_timeout)
                except Exception:
                    log.exception("session reaper failed")
            for lst in self._listeners.values():
                rejected = getattr(lst, "rejected", None)
                if isinstance(rejected, int) and self._metrics is not None:
                    c = self._metrics.rejected
                    done = getattr(self, "_rejected_seen", 0)
                    if rejected > done:
                        c.inc(rejected - done)
                        self._rejected_seen = rejected

    def snapshot(self):
        """Write a snapshot now (needs ``snapshot_dir``)."""
        if self.service is None:
            raise ConfigError("server not started")
        return self.service.snapshot()

    def drain(self) -> None:
        """Stop taking new work: health NOT_SERVING, new calls refused."""
        if self.service is not None:
            self.service.draining = True
        if self._health is not None:
            self._health.enter_graceful_shutdown()

    def stop(self, timeout: float | None = None) -> None:
        """Drain, wait for in-flight transfers (bounded), snapshot, close. Idempotent.

        Raises:
            SnapshotError: the shutdown snapshot failed (raised once everything is closed; the previous
                snapshot is whole, what was put since is lost).
        """
        failed: SnapshotError | None = None
        with self._stop_lock:
            if self._stopped.is_set() or not self._started:
                self._stopped.set()
                return
            timeout = self.config.drain_timeout if timeout is None else timeout
            log.info("draining (up to %.0fs for in-flight transfers)", timeout)
            self.drain()
            svc = self.service
            deadline = time.monotonic() + timeout
            if svc is not None:
                while svc.busy() and time.monotonic() < deadline:
                    time.sleep(0.05)
                left = svc.busy()
                if left:
                    log.warning("drain: %d transfers still in flight after %.0fs; abandoning them", left, timeout)
                if self.config.snapshot_dir:
                    try:
                        svc.snapshot()
                    except Exception as exc:  # noqa: BLE001 - close everything first, then raise
                        log.error(
                            "snapshot on shutdown failed: %s; the previous snapshot is kept, what was put "
                            "since it is lost",
                            exc,
                        )
                        failed = exc if isinstance(exc, SnapshotError) else SnapshotError(f"shutdown snapshot: {exc}")
                        if failed is not exc:
                            failed.__cause__ = exc
            self._teardown()
            self._stopped.set()
            log.info("stopped")
        if failed is not None:
            raise failed

    def _teardown(self) -> None:
        if self.service is not None:
            self.service.close_all("server shutting down")
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait(5.0)
            self._grpc = None
        for lst in self._listeners.values():
            try:
                lst.close()
            except Exception:  # noqa: BLE001
                pass
        if self._metrics is not None:
            self._metrics.close()
        if self._store is not None:
            self._store.close()  # unlink every shared-memory region

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- foreground ---------------------------------------------------------------------
    def serve_forever(self, *, ready_stream=None) -> int:
        """Run until SIGTERM/SIGINT; returns the exit code (see the module docstring).

        Prints the ready JSON as one line on ``ready_stream`` (stdout) and to
        ``config.ready_file`` if set. A second SIGINT/SIGTERM exits at once (130).
        """
        stop = threading.Event()
        hits = [0]

        def on_signal(signum: int, frame: Any) -> None:
            hits[0] += 1
            if hits[0] == 1:
                log.warning("%s: shutting down gracefully (again to force)", signal.Signals(signum).name)
                stop.set()
            else:
                log.error("%s again: exiting now", signal.Signals(signum).name)

                unlink_all()  # os._exit skips atexit: leave nothing in /dev/shm
                os._exit(130)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                self.start()
            except SnapshotError as exc:
                log.error("refusing to start: %s", exc)
                return EXIT_SNAPSHOT_UNREADABLE
            info = json.dumps(self.ready_info())
            if self.config.ready_file:  # first, so whoever reads the line finds the file too
                tmp = self.config.ready_file + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(info + "\n")
                os.replace(tmp, self.config.ready_file)
            stream = sys.stdout if ready_stream is None else ready_stream
            print(info, file=stream, flush=True)
            while not stop.wait(0.5):
                pass
            try:
                self.stop()
            except SnapshotError:
                return EXIT_SNAPSHOT_FAILED  # logged by stop()
            return EXIT_OK
        finally:
            for s, h in old.items():
                signal.signal(s, h)
