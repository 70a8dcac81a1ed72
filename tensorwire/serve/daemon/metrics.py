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

Data-plane operations are counted without a lock or a label look-up: each
session keeps a :class:`Tally` (written only by the thread running its job,
one at a time) that is folded into the families above at each scrape and when
the session ends (on the 2-core VM the prometheus_client calls of one request
cost ~15 µs of the daemon's CPU; a tally ~1 µs). The two latency histograms
are this module's own (:class:`_Histogram`: prometheus_client has no way to
add a tally's bucket counts); they are exposed as prometheus_client's would be,
without the ``_created`` samples.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Any

__all__ = ["Metrics", "Tally"]

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
#: Buckets of a latency histogram: one per bound, then +Inf.
_NBUCKETS = len(_LATENCY_BUCKETS) + 1


class Tally:
    """One session's data-plane counts (see the module docstring): only growth is ever folded.

    ``ops``: (op, status) -> [count, seconds, bucket counts...];
    ``transfers``: (transport, direction) -> [count, bytes, seconds, bucket counts...].
    """

    __slots__ = ("ops", "transfers", "_seen")

    def __init__(self) -> None:
        self.ops: dict[tuple[str, str], list[Any]] = {}
        self.transfers: dict[tuple[str, str], list[Any]] = {}
        self._seen: dict[tuple[str, str, str], list[Any]] = {}

    def op(self, op: str, status: str, seconds: float) -> None:
        c = self.ops.get((op, status))
        if c is None:
            c = self.ops[(op, status)] = [0, 0.0] + [0] * _NBUCKETS
        c[0] += 1
        c[1] += seconds
        c[2 + bisect_left(_LATENCY_BUCKETS, seconds)] += 1

    def transfer(self, transport: str, direction: str, nbytes: int, seconds: float) -> None:
        c = self.transfers.get((transport, direction))
        if c is None:
            c = self.transfers[(transport, direction)] = [0, 0, 0.0] + [0] * _NBUCKETS
        c[0] += 1
        c[1] += nbytes
        c[2] += seconds
        c[3 + bisect_left(_LATENCY_BUCKETS, seconds)] += 1

    def _delta(self, kind: str, key: tuple[str, str], cell: list[Any]) -> list[Any]:
        """What ``cell`` grew by since the last fold (and remember it)."""
        now = list(cell)  # one C call: a consistent copy of each element
        seen = self._seen.get((kind, *key))
        self._seen[(kind, *key)] = now
        return now if seen is None else [max(0, a - b) for a, b in zip(now, seen)]


class _HistogramChild:
    __slots__ = ("_lock", "counts", "total")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = [0] * _NBUCKETS
        self.total = 0.0

    def observe(self, amount: float) -> None:
        with self._lock:
            self.counts[bisect_left(_LATENCY_BUCKETS, amount)] += 1
            self.total += amount

    def add(self, counts: list[int], total: float) -> None:
        with self._lock:
            for i, n in enumerate(counts):
                self.counts[i] += n
            self.total += total


class _Histogram:
    """A labelled latency histogram (``labels(...).observe(seconds)``), exposed as prometheus_client's Histogram."""

    def __init__(self, name: str, documentation: str, labelnames: list[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._children: dict[tuple[str, ...], _HistogramChild] = {}
        self._lock = threading.Lock()

    def labels(self, *values: str) -> _HistogramChild:
        c = self._children.get(values)
        if c is None:
            with self._lock:
                c = self._children.setdefault(tuple(str(v) for v in values), _HistogramChild())
        return c

    def describe(self) -> list[Any]:
        from prometheus_client.core import HistogramMetricFamily

        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> list[Any]:
        from prometheus_client.core import HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        fam = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            children = list(self._children.items())
        bounds = [floatToGoString(b) for b in _LATENCY_BUCKETS] + ["+Inf"]
        for values, child in children:
            with child._lock:
                counts, total = list(child.counts), child.total
            acc, buckets = 0, []
            for le, n in zip(bounds, counts):
                acc += n
                buckets.append((le, acc))
            fam.add_metric(list(values), buckets, total)
        return [fam]


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
        from prometheus_client import CollectorRegistry, Counter, Gauge

        r = self.registry = CollectorRegistry(auto_describe=True)
        self._before: list[Any] = []
        r.register(_BeforeCollect(self._before))  # first: it runs before the counters are read
        self.bytes = Counter("tensorwire_bytes", "Data-plane payload bytes", ["transport", "direction"], registry=r)
        self.transfers = Counter("tensorwire_transfers", "Data-plane transfers", ["transport", "direction"], registry=r)
        self.transfer_seconds = _Histogram(
            "tensorwire_transfer_seconds", "Data-plane transfer latency", ["transport", "direction"]
        )
        r.register(self.transfer_seconds)
        self.operations = Counter("tensorwire_operations", "Control calls by outcome", ["op", "status"], registry=r)
        self.operation_seconds = _Histogram("tensorwire_operation_seconds", "Control call latency", ["op"])
        r.register(self.operation_seconds)
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
        self._fold_lock = threading.Lock()

    def before_collect(self, fn: Any) -> None:
        """Call ``fn()`` before each scrape (it folds counts the daemon learns only then: lease reads)."""
        self._before.append(fn)

    def fold(self, tally: Tally) -> None:
        """Add what ``tally`` counted since its last fold (a scrape, or its session's end)."""
        with self._fold_lock:
            for key, cell in list(tally.ops.items()):
                d = tally._delta("op", key, cell)
                if d[0]:
                    self.operations.labels(*key).inc(d[0])
                if any(d[2:]):
                    self.operation_seconds.labels(key[0]).add(d[2:], d[1])
            for key, cell in list(tally.transfers.items()):
                d = tally._delta("transfer", key, cell)
                if d[0]:
                    self.transfers.labels(*key).inc(d[0])
                if d[1]:
                    self.bytes.labels(*key).inc(d[1])
                if any(d[3:]):
                    self.transfer_seconds.labels(*key).add(d[3:], d[2])

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
