"""``bench/bench_overlap_gpu.py`` without a GPU: a CPU dry run on 2 ranks under torchrun (gloo stands in for
NCCL), and its argument checks."""

from __future__ import annotations

import json

import pytest
from bench_scripts import run_bench

torch = pytest.importorskip("torch")


@pytest.mark.timeout(180)
def test_cpu_dry_run_reports_both_backends_and_no_corruption(tmp_path):
    out = tmp_path / "o.md"
    args = ["--device", "cpu", "--dim", "256", "--mib", "1", "--matmuls", "3", "--rounds", "3", "--turns", "1"]
    res = run_bench("bench_overlap_gpu.py", *args, "--machine", "ci", "--out", str(out), timeout=160)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    assert "[overlap bench] turn 1/1: tensorwire ..." in res.stderr
    assert "[overlap bench] turn 1/1: gloo ..." in res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert {(r["backend"], r["mode"]) for r in lines} == {
        (b, m) for b in ("tensorwire", "gloo") for m in ("overlap", "matmul", "messages")
    }
    text = out.read_text()
    assert "(ci)" in text and f"torch {torch.__version__}" in text and "target (issue): tensorwire moves" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert {"tensorwire", "gloo"} <= set(rows), text
    for name in ("tensorwire", "gloo"):
        assert rows[name].rstrip().endswith("| 0 |"), rows[name]  # the corrupt-element column
    raw = json.loads(out.with_suffix(".json").read_text())
    for name in ("tensorwire", "gloo"):
        s = raw["summary"][name]
        assert s["corrupt"] == 0, s
        assert s["tflops_alone"] > 0 and s["tflops_overlap"] > 0 and s["gbps_alone"] > 0 and s["gbps_overlap"] > 0
    assert all(r["corrupt"] == 0 for r in raw["runs"]), raw["runs"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--dim", "--matmuls", "--mib", "--rounds", "--turns"])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, flag):
    out = tmp_path / "o.md"
    res = run_bench("bench_overlap_gpu.py", "--device", "cpu", flag, "0", "--out", str(out), timeout=50)
    assert res.returncode == 2, res
    assert f"{flag} must be at least 1, got 0" in res.stderr, res.stderr
    assert not out.exists()


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_refuses_clearly_without_cuda(tmp_path):
    res = run_bench("bench_overlap_gpu.py", "--out", str(tmp_path / "o.md"), timeout=50)
    assert res.returncode == 2, res
    assert "CUDA is not available" in res.stderr
    assert not (tmp_path / "o.md").exists()
