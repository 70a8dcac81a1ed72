"""``bench/probe_pingpong_gaps.py``: receive buffers and idle gaps, tensorwire against gloo; and its refusals."""

from __future__ import annotations

import re

import pytest
from bench_scripts import run_bench

pytest.importorskip("torch")


@pytest.mark.timeout(200)
def test_one_job_gives_a_row_per_backend_buffer_and_gap(tmp_path):
    out = tmp_path / "probe.md"
    args = ["--sizes", "4K", "--iters", "3", "--rounds", "2", "--gaps", "0,0.5", "--out", str(out)]
    res = run_bench("probe_pingpong_gaps.py", *args, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    assert "one two-rank job: 1 size(s), 2 round(s)" in res.stderr  # progress
    text = out.read_text()
    assert text == res.stdout
    buf = re.findall(r"^\| 4 KiB \| (gloo|tensorwire) \| (same|second) \| (\d+\.\d) \| (\d+), (\d+) \|$", text, re.M)
    assert sorted((b, how) for b, how, *_ in buf) == [
        ("gloo", "same"),
        ("gloo", "second"),
        ("tensorwire", "same"),
        ("tensorwire", "second"),
    ]
    for _, _, med, *rounds in buf:  # the median of two rounds lies between them
        lo, hi = sorted(float(r) for r in rounds)
        assert lo - 1 <= float(med) <= hi + 1
    gaps = re.findall(r"^\| 4 KiB \| ([\d.]+) ms \| (gloo|tensorwire) \| (\d+\.\d) \| (\d+\.\d) \|$", text, re.M)
    assert sorted((g, b) for g, b, *_ in gaps) == [
        ("0", "gloo"),
        ("0", "tensorwire"),
        ("0.5", "gloo"),
        ("0.5", "tensorwire"),
    ]
    assert all(float(med) > 0 and float(mean) > 0 for *_, med, mean in gaps)


@pytest.mark.timeout(60)
def test_refuses_no_iterations_a_bad_size_bad_gaps_and_an_unknown_backend():
    res = run_bench("probe_pingpong_gaps.py", "--iters", "0", timeout=50)
    assert res.returncode == 2 and "--iters and --rounds must be >= 1" in res.stderr
    res = run_bench("probe_pingpong_gaps.py", "--sizes", "4K,6", timeout=50)
    assert res.returncode == 2 and "multiple of 4 bytes" in res.stderr
    res = run_bench("probe_pingpong_gaps.py", "--sizes", "4X", timeout=50)
    assert res.returncode == 2 and "--sizes: not a size" in res.stderr
    res = run_bench("probe_pingpong_gaps.py", "--gaps", "1,x", timeout=50)
    assert res.returncode == 2 and "not a list of numbers" in res.stderr
    res = run_bench("probe_pingpong_gaps.py", "--gaps", "-1", timeout=50)
    assert res.returncode == 2 and "between 0 and 1000 ms" in res.stderr
    res = run_bench("probe_pingpong_gaps.py", "--backends", "gloo,nccl", timeout=50)
    assert res.returncode == 2 and "--backends: a comma-separated choice of gloo and tensorwire" in res.stderr


@pytest.mark.timeout(120)
def test_tensorwire_alone_times_no_gloo_messages():
    args = ["--sizes", "4K", "--iters", "3", "--rounds", "1", "--gaps", "0", "--backends", "tensorwire"]
    res = run_bench("probe_pingpong_gaps.py", *args, timeout=110)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| 4 KiB |")]
    assert len(rows) == 3 and all("| tensorwire |" in r for r in rows), rows
