"""Where the bytes go: counts, latencies, profiler ranges and a Prometheus endpoint for links and the backend.

Three ways to read the same counts (:mod:`.registry`):

- :func:`metrics`: a plain dict, for logging from a training loop::

      m = tw.metrics()
      m["totals"]["send"]            # {"messages": ..., "bytes": ...}
      m["flows"]                     # per peer, path and direction
      m["fallbacks"], m["errors"]

- a Prometheus endpoint per rank, opt-in: ``TENSORWIRE_METRICS_PORT`` (plus
  the local rank under torchrun), started by the first :class:`~tensorwire.Node`
  of the process (:func:`start_endpoint`); names in :mod:`.exporter` and
  ``docs/operations.md``;
- one summary line per node when it closes, with ``TENSORWIRE_LOG=info``
  (:func:`log_summary`).

Profiler ranges (``torch.profiler``) and the hooks links and the backend call
are in :mod:`.hooks`. Counting is on unless ``TENSORWIRE_METRICS=0``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from tensorwire.observe.exporter import EXPORTER, P2PCollector, render
from tensorwire.observe.hooks import GroupWatch, LinkWatch, profiler_flag, profiling, traced_wait
from tensorwire.observe.registry import (
    CE_PARTS,
    PATHS,
    REGISTRY,
    enabled,
    sample_every,
    set_enabled,
    set_sample_every,
)
from tensorwire.settings import setting

__all__ = [
    "metrics",
    "reset",
    "enabled",
    "set_enabled",
    "sample_every",
    "set_sample_every",
    "profiling",
    "profiler_flag",
    "start_endpoint",
    "stop_endpoint",
    "endpoint_port",
    "render",
    "summary",
    "log_summary",
    "note_negotiated",
    "note_fallback",
    "note_error",
    "ce_counts",
    "CE_PARTS",
    "P2PCollector",
    "LinkWatch",
    "GroupWatch",
    "traced_wait",
    "PATHS",
]

log = logging.getLogger(__name__)


def metrics() -> dict[str, Any]:
    """This process's point-to-point counts as plain data (``tw.metrics()``).

    Keys: ``flows`` (one dict per peer, path and direction: ``messages``, ``bytes`` and ``completed``, every
    message; ``call_seconds`` and ``completion_seconds`` with their bucket counts, of the ``timed`` messages:
    one in :func:`sample_every` of each route, see :mod:`.registry`),
    ``negotiations``, ``fallbacks`` (``wanted``, ``taken``, ``reason``), ``errors``
    (``kind``: the error's class), ``held`` (``slots``, ``slot_bytes``, ``mapped_bytes``),
    ``ce`` (per peer on the copy-engine path, how many of this side's messages played each part of
    :data:`CE_PARTS`: came first, came second and copied on the caller's stream or on an internal stream, a
    large send whose receiver came while it waited, did not, or that stopped because the peer waited in a send
    too), ``totals``
    (``{"send"|"recv": {"messages", "bytes"}}``) and ``enabled``.
    """
    snap = REGISTRY.snapshot()
    totals = {d: {"messages": 0, "bytes": 0} for d in ("send", "recv")}
    for f in snap["flows"]:
        t = totals.setdefault(f["direction"], {"messages": 0, "bytes": 0})
        t["messages"] += f["messages"]
        t["bytes"] += f["bytes"]
    snap["totals"] = totals
    snap["enabled"] = enabled()
    return snap


def reset() -> None:
    """Zero every count of this process (tests, or a fresh start of a measured phase)."""
    REGISTRY.clear()


def ce_counts(peer: int) -> list[int]:
    """The counts a copy-engine pair with ``peer`` keeps in place (``CePair.counts``; :data:`CE_PARTS`)."""
    return REGISTRY.ce_counts(peer)


def note_negotiated(peer: int, path: str) -> None:
    """A link with ``peer`` was set up on ``path`` (called where links are negotiated)."""
    REGISTRY.negotiated(peer, path)


def note_fallback(peer: int | str, wanted: str, taken: str, reason: str) -> None:
    """Traffic to ``peer`` takes ``taken`` instead of ``wanted`` because of ``reason`` (a snake_case label)."""
    REGISTRY.fell_back(peer, wanted, taken, reason)


def note_error(peer: int | str, path: str, exc: BaseException) -> None:
    REGISTRY.error(peer, path, exc)


def start_endpoint(host: str, *, environ: Any = None) -> int | None:
    """Start the Prometheus endpoint if ``TENSORWIRE_METRICS_PORT`` asks for it: that port plus ``LOCAL_RANK``
    (torchrun's; 0 without it), or any free port for 0. Returns the bound port, or None when not asked for.
    One endpoint per process: later calls return its port.

    Raises:
        ConfigError: the variable is invalid, or the port cannot be bound.
    """
    base = setting("metrics_port", environ)
    if base is None:
        return None
    env = os.environ if environ is None else environ
    local = int(env.get("LOCAL_RANK", "0") or 0)
    port = base + local if base else 0
    bound = EXPORTER.start(host, port)
    log.info("tensorwire: point-to-point metrics on http://%s:%d/metrics", host, bound)
    return bound


def endpoint_port() -> int | None:
    """The port of the running endpoint, or None."""
    return EXPORTER.port


def stop_endpoint() -> None:
    EXPORTER.stop()


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def summary(rank: int | None = None) -> str:
    """One line: messages and bytes by direction, peer and path; negotiations, fallbacks and errors; the parts
    copy-engine messages played, per peer."""
    m = metrics()
    parts = []
    for d in ("send", "recv"):
        t = m["totals"][d]
        per = sorted(
            (f for f in m["flows"] if f["direction"] == d and f["messages"]), key=lambda f: (f["peer"], f["path"])
        )
        detail = ", ".join(
            f"{f['path']}->{f['peer']} {f['messages']}"
            + (f" ({f['call_seconds'] / f['timed'] * 1e6:.0f} us/call)" if f["timed"] else "")
            for f in per
        )
        parts.append(f"{d} {t['messages']} msgs {_size(t['bytes'])}" + (f" [{detail}]" if detail else ""))
    links = ", ".join(f"{e['path']}->{e['peer']} x{e['count']}" for e in m["negotiations"]) or "none"
    falls = (
        ", ".join(f"{e['wanted']}->{e['taken']} to {e['peer']} ({e['reason']}) x{e['count']}" for e in m["fallbacks"])
        or "none"
    )
    errors = ", ".join(f"{e['kind']} on {e['path']}->{e['peer']} x{e['count']}" for e in m["errors"]) or "none"
    ce = "".join(
        f"; copy engine ->{e['peer']}: first {e['first']}, second {e['second_inline'] + e['second_queued']} "
        f"({e['second_queued']} on an internal stream), large sends pushed after a wait {e['push_waited']}, "
        f"waited in vain {e['push_wait_missed']}, stopped for the peer's own wait {e['push_wait_crossed']}"
        for e in sorted(m["ce"], key=lambda e: e["peer"])
    )
    who = f" rank {rank}" if rank is not None else ""
    return f"tensorwire{who}: {'; '.join(parts)}; links: {links}; fallbacks: {falls}; errors: {errors}{ce}"


def log_summary(rank: int | None = None) -> None:
    """With ``TENSORWIRE_LOG=info``: log :func:`summary` at INFO on this module's logger, or write it to stderr
    when logging is not configured (no handler would show it)."""
    if setting("log") != "info":
        return
    line = summary(rank)
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", line)
    else:
        sys.stderr.write(line + "\n")
