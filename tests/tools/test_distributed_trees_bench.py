"""``bench/bench_distributed_trees.py``: two source trees, one ping-pong, in turns; and its refusals."""

from __future__ import annotations

import re
import subprocess

import pytest
from bench_scripts import ROOT, run_bench

pytest.importorskip("torch")


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return run_bench("bench_distributed_trees.py", *args, timeout=timeout, checkout_first=False)


@pytest.mark.timeout(200)
def test_two_trees_in_turns_give_a_row_per_size_and_a_ratio(tmp_path):
    other = tmp_path / "other"
    other.symlink_to(ROOT)  # the same code under a second name; "." (relative to the cwd) names the first
    args = ["--trees", f".,{other}", "--labels", "one,two", "--turns", "2", "--iters", "5", "--sizes", "4K,64K"]
    res = _run(*args, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    for size in ("4 KiB", "64 KiB"):
        row = next(line for line in res.stdout.splitlines() if line.startswith(f"| {size} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 4, row
        for cell in cells[1:3]:  # median (turn, turn)
            assert re.fullmatch(r"\d+\.\d \(\d+, \d+\)", cell), row
        assert re.fullmatch(r"\d+\.\d\dx", cells[3]), row
    assert res.stderr.count("turn ") == 4  # progress: one line per job
    assert "| size | one µs (per turn) | two µs (per turn) | two / one |" in res.stdout


@pytest.mark.timeout(60)
def test_refuses_fewer_than_two_trees_a_directory_without_tensorwire_a_bad_size_and_no_iterations(tmp_path):
    res = _run("--trees", ROOT, timeout=50)
    assert res.returncode == 2 and "at least two" in res.stderr
    res = _run("--trees", f"{ROOT},{tmp_path}", timeout=50)
    assert res.returncode == 2 and "not a tensorwire source tree" in res.stderr
    res = _run("--trees", f"{ROOT},{ROOT}", "--sizes", "4K,4X", timeout=50)
    assert res.returncode == 2 and "--sizes: not a size: '4X'" in res.stderr
    res = _run("--trees", f"{ROOT},{ROOT}", "--iters", "0", timeout=50)
    assert res.returncode == 2 and "--iters and --turns must be >= 1" in res.stderr
