"""``bench/profile_ce_pair_cpu.py``: the copy-engine pair's own host time per message, driver free, on CPU."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from bench_scripts import run_bench

pytest.importorskip("torch")


def _leftovers() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("tw-ce-pair-*")}


@pytest.mark.timeout(120)
def test_both_orders_are_timed_the_bytes_checked_and_the_region_removed():
    before = _leftovers()
    res = run_bench("profile_ce_pair_cpu.py", "--messages", "300", "--bytes", "1000", "--profile", timeout=100)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    assert re.search(r"^build: (pure Python|compiled \(\d+/\d+ modules\)|partly compiled)", res.stdout, re.M)
    times = re.findall(r"^(receiver first|sender first) +([\d.]+) us per message per side", res.stdout, re.M)
    assert [k for k, _ in times] == ["receiver first", "sender first"]
    assert all(float(us) > 0 for _, us in times)
    assert "function calls" in res.stdout  # --profile printed cProfile's table
    assert _leftovers() == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--messages", "0"], ["--bytes", "0"]])
def test_it_refuses_nothing_to_time(args):
    res = run_bench("profile_ce_pair_cpu.py", *args, timeout=50)
    assert res.returncode == 2
    assert "--messages >= 1 and --bytes >= 1" in res.stderr
