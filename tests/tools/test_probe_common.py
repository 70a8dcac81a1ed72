"""bench/probe_common.py: the two-process probes' shared pair of ranks and their size options."""

from __future__ import annotations

import argparse

import pytest

from bench_scripts import BENCH, bench_script, run_bench

pytestmark = pytest.mark.timeout(120)


def test_run_pair_returns_what_each_rank_returned(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # (as when a probe runs: its spawned ranks import probe_common from there)
    pc = bench_script("probe_common")
    assert pc.run_pair(pow, 3, limit_s=60) == {0: 0, 1: 1}  # pow(rank, 3) in each spawned process


def test_run_pair_ends_the_program_naming_the_rank_that_raised(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    pc = bench_script("probe_common")
    with pytest.raises(SystemExit, match=r"^the probe: rank [01] failed: ZeroDivisionError"):
        pc.run_pair(divmod, 0, limit_s=60)


def test_size_list_reads_sizes_and_names_a_bad_one(capsys):
    pc = bench_script("probe_common")
    ap = argparse.ArgumentParser(prog="probe")
    assert pc.size_list(ap, "--sizes", "4K,1M") == [4096, 1 << 20]
    for bad in ("4K,1Q", "0"):
        with pytest.raises(SystemExit) as exc:
            pc.size_list(ap, "--sizes", bad)
        assert exc.value.code == 2
        assert repr(bad.split(",")[-1]) in capsys.readouterr().err


def test_a_probe_refuses_a_bad_size_before_starting_its_ranks():
    out = run_bench("probe_cma_pieces.py", "--sizes", "1M,1Q", timeout=60)
    assert out.returncode == 2
    assert "--sizes: '1Q' is not a size in bytes" in out.stderr
