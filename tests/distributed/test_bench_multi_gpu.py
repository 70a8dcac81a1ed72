"""``bench/bench_multi_gpu.py`` without a GPU: a clear refusal, its argument checks, and a CPU dry run on 3 ranks
(gloo stands in for NCCL)."""

from __future__ import annotations

import json
import subprocess

import pytest
from bench_scripts import run_bench

torch = pytest.importorskip("torch")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_bench("bench_multi_gpu.py", *args, timeout=timeout)


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_refuses_clearly_without_cuda(tmp_path):
    res = _run("--out", str(tmp_path / "m.md"), timeout=50)
    assert res.returncode == 2, res
    assert "CUDA is not available" in res.stderr
    assert not (tmp_path / "m.md").exists()


@pytest.mark.timeout(240)
def test_cpu_dry_run_reports_both_backends_equal_losses_and_no_corruption(tmp_path):
    out = tmp_path / "m.md"
    args = ["--device", "cpu", "--nproc", "3", "--acts", "1", "--ring-mib", "1", "--width", "128"]
    args += ["--steps", "2", "--rounds", "1", "--microbatches", "4", "--check", "--machine", "ci"]
    res = _run(*args, "--out", str(out), "--timeout", "200", timeout=220)
    missed = [line for line in res.stderr.splitlines() if line.startswith("[multi bench] missed: ")]
    # --check: exit 1 exactly when a target is missed; on a CPU only the speed targets may be
    assert res.returncode == (1 if missed else 0), res.stderr[-3000:] + res.stdout[-3000:]
    assert all("step" in line or "total GB/s" in line for line in missed), missed
    text = out.read_text()
    for heading in ("## torch.distributed.pipelining: 3 ranks", "## Ring: every rank streams", "## Targets"):
        assert heading in text, text
    assert "| 1f1b | 1 MiB |" in text and "| interleaved-1f1b | 1 MiB |" in text
    assert "| 1 MiB |" in text and "(ci)" in text and f"torch {torch.__version__}" in text
    results = json.loads(out.with_suffix(".json").read_text())
    assert sorted(results) == ["0", "1", "2"]
    for r in results.values():
        assert set(r["pipelining"]) == {"1f1b/1", "interleaved-1f1b/1"}
        for v in r["pipelining"].values():
            assert v["gloo"]["step"] > 0 and v["tensorwire"]["step"] > 0
        ring = r["ring"]["1"]
        assert ring["gloo"]["seconds"] > 0 and ring["tensorwire"]["seconds"] > 0
        assert ring["gloo"]["corrupt"] == 0 and ring["tensorwire"]["corrupt"] == 0, ring
    for key, v in results["2"]["pipelining"].items():  # the last stage: the same model and data, the same loss
        assert v["gloo"]["loss"] is not None and v["gloo"]["loss"] == v["tensorwire"]["loss"], (key, v)
    assert results["0"]["transport"] == {"1": "tcp", "2": "tcp"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args,message",
    [
        (("--parts", "ring,bogus"), "--parts 'ring,bogus': choose one or more of pipelining,ring"),
        (("--ring-mib", "1,x"), "'1,x' is not a comma-separated list of MiB counts"),
        (("--acts", "0"), "--acts: sizes in MiB, each at least 1"),
        (("--nproc", "1"), "--nproc must be at least 2, got 1"),
        (("--microbatches", "2"), "Schedule1F1B needs at least as many microbatches as stages (4), got 2"),
        (("--nproc", "3", "--microbatches", "7"), "ScheduleInterleaved1F1B needs the microbatches to be a multiple"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    out = tmp_path / "m.md"
    res = _run("--device", "cpu", *args, "--out", str(out), timeout=50)
    assert res.returncode == 2, res
    assert message in res.stderr, res.stderr
    assert not out.exists()
