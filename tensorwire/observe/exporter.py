"""The registry of :mod:`.registry` in Prometheus' text format, on a registry and an HTTP endpoint of its own.

:class:`P2PCollector` turns a snapshot into metric families at each scrape (nothing
is counted twice: the flows are the only store). :func:`serve` starts the
endpoint (``prometheus_client``'s server on a registry of its own, as the serve
daemon's metrics do, so the process's default registry is left alone).

Families (label ``peer`` is the peer's rank, ``path`` one of
:data:`tensorwire.observe.registry.PATHS`, ``direction`` ``send`` or ``recv``):

- ``tensorwire_p2p_messages_total{peer,path,direction}``
- ``tensorwire_p2p_bytes_total{peer,path,direction}``
- ``tensorwire_p2p_call_seconds{peer,path,direction}`` (histogram): host time per call
- ``tensorwire_p2p_completion_seconds{peer,path,direction}`` (histogram): post to completion
- ``tensorwire_p2p_negotiations_total{peer,path}``: links set up, by the path chosen
- ``tensorwire_p2p_fallbacks_total{peer,wanted,taken,reason}``
- ``tensorwire_p2p_errors_total{peer,path,kind}``: failures by error class
- ``tensorwire_p2p_slots{peer,path}``, ``tensorwire_p2p_slot_bytes{peer,path}``,
  ``tensorwire_p2p_mapped_bytes{peer,path}``: held now
- ``tensorwire_p2p_ce_messages_total{peer,part}``: this side's copy-engine messages by the part each played
  (``part`` one of :data:`tensorwire.observe.registry.CE_PARTS`)
"""

from __future__ import annotations

import threading
from typing import Any

from tensorwire.errors import ConfigError
from tensorwire.observe.registry import BUCKETS_US, CE_PARTS, REGISTRY, Registry

__all__ = ["P2PCollector", "Exporter", "EXPORTER", "render"]


def _le(us: int) -> str:
    return repr(us / 1e6)


class P2PCollector:
    """A ``prometheus_client`` collector over a :class:`~tensorwire.observe.registry.Registry`."""

    def __init__(self, registry: Registry = REGISTRY) -> None:
        self._registry = registry

    def describe(self) -> list[Any]:
        return []  # families come and go with the flows; nothing to check at registration

    def collect(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = self._registry.snapshot()
        flow_labels = ["peer", "path", "direction"]
        messages = CounterMetricFamily("tensorwire_p2p_messages", "Point-to-point messages", labels=flow_labels)
        nbytes = CounterMetricFamily("tensorwire_p2p_bytes", "Point-to-point payload bytes", labels=flow_labels)
        calls = HistogramMetricFamily(
            "tensorwire_p2p_call_seconds", "Host time per send/recv/isend/irecv call", labels=flow_labels
        )
        done = HistogramMetricFamily(
            "tensorwire_p2p_completion_seconds", "Time from a message's post to its completion", labels=flow_labels
        )
        bounds = [_le(b) for b in BUCKETS_US] + ["+Inf"]
        for f in snap["flows"]:
            values = [f["peer"], f["path"], f["direction"]]
            messages.add_metric(values, f["messages"])
            nbytes.add_metric(values, f["bytes"])
            for fam, counts, total in (
                (calls, f["call_buckets"], f["call_seconds"]),
                (done, f["completion_buckets"], f["completion_seconds"]),
            ):
                acc, buckets = 0, []
                for le, n in zip(bounds, counts):
                    acc += n
                    buckets.append((le, acc))
                fam.add_metric(values, buckets, total)
        negotiations = CounterMetricFamily(
            "tensorwire_p2p_negotiations", "Links set up, by the path chosen", labels=["peer", "path"]
        )
        for e in snap["negotiations"]:
            negotiations.add_metric([e["peer"], e["path"]], e["count"])
        fallbacks = CounterMetricFamily(
            "tensorwire_p2p_fallbacks",
            "Traffic that took a slower path than the preferred one, and why",
            labels=["peer", "wanted", "taken", "reason"],
        )
        for e in snap["fallbacks"]:
            fallbacks.add_metric([e["peer"], e["wanted"], e["taken"], e["reason"]], e["count"])
        errors = CounterMetricFamily(
            "tensorwire_p2p_errors", "Point-to-point failures by error class", labels=["peer", "path", "kind"]
        )
        for e in snap["errors"]:
            errors.add_metric([e["peer"], e["path"], e["kind"]], e["count"])
        slots = GaugeMetricFamily("tensorwire_p2p_slots", "Slots held", labels=["peer", "path"])
        slot_bytes = GaugeMetricFamily("tensorwire_p2p_slot_bytes", "Bytes of the slots held", labels=["peer", "path"])
        mapped = GaugeMetricFamily(
            "tensorwire_p2p_mapped_bytes", "Bytes of peers' memory mapped into this process", labels=["peer", "path"]
        )
        for e in snap["held"]:
            slots.add_metric([e["peer"], e["path"]], e["slots"])
            slot_bytes.add_metric([e["peer"], e["path"]], e["slot_bytes"])
            mapped.add_metric([e["peer"], e["path"]], e["mapped_bytes"])
        ce = CounterMetricFamily(
            "tensorwire_p2p_ce_messages",
            "This side's copy-engine messages by the part each played (who copied, on which stream; large sends "
            "that waited for their receiver)",
            labels=["peer", "part"],
        )
        for e in snap["ce"]:
            for part in CE_PARTS:
                ce.add_metric([e["peer"], part], e[part])
        return [messages, nbytes, calls, done, negotiations, fallbacks, errors, slots, slot_bytes, mapped, ce]


def render(registry: Registry = REGISTRY) -> bytes:
    """The Prometheus text exposition of ``registry`` (what the endpoint serves)."""
    from prometheus_client import CollectorRegistry, generate_latest

    r = CollectorRegistry(auto_describe=False)
    r.register(P2PCollector(registry))
    return bytes(generate_latest(r))


class Exporter:
    """The process's Prometheus endpoint (at most one: :meth:`start` again returns the running one's port)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: Any = None
        self.port: int | None = None

    def start(self, host: str, port: int, registry: Registry = REGISTRY) -> int:
        """Serve ``registry`` on ``host:port`` (0: any free port); returns the bound port.

        Raises:
            ConfigError: the port cannot be bound (in use, no permission).
        """
        with self._lock:
            if self._server is not None:
                assert self.port is not None
                return self.port
            from prometheus_client import CollectorRegistry, start_http_server

            r = CollectorRegistry(auto_describe=False)
            r.register(P2PCollector(registry))
            try:
                res = start_http_server(port, addr=host, registry=r)
            except OSError as exc:
                raise ConfigError(f"cannot serve tensorwire's metrics on {host}:{port}: {exc}") from exc
            server, thread = res if isinstance(res, tuple) else (res, None)
            self._server, self._thread = server, thread
            self.port = int(server.server_port)
            return self.port

    def stop(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            self.port = None
        if server is not None:
            server.shutdown()
            server.server_close()


EXPORTER = Exporter()
