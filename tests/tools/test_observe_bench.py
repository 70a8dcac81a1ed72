"""bench/bench_observe.py runs end to end and prints its table (a tiny run: the figures are not checked)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_bench_observe_prints_every_row_with_ratios():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_observe.py"), "--pairs", "1", "--burst", "20"],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    for label in (
        "Link over TCP, one thread (4 calls per round trip)",
        "the same, off vs off (the noise floor: nothing differs)",
        "backend tensorwire over TCP, 2 ranks (rank 0, 2 calls per round trip)",
    ):
        cells = [c.strip() for c in rows[label].split("|")[2:-1]]
        assert len(cells) == 4 and all(float(c.split()[0]) > 0 for c in cells), rows[label]
    for label in (
        "Link.send hook, counting on",
        "record_function, no profiler",
        "profiler flag check (what the hooks do)",
    ):
        assert float(rows[label].split("|")[2]) > 0
