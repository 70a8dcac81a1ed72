"""``bench/probe_serve_rows.py``: a lease get_rows split against local gathers, in one process; and its refusals."""

from __future__ import annotations

import os
import re

import pytest
from bench_scripts import run_bench

torch = pytest.importorskip("torch")
pytest.importorskip("grpc")


def _shm_files() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("tw-probe-rows-")} if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(200)
def test_every_path_gets_a_row_and_the_split_adds_up(tmp_path):
    before = _shm_files()
    out = tmp_path / "probe.md"
    args = ["--rows", "2000", "--batch", "512", "--reps", "6", "--per-turn", "3", "--profile-calls", "5"]
    res = run_bench("probe_serve_rows.py", *args, "--tcp-client", "--out", str(out), timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    assert "[probe] 5 paths in turns, 6 calls each" in res.stderr  # progress
    text = out.read_text()
    assert text == res.stdout
    rows = dict(re.findall(r"^\| (client|tcp client|leased view|own shm|local) \| ([\d.]+) µs \|", text, re.M))
    assert sorted(rows) == ["client", "leased view", "local", "own shm", "tcp client"]
    assert all(float(v) > 0 for v in rows.values())
    assert re.search(
        r"^\| local \| [\d.]+ µs \| [\d.]+ \| 1\.00x \| [\d.]+ / [\d.]+ \|$", text, re.M
    )  # local vs itself
    faults = re.findall(
        r"^\| (?:client|tcp client|leased view|own shm|local) \|.*\| ([\d.]+) / ([\d.]+) \|$", text, re.M
    )
    assert len(faults) == 5  # every path's page faults per call, counted in their own pass
    outside = float(re.search(r"The call outside its gather: (-?[\d.]+) µs", text).group(1))
    assert outside == pytest.approx(float(rows["client"]) - float(rows["leased view"]), abs=0.11)
    assert re.search(r"\d+ reads from the lease", text) and "lease_rows" in text  # the lease served; profiled
    assert "--tcp-client`." in text
    assert _shm_files() == before  # the probe's own shared-memory file is gone


@pytest.mark.timeout(200)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_client_is_a_path_of_the_turns():
    res = run_bench(
        "probe_serve_rows.py",
        "--rows",
        "2000",
        "--batch",
        "256",
        "--reps",
        "6",
        "--per-turn",
        "3",
        "--profile-calls",
        "0",
        "--gpu-client",
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    assert re.search(r"^\| client -> cuda \| [\d.]+ µs \|.*\| [\d.]+ / [\d.]+ \|$", res.stdout, re.M)
    assert "--gpu-client`." in res.stdout


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_the_gpu_client_is_refused_without_cuda():
    res = run_bench("probe_serve_rows.py", "--gpu-client", timeout=50)
    assert res.returncode == 2 and "--gpu-client needs CUDA" in res.stderr


@pytest.mark.timeout(60)
def test_refuses_sizes_below_one():
    res = run_bench("probe_serve_rows.py", "--reps", "0", timeout=50)
    assert res.returncode == 2 and "--reps and --per-turn must be >= 1" in res.stderr
    res = run_bench("probe_serve_rows.py", "--profile-calls", "-1", timeout=50)
    assert res.returncode == 2 and "--profile-calls >= 0" in res.stderr


@pytest.mark.timeout(120)
def test_daemon_env_reaches_the_daemon_only():
    """``--daemon-env TENSORWIRE_SHM=0``: the daemon starts without shared memory (so the probe's client cannot have
    it), while this process's environment -- the clients' -- is not changed by it."""
    res = run_bench(
        "probe_serve_rows.py",
        "--rows",
        "1000",
        "--batch",
        "16",
        "--reps",
        "2",
        "--daemon-env",
        "TENSORWIRE_SHM=0",
        timeout=100,
    )
    assert res.returncode != 0 and "the daemon offers no shared memory" in res.stderr, res.stderr[-2000:]
    res = run_bench("probe_serve_rows.py", "--daemon-env", "TENSORWIRE_SHM", timeout=50)
    assert res.returncode == 2 and "--daemon-env 'TENSORWIRE_SHM': expected VAR=VALUE" in res.stderr
