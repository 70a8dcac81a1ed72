"""bench/probe_cma_split.py and bench/profile_stream.py: one short run each, end to end (figures not checked: each
size gets the three mechanisms and positive rates, the split's bytes arrive intact -- the probe checks them and
exits non-zero otherwise -- and the profile names both sides with their rates)."""

from __future__ import annotations

import re

import pytest

from bench_scripts import run_bench

pytestmark = pytest.mark.timeout(240)


def test_the_split_probe_measures_every_mechanism_at_every_size():
    from tensorwire.transport.cma import supported

    if not supported():
        pytest.skip("no cross-memory attach on this host")
    out = run_bench("probe_cma_split.py", "--turns", "1", "--sizes", "64K,1M", "--messages", "4", timeout=220)
    if out.returncode and ("Operation not permitted" in out.stdout + out.stderr):
        pytest.skip("this host does not let one process copy into another (ptrace rules)")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [ln for ln in out.stdout.splitlines() if re.match(r"\| (64|1024) KiB \|", ln)]
    assert len(rows) == 2, out.stdout
    for ln in rows:
        rates = [float(x) for x in re.findall(r"([0-9.]+) GB/s", ln)]
        assert len(rates) == 3 and all(r > 0 for r in rates), ln


def test_the_stream_profile_prints_both_sides():
    out = run_bench(
        "profile_stream.py", "--bytes", "256K", "--rounds", "4", "--messages", "4", "--top", "3", timeout=220
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for side in ("rank 0 (sender)", "rank 1 (receiver)"):
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(side)), None)
        assert line is not None, out.stdout
        assert float(re.search(r"([0-9.]+) GB/s", line).group(1)) > 0, line
    assert out.stdout.count("function calls") == 2
