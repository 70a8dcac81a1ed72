"""``tensorwire bench``: tiny real runs (two processes per backend), output structure, --check, failure handling."""

from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest

from tensorwire.benchmark import report
from tensorwire.benchmark.backends import resolve
from tensorwire.benchmark.config import BenchConfig, default_sizes, parse_size, schedule
from tensorwire.benchmark.runner import run_pair
from tensorwire.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAST = ["--sizes", "4K,64K", "--iters-scale", "0.02", "--no-progress", "--timeout", "60"]


def _bench(*args: str, timeout: float = 100) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _no_children_left() -> None:
    deadline = time.monotonic() + 5
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mp.active_children()


# -- pure logic -------------------------------------------------------------------------------


def test_sizes_are_powers_of_two_between_the_bounds():
    assert parse_size("4K") == 4096 and parse_size("16MiB") == 16 << 20 and parse_size("1g") == 1 << 30
    assert default_sizes(4096, 64 << 10) == (4096, 8192, 16384, 32768, 65536)
    assert default_sizes(5000, 20000) == (8192, 16384)
    with pytest.raises(ConfigError):
        parse_size("lots")
    with pytest.raises(ConfigError):
        default_sizes(4096, 1024)


def test_schedule_uses_fewer_iterations_above_one_mebibyte():
    small, mid, big = schedule(4096), schedule(1 << 20), schedule(256 << 20)
    assert small.rtt_iters >= 500 and mid.rtt_iters < small.rtt_iters and big.rtt_iters < mid.rtt_iters
    assert big.rtt_iters >= 5 and big.uni_reps * big.uni_batch >= 6
    assert schedule(4096, scale=0.01).rtt_iters >= 2


def test_backend_aliases_resolve_per_device():
    assert resolve(["grpc"], device="cpu") == ("grpc-unary", "grpc-stream")
    assert resolve(["torch"], device="cuda") == ("torch-nccl",)
    assert "torch-gloo" in resolve(["all"], device="cpu")
    assert resolve(["raw-tcp,tensorwire", "raw-tcp"], device="cpu") == ("raw-tcp", "tensorwire-tcp", "tensorwire-ucx")
    assert resolve(["raw"], device="cpu") == ("raw-tcp", "raw-ucxx", "raw-ucxx-cm")
    with pytest.raises(ConfigError):
        resolve(["carrier-pigeon"], device="cpu")


def _fake_raw(rates: dict[str, float], *, failed: str | None = None) -> dict:
    """Synthetic results: each backend moves `rate` GB/s, round trip = size / rate."""
    sizes = [4096, 1 << 20, 16 << 20]
    backends = {}
    for name, rate in rates.items():
        entries = []
        for s in sizes:
            t = s / (rate * 1e9)
            entries.append(
                {
                    "size": s,
                    "first_s": 3 * t,
                    "warmup": 1,
                    "uni": {"batch": 4, "seconds": [4 * t] * 3},
                    "rtt": {"seconds": [t] * 10, "switches_per_rtt": 1.0},
                }
            )
        backends[name] = {
            "status": "ok",
            "error": "",
            "sender": {"sizes": entries, "transport": None},
            "receiver": {"switches_per_rtt": {str(s): 1.0 for s in sizes}},
        }
    if failed:
        backends[failed] = {
            "status": "failed",
            "error": "rank 0: PeerLostError: boom",
            "sender": None,
            "receiver": None,
        }
    cfg = BenchConfig(backends=tuple(backends), sizes=tuple(sizes)).to_dict()
    memcheck = [
        {
            "transport_asked": "auto",
            "status": "ok",
            "transport": "tcp",
            "size": 1 << 20,
            "steps": 10,
            "verdict": "PASS",
            "ranks": {
                r: {
                    "rss_growth": 0,
                    "traced_growth": 0,
                    "traced_peak": 0,
                    "slots_stable": True,
                    "recv_buffers": 2,
                    "recv_in_slots": True,
                    "verdict": "PASS",
                }
                for r in ("0", "1")
            },
        }
    ]
    return {"config": cfg, "backends": backends, "memcheck": memcheck, "environment": {"cpu": "test"}}


def test_summary_ratios_and_targets():
    raw = _fake_raw(
        {"tensorwire-tcp": 3.0, "tensorwire-ucx": 1.0, "grpc-unary": 0.3, "grpc-stream": 0.5, "raw-tcp": 3.2},
        failed="raw-ucxx",
    )
    s = report.summarize(raw)
    r16 = s["ratios"][str(16 << 20)]
    assert r16["uni_GBps:tw/grpc"] == pytest.approx(6.0) and r16["uni_GBps:grpc_best"] == "grpc-stream"
    assert r16["uni_GBps:tw/raw_tcp"] == pytest.approx(3.0 / 3.2)
    assert r16["uni_GBps:peer_best"] == "raw-tcp"
    t = {(x["id"], x["detail"].split(":")[0]): x["status"] for x in s["targets"]}
    assert t[("T1", "vs grpc-stream, stream (uni)")] == "MET"  # 3.0 / 0.5
    assert t[("T1", "vs grpc-unary, stream (uni)")] == "MET"  # 3.0 / 0.3
    assert t[("T2", "p50 round trip")] == "MISSED"  # 6x lower latency, not 10x
    assert t[("T3", "stream (uni)")] == "MET"
    assert [x for x in s["targets"] if x["id"] == "T4"][0]["status"] == "MET"  # auto=tcp and tcp is faster
    text = report.render_text(raw, s)
    assert "FAILED" in text and "raw-ucxx: failed: rank 0: PeerLostError: boom" in text
    md = report.render_markdown(raw, s, command="tensorwire bench")
    assert "| size |" in md and "**MET**" in md


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    raw = _fake_raw({"tensorwire-tcp": 3.0, "grpc-unary": 0.3})
    path = tmp_path / "p.png"
    assert report.plot(str(path), raw, report.summarize(raw)) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- real runs ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_bench_tiny_run_with_check_json_csv_table(tmp_path):
    out = _bench(
        "--backends",
        "raw-tcp,tensorwire-tcp,grpc-unary,grpc-stream",
        "--check",
        "--memcheck-steps",
        "50",
        "--json",
        str(tmp_path / "b.json"),
        "--csv",
        str(tmp_path / "b.csv"),
        *FAST,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for needle in (
        "# Unidirectional",
        "# Round trip",
        "tw-tcp",
        "grpc-stream",
        "raw-tcp",
        "tw/gRPC",
        "4 KiB",
        "64 KiB",
        "# Targets",
        "# Memory check",
        "First transfer",
        "wake-ups per round trip",
    ):
        assert needle in text, needle
    data = json.load(open(tmp_path / "b.json"))
    assert data["format"] == "tensorwire-bench/1" and data["config"]["check"] is True
    for name in ("raw-tcp", "tensorwire-tcp", "grpc-unary", "grpc-stream"):
        res = data["backends"][name]
        assert res["status"] == "ok", res
        assert [e["size"] for e in res["sender"]["sizes"]] == [4096, 65536]
        for size in ("4096", "65536"):
            row = data["summary"]["rows"][name][size]
            assert row["uni_GBps"] > 0 and 0 < row["rtt_p50_us"] <= row["rtt_p99_us"] and row["first_us"] > 0
        assert res["receiver"]["messages"] > 0
    assert data["backends"]["tensorwire-tcp"]["sender"]["transport"] == "tcp"
    assert {t["id"] for t in data["summary"]["targets"]} == {"T1", "T2", "T3", "T4"}
    mem = data["memcheck"][0]
    assert mem["transport_asked"] == "auto" and mem["status"] == "ok" and mem["transport"] in ("tcp", "ucx")
    assert all(r["slots_stable"] and r["recv_in_slots"] for r in mem["ranks"].values())
    rows = list(csv.DictReader(open(tmp_path / "b.csv")))
    assert len(rows) == 8 and set(rows[0]) == set(report.CSV_FIELDS)
    # the saved JSON re-renders the same table without running anything
    again = _bench("--from-json", str(tmp_path / "b.json"), "--markdown", str(tmp_path / "b.md"), timeout=60)
    assert again.returncode == 0 and again.stdout == text
    assert "| size |" in (tmp_path / "b.md").read_text()
    _no_children_left()


@pytest.mark.timeout(150)
def test_check_with_messages_in_flight_isend(tmp_path):
    """--check stamps the source before each send: with isend windows (2 and 4 in flight, the receiver's link at
    depth 4) no message may still be reading it -- this used to time out (the stamp of message k+1 landed in
    message k; the receiver's check failed and the sender waited for an ack forever)."""
    pytest.importorskip("ucxx")
    out = _bench(
        "--backends",
        "tensorwire-ucx-isend,tensorwire-ucx-isend4",
        "--check",
        "--no-memcheck",
        "--json",
        str(tmp_path / "i.json"),
        *FAST,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.load(open(tmp_path / "i.json"))
    for name in ("tensorwire-ucx-isend", "tensorwire-ucx-isend4"):
        res = data["backends"][name]
        assert res["status"] == "ok" and res["sender"]["transport"] == "ucx", res
        assert res["receiver"]["messages"] > 0
    _no_children_left()


@pytest.mark.timeout(120)
def test_raw_ucxx_with_two_receive_buffers_delivers_every_message_checked(tmp_path):
    """raw-ucxx-2buf receives into two buffers in turn: --check compares each returned buffer with the
    message's stamps, so a receiver handing back the buffer it did not receive into fails here."""
    pytest.importorskip("ucxx")
    out = _bench("--backends", "raw-ucxx-2buf", "--check", "--no-memcheck", "--json", str(tmp_path / "r.json"), *FAST)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.load(open(tmp_path / "r.json"))["backends"]["raw-ucxx-2buf"]
    assert res["status"] == "ok", res
    assert res["receiver"]["messages"] > 0
    _no_children_left()


@pytest.mark.timeout(90)
def test_check_catches_a_corrupted_byte(tmp_path):
    out = _bench(
        "--backends",
        "raw-tcp",
        "--check",
        "--inject-corruption",
        "raw-tcp",
        "--no-memcheck",
        "--json",
        str(tmp_path / "c.json"),
        *FAST,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    res = json.load(open(tmp_path / "c.json"))["backends"]["raw-tcp"]
    assert res["status"] == "failed" and res["check_failed"]
    assert "CHECK FAILED" in res["error"] and "message 2" in res["error"] and "1 byte(s) differ" in res["error"]
    assert "CHECK FAILED" in out.stdout
    # Without --check the same corruption goes unnoticed: the check is what catches it.
    out = _bench("--backends", "raw-tcp", "--inject-corruption", "raw-tcp", "--no-memcheck", *FAST)
    assert out.returncode == 0 and "CHECK FAILED" not in out.stdout


@pytest.mark.timeout(90)
def test_check_catches_corruption_through_grpc_server(tmp_path):
    out = _bench(
        "--backends",
        "grpc-stream",
        "--check",
        "--inject-corruption",
        "grpc-stream",
        "--no-memcheck",
        "--json",
        str(tmp_path / "g.json"),
        *FAST,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    res = json.load(open(tmp_path / "g.json"))["backends"]["grpc-stream"]
    assert res["status"] == "failed" and "CHECK FAILED" in res["error"]


@pytest.mark.timeout(60)
def test_unavailable_backend_is_skipped_not_a_crash():
    cfg = BenchConfig(backends=("torch-nccl",), sizes=(4096,), iters_scale=0.02, timeout=30, memcheck=False)
    res = run_pair("torch-nccl", cfg)
    assert res["status"] == "skipped" and "CUDA" in res["error"]
    _no_children_left()


def _boom_entry(name, rank, cfg_dict, host, port, prefix, q):
    if rank == 0:
        q.put(("error", 0, "PeerLostError", "injected failure", "tb"))
        return
    time.sleep(3600)  # the other side hangs: the runner must kill it


def _hang_entry(name, rank, cfg_dict, host, port, prefix, q):
    time.sleep(3600)


@pytest.mark.timeout(60)
def test_failing_backend_is_reported_and_its_peer_killed():
    cfg = BenchConfig(backends=("boom",), sizes=(4096,), timeout=30, memcheck=False)
    t0 = time.monotonic()
    res = run_pair("boom", cfg, target=_boom_entry)
    assert res["status"] == "failed" and "injected failure" in res["error"]
    assert time.monotonic() - t0 < 20
    _no_children_left()


@pytest.mark.timeout(60)
def test_hanging_backend_times_out_and_is_killed():
    cfg = BenchConfig(backends=("hang",), sizes=(4096,), memcheck=False)
    res = run_pair("hang", cfg, target=_hang_entry, timeout=4)
    assert res["status"] == "failed" and "timed out" in res["error"]
    _no_children_left()


@pytest.mark.timeout(60)
def test_wrapper_script_help():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_transports.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and "--max-size" in out.stdout and "--check" in out.stdout
