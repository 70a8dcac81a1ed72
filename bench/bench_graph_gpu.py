#!/usr/bin/env python
"""A training step captured in a CUDA graph, its point-to-point inside: backend tensorwire vs NCCL, in turns.

::

    torchrun --standalone --nproc-per-node 2 bench/bench_graph_gpu.py --out bench/results/graph-gpu_<machine>_<date>.md
    torchrun --standalone --nproc-per-node 2 bench/bench_graph_gpu.py --check   # bit-exact checks (GPU tests)

Two ranks, two pipeline stages of a bf16 MLP (width 4096), ``--micro`` microbatches per step whose activations are
``--acts`` MiB each: stage 0 computes ``x @ W0`` per microbatch and sends it; stage 1 computes a squared-error loss
of ``a @ W1``, sends the activation's gradient back, and both update their weight (plain SGD, gradients by hand:
no autograd, so eager and captured steps run the same kernels). Each backend's step runs eagerly and captured
(``torch.cuda.graph``, after one eager warm-up step), in turns; NCCL needs two GPUs (with one GPU, both ranks
share it and only tensorwire runs). Reported: step time (median), host time per ``replay()``, and the weights'
checksum after the run (the same for every mode: the same bytes arrive).

``--check``: 100 captured replays against 100 eager steps from the same start, weights compared bit for bit,
with 1 and 4 microbatches; prints ``GRAPH CHECKS PASSED``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import faulthandler
import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import tensorwire  # (registers the backend)
import tensorwire.native

MIB = 1 << 20
WIDTH = 4096


class Stage:
    """One rank's half of the two-stage step, on static buffers (what a captured graph needs)."""

    def __init__(self, rank: int, rows: int, micro: int, device: torch.device, group, seed: int = 0) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed + rank)
        self.rank, self.peer, self.group, self.micro = rank, 1 - rank, group, micro
        dt = torch.bfloat16
        self.w = (torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5).to(dt).to(device)
        self.x = [torch.randn(rows, WIDTH, generator=g).to(dt).to(device) for _ in range(micro)]
        self.target = [torch.randn(rows, WIDTH, generator=g).to(dt).to(device) for _ in range(micro)]
        self.act_in = [torch.zeros(rows, WIDTH, dtype=dt, device=device) for _ in range(micro)]
        self.grad_in = [torch.zeros(rows, WIDTH, dtype=dt, device=device) for _ in range(micro)]
        self.lr = 1e-3

    def step(self) -> None:
        if self.group is None:
            self._compute_only()
            return
        grp, peer = self.group, self.peer
        if self.rank == 0:
            acts = [x @ self.w for x in self.x]
            # (two batches, as the other rank posts them: NCCL 2.28 truncated messages when one rank's batch
            # held sends and receives that the peer posted in two)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, a, peer, group=grp) for a in acts]):
                w.wait()
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, gr, peer, group=grp) for gr in self.grad_in]):
                w.wait()
            gw = sum(x.t() @ gr for x, gr in zip(self.x, self.grad_in))
            self.w.sub_(self.lr * gw)
        else:
            ops = [dist.P2POp(dist.irecv, a, peer, group=grp) for a in self.act_in]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            grads, gw = [], None
            for a, tgt in zip(self.act_in, self.target):
                g_out = (a @ self.w - tgt) * (2.0 / a.numel())
                gw = a.t() @ g_out if gw is None else gw + a.t() @ g_out
                grads.append(g_out @ self.w.t())
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, gr, peer, group=grp) for gr in grads]):
                w.wait()
            self.w.sub_(self.lr * gw)

    def _compute_only(self) -> None:
        """The rank's kernels of :meth:`step` with no message at all (``--floor``): what arrives stays as it is."""
        if self.rank == 0:
            acts = [x @ self.w for x in self.x]
            del acts  # (computed as the step does; nothing sends them)
            gw = sum(x.t() @ gr for x, gr in zip(self.x, self.grad_in))
            self.w.sub_(self.lr * gw)
        else:
            gw = None
            for a, tgt in zip(self.act_in, self.target):
                g_out = (a @ self.w - tgt) * (2.0 / a.numel())
                gw = a.t() @ g_out if gw is None else gw + a.t() @ g_out
                g_out @ self.w.t()
            self.w.sub_(self.lr * gw)

    def checksum(self) -> float:
        return float(self.w.float().sum())


def _capture(stage: Stage) -> torch.cuda.CUDAGraph:
    # warm-up as torch's capture docs ask (eager steps on a side stream): sets up what the capture needs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        stage.step()
    return g


def _capture_unbatched(stage: Stage) -> torch.cuda.CUDAGraph:
    """The step captured with every flag wait and its reset as two graph nodes (no batch of stream memory
    operations): the captured path as it was before they were batched, for ``--ab-flags``."""
    from tensorwire.transport.ce import CeDriver

    drv = CeDriver.get()
    batch, drv._batch = drv._batch, None
    try:
        return _capture(stage)
    finally:
        drv._batch = batch


def _capture_flags(stage: Stage, kernels: bool) -> torch.cuda.CUDAGraph:
    """The step captured with every captured message's flags written and waited on by kernels (``kernels``) or
    by stream memory operations, whatever ``TENSORWIRE_CE_GRAPH_FLAGS`` would choose (``--ab-kernels``)."""
    from tensorwire.transport.ce.graphs import Capture

    real = Capture._flag_kernels
    Capture._flag_kernels = lambda self, device: kernels and self.driver.flag_kernels(device)  # type: ignore[method-assign]
    try:
        return _capture(stage)
    finally:
        Capture._flag_kernels = real  # type: ignore[method-assign]


def check(rank: int, device: torch.device, group) -> list[str]:
    failures = []
    for micro in (1, 4):
        eager = Stage(rank, 64, micro, device, group)
        for _ in range(101):
            eager.step()
        torch.cuda.synchronize()
        cap = Stage(rank, 64, micro, device, group)
        g = _capture(cap)  # 1 eager step + capture
        for _ in range(100):
            g.replay()
        torch.cuda.synchronize()
        if not torch.equal(eager.w, cap.w):
            failures.append(
                f"{micro} microbatch(es): weights after 100 replays differ from 100 eager steps "
                f"({eager.checksum()} vs {cap.checksum()})"
            )
        del g
    return failures


def timed(fn, n: int) -> tuple[float, float]:
    """(median step seconds, median host seconds of the call) over n steps."""
    steps, host = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        steps.append(t2 - t0)
    return statistics.median(steps), statistics.median(host)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--acts", default="1,16,64", help="activation MiB per microbatch (comma-separated)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micros", default="2,16", help="microbatches per step (2 x that many messages per rank)")
    ap.add_argument("--nccl-capture", action="store_true", help="also capture NCCL's step (eager NCCL always runs)")
    ap.add_argument(
        "--stall-s",
        type=float,
        default=0.0,
        help="print every thread's stack and exit if the run takes longer than this (0: never)",
    )
    ap.add_argument(
        "--ab-flags",
        action="store_true",
        help="also capture tensorwire's step with each flag wait and its reset as two graph nodes instead of one "
        "batch (the code before), replayed in turns with the rest (diagnostic; the checksums then differ from NCCL's)",
    )
    ap.add_argument(
        "--ab-kernels",
        action="store_true",
        help="also capture tensorwire's step with its flags by kernels and by stream memory operations, whatever "
        "TENSORWIRE_CE_GRAPH_FLAGS chooses, replayed in turns with the rest (the host time per replay of each)",
    )
    ap.add_argument(
        "--teardown-s",
        type=float,
        default=60.0,
        help="how long the groups' teardown may take at the end before the run leaves without it",
    )
    ap.add_argument("--turns", type=int, default=1, help="measure the modes of a row in this many turns")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also time each rank's kernels of the step captured with no message at all; their sum is the step "
        "a transport that took no time would give (the two stages run one after the other in this step)",
    )
    args = ap.parse_args()
    if args.stall_s > 0:  # (a hung capture or replay shows where it waits)
        faulthandler.dump_traceback_later(args.stall_s, exit=True)
    # which calls the captured flags make (stream memory operations or kernels), said once per pair in the log
    flags_log = logging.getLogger("tensorwire.transport.ce.graphs")
    flags_log.setLevel(logging.INFO)
    flags_log.addHandler(logging.StreamHandler(sys.stderr))
    acts = [int(a) for a in args.acts.split(",") if a]
    if not acts or min(acts) < 1 or args.steps < 3:
        ap.error("--acts >= 1 MiB each, --steps >= 3")
    if not args.teardown_s > 0:
        ap.error(f"--teardown-s must be > 0 seconds, got {args.teardown_s}")
    if args.ab_kernels and tensorwire.native.status().get("tensorwire.transport.ce.graphs") == "compiled":
        # (_capture_flags swaps a method of Capture, which a compiled class does not allow)
        ap.error(
            "--ab-kernels needs the pure-Python copy-engine modules; this tensorwire is compiled (tensorwire.native)"
        )
    rank = int(os.environ["RANK"])
    ngpu = torch.cuda.device_count()
    device = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(device)
    dist.init_process_group("tensorwire")
    groups = {"tensorwire": dist.group.WORLD}
    if ngpu >= 2:
        groups["nccl"] = dist.new_group(backend="nccl")
    for grp in groups.values():
        # one blocking send/recv pair first: NCCL 2.28 faulted, or truncated messages, when a group's first
        # point-to-point was a batch (see bench/bench_distributed_gpu.py); every group gets it alike
        t = torch.zeros(1, device=device)
        if rank == 0:
            dist.send(t, 1, group=grp)
            dist.recv(t, 1, group=grp)
        else:
            dist.recv(t, 0, group=grp)
            dist.send(t, 0, group=grp)
        torch.cuda.synchronize()
    if args.check:
        failures = check(rank, device, groups["tensorwire"])
        out: list = [None, None]
        dist.all_gather_object(out, failures)
        dist.destroy_process_group()
        if rank == 0:
            bad = [f for fs in out for f in (fs or [])]
            print("\n".join(bad) if bad else "GRAPH CHECKS PASSED", flush=True)
            return 1 if bad else 0
        return 0
    rows_of = {a: a * MIB // (WIDTH * 2) for a in acts}
    results = []
    micros = [int(m) for m in args.micros.split(",") if m]
    for a in acts:
        for micro in micros:
            row: dict = {"act_mib": a, "micro": micro, "messages_per_rank": 2 * micro}
            for name, grp in list(groups.items()):
                st = Stage(rank, rows_of[a], micro, device, grp)
                if rank == 0:
                    print(f"[graph bench] {a} MiB x {micro}: {name}", file=sys.stderr, flush=True)
                if name == "nccl" and not args.nccl_capture:
                    st.step()
                    step, host = timed(st.step, args.steps)
                    row["nccl_eager_ms"], row["nccl_eager_host_us"] = step * 1e3, host * 1e6
                    row["nccl_checksum"] = st.checksum()  # (not the same steps as tensorwire's: not compared)
                    continue
                try:
                    g = _capture(st)
                except Exception as exc:  # noqa: BLE001 - reported, and that backend leaves the run
                    row[f"{name}_error"] = f"capture failed: {type(exc).__name__}: {str(exc)[:200]}"
                    if rank == 0:
                        print(f"{name}: capture failed: {exc}", flush=True)
                    del groups[name]
                    continue
                modes = [("eager", st.step), ("captured", g.replay)]
                if args.ab_flags and name == "tensorwire":
                    modes.append(("unbatched", _capture_unbatched(st).replay))
                if args.ab_kernels and name == "tensorwire":
                    modes.append(("memops", _capture_flags(st, False).replay))
                    modes.append(("kernels", _capture_flags(st, True).replay))
                got: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m, _ in modes}
                for _turn in range(max(1, args.turns)):
                    for mode, fn in modes:
                        fn()
                        step, host = timed(fn, args.steps)
                        got[mode][0].append(step)
                        got[mode][1].append(host)
                for mode, (steps, hosts) in got.items():
                    row[f"{name}_{mode}_ms"] = statistics.median(steps) * 1e3
                    row[f"{name}_{mode}_host_us"] = statistics.median(hosts) * 1e6
                torch.cuda.synchronize()
                row[f"{name}_checksum"] = st.checksum()
                del g, modes
            if args.floor:  # each rank's compute alone, captured; rank 0 adds rank 1's (sent over the group)
                st = Stage(rank, rows_of[a], micro, device, None)
                g = _capture(st)
                g.replay()
                own, _host = timed(g.replay, args.steps)
                t = torch.tensor([own], dtype=torch.float64)
                if rank == 0:
                    dist.recv(t, 1, group=groups["tensorwire"])
                    row["floor_ranks_ms"] = [own * 1e3, float(t[0]) * 1e3]
                    row["floor_ms"] = sum(row["floor_ranks_ms"])
                else:
                    dist.send(t, 0, group=groups["tensorwire"])
                del g
            # the weights are compared only where both backends ran the same steps (NCCL captured too, no extra
            # tensorwire modes)
            row["same_steps"] = "nccl_captured_ms" in row and not (args.ab_flags or args.ab_kernels)
            results.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0 and args.out:  # (before the groups go: a hang tearing one down must not lose the figures)
        _report(args.out, results, ngpu, torch.cuda.get_device_name(device))
    return _teardown(groups, rank, args.teardown_s)


def _teardown(groups: dict, rank: int, limit_s: float) -> int:
    """Destroy NCCL's group first, then the default one, within ``limit_s`` seconds; past it, say so and leave.

    After a captured NCCL step NCCL's group has hung in ``destroy_process_group`` on two GPUs of one host
    (``graph-gpu_h200x2_2026-11-29-3``), with every figure already written. The run then ends with status 0
    and one line naming the hang, instead of the stall timer's traceback and status 1.
    """
    import threading

    faulthandler.cancel_dump_traceback_later()
    if torch.cuda.is_available():
        torch.cuda.synchronize()

    def destroy() -> None:
        if "nccl" in groups:
            dist.destroy_process_group(groups["nccl"])
        dist.destroy_process_group()

    th = threading.Thread(target=destroy, name="teardown", daemon=True)
    th.start()
    th.join(limit_s)
    if th.is_alive():
        print(
            f"rank {rank}: destroy_process_group did not return within {limit_s:g} s (NCCL's group after a "
            "captured step); the figures are written, leaving without it",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(0)
    return 0


def _report(out: str, rows: list[dict], ngpu: int, name: str) -> None:
    nccl = ngpu >= 2
    lines = [
        "# A training step captured in a CUDA graph: backend tensorwire" + (" vs NCCL" if nccl else ""),
        "",
        f"{_dt.date.today().isoformat()}; {'two GPUs' if nccl else 'one GPU, two processes'} ({name}); "
        "`torchrun --standalone --nproc-per-node 2 bench/bench_graph_gpu.py`. Two stages (bf16, width 4096), "
        "activations per microbatch as given, every point-to-point inside the step; median step time "
        "(device synchronized) and host time of the call (`step()` eager, `replay()` captured).",
        "",
        "| activation | microbatches (messages per rank) | tw eager | tw captured | tw captured host |"
        + (" NCCL eager | NCCL captured | NCCL captured host | tw/NCCL captured |" if nccl else ""),
        "| --- | --- | ---: | ---: | ---: |" + (" ---: | ---: | ---: | ---: |" if nccl else ""),
    ]
    for r in rows:
        host = f"{r['tensorwire_captured_host_us']:.0f} us"
        if "tensorwire_unbatched_host_us" in r:  # (--ab-flags: the unbatched graph's figures beside)
            host += (
                f" (unbatched flags: {r['tensorwire_unbatched_host_us']:.0f} us, step "
                f"{r['tensorwire_unbatched_ms']:.2f} ms)"
            )
        for mode in ("memops", "kernels"):  # (--ab-kernels)
            if f"tensorwire_{mode}_host_us" in r:
                host += (
                    f"; flags by {mode}: {r[f'tensorwire_{mode}_host_us']:.0f} us, step "
                    f"{r[f'tensorwire_{mode}_ms']:.2f} ms"
                )
        line = (
            f"| {r['act_mib']} MiB | {r['micro']} ({r['messages_per_rank']}) | {r['tensorwire_eager_ms']:.2f} ms | "
            f"{r['tensorwire_captured_ms']:.2f} ms | {host} |"
        )
        if nccl:
            eager = f"{r['nccl_eager_ms']:.2f} ms" if "nccl_eager_ms" in r else "-"
            if "nccl_captured_ms" in r:
                line += (
                    f" {eager} | {r['nccl_captured_ms']:.2f} ms | {r['nccl_captured_host_us']:.0f} us"
                    f" | {r['tensorwire_captured_ms'] / r['nccl_captured_ms']:.2f} |"
                )
            else:
                line += f" {eager} | {r.get('nccl_error', 'not captured (run with --nccl-capture)')} | - | - |"
        lines.append(line)
    floors = [r for r in rows if "floor_ms" in r]
    if floors:
        lines += [
            "",
            "The floor (`--floor`): each rank's kernels of the same step captured with no message at all, and their "
            "sum -- in this step the two stages run one after the other, so a transport that took no time would "
            "give that step. A target of x times NCCL's captured step is out of reach for any transport where the "
            "floor alone is above x times it.",
            "",
            "| activation | microbatches | floor (rank 0 + rank 1) | tw captured / floor |"
            + (" floor / NCCL captured | NCCL captured / floor |" if nccl else ""),
            "| --- | --- | ---: | ---: |" + (" ---: | ---: |" if nccl else ""),
        ]
        for r in floors:
            f0, f1 = r["floor_ranks_ms"]
            line = (
                f"| {r['act_mib']} MiB | {r['micro']} | {r['floor_ms']:.2f} ms ({f0:.2f} + {f1:.2f}) | "
                f"{r['tensorwire_captured_ms'] / r['floor_ms']:.2f} |"
            )
            if nccl and "nccl_captured_ms" in r:
                nccl_ms = r["nccl_captured_ms"]
                line += f" {r['floor_ms'] / nccl_ms:.2f} | {nccl_ms / r['floor_ms']:.2f} |"
            elif nccl:
                line += " - | - |"
            lines.append(line)
    same = [r for r in rows if r.get("same_steps") and "nccl_checksum" in r and "tensorwire_checksum" in r]
    agree = sum(r["nccl_checksum"] == r["tensorwire_checksum"] for r in same)
    if same:
        compared = (
            f"the weights' checksums after the run agree between tensorwire and NCCL in {agree} of {len(same)} rows "
            "(the same bytes arrived)"
        )
    else:
        compared = (
            "the weights are not compared in this run: NCCL ran only eager steps (no `--nccl-capture`) or tensorwire "
            "ran extra flag modes (`--ab-flags`, `--ab-kernels`), so the two took different steps"
        )
    lines += [
        "",
        "Each backend and size trains its own copy from the same start through the same modes (warm-up, capture "
        f"where captured, the eager and the captured steps); {compared}. "
        "`--check` compares captured against eager steps bit for bit.",
    ]
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({"gpus": ngpu, "device": name, "rows": rows}, f, indent=1)
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
