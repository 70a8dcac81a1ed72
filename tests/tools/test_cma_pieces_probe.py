"""bench/probe_cma_pieces.py: one short turn end to end (the figures are not checked, only that every size gets
the socket and every piece size, each positive, and that the paths the Link counted are named)."""

from __future__ import annotations

import re

import pytest

from bench_scripts import bench_script, run_bench

pytestmark = pytest.mark.timeout(240)


def test_variants_put_the_socket_and_every_piece_size_in_each_turn():
    p = bench_script("probe_cma_pieces")
    v = p._variants([1 << 20, 4 << 20], [1 << 20, 256 << 10])
    assert sorted(v) == sorted((s, q) for s in (1 << 20, 4 << 20) for q in (0, 1 << 20, 256 << 10))


def test_one_turn_prints_every_size_and_piece():
    out = run_bench("probe_cma_pieces.py", "--turns", "1", "--sizes", "256K,1M", "--pieces", "1M,128K", timeout=220)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln for ln in out.stdout.splitlines() if re.match(r"\| (256|1024) KiB \|", ln)]
    assert len(rows) == 2, out.stdout
    for ln in rows:
        rates = [float(x) for x in re.findall(r"([0-9.]+) GB/s", ln)]
        assert len(rates) == 3 and all(r > 0 for r in rates), ln
    paths = next(ln for ln in out.stdout.splitlines() if ln.startswith("# paths the link"))
    assert "'cma'" in paths or "'tcp'" in paths, paths  # (cma where this host lets one process write another)
