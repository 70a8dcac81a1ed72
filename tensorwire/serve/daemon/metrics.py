"""Prometheus metrics of the serve daemon, on a registry of their own.

Names (all ``tensorwire_*``):

- ``tensorwire_bytes_total{transport,direction}``: data-plane payload bytes
  (direction ``in`` = client -> server).
- ``tensorwire_transfers_total{transport,direction}`` and
  ``tensorwire_transfer_seconds{transport,direction}`` (histogram).
- ``tensorwire_operations_total{op,status}`` and ``tensorwire_operation_seconds{op}``
  (histogram): every control call, by outcome (``ok`` or a gRPC status name).
- ``tensorwire_errors_total{kind}``: failures by tensorwire error class.
- ``tensorwire_tensors``, ``tensorwire_slots``: names held, slots allocated.
- ``tensorwire_memory_bytes`` (allocated), ``tensorwire_reserved_bytes``
  (charged against the limit), ``tensorwire_max_bytes``; ``tensorwire_session_buffer_bytes``: the part of
  the reserved bytes that sessions' row and request buffers hold (freed when a session closes).
- ``tensorwire_shm_regions``, ``tensorwire_shm_bytes``: shared-memory regions
  under ``/dev/shm`` (slots, session scratch and hello regions) and their bytes.
  Bytes clients copied through them count in ``tensorwire_bytes_total`` with
  ``transport="shm"`` -- reads a client served from a read lease too (it counts
  them in its session's page; they are added at each scrape and when the
  session closes).
- ``tensorwire_sessions``, ``tensorwire_inflight_transfers``,
  ``tensorwire_rejected_connections_total``, ``tensorwire_snapshots_total{status}``.

Tensor names are never labels (unbounded cardinality).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _BeforeCollect:
    """A collector of nothing that runs hooks first thing in each collection."""

    def __init__(self, hooks: list[Any]) -> None:
        self._hooks = hooks

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        for fn in list(self._hooks):
            try:
                fn()
            except Exception:
                import logging

                logging.getLogger(__name__).exception("a metrics hook failed")
        return []


class Metrics:
    """The daemon's metrics; ``registry`` is private to this instance."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry(auto_describe=True)
        self._before: list[Any] = []
        r.register(_BeforeCollect(self._before))  # first: it runs before the counters are read
        self.bytes = Counter("tensorwire_bytes", "Data-plane payload bytes", ["transport", "direction"], registry=r)
        self.transfers = Counter("tensorwire_transfers", "Data-plane transfers", ["transport", "direction"], registry=r)
        self.transfer_seconds = Histogram(
            "tensorwire_transfer_seconds",
            "Data-plane transfer latency",
            ["transport", "direction"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.operations = Counter("tensorwire_operations", "Control calls by outcome", ["op", "status"], registry=r)
        self.operation_seconds = Histogram(
            "tensorwire_operation_seconds", "Control call latency", ["op"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.errors = Counter("tensorwire_errors", "Failures by error class", ["kind"], registry=r)
        self.tensors = Gauge("tensorwire_tensors", "Tensors held", registry=r)
        self.slots = Gauge("tensorwire_slots", "Slots allocated", registry=r)
        self.memory = Gauge("tensorwire_memory_bytes", "Bytes of slots allocated", registry=r)
        self.reserved = Gauge("tensorwire_reserved_bytes", "Bytes reserved against --max-bytes", registry=r)
        self.max_bytes = Gauge("tensorwire_max_bytes", "The --max-bytes limit", registry=r)
        self.session_buffers = Gauge(
            "tensorwire_session_buffer_bytes",
            "Bytes of sessions' row and request buffers (part of the reserved bytes)",
            registry=r,
        )
        self.sessions = Gauge("tensorwire_sessions", "Open client sessions", registry=r)
        self.inflight = Gauge("tensorwire_inflight_transfers", "Transfers scheduled or running", registry=r)
        self.rejected = Counter(
            "tensorwire_rejected_connections", "Data connections dropped (bad credential or garbage)", registry=r
        )
        self.snapshots = Counter("tensorwire_snapshots", "Snapshots written", ["status"], registry=r)
        self.shm_regions = Gauge("tensorwire_shm_regions", "Shared-memory regions under /dev/shm", registry=r)
        self.shm_bytes = Gauge("tensorwire_shm_bytes", "Bytes of shared-memory regions", registry=r)
        self._http: Any = None
        self.port: int | None = None

    def before_collect(self, fn: Any) -> None:
        """Call ``fn()`` before each scrape (it folds counts the daemon learns only then: lease reads)."""
        self._before.append(fn)

    def shm_changed(self, regions: int, nbytes: int) -> None:
        self.shm_regions.set(regions)
        self.shm_bytes.set(nbytes)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port."""
        from prometheus_client import start_http_server

        res = start_http_server(port, addr=host, registry=self.registry)
        server = res[0] if isinstance(res, tuple) else res
        self._http = server
        self.port = int(server.server_port) if server is not None and hasattr(server, "server_port") else port
        return self.port

    def close(self) -> None:
        if self._http is not None:
            try:
                self._http.shutdown()
                self._http.server_close()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._http = None

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
