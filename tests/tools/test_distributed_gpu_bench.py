"""``bench/bench_distributed_gpu.py`` without a GPU: a clear refusal, and a CPU dry run (gloo stands in for NCCL)."""

from __future__ import annotations

import json
import subprocess

import pytest
from bench_scripts import bench_script, run_bench

torch = pytest.importorskip("torch")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_bench("bench_distributed_gpu.py", *args, timeout=timeout)


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_refuses_clearly_without_cuda(tmp_path):
    res = _run("--out", str(tmp_path / "d.md"), timeout=50)
    assert res.returncode == 2, res
    assert "CUDA is not available" in res.stderr
    assert not (tmp_path / "d.md").exists()


@pytest.mark.timeout(240)
def test_cpu_dry_run_reports_every_part_and_equal_losses(tmp_path):
    out = tmp_path / "d.md"
    args = ["--device", "cpu", "--max-mib", "1", "--acts", "1", "--steps", "2", "--rounds", "1", "--width", "256"]
    res = _run(*args, "--out", str(out), "--timeout", "200", timeout=220)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    text = out.read_text()
    for heading in ("## Point-to-point", "## Overlap", "## torch.distributed.pipelining"):
        assert heading in text, text
    assert "| 1 MiB |" in text
    results = json.loads(out.with_suffix(".json").read_text())
    pipe = results["1"]["pipelining"]
    assert set(pipe) == {"gpipe/1", "1f1b/1"}
    for key, v in pipe.items():  # the same model and data over either backend: the same loss
        assert v["gloo"]["loss"] == v["tensorwire"]["loss"], (key, v)
    assert results["0"]["transport"] == {"1": "tcp"}
    # the checkout's tensorwire ran (no --tree): the report says which hot path, here the checkout's own
    assert results["0"]["hot_path"] == results["1"]["hot_path"]
    assert f"hot path {results['0']['hot_path']}." in text


@pytest.mark.timeout(60)
def test_a_tree_without_tensorwire_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "d.md"
    res = _run("--device", "cpu", "--tree", str(tmp_path), "--out", str(out), timeout=50)
    assert res.returncode == 2, res
    assert f"--tree {tmp_path}: no tensorwire package there" in res.stderr
    assert not out.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args,message",
    [
        (("--parts", "p2p,bogus"), "--parts 'p2p,bogus': choose one or more of p2p,overlap,pipelining"),
        (("--parts", ","), "--parts ',': choose one or more of"),
        (("--acts", "1,x"), "'1,x' is not a comma-separated list of MiB counts"),
        (("--acts", "0"), "--acts: activation sizes in MiB, each at least 1"),
        (("--steps", "0"), "--steps must be at least 1, got 0"),
        (("--max-mib", "-1"), "--max-mib must be at least 1, got -1"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    out = tmp_path / "d.md"
    res = _run("--device", "cpu", *args, "--out", str(out), timeout=50)
    assert res.returncode == 2, res
    assert message in res.stderr, res.stderr
    assert not out.exists()


@pytest.mark.timeout(60)
def test_a_part_left_out_gets_no_section():
    import argparse

    b = bench_script("bench_distributed_gpu")
    args = argparse.Namespace(device="cuda", rounds=1, steps=2, max_mib=1, acts=[1], tree=None, machine="m", width=256)
    step = {"nccl": {"step": 0.002, "loss": 1.5}, "tensorwire": {"step": 0.001, "loss": 1.5}}
    rank = {
        "ref": "nccl",
        "device": "cuda:0",
        "transport": {"1": "tcp+ce"},
        "hot_path": "pure Python",
        "p2p": {
            "1048576": {"pingpong": {"nccl": 1e-4, "tensorwire": 5e-5}, "stream": {"nccl": 1e-4, "tensorwire": 1e-4}}
        },
        "overlap": {},
        "pipelining": {"gpipe/1": step},
    }
    text = b.report({0: rank, 1: dict(rank, device="cuda:1")}, args, 1.0, "2 x GPU")
    assert "## Point-to-point" in text and "| 1 MiB | 21.0 | 41.9 | 2.00x |" in text
    assert "## torch.distributed.pipelining" in text and "| gpipe | 1 MiB | 2.00 ms | 1.00 ms | 0.50x |" in text
    assert "## Overlap" not in text  # (--parts p2p,pipelining: it printed a heading over an empty table before)
