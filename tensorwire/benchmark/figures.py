"""Turn raw pair results into figures, per-size ratios and target verdicts (:func:`summarize`).

Figures per backend and size:

- ``uni_GBps``: bytes of a batch / its time, median of the batches;
- ``rtt_p50_us`` / ``rtt_p99_us``: round trip (send + small ack);
- ``rtt_GBps``: size / median round trip (the ANCHORS figure);
- ``first_us`` and ``first_x``: the first transfer on fresh buffers, and its
  ratio to the median round trip (registration / page-fault cost);
- ``wakeups_per_rtt``: voluntary context switches per round trip, both
  processes together (each is one thread going to sleep, so one wake-up);
- ``cpu_us_per_rtt``: user+system CPU per round trip, both processes (robust
  to other load on the cores; a spinning backend's waiting shows up here).

Ratios use, per size, the best tensorwire transport, the best gRPC variant
and the best *peer* (every backend that is not tensorwire).

:mod:`tensorwire.benchmark.report` renders what :func:`summarize` returns.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

from tensorwire.benchmark.backends import GRPC, is_tensorwire
from tensorwire.benchmark.config import format_size

__all__ = ["summarize", "TARGETS", "MiB"]

MiB = 1 << 20

#: (id, description) of the targets the bench reports on.
TARGETS = (
    ("T1", "throughput >= 5x gRPC at every size >= 16 MiB (best tensorwire transport; each gRPC variant)"),
    ("T2", "4 KiB round trip >= 10x lower than the best gRPC (best tensorwire transport)"),
    ("T3", ">= 0.9x the raw TCP socket at every size >= 1 MiB (faster tensorwire transport)"),
    ("T4", "transport=auto picks the faster tensorwire transport by itself"),
)


def _pct(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of a sorted list."""
    if not sorted_xs:
        return math.nan
    k = max(0, min(len(sorted_xs) - 1, math.ceil(q * len(sorted_xs)) - 1))
    return sorted_xs[k]


def _backend_rows(res: dict[str, Any]) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    snd = res.get("sender") or {}
    rcv = (res.get("receiver") or {}).get("switches_per_rtt", {})
    rcv_cpu = (res.get("receiver") or {}).get("cpu_s_per_rtt", {})
    for e in snd.get("sizes", []):
        size = e["size"]
        row: dict[str, float] = {"first_us": e["first_s"] * 1e6}
        if "uni" in e:
            rates = [e["uni"]["batch"] * size / s / 1e9 for s in e["uni"]["seconds"] if s > 0]
            row["uni_GBps"] = statistics.median(rates) if rates else math.nan
            row["uni_GBps_max"] = max(rates) if rates else math.nan
        if "rtt" in e:
            xs = sorted(e["rtt"]["seconds"])
            p50 = statistics.median(xs)
            row["rtt_p50_us"] = p50 * 1e6
            row["rtt_p99_us"] = _pct(xs, 0.99) * 1e6
            row["rtt_GBps"] = size / p50 / 1e9
            row["rtt_n"] = len(xs)
            row["first_x"] = e["first_s"] / p50
            sw = e["rtt"].get("switches_per_rtt")
            if sw is not None:
                row["wakeups_per_rtt"] = sw + float(rcv.get(str(size), 0.0))
            cpu = e["rtt"].get("cpu_s_per_rtt")
            if cpu is not None:
                row["cpu_us_per_rtt"] = (cpu + float(rcv_cpu.get(str(size), 0.0))) * 1e6
        rows[size] = row
    return rows


def _best(
    rows: dict[str, dict[int, dict[str, float]]], names: Iterable[str], size: int, key: str, *, low: bool = False
) -> tuple[str | None, float]:
    vals = [
        (n, rows[n][size][key])
        for n in names
        if n in rows and size in rows[n] and key in rows[n][size] and not math.isnan(rows[n][size][key])
    ]
    if not vals:
        return None, math.nan
    return (min if low else max)(vals, key=lambda kv: kv[1])


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Figures, per-size ratios and target verdicts from ``{"config", "backends", "memcheck", ...}``."""
    backends: dict[str, Any] = raw["backends"]
    ok = [n for n, r in backends.items() if r.get("status") == "ok"]
    rows = {n: _backend_rows(backends[n]) for n in ok}
    sizes = sorted({s for r in rows.values() for s in r} | set(raw["config"]["sizes"]))
    tw = [n for n in ok if is_tensorwire(n)]
    peers = [n for n in ok if not is_tensorwire(n)]
    grpc = [n for n in ok if n in GRPC]
    ratios: dict[int, dict[str, Any]] = {}
    for size in sizes:
        r: dict[str, Any] = {}
        for key, low in (("uni_GBps", False), ("rtt_GBps", False), ("rtt_p50_us", True)):
            tw_n, tw_v = _best(rows, tw, size, key, low=low)
            groups = [("grpc", grpc), ("peer", peers), ("raw_tcp", ["raw-tcp"] if "raw-tcp" in ok else [])]
            groups += [(g, [g]) for g in grpc]  # each gRPC variant alone (T1 is reported against both)
            for label, group in groups:
                g_n, g_v = _best(rows, group, size, key, low=low)
                if tw_n is None or g_n is None or not g_v or not tw_v:
                    continue
                r[f"{key}:tw/{label}"] = (g_v / tw_v) if low else (tw_v / g_v)  # >1 = tensorwire better
                r[f"{key}:{label}_best"] = g_n
            if tw_n is not None:
                r[f"{key}:tw_best"] = tw_n
        ratios[size] = r
    targets = _targets(raw, rows, ratios, sizes, tw)
    return {
        "rows": {n: {str(s): v for s, v in r.items()} for n, r in rows.items()},
        "ratios": {str(s): v for s, v in ratios.items()},
        "targets": targets,
    }


def _targets(raw: dict[str, Any], rows: dict, ratios: dict, sizes: list[int], tw: list[str]) -> list[dict[str, Any]]:
    out = []

    def verdict(tid: str, values: list[tuple[int, float]], need: float, what: str) -> None:
        desc = dict(TARGETS)[tid]
        if not values:
            out.append({"id": tid, "target": desc, "status": "N/A", "detail": f"no data ({what})"})
            return
        worst_size, worst = min(values, key=lambda kv: kv[1])
        status = "MET" if worst >= need else "MISSED"
        detail = f"worst {worst:.2f}x at {format_size(worst_size)} (need >= {need}x); " + ", ".join(
            f"{format_size(s)}: {v:.2f}x" for s, v in values
        )
        out.append(
            {
                "id": tid,
                "target": desc,
                "status": status,
                "worst": worst,
                "worst_size": worst_size,
                "detail": f"{what}: {detail}",
            }
        )

    big = [s for s in sizes if s >= 16 * MiB]
    grpc_names = sorted({k.split(":tw/")[1] for r in ratios.values() for k in r if ":tw/grpc-" in k})
    for g in grpc_names or ["grpc"]:
        for key, what in (("uni_GBps", "stream (uni)"), ("rtt_GBps", "send+ack (rtt)")):
            verdict(
                "T1",
                [(s, ratios[s][f"{key}:tw/{g}"]) for s in big if f"{key}:tw/{g}" in ratios[s]],
                5.0,
                f"vs {g}, {what}",
            )
    verdict(
        "T2",
        [(s, ratios[s]["rtt_p50_us:tw/grpc"]) for s in sizes if s == 4096 and "rtt_p50_us:tw/grpc" in ratios[s]],
        10.0,
        "p50 round trip",
    )
    mid = [s for s in sizes if s >= MiB]
    for key, what in (("uni_GBps", "stream (uni)"), ("rtt_GBps", "send+ack (rtt)")):
        verdict("T3", [(s, ratios[s][f"{key}:tw/raw_tcp"]) for s in mid if f"{key}:tw/raw_tcp" in ratios[s]], 0.9, what)
    out.append(_auto_target(raw, rows, mid))
    return out


def _auto_target(raw: dict[str, Any], rows: dict, mid: list[int]) -> dict[str, Any]:
    desc = dict(TARGETS)["T4"]
    auto = [m for m in (raw.get("memcheck") or []) if m.get("transport_asked") == "auto" and m.get("status") == "ok"]
    picked = auto[0].get("transport") if auto else None
    have = [t for t in ("tcp", "ucx") if f"tensorwire-{t}" in rows]
    if picked is None or not have:
        return {"id": "T4", "target": desc, "status": "N/A", "detail": "auto choice or tensorwire figures missing"}
    wins: dict[str, int] = {t: 0 for t in have}
    for s in mid:
        vals = {t: rows[f"tensorwire-{t}"].get(s, {}).get("uni_GBps", math.nan) for t in have}
        vals = {t: v for t, v in vals.items() if not math.isnan(v)}
        if vals:
            wins[max(vals, key=vals.__getitem__)] += 1
    lat = {t: rows[f"tensorwire-{t}"].get(4096, {}).get("rtt_p50_us", math.nan) for t in have}
    lat = {t: v for t, v in lat.items() if not math.isnan(v)}
    if any(wins.values()):
        faster = max(wins, key=wins.__getitem__)
    elif len(lat) == len(have):  # no size >= 1 MiB ran: judge by the small-message latency
        faster = min(lat, key=lat.__getitem__)
    else:
        faster = None
    detail = (
        f"auto picked {picked}; faster at >= 1 MiB (sizes won): "
        + ", ".join(f"{t} {n}" for t, n in wins.items())
        + ("; 4 KiB p50: " + ", ".join(f"{t} {v:.1f} us" for t, v in lat.items()) if lat else "")
    )
    if len(have) < 2:
        return {
            "id": "T4",
            "target": desc,
            "status": "N/A",
            "picked": picked,
            "detail": detail + " (only one transport ran)",
        }
    status = "MET" if faster == picked else "MISSED"
    return {"id": "T4", "target": desc, "status": status, "picked": picked, "faster": faster, "detail": detail}
