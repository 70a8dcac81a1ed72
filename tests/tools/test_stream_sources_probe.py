"""bench/probe_stream_sources.py: one turn end to end (the figures are not checked, only that every row, path
and layout is there and positive), and the layouts it measures."""

from __future__ import annotations

import re

import pytest

from bench_scripts import bench_script, run_bench

pytestmark = pytest.mark.timeout(240)


def test_each_row_and_path_gets_the_bench_layout_and_the_demo_layout():
    p = bench_script("probe_stream_sources")
    v = p._variants(p.ROWS)
    assert len(v) == len(set(v))
    for i, (_label, _size, m) in enumerate(p.ROWS):
        for path in p.PATHS:
            mine = {(k, b) for r, q, k, b, w in v if r == i and q == path and not w}
            assert mine == {(k, b) for k in (1, m) for b in (2, m)}  # (m == 2: the layouts coincide)
            assert [(k, b) for r, q, k, b, w in v if r == i and q == path and w] == [(1, 2)]


def test_one_turn_prints_every_row_and_path():
    out = run_bench("probe_stream_sources.py", "--turns", "1", timeout=220)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln for ln in out.stdout.splitlines() if re.match(r"\| (1|64) MiB stream \|", ln)]
    assert len(rows) == 4, out.stdout
    for ln in rows:
        rates = [float(x) for x in re.findall(r"([0-9.]+) GB/s", ln)]
        assert len(rates) == 5 and all(r > 0 for r in rates), ln
