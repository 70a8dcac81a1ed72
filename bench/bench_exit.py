"""Exit statuses of short client scripts (and torchrun jobs), counted: the reliability target of issue 38.

Each run is a fresh process running the script a new user writes::

    import torch, tensorwire as tw
    with tw.Client("127.0.0.1:PORT") as c:
        c.get("weights")

against a local ``tensorwire serve`` (one daemon per build, default flags),
and counts its exit status. Builds take turns, run by run, so both see the
same load: ``pure`` (this tree) and ``native`` (``make native``: the package
with its hot modules compiled by mypyc, in ``build/native``), when built.
``--jobs N`` also runs N two-rank torchrun jobs with ``backend="tensorwire"``
(one send/recv, no destroy_process_group).

Target: 0 non-zero exits in 1,000 client runs per build and in 100 torchrun jobs.

    python bench/bench_exit.py --runs 1000 --jobs 100 --out bench/results/exit_cpu2_DATE.md

The table is rewritten after every run, so a run cut short leaves its counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import select
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = """import sys, torch, tensorwire as tw
with tw.Client("127.0.0.1:" + sys.argv[1]) as c:
    c.get("weights")
"""
JOB = """import torch, torch.distributed as d, tensorwire
d.init_process_group("tensorwire")
t = torch.arange(65536, dtype=torch.float32) if d.get_rank() == 0 else torch.zeros(65536)
d.send(t, 1) if d.get_rank() == 0 else d.recv(t, 0)
d.barrier()
"""


def env_for(path: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env["PYTHONPATH"] = str(path)
    return env


def compiled(path: pathlib.Path) -> str:
    """``compiled`` or ``python``: how the tree at ``path`` imports its hot modules (run from inside it)."""
    code = "import tensorwire.native as n; print('compiled' if n.compiled() else 'python')"
    r = subprocess.run([sys.executable, "-c", code], cwd=path, env=env_for(path), capture_output=True, text=True)
    return r.stdout.strip() or f"not importable: {r.stderr.strip()[-200:]}"


def start_daemon(env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen(
        [sys.executable, "-m", "tensorwire", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd=env["PYTHONPATH"],
        text=True,
    )
    assert p.stdout is not None
    ready, _, _ = select.select([p.stdout], [], [], 120)
    if not ready:
        p.kill()
        raise SystemExit("the daemon did not become ready in 120 s")
    info = json.loads(p.stdout.readline())
    port = int(info["port"])
    put = "import torch, tensorwire as tw, sys\nwith tw.Client('127.0.0.1:' + sys.argv[1]) as c:\n    c.put('weights', torch.randn(1024, 256))\n"
    subprocess.run([sys.executable, "-c", put, str(port)], env=env, cwd=env["PYTHONPATH"], check=True, timeout=120)
    return p, port


def one(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, bool]:
    """(exit status, whether the output says 'terminate called')."""
    try:
        r = subprocess.run(
            cmd,
            env=env,
            cwd=env["PYTHONPATH"],  # (the tree under test first on sys.path, whatever the command)
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return -9, False
    return r.returncode, "terminate called" in (r.stdout + r.stderr)


def shown_args() -> str:
    """This run's arguments, paths by their last component (the results name no directory of this machine)."""
    return " ".join(pathlib.Path(a).name if os.sep in a else a for a in sys.argv[1:])


def write(
    out: pathlib.Path | None,
    counts: dict[str, collections.Counter],
    aborts: dict[str, int],
    t0: float,
    notes: list[str],
) -> str:
    lines = [
        "# Exit statuses of short tensorwire processes",
        "",
        f"Machine: {os.cpu_count()}-core {platform.machine()} VM, Python {platform.python_version()}; "
        f"{time.monotonic() - t0:.0f} s. Command: `python bench/bench_exit.py {shown_args()}`.",
        "",
        *notes,
        "",
        "| what | runs | exit 0 | non-zero (status: count) | 'terminate called' |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    for what, c in counts.items():
        n = sum(c.values())
        bad = ", ".join(f"{k}: {v}" for k, v in sorted(c.items()) if k != 0) or "none"
        lines.append(f"| {what} | {n} | {c.get(0, 0)} | {bad} | {aborts.get(what, 0)} |")
    text = "\n".join(lines) + "\n"
    if out is not None:
        out.write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=100, help="client runs per build")
    ap.add_argument("--jobs", type=int, default=0, help="two-rank torchrun jobs")
    ap.add_argument("--parallel", type=int, default=2, help="processes at a time")
    ap.add_argument("--builds", default="pure,native", help="comma-separated: pure, native")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    ap.add_argument("--minutes", type=float, default=0.0, help="stop starting runs after this long (0: never)")
    ap.add_argument(
        "--baseline", type=pathlib.Path, default=None, help="a tree of an earlier commit (git archive): its runs too"
    )
    ap.add_argument("--baseline-runs", type=int, default=0, help="client runs of the baseline tree")
    args = ap.parse_args()
    builds = {"pure": ROOT, "native": ROOT / "build" / "native"}
    if args.baseline is not None:
        builds["baseline"] = args.baseline.resolve()
    wanted = [b for b in args.builds.split(",") if b]
    for b in wanted:
        if b not in builds or (b == "native" and not (builds[b] / "tensorwire").is_dir()):
            raise SystemExit(f"build {b!r} is not there (native: run `make native` first)")
    notes = [f"- {b} build: hot modules {compiled(builds[b])}" for b in wanted]
    if args.baseline is not None:
        notes.append(f"- baseline tree ({args.baseline.name}): hot modules {compiled(builds['baseline'])}")
    t0 = time.monotonic()
    counts: dict[str, collections.Counter] = {}
    aborts: dict[str, int] = collections.Counter()
    daemons = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = pathlib.Path(tmp) / "one_get.py"
        script.write_text(SCRIPT)
        job = pathlib.Path(tmp) / "job.py"
        job.write_text(JOB)
        try:
            for b in wanted:
                daemons[b] = start_daemon(env_for(builds[b]))
                counts[f"client, {b} build"] = collections.Counter()
            if args.baseline is not None:
                daemons["baseline"] = start_daemon(env_for(builds["baseline"]))
                counts["client, baseline tree"] = collections.Counter()
            tasks: list[tuple[str, list[str], dict[str, str], float]] = []
            for i in range(max(args.runs, args.baseline_runs)):
                for b in wanted:  # in turns
                    if i < args.runs:
                        cmd = [sys.executable, str(script), str(daemons[b][1])]
                        tasks.append((f"client, {b} build", cmd, env_for(builds[b]), 120.0))
                if args.baseline is not None and i < args.baseline_runs:
                    cmd = [sys.executable, str(script), str(daemons["baseline"][1])]
                    tasks.append(("client, baseline tree", cmd, env_for(builds["baseline"]), 120.0))
            if args.jobs:
                counts["torchrun 2 ranks, pure build"] = collections.Counter()
                for i in range(args.jobs):
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
                    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--max-restarts", "0", str(job)]
                    # interleaved with the client runs
                    tasks.insert(
                        min(len(tasks), (i + 1) * max(1, len(tasks) // args.jobs)),
                        ("torchrun 2 ranks, pure build", cmd, env_for(ROOT), 300.0),
                    )
            with ThreadPoolExecutor(max_workers=args.parallel) as pool:
                futs = [(what, pool.submit(one, cmd, env, to)) for what, cmd, env, to in tasks]
                stop_at = t0 + 60 * args.minutes if args.minutes else None
                for k, (what, f) in enumerate(futs):
                    if stop_at is not None and time.monotonic() > stop_at:
                        for _, g in futs[k:]:
                            g.cancel()  # (the ones running finish and are not counted)
                        notes.append(f"- stopped after {args.minutes:g} minutes (--minutes)")
                        break
                    rc, aborted = f.result()
                    counts[what][rc] += 1
                    aborts[what] += int(aborted)
                    if k % 20 == 19:
                        write(args.out, counts, aborts, t0, notes)
        finally:
            for p, _ in daemons.values():
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    print(write(args.out, counts, aborts, t0, notes), end="")


if __name__ == "__main__":
    main()
