#!/usr/bin/env python
"""torch.distributed point-to-point and a GPipe step: backend "tensorwire" vs gloo, one torchrun job, in turns.

::

    python bench/bench_distributed.py                          # launches torchrun (2 ranks) itself
    python bench/bench_distributed.py --out bench/results/distributed_cpu2_<date>.md
    TENSORWIRE_TRANSPORT=tcp python bench/bench_distributed.py # pin the transport

One job, two ranks, two groups over the same processes: the default group is
gloo, a second group is made with ``dist.new_group(backend="tensorwire")``.
Every measurement alternates between them (``--rounds`` blocks of gloo then
tensorwire), so a change of load on a shared machine hits both.

- **ping-pong**: ``dist.send`` then ``dist.recv`` of one contiguous float32
  tensor (rank 1 mirrors), sizes 4 KiB ... 256 MiB. Reported: the round trip
  (each round's mean over its round trips, then the median of the rounds; a
  round trip that the scheduler or the load stretched counts in its round's
  mean) and the bandwidth ``2 x size / round trip``. For a median over single
  round trips, two trees in turns: ``bench/bench_distributed_trees.py``. Up to
  64 KiB a third group takes its turn: the Python floor (``bench/floor_pg.py``,
  a ProcessGroup that only moves the bytes over a socket and checks nothing),
  the round trip below which no Python backend can go on the machine; and, in
  the same turns, that group's socket alone (the same ``sendall`` and polled
  ``recv_into``, called directly: no torch), so the floor splits into what
  the socket costs and what torch's dispatch into a Python group costs.
- **GPipe step**: ``torch.distributed.pipelining.ScheduleGPipe`` over two
  stages whose compute is one elementwise scale each, around the exchange of
  the activations (``--act-mib`` per microbatch, default 16) and of their
  gradients; 4 microbatches. Reported: median step time, and each rank's
  compute alone (its stage's forward and backward over the same microbatches,
  no exchange) -- a lower bound of what no backend can take away: in the
  pipeline the last stage also computes the input's gradient and merges its
  outputs, and its compute is about half of a tensorwire step on a 16-core host
  (``bench/results/distributed-tuning_h100_2026-11-27.md``, section 5). The
  compute runs on ``--threads`` threads per rank (default: a quarter of the
  cores, at least one).
- **Where the CPU goes** (``--perf``, needs Linux ``perf``): ``--perf-iters``
  4 KiB round trips per group while ``perf record`` samples each rank's
  process; each rank's CPU per round trip split by the shared object it ran
  in (kernel, interpreter, compiled hot path, torch, C library: see
  ``bench/perf_split.py``).
- **RSS**: the resident set of each rank over ``--rss-steps`` (1,000) ping-pong
  steps (4 KiB and 1 MiB alternating) after a warm-up, per backend, and over
  ``--rss-gpipe`` GPipe steps.

Ratios are tensorwire / gloo (time: lower is better; bandwidth: higher).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import floor_pg  # (this script's folder is on sys.path)
import perf_split

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
#: sizes at which the Python floor (bench/floor_pg.py) is timed too
FLOOR_MAX = 64 << 10


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _iters(size: int) -> int:
    return max(3, min(300, (64 << 20) // size))


def _pingpong(dist, torch, group, rank: int, x, n: int, settle=None, into=None) -> float:
    """Seconds per round trip; ``settle()`` (if given) runs before the clock stops (a device sync).
    ``into``: the tensor receives go to (default ``x`` itself)."""
    peer = 1 - rank
    y = x if into is None else into
    t0 = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            dist.send(x, peer, group=group)
            dist.recv(y, peer, group=group)
        else:
            dist.recv(y, peer, group=group)
            dist.send(x, peer, group=group)
    if settle is not None:
        settle()
    return (time.perf_counter() - t0) / n


def _socket_pingpong(group, rank: int, x, n: int) -> float:
    """Seconds per round trip of the Python floor's own socket, driven directly (no torch dispatch)."""
    send, recv = group.raw_send, group.raw_recv
    data = memoryview(x.numpy()).cast("B")
    t0 = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            send(data)
            recv(data)
        else:
            recv(data)
            send(data)
    return (time.perf_counter() - t0) / n


def _perf_pingpong(dist, torch, groups: dict, rank: int, n: int) -> dict:
    """``--perf``: ``n`` 4 KiB round trips per group while ``perf record`` samples this rank's process; per group
    the round trip and the process's CPU per round trip (all its threads), and the CPU's split by shared object
    (or why there is none)."""
    x = torch.zeros(1024)
    out = {}
    for name, g in groups.items():
        _pingpong(dist, torch, g, rank, x, 20)
        dist.barrier()
        rec = perf_split.Recorder(os.getpid())
        rec.start()
        dist.barrier()
        c0 = time.process_time()
        rt = _pingpong(dist, torch, g, rank, x, n)
        cpu = (time.process_time() - c0) / n
        out[name] = {"rt": rt, "cpu": cpu, "shares": rec.stop()}
        dist.barrier()
    return out


def _gpipe(torch, group, rank: int, act_mib: int, n_mb: int = 4):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    class Scale(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(width))

        def forward(self, x):
            return x * self.w

    width = 4096
    rows = act_mib * (1 << 20) // (4 * width)
    stage = PipelineStage(Scale(width), rank, 2, torch.device("cpu"), group=group)
    sched = ScheduleGPipe(stage, n_microbatches=n_mb, loss_fn=torch.nn.MSELoss())
    x = torch.randn(rows * n_mb, width)
    y = torch.randn(rows * n_mb, width)

    def step() -> float:
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        return time.perf_counter() - t0

    def compute_alone() -> float:
        mod = Scale(width)
        t0 = time.perf_counter()
        for mb in (x if rank == 0 else y).chunk(n_mb):
            out = mod(mb)
            (torch.nn.functional.mse_loss(out, mb) if rank == 1 else out.sum()).backward()
        return time.perf_counter() - t0

    return step, compute_alone


def hot_path() -> str:
    """Which hot path the imported tensorwire runs (``tensorwire.native.summary()``)."""
    try:
        from tensorwire.native import summary
    except ModuleNotFoundError:  # a tree from before the compiled hot path
        return "pure Python"
    except ImportError:  # a tree from before native.summary
        return "unknown"
    return summary()


def add_tree_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--tree",
        type=Path,
        default=None,
        help="import tensorwire from this folder instead of this checkout (build/native: the compiled hot path)",
    )


def with_tree(ap: argparse.ArgumentParser, tree: Path | None, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the tensorwire of ``tree`` (default: this checkout) first on ``PYTHONPATH`` of the job."""
    tree = tree if tree is not None else Path(__file__).resolve().parent.parent
    if not (tree / "tensorwire" / "__init__.py").is_file():
        ap.error(f"--tree {tree}: no tensorwire package there (`make native` builds build/native)")
    return dict(env, PYTHONPATH=os.pathsep.join([str(tree.resolve()), env.get("PYTHONPATH", "")]))


def write_result(result_dir: str | None, rank: int, out: dict) -> None:
    """Hand a worker's result to the launcher: ``rank<N>.json`` in ``result_dir`` (written, then renamed), or a
    ``RESULT {json}`` line on stdout where no folder was given. Files, because the ranks share one stdout and
    two ranks' lines can run into each other there."""
    text = json.dumps({"rank": rank, **out})
    if result_dir is None:
        print("RESULT " + text, flush=True)
        return
    tmp = Path(result_dir) / f".rank{rank}.json"
    tmp.write_text(text)
    os.replace(tmp, tmp.with_name(f"rank{rank}.json"))


def run_ranks(cmd: list[str], env: dict[str, str], timeout: float, **popen: Any) -> tuple[Any, dict[int, dict]]:
    """Run a torchrun job whose workers call :func:`write_result`; ``(completed process, {rank: result})``.

    ``cmd`` gets ``--result-dir <a temporary folder>``; ``popen``: more arguments of ``subprocess.run``
    (stdout is captured as text). Raises ``SystemExit`` if the job runs past ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as rd:
        try:
            proc = subprocess.run(
                [*cmd, "--result-dir", rd], env=env, stdout=subprocess.PIPE, text=True, timeout=timeout, **popen
            )
        except subprocess.TimeoutExpired as exc:
            raise SystemExit(f"benchmark job did not finish in {timeout:.0f} s") from exc
        results = {}
        for f in sorted(Path(rd).glob("rank*.json")):
            data = json.loads(f.read_text())
            results[data["rank"]] = data
    return proc, results


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import tensorwire  # noqa: F401 - registers the backend

    hot = hot_path()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tw = dist.new_group([0, 1], backend="tensorwire")
    groups = {"gloo": None, "tensorwire": tw}
    floor_pg.register()
    floor = dist.new_group([0, 1], backend=floor_pg.NAME)
    out: dict = {"transport": dict(tw.transports), "hot_path": hot, "pingpong": {}, "gpipe": {}, "rss": {}}
    sizes = [s for s in SIZES if s <= args.max_mib << 20]
    for size in sizes:
        x = torch.zeros(size // 4)
        these = dict(groups, floor=floor) if size <= FLOOR_MAX else groups
        samples: dict[str, list[float]] = {name: [] for name in these}
        if size <= FLOOR_MAX:
            samples["socket"] = []
        for g in these.values():  # warm-up (first message of each signature, connections)
            _pingpong(dist, torch, g, rank, x, 2)
        for _ in range(args.rounds):
            n = max(1, _iters(size) // args.rounds)
            for name, g in these.items():
                dist.barrier()
                samples[name].append(_pingpong(dist, torch, g, rank, x, n))
            if size <= FLOOR_MAX:
                dist.barrier()
                samples["socket"].append(_socket_pingpong(floor, rank, x, n))
        out["pingpong"][size] = {k: statistics.median(v) for k, v in samples.items()}
    if args.perf:
        out["perf"] = _perf_pingpong(dist, torch, dict(groups, floor=floor), rank, args.perf_iters)
    made = {name: _gpipe(torch, g, rank, args.act_mib) for name, g in groups.items()}
    steps = {name: step for name, (step, _) in made.items()}
    compute_alone = made["gloo"][1]  # (the same stage and microbatches in either group)
    for name in groups:
        steps[name]()  # warm-up: shape inference, first messages
    gp: dict[str, list[float]] = {"gloo": [], "tensorwire": []}
    for _ in range(args.gpipe_steps):
        for name in groups:
            dist.barrier()
            gp[name].append(steps[name]())
    out["gpipe"] = {k: statistics.median(v) for k, v in gp.items()}
    compute_alone()  # warm-up
    out["compute_alone"] = statistics.median(compute_alone() for _ in range(args.gpipe_steps))
    out["threads"] = args.threads
    # RSS over many steps after warm-up, per backend
    small, large = torch.zeros(1024), torch.zeros(1 << 18)
    for name, g in groups.items():
        for _ in range(50):
            _pingpong(dist, torch, g, rank, small, 1)
            _pingpong(dist, torch, g, rank, large, 1)
        before = _rss_mib()
        for i in range(args.rss_steps):
            _pingpong(dist, torch, g, rank, small if i % 2 else large, 1)
        mid = _rss_mib()
        for _ in range(args.rss_gpipe):
            steps[name]()
        out["rss"][name] = {"before": before, "after_pingpong": mid, "after_gpipe": _rss_mib()}
    # How tensorwire's bytes moved: cross-memory attach (TCP between processes of one host) or the socket.
    out["cma"] = {}
    for p, peer in getattr(tw, "_peers", {}).items():
        c = getattr(peer.transport, "cma", None)
        if c is not None:
            out["cma"][p] = {"state": c.state, "messages": c.messages_written, "mib": c.bytes_written / 2**20}
    dist.barrier()
    dist.destroy_process_group(tw)
    dist.destroy_process_group(floor)
    dist.destroy_process_group()
    write_result(args.result_dir, rank, out)


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def report(results: dict, args: argparse.Namespace, load: tuple[float, float, float], wall: float) -> str:
    r0 = results[0]
    lines = [
        f"# torch.distributed: backend tensorwire vs gloo ({args.machine})",
        "",
        f"Date {_dt.date.today().isoformat()}; {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; tensorwire transport {sorted(set(r0['transport'].values()))}, "
        f"hot path {r0.get('hot_path', 'pure Python')} (`tensorwire.native`); "
        f"load average before the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min); run took {wall:.0f} s.",
        'One torchrun job, 2 ranks; gloo default group and a `new_group(backend="tensorwire")` over the same '
        f"processes, measured in turns ({args.rounds} rounds per size). Command: "
        f"`python bench/bench_distributed.py --rounds {args.rounds}"
        + (f" --tree {args.tree}" if args.tree is not None else "")
        + (" --perf" if args.perf else "")
        + "`"
        + (f" with `TENSORWIRE_CMA={os.environ['TENSORWIRE_CMA']}`" if os.environ.get("TENSORWIRE_CMA") else "")
        + ".",
        "Cross-memory attach (TCP, one host; rank 0's sends): "
        + (
            "; ".join(
                f"to rank {p}: {v['state']}, {v['messages']} messages, {v['mib']:.0f} MiB"
                for p, v in sorted(r0.get("cma", {}).items())
            )
            or "not on these connections"
        )
        + ".",
        "",
        "## send/recv ping-pong (rank 0's view)",
        "",
        f"Python floor (up to {_fmt_size(FLOOR_MAX)}): a ProcessGroup that only moves the bytes over one TCP socket "
        "(`bench/floor_pg.py`: no checks, no tags, no failure detection), timed in the same turns: the round trip no "
        "Python backend can go below on this machine. Socket alone: the floor's socket calls made directly, no "
        "torch (floor minus socket: torch's dispatch into a Python group, its Work objects and the tensor's byte view).",
        "",
        "| size | gloo round trip | tensorwire round trip | tw/gloo time | gloo GB/s | tensorwire GB/s | tw/gloo bandwidth "
        "| Python floor | floor/gloo time | socket alone |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size, v in sorted(r0["pingpong"].items(), key=lambda kv: int(kv[0])):
        size = int(size)
        g, t, f, s = v["gloo"], v["tensorwire"], v.get("floor"), v.get("socket")
        lines.append(
            f"| {_fmt_size(size)} | {g * 1e6:.0f} µs | {t * 1e6:.0f} µs | {t / g:.2f}x | "
            f"{2 * size / g / 1e9:.2f} | {2 * size / t / 1e9:.2f} | {g / t:.2f}x | "
            + (f"{f * 1e6:.0f} µs | {f / g:.2f}x |" if f is not None else "| |")
            + (f" {s * 1e6:.0f} µs |" if s is not None else " |")
        )
    if "perf" in r0:
        lines += [
            "",
            "## Where a 4 KiB round trip's CPU goes (`--perf`)",
            "",
            f"{args.perf_iters} round trips per group while `perf record` samples each rank's process (which slows "
            "them), after the turns above. Process CPU: all the rank's threads per round trip; as large as the round "
            "trip where the process never sleeps (a reader polling for the next message), larger where several "
            "threads work at once. Split by the shared object each sample fell in (`bench/perf_split.py`).",
            "",
        ]
        rows = [
            (
                f"rank {rank}, {name}",
                [str(rank), name, f"{v['rt'] * 1e6:.1f} µs", f"{v['cpu'] * 1e6:.1f} µs"],
                v["cpu"] * 1e6,
                v["shares"],
            )
            for rank in sorted(results)
            for name, v in results[rank].get("perf", {}).items()
        ]
        lines += perf_split.table(["rank", "group", "round trip under perf", "process CPU per round trip"], 2, rows)
    g, t = r0["gpipe"]["gloo"], r0["gpipe"]["tensorwire"]
    lines += [
        "",
        f"## GPipe step (2 stages, 4 microbatches, {args.act_mib} MiB activations per microbatch, elementwise compute)",
        "",
        "| gloo | tensorwire | tw/gloo | compute alone, rank 0 / rank 1 (no exchange) |",
        "| ---: | ---: | ---: | ---: |",
        f"| {g * 1e3:.1f} ms | {t * 1e3:.1f} ms | {t / g:.2f}x | {r0.get('compute_alone', 0) * 1e3:.1f} / "
        f"{results.get(1, {}).get('compute_alone', 0) * 1e3:.1f} ms on {r0.get('threads', 1)} thread(s) per rank |",
        "",
        f"## RSS (MiB) over {args.rss_steps} ping-pong steps (4 KiB / 1 MiB alternating) and {args.rss_gpipe} GPipe "
        "steps, after warm-up",
        "",
        "| rank | backend | before | after ping-pong | after GPipe | growth |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for rank in sorted(results):
        for name, v in results[rank]["rss"].items():
            lines.append(
                f"| {rank} | {name} | {v['before']:.1f} | {v['after_pingpong']:.1f} | "
                f"{v['after_gpipe']:.1f} | {v['after_gpipe'] - v['before']:+.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)  # (the workers' results, one file each)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--act-mib", type=int, default=16)
    ap.add_argument("--gpipe-steps", type=int, default=5)
    ap.add_argument("--rss-steps", type=int, default=1000)
    ap.add_argument("--rss-gpipe", type=int, default=20)
    ap.add_argument("--machine", default="cpu2")
    ap.add_argument(
        "--perf", action="store_true", help="also split each rank's CPU of a 4 KiB round trip by shared object (perf)"
    )
    ap.add_argument("--perf-iters", type=int, default=5000, help="round trips per group under perf")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 4), help="compute threads per rank")
    ap.add_argument("--out", type=Path, default=None)
    add_tree_option(ap)
    args = ap.parse_args()
    if args.perf and args.perf_iters < 1:
        ap.error("--perf-iters must be at least 1")
    if args.worker:
        worker(args)
        return
    load = os.getloadavg()
    here = Path(__file__).resolve()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(here),
        "--worker",
        "--rounds",
        str(args.rounds),
        "--max-mib",
        str(args.max_mib),
        "--act-mib",
        str(args.act_mib),
        "--gpipe-steps",
        str(args.gpipe_steps),
        "--rss-steps",
        str(args.rss_steps),
        "--rss-gpipe",
        str(args.rss_gpipe),
        "--threads",
        str(args.threads),
    ]
    if args.perf:
        cmd += ["--perf", "--perf-iters", str(args.perf_iters)]
    env = with_tree(ap, args.tree, dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    t0 = time.monotonic()
    proc, results = run_ranks(cmd, env, 3600, stderr=subprocess.PIPE)
    wall = time.monotonic() - t0
    if proc.returncode != 0 or len(results) != 2:
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-12000:])
        raise SystemExit(f"benchmark job failed (exit {proc.returncode})")
    text = report(results, args, load, wall)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
