"""bench/probe_stream_sources.py: one turn end to end (the figures are not checked, only that every row, path
and layout is there and positive), and the layouts it measures."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROBE = ROOT / "bench" / "probe_stream_sources.py"

pytestmark = pytest.mark.timeout(240)


def _load():
    spec = importlib.util.spec_from_file_location("probe_stream_sources", PROBE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_row_and_path_gets_the_bench_layout_and_the_demo_layout():
    p = _load()
    v = p._variants(p.ROWS)
    assert len(v) == len(set(v))
    for i, (_label, _size, m) in enumerate(p.ROWS):
        for path in p.PATHS:
            mine = {(k, b) for r, q, k, b in v if r == i and q == path}
            assert mine == {(k, b) for k in (1, m) for b in (2, m)}  # (m == 2: the layouts coincide)


def test_one_turn_prints_every_row_and_path():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, str(PROBE), "--turns", "1"], capture_output=True, text=True, timeout=220, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln for ln in out.stdout.splitlines() if re.match(r"\| (1|64) MiB stream \|", ln)]
    assert len(rows) == 4, out.stdout
    for ln in rows:
        rates = [float(x) for x in re.findall(r"([0-9.]+) GB/s", ln)]
        assert len(rates) == 4 and all(r > 0 for r in rates), ln
