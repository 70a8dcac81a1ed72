"""bench/ce_python_cpu.py: one short turn end to end, with the backend's layer, so its stand-in driver keeps up
with the calls the copy-engine pair makes (it fell behind once: the pair loads its flag kernels at a device's
first message, and the stand-in had no such method). The figures are not checked, only that each part is there."""

from __future__ import annotations

import re

import pytest

from bench_scripts import run_bench

pytestmark = pytest.mark.timeout(180)


def test_one_turn_times_every_part():
    out = run_bench("ce_python_cpu.py", "--iters", "200", "--turns", "1", "--layers", timeout=160)
    assert out.returncode == 0, out.stderr[-2000:]
    for part in ("first side", "second side", "two order_after", "copyengine.isend", "copyengine.irecv"):
        line = next((ln for ln in out.stdout.splitlines() if part in ln), None)
        assert line is not None, (part, out.stdout)
        us = [float(x) for x in re.findall(r"([0-9]+\.[0-9]+)", line)]
        assert us and all(x > 0 for x in us), line
