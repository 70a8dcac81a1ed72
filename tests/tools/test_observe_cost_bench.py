"""bench/bench_observe_cost.py: a tiny run end to end (the figures are not checked, only that every row and
every turn is there), its turn orders, its statistics, and its refusal of bad arguments."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_observe_cost.py"

pytestmark = pytest.mark.timeout(240)


def _load():
    spec = importlib.util.spec_from_file_location("bench_observe_cost", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=220, env=env, cwd=ROOT
    )


def test_every_cycle_runs_each_turn_once_in_a_seeded_order():
    b = _load()
    orders = b.orders(60, 5)
    assert all(sorted(o) == sorted(b.CONDITIONS) for o in orders)
    assert len(set(orders)) > 1 and orders == b.orders(60, 5) and orders != b.orders(60, 6)


def test_the_summary_reads_the_ratios_per_cycle():
    b = _load()
    rows = [
        {"off": 100.0, "on": 110.0, "off2": 100.0, "off_cpu": 50.0, "on_cpu": 55.0, "off2_cpu": 50.0},
        {"off": 200.0, "on": 220.0, "off2": 220.0, "off_cpu": 50.0, "on_cpu": 50.0, "off2_cpu": 50.0},
        {"off": 100.0, "on": 103.0, "off2": 90.0, "off_cpu": 50.0, "on_cpu": 60.0, "off2_cpu": 50.0},
    ]
    s = b.summarize(rows, 1)
    assert s["on/off"]["median"] == pytest.approx(1.1)
    assert s["off2/off"]["median"] == pytest.approx(1.0)
    assert s["on/offs"]["median"] == pytest.approx(103 / 95)  # (1.1, 220 / 210, 103 / 95: the middle one)
    assert s["on/off"]["ci"][0] <= s["on/off"]["median"] <= s["on/off"]["ci"][1]
    assert s["off"] == pytest.approx(0.1) and s["on"] == pytest.approx(0.11)


def test_a_tiny_run_prints_every_row_and_every_turn():
    out = _run("--cycles", "2", "--turn", "5")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [
        line
        for line in out.stdout.splitlines()
        if line.startswith("| ") and "us/call" not in line and "---" not in line
    ]
    labels = [r.split("|")[1].strip() for r in rows]
    assert labels == [
        "backend tensorwire over tcp, rank 0 (2 calls per round trip)",
        "backend tensorwire over tcp, rank 1",
        "Link over TCP, both ends in one thread (4 calls per round trip)",
    ]
    for r in rows:
        cells = [c.strip() for c in r.split("|")[2:-1]]
        assert all(float(c.split()[0]) > 0 for c in cells[:7]), r
    turns = [line for line in out.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(turns) == 3 * 2  # per measurement, one line per cycle


@pytest.mark.parametrize(
    ("args", "says"), [(("--cycles", "0"), "at least 1"), (("--what", "gpu"), "--what takes backend and/or link")]
)
def test_bad_arguments_are_refused(args, says):
    out = _run(*args)
    assert out.returncode == 2 and says in out.stderr
