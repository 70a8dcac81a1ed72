"""``bench/bench_graph_gpu.py`` without a GPU: the weights are compared only between runs of the same steps; the
teardown at the end is bounded."""

from __future__ import annotations

import threading

import pytest
from bench_scripts import bench_script, run_bench

pytest.importorskip("torch")
pytestmark = pytest.mark.timeout(60)


def _row(same_steps: bool, nccl_sum: float) -> dict:
    row = {
        "act_mib": 1,
        "micro": 2,
        "messages_per_rank": 4,
        "tensorwire_eager_ms": 1.0,
        "tensorwire_captured_ms": 0.4,
        "tensorwire_captured_host_us": 30.0,
        "tensorwire_checksum": 1.5,
        "nccl_eager_ms": 0.9,
        "nccl_checksum": nccl_sum,
        "same_steps": same_steps,
    }
    if same_steps:
        row.update(nccl_captured_ms=0.5, nccl_captured_host_us=20.0)
    return row


def test_weights_of_the_same_steps_are_compared(tmp_path):
    b = bench_script("bench_graph_gpu")
    out = tmp_path / "g.md"
    b._report(str(out), [_row(True, 1.5), _row(True, 2.5)], 2, "GPU")
    text = out.read_text()
    assert "agree between tensorwire and NCCL in 1 of 2 rows" in text
    assert "| 0.80 |" in text  # tw / NCCL captured: 0.4 / 0.5


def test_eager_only_nccl_is_not_compared(tmp_path):
    b = bench_script("bench_graph_gpu")
    out = tmp_path / "g.md"
    b._report(str(out), [_row(False, 9.0)], 2, "GPU")
    text = out.read_text()
    assert "the weights are not compared in this run" in text
    assert "agree between" not in text  # (it said "in 0 of 6 rows" for a run without --nccl-capture before)


def test_the_floor_is_both_ranks_compute_and_is_set_against_each_step(tmp_path):
    b = bench_script("bench_graph_gpu")
    out = tmp_path / "g.md"
    row = dict(_row(True, 1.5), floor_ranks_ms=[0.1, 0.2], floor_ms=0.3)
    b._report(str(out), [row], 2, "GPU")
    text = out.read_text()
    # floor 0.3 ms; tensorwire captured 0.4 ms (1.33x the floor); NCCL captured 0.5 ms (the floor 0.60x it)
    assert "| 1 MiB | 2 | 0.30 ms (0.10 + 0.20) | 1.33 | 0.60 | 1.67 |" in text, text


def test_teardown_destroys_nccls_group_first_then_the_default_one(monkeypatch):
    mod = bench_script("bench_graph_gpu")
    done: list = []
    monkeypatch.setattr(mod.dist, "destroy_process_group", lambda group=None: done.append(group))
    assert mod._teardown({"tensorwire": "world", "nccl": "nccl-group"}, 0, 5.0) == 0
    assert done == ["nccl-group", None]


def test_a_hung_teardown_is_left_after_the_limit_with_one_line_and_status_0(monkeypatch, capsys):
    mod = bench_script("bench_graph_gpu")
    release = threading.Event()
    calls: list = []
    exits: list = []

    def hung_destroy(group=None):
        calls.append(group)
        release.wait(30)

    monkeypatch.setattr(mod.dist, "destroy_process_group", hung_destroy)
    monkeypatch.setattr(mod.os, "_exit", exits.append)
    try:
        mod._teardown({"tensorwire": "world", "nccl": "nccl-group"}, 1, 0.2)
    finally:
        release.set()  # the teardown thread finishes both calls while the stand-in is still in place
        for th in threading.enumerate():
            if th.name == "teardown":
                th.join(10)
    assert exits == [0]
    assert calls == ["nccl-group", None]
    assert "rank 1: destroy_process_group did not return within 0.2 s" in capsys.readouterr().err


@pytest.mark.parametrize("limit", ["0", "-5"])
def test_a_teardown_limit_that_is_not_positive_is_refused(limit):
    got = run_bench("bench_graph_gpu.py", "--teardown-s", limit, timeout=50)
    assert got.returncode == 2
    assert f"--teardown-s must be > 0 seconds, got {float(limit)}" in got.stderr
