"""examples/pipeline_parallel.py under the real torchrun: same loss and parameters as one process.

Each test starts ``python -m torch.distributed.run --standalone`` (free ports
chosen by the agent) in its own session, bounded by a timeout, and kills the
whole process group in ``finally``.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys

import pytest
import torch

from netns import EXAMPLE, child_env, run, tail, torchrun_standalone

STEPS = 8
MICROBATCHES = 4


def load_example():
    """The example as a module (its model, data and single-process reference training)."""
    name = "pipeline_parallel_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve string annotations through sys.modules
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod


def reference(steps: int = STEPS, microbatches: int = MICROBATCHES, **cfg):
    ex = load_example()
    config = ex.Config(steps=steps, microbatches=microbatches, **cfg)
    model, losses = ex.train_reference(config)
    return ex.global_params(model), losses


def load_stages(out_dir, world: int) -> tuple[dict[str, torch.Tensor], list[float], list[dict]]:
    params, losses, metas = {}, [], []
    for r in range(world):
        got = torch.load(out_dir / f"stage{r}.pt")
        assert not set(got["params"]) & set(params), "two stages claim the same parameter"
        params.update(got["params"])
        if r == world - 1:
            losses = got["losses"]
        metas.append(got)
    return params, losses, metas


def assert_matches_reference(params, losses, ref_params, ref_losses, *, rtol=1e-4, atol=1e-6):
    assert set(params) == set(ref_params), "the stages together must hold every parameter exactly once"
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=rtol, atol=atol, msg=f"parameter {name}")
    assert len(losses) == len(ref_losses)
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=atol), f"step {i}: loss {a} vs single-process {b}"


CASES = [
    pytest.param(2, "tcp", "auto", id="2-tcp"),
    # --overlap on: sends are isends waited for at the end of the step (the CUDA default), here on CPU:
    # over UCX posted in the caller's thread, over TCP queued on the link's sender thread.
    pytest.param(2, "auto", "on", id="2-auto-overlap"),
    pytest.param(4, "tcp", "on", id="4-tcp-overlap"),
    pytest.param(4, "auto", "auto", id="4-auto", marks=pytest.mark.slow),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc,transport,overlap", CASES)
def test_pipeline_matches_single_process_training(tmp_path, nproc, transport, overlap):
    out = tmp_path / "params"
    cmd = torchrun_standalone(
        nproc,
        "--steps",
        str(STEPS),
        "--microbatches",
        str(MICROBATCHES),
        "--transport",
        transport,
        "--overlap",
        overlap,
        "--check",
        "--save-params",
        str(out),
    )
    rc, log = run(cmd, env=child_env(TENSORWIRE_TIMEOUT="60"), log=tmp_path / "torchrun.log", timeout=150)
    assert rc == 0, tail(log)
    # every rank's own --check passed, the last rank printed every step's loss, both ends their throughput
    assert log.count("check OK") == nproc, tail(log)
    assert len(re.findall(r"step +\d+ loss ", log)) == STEPS, tail(log)
    for r in (0, nproc - 1):
        assert re.search(rf"\[rank {r}\] summary: {STEPS} steps, [\d.]+ MiB exchanged .* MiB/s", log), tail(log)
    params, losses, metas = load_stages(out, nproc)
    ref_params, ref_losses = reference()
    assert_matches_reference(params, losses, ref_params, ref_losses)
    assert all(m["overlap"] == (overlap == "on") for m in metas), metas  # CPU stages: auto means off
    used = {t for m in metas for t in m["transports"].values()}
    if transport == "tcp":
        assert used == {"tcp"}
    else:
        assert used <= {"tcp", "ucx"} and used, used
    # the loss goes down over the run (lr and model are set up to train visibly)
    assert losses[-1] < losses[0] * 1.5


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path):
    """Rank 1 SIGKILLs itself at step 7 on the first attempt; torchrun restarts the group (--max-restarts 1),
    tensorwire re-bootstraps under restart count 1, the stages agree on checkpoint step 6 and finish."""
    steps, die_at, every = 12, 7, 3
    out, ckpt = tmp_path / "params", tmp_path / "ckpt"
    cmd = torchrun_standalone(
        2,
        "--steps",
        str(steps),
        "--microbatches",
        str(MICROBATCHES),
        "--transport",
        "tcp",
        "--ckpt-dir",
        str(ckpt),
        "--ckpt-every",
        str(every),
        "--die-at-step",
        str(die_at),
        "--save-params",
        str(out),
        max_restarts=1,
    )
    rc, log = run(
        cmd,
        env=child_env(TENSORWIRE_TIMEOUT="60", TENSORWIRE_PEER_TIMEOUT="10"),
        log=tmp_path / "torchrun.log",
        timeout=200,
    )
    assert rc == 0, tail(log, 120)
    assert f"--die-at-step {die_at}: SIGKILL self (attempt 0)" in log, tail(log)
    first = re.findall(r"\[rank (\d)\] attempt 0 prefix (\S+) .*? start at step 0;", log)
    second = re.findall(r"\[rank (\d)\] attempt 1 prefix (\S+) .*? start at step (\d+);", log)
    assert sorted(r for r, _ in first) == ["0", "1"], tail(log)
    assert sorted(r for r, _, _ in second) == ["0", "1"], tail(log)
    # no stale addresses: the second attempt lives under its own store prefix
    assert all(p.endswith("/0/") for _, p in first) and all(p.endswith("/1/") for _, p, _ in second)
    resumed = {int(s) for _, _, s in second}
    assert resumed == {6}, f"both stages must resume from the newest common checkpoint (6), got {resumed}"
    params, losses, metas = load_stages(out, 2)
    assert all(m["attempt"] == 1 for m in metas)
    ref_params, ref_losses = reference(steps=steps)
    assert_matches_reference(params, losses, ref_params, ref_losses)


@pytest.mark.timeout(150)
def test_gpu_pipeline_bench_dry_run_on_cpu(tmp_path):
    """bench/bench_pipeline_gpu.py without CUDA (gloo instead of NCCL): every variant runs, interleaved,
    and all of them end at the same loss (the same bytes arrive whichever way they travel)."""
    from netns import TORCHRUN

    bench = EXAMPLE.parents[1] / "bench" / "bench_pipeline_gpu.py"
    out = tmp_path / "pipe.json"
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.2",
        str(bench),
        "--hidden",
        "64",
        "--batch",
        "32",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--variants",
        "tensorwire,tensorwire-blocking,nccl,grpc",
        "--out-json",
        str(out),
    ]
    rc, log = run(cmd, env=child_env(TENSORWIRE_TIMEOUT="60"), log=tmp_path / "torchrun.log", timeout=120)
    assert rc == 0, tail(log)
    import json

    ranks = json.loads(out.read_text())["ranks"]
    last = ranks[1]
    assert set(last) == {"tensorwire", "tensorwire-blocking", "nccl", "grpc"}
    losses = {v: r["final_loss"] for v, r in last.items()}
    assert len({round(x, 6) for x in losses.values()}) == 1, losses
    first = ranks[0]
    for v in ("tensorwire", "nccl"):
        assert first[v]["exchange_blocking_ms"] > 0 and first[v]["exchange_overlapped_ms"] > 0
    assert "exchange_overlapped_ms" not in first["grpc"]
