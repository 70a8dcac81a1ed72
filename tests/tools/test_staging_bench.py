"""``bench/bench_staged_gpu.py`` without a GPU: refuses clearly, and its process plumbing works (CPU dry run)."""

from __future__ import annotations

import subprocess

import pytest
from bench_scripts import run_bench

torch = pytest.importorskip("torch")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_bench("bench_staged_gpu.py", *args, timeout=timeout, keep_transport=True)


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_bench_exits_non_zero_with_a_clear_message_without_cuda(tmp_path):
    out = tmp_path / "staged.md"
    res = _run("--out", str(out), timeout=100)
    assert res.returncode == 2, res
    assert "CUDA is not available" in res.stderr and "Nothing was measured" in res.stderr
    assert not out.exists()


@pytest.mark.timeout(300)
def test_bench_cpu_dry_run_writes_the_side_by_side_table(tmp_path):
    out, js = tmp_path / "staged.md", tmp_path / "staged.json"
    res = _run(
        "--cpu-dry-run",
        "--sizes",
        "64K,256K",
        "--budget",
        "1M",
        "--max-iters",
        "5",
        "--timeout",
        "200",
        "--out",
        str(out),
        "--json",
        str(js),
        timeout=280,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = out.read_text()
    assert "CPU DRY RUN" in text
    assert "| size | pinned D2H | pinned H2D | raw TCP socket | bound = min |" in text
    rows = [line for line in text.splitlines() if line.startswith("| 64 KiB") or line.startswith("| 256 KiB")]
    assert len(rows) == 2 and all("–" not in r.split("|")[4] for r in rows), rows  # every column measured
    import json

    data = json.loads(js.read_text())
    assert set(data["staged"]) == set(data["unchunked"]) == set(data["socket"]) == {"65536", "262144"}
    assert data["errors"] == []


@pytest.mark.timeout(60)
def test_bench_rejects_a_bad_chunk_before_starting_anything():
    res = _run("--cpu-dry-run", "--chunk", "lots", timeout=50)
    assert res.returncode != 0 and "TENSORWIRE_STAGING_CHUNK" in res.stderr
