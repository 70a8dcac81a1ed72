"""The outputs of ``tensorwire bench``, from the raw results and their summary.

Outputs: an OSU / nccl-tests style text table (stdout), markdown (same
tables), JSON (raw timings + summary), CSV (one row per backend and size) and
a PNG plot (matplotlib, Agg backend; skipped with a note when matplotlib is
missing). The summary (figures, ratios, target verdicts) comes from
:func:`tensorwire.benchmark.figures.summarize`, re-exported here.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Iterable

from tensorwire.benchmark.backends import BACKENDS
from tensorwire.benchmark.config import format_size
from tensorwire.benchmark.figures import TARGETS, MiB, summarize

__all__ = ["summarize", "render_text", "render_markdown", "write_json", "write_csv", "plot", "TARGETS"]

SHORT = {
    "tensorwire-tcp": "tw-tcp",
    "tensorwire-tcp-stream": "tw-tcp-stream",
    "tensorwire-ucx": "tw-ucx",
    "tensorwire-ucx-isend": "tw-ucx-isend",
    "grpc-unary": "grpc-unary",
    "grpc-stream": "grpc-stream",
    "raw-tcp": "raw-tcp",
    "raw-ucxx": "raw-ucxx",
    "raw-ucxx-cm": "ucxx-cm",
    "raw-ucxx-cmnoerr": "ucxx-cmne",
    "raw-ucxx-2buf": "ucxx-2buf",
    "torch-gloo": "gloo",
    "torch-nccl": "nccl",
    "nixl": "nixl",
}


# -- text / markdown ----------------------------------------------------------------------


def _fmt(v: float | None, *, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v >= 1000:
        return f"{v:.0f}"
    if v >= 100:
        return f"{v:.1f}" if digits > 3 else f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _cell(raw: dict[str, Any], summary: dict[str, Any], name: str, size: int, key: str) -> str:
    res = raw["backends"][name]
    if res.get("status") != "ok":
        return "FAILED" if res.get("status") == "failed" else "skip"
    row = summary["rows"].get(name, {}).get(str(size), {})
    if key == "rtt":
        if "rtt_p50_us" not in row:
            return "-"
        return f"{_fmt(row['rtt_p50_us'])}/{_fmt(row['rtt_p99_us'])}"
    if key == "first":
        if "first_x" not in row:
            return "-"
        return f"{_fmt(row['first_us'])} ({row['first_x']:.1f}x)"
    return _fmt(row.get(key))


def _tables(raw: dict[str, Any], summary: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    cfg = raw["config"]
    names = list(raw["backends"])
    sizes = [int(s) for s in cfg["sizes"]]
    ratios = summary["ratios"]
    tables = []

    def ratio(size: int, key: str) -> str:
        v = ratios.get(str(size), {}).get(key)
        return "-" if v is None else f"{v:.2f}"

    if "uni" in cfg["patterns"]:
        head = ["size"] + [SHORT.get(n, n) for n in names] + ["tw/gRPC", "tw/peer", "tw/raw-tcp"]
        body = [
            [format_size(s)]
            + [_cell(raw, summary, n, s, "uni_GBps") for n in names]
            + [ratio(s, "uni_GBps:tw/grpc"), ratio(s, "uni_GBps:tw/peer"), ratio(s, "uni_GBps:tw/raw_tcp")]
            for s in sizes
        ]
        tables.append(
            (
                "Unidirectional: stream of sends, one ack at the end -- GB/s (median of the batches); "
                "ratios: best tensorwire / best gRPC, best peer, raw TCP (>1: tensorwire faster)",
                head,
                body,
            )
        )
    if "rtt" in cfg["patterns"]:
        head = ["size"] + [SHORT.get(n, n) for n in names] + ["tw/gRPC", "tw/peer", "tw/raw-tcp"]
        body = [
            [format_size(s)]
            + [_cell(raw, summary, n, s, "rtt") for n in names]
            + [ratio(s, "rtt_p50_us:tw/grpc"), ratio(s, "rtt_p50_us:tw/peer"), ratio(s, "rtt_p50_us:tw/raw_tcp")]
            for s in sizes
        ]
        tables.append(
            (
                "Round trip: one-way send + 1-byte ack -- p50/p99 us; ratios of p50: peer / tensorwire "
                "(>1: tensorwire faster)",
                head,
                body,
            )
        )
        head = ["size"] + [SHORT.get(n, n) for n in names] + ["tw/gRPC", "tw/peer", "tw/raw-tcp"]
        body = [
            [format_size(s)]
            + [_cell(raw, summary, n, s, "rtt_GBps") for n in names]
            + [ratio(s, "rtt_GBps:tw/grpc"), ratio(s, "rtt_GBps:tw/peer"), ratio(s, "rtt_GBps:tw/raw_tcp")]
            for s in sizes
        ]
        tables.append(("Round trip as throughput: size / p50 -- GB/s (the ANCHORS figure)", head, body))
        pick = sorted({s for s in sizes if s in (sizes[0], 4096, MiB, 16 * MiB, sizes[-1])})
        head = ["size"] + [SHORT.get(n, n) for n in names]
        body = [[format_size(s)] + [_cell(raw, summary, n, s, "first") for n in names] for s in pick]
        tables.append(
            (
                "First transfer on fresh buffers -- us (x the median round trip); registration and page "
                "faults are paid once, later transfers do not pay them",
                head,
                body,
            )
        )
        s0 = sizes[0]
        head = ["backend", f"p50 us at {format_size(s0)}", "wake-ups per round trip", "CPU us per round trip"]
        body = []
        for n in names:
            row = summary["rows"].get(n, {}).get(str(s0), {})
            body.append(
                [n, _fmt(row.get("rtt_p50_us")), _fmt(row.get("wakeups_per_rtt")), _fmt(row.get("cpu_us_per_rtt"))]
            )
        tables.append(
            (
                f"Where a {format_size(s0)} round trip goes -- both processes: wake-ups = voluntary context "
                "switches (a thread went to sleep and had to be woken, ~25 us each on this kind of VM); CPU = "
                "user+system time (spinning backends burn CPU instead of sleeping)",
                head,
                body,
            )
        )
    return tables


def _failures(raw: dict[str, Any]) -> list[str]:
    out = []
    for n, r in raw["backends"].items():
        if r.get("status") in ("failed", "skipped"):
            out.append(f"{n}: {r['status']}: {r.get('error', '')}".strip())
    return out


def _memcheck_lines(raw: dict[str, Any]) -> list[str]:
    out = []
    for m in raw.get("memcheck") or []:
        if m.get("status") != "ok":
            out.append(f"memcheck ({m.get('transport_asked')}): {m.get('status')}: {m.get('error', '')}")
            continue
        for rank in ("0", "1"):
            r = m["ranks"][rank]
            out.append(
                f"memcheck transport={m['transport_asked']} (link used {m['transport']}), rank {rank}: "
                f"{m['steps']} steps x {format_size(m['size'])} each way: RSS {r['rss_growth']:+d} B after step 2"
                + (f" ({r['rss_second_half']:+d} B in the 2nd half)" if "rss_second_half" in r else "")
                + ", "
                f"tracemalloc {r['traced_growth']:+d} B ({r.get('traced_second_half', 0):+d} B in the 2nd half; peak "
                f"{r['traced_peak']} B), slot data_ptrs stable: "
                f"{'yes' if r['slots_stable'] else 'NO'}, recv returned {r['recv_buffers']} distinct slot buffer(s)"
                f"{'' if r['recv_in_slots'] else ' NOT IN THE SLOTS'} -> {r['verdict']}"
            )
    return out


def _env_lines(raw: dict[str, Any]) -> list[str]:
    env = raw.get("environment") or {}
    out = []
    for k, v in env.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items()) or "(none)"
        elif isinstance(v, list):
            v = "; ".join(str(x) for x in v) or "(none)"
        v = str(v)
        if "\n" in v:  # e.g. the nvidia-smi topology matrix
            out.append(f"{k}:")
            out.extend(f"    {line}" for line in v.splitlines())
        else:
            out.append(f"{k}: {v}")
    for k in ("started", "finished", "load average at end"):
        if raw.get(k):
            out.append(f"{k}: {raw[k]}")
    return out


def render_text(raw: dict[str, Any], summary: dict[str, Any]) -> str:
    """nccl-tests / OSU style: '#' comment lines, right-aligned columns."""
    buf = io.StringIO()
    w = buf.write
    w(
        f"# tensorwire bench -- device {raw['config']['device']}, {raw.get('where', 'one host, two processes')}"
        f"{', --check (timings include verification)' if raw['config']['check'] else ''}\n"
    )
    for line in _env_lines(raw):
        w(f"#   {line}\n")
    for title, head, body in _tables(raw, summary):
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        w(f"#\n# {title}\n#\n")
        w("# " + "  ".join(h.rjust(wd) for h, wd in zip(head, widths)) + "\n")
        for row in body:
            w("  " + "  ".join(c.rjust(wd) for c, wd in zip(row, widths)) + "\n")
    w("#\n# Targets (this run)\n")
    for t in summary["targets"]:
        w(f"#   {t['id']} {t['status']:<6} {t['target']}\n#          {t['detail']}\n")
    mem = _memcheck_lines(raw)
    if mem:
        w("#\n# Memory check: a Link allocates nothing after its first step into each slot\n")
        for line in mem:
            w(f"#   {line}\n")
    fails = _failures(raw)
    if fails:
        w("#\n# Failed / skipped backends\n")
        for line in fails:
            w(f"#   {line}\n")
    return buf.getvalue()


def render_markdown(raw: dict[str, Any], summary: dict[str, Any], *, command: str | None = None) -> str:
    buf = io.StringIO()
    w = buf.write
    w(f"# tensorwire bench: {raw['config']['device']}, {raw.get('where', 'one host, two processes')}\n\n")
    if command:
        w(f"Command:\n\n```\n{command}\n```\n\n")
    w("## Environment\n\n")
    block = False
    for line in _env_lines(raw):
        if line.startswith("    "):  # continuation of a multi-line value (the topology matrix)
            if not block:
                w("\n```\n")
                block = True
            w(line[4:] + "\n")
            continue
        if block:
            w("```\n\n")
            block = False
        w(f"- {line}\n")
    if block:
        w("```\n")
    w("\n## Targets\n\n| id | target | verdict | detail |\n| --- | --- | --- | --- |\n")
    for t in summary["targets"]:
        w(f"| {t['id']} | {t['target']} | **{t['status']}** | {t['detail']} |\n")
    for title, head, body in _tables(raw, summary):
        w(f"\n## {title.split(' -- ')[0]}\n\n{title.split(' -- ', 1)[-1]}\n\n")
        w("| " + " | ".join(head) + " |\n")
        w("| " + " | ".join("---:" if i else "---" for i in range(len(head))) + " |\n")
        for row in body:
            w("| " + " | ".join(row) + " |\n")
    mem = _memcheck_lines(raw)
    if mem:
        w("\n## Memory check\n\n")
        for line in mem:
            w(f"- {line}\n")
    fails = _failures(raw)
    if fails:
        w("\n## Failed / skipped backends\n\n")
        for line in fails:
            w(f"- {line}\n")
    return buf.getvalue()


# -- files ---------------------------------------------------------------------------------


def _compact(x: Any) -> Any:
    """Floats to 7 significant digits (timings are not that precise; keeps the file small)."""
    if isinstance(x, float):
        return float(f"{x:.7g}")
    if isinstance(x, dict):
        return {k: _compact(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_compact(v) for v in x]
    return x


def as_saved(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` exactly as :func:`write_json` keeps it (floats to 7 significant digits, JSON types)."""
    return json.loads(json.dumps(_compact(raw), default=str))


def write_json(path: str, raw: dict[str, Any], summary: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(
            _compact({"format": "tensorwire-bench/1", **raw, "summary": summary}),
            f,
            indent=None,
            separators=(",", ":"),
            default=str,
        )
        f.write("\n")


CSV_FIELDS = (
    "backend",
    "status",
    "size",
    "uni_GBps",
    "rtt_p50_us",
    "rtt_p99_us",
    "rtt_GBps",
    "rtt_n",
    "first_us",
    "first_x",
    "wakeups_per_rtt",
    "cpu_us_per_rtt",
)


def write_csv(path: str, raw: dict[str, Any], summary: dict[str, Any]) -> None:
    with open(path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(CSV_FIELDS)
        for name, res in raw["backends"].items():
            rows = summary["rows"].get(name, {})
            for size in raw["config"]["sizes"]:
                row = rows.get(str(size), {})
                wr.writerow(
                    [name, res.get("status"), size]
                    + [
                        "" if row.get(k) is None else (f"{row[k]:.6g}" if isinstance(row[k], float) else row[k])
                        for k in CSV_FIELDS[3:]
                    ]
                )


def plot(path: str, raw: dict[str, Any], summary: dict[str, Any], *, title: str | None = None) -> str | None:
    """Write a PNG (log2 size axis, one line per backend). Returns None, or why it was not written."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install 'tensorwire[plot]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cfg = raw["config"]
    panels = [
        (k, lab)
        for k, lab, p in (
            ("uni_GBps", "stream of sends (uni): GB/s", "uni"),
            ("rtt_p50_us", "send + 1-byte ack (rtt): p50 latency, us", "rtt"),
        )
        if p in cfg["patterns"]
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.6), squeeze=False)
    styles = {
        "tensorwire-tcp": ("C0", "-", 2.6),
        "tensorwire-ucx": ("C3", "-", 2.6),
        "tensorwire-ucx-isend": ("C3", "--", 2.2),
    }
    others = iter(["C1", "C2", "C4", "C5", "C6", "C7", "C8", "C9"])
    colors = {n: styles.get(n, (None, "--", 1.4)) for n in raw["backends"]}
    for n in colors:
        if colors[n][0] is None:
            colors[n] = (next(others, "k"), "--", 1.4)
    for ax, (key, label) in zip(axes[0], panels):
        for name, res in raw["backends"].items():
            if res.get("status") != "ok":
                continue
            rows = summary["rows"].get(name, {})
            xs = [int(s) for s in rows if key in rows[s]]
            xs.sort()
            ys = [rows[str(s)][key] for s in xs]
            if not xs:
                continue
            c, ls, lw = colors[name]
            ax.plot(xs, ys, ls, color=c, lw=lw, marker="o", ms=3.5, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [int(s) for s in cfg["sizes"]][::2]
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(t).replace(" ", "") for t in ticks], rotation=45, ha="right")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("message size")
        ax.set_title(label)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
    failed = [n for n, r in raw["backends"].items() if r.get("status") != "ok"]
    handles, labels = axes[0][0].get_legend_handles_labels()
    if failed:
        labels = labels + [f"(not shown: {', '.join(failed)})"]
        handles = handles + [plt.Line2D([], [], color="none")]
    axes[0][0].legend(handles, labels, fontsize=8, loc="best")
    env = raw.get("environment") or {}
    fig.suptitle(
        title
        or f"tensorwire bench -- {cfg['device']}, {raw.get('where', 'one host')}; "
        f"{env.get('cpu', '')}, nproc {env.get('nproc', '?')}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def backend_descriptions(names: Iterable[str]) -> list[str]:
    return [f"{n}: {BACKENDS[n][2]}" for n in names if n in BACKENDS]
