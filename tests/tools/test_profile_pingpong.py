"""``bench/profile_pingpong.py --plain --backend``: the same 4 KiB ping-pong over tensorwire, gloo or the Python floor,
timed without the profiler (what ``perf stat`` around two runs of different lengths compares)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from bench_scripts import BENCH, bench_env

pytest.importorskip("torch")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["tensorwire", "python-floor"])
def test_plain_runs_each_backend_and_prints_its_round_trip(tmp_path, backend):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(BENCH / "profile_pingpong.py"),
        "--plain",
        "--iters",
        "50",
        "--backend",
        backend,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=bench_env())
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    m = re.search(rf"^{backend} round trip 4096 B: ([\d.]+) us \(median of 50\)$", res.stdout, re.M)
    assert m and float(m.group(1)) > 0, res.stdout
    assert "function calls" not in res.stdout  # no profile printed
