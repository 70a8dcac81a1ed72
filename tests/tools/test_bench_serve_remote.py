"""bench/bench_serve.py --remote: a tiny run end to end with a daemon variant and clients at once (the figures
are not checked, only that every row is there and says what ran), and its refusal of a malformed variant or
count of clients."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_serve.py"

pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=280, env=env, cwd=ROOT
    )


def test_a_remote_run_with_a_variant_and_clients_at_once_writes_every_row(tmp_path):
    out = tmp_path / "remote.md"
    r = _run(
        "--remote", "--transport", "tcp", "--quick", "--rounds", "1",
        "--variant", "OMP_NUM_THREADS=1", "--concurrent", "2", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| get_rows") and "one row" not in line]
    paths = [row.split("|")[2].strip() for row in rows]
    assert paths == [
        "tensorwire/tcp",
        "tensorwire/tcp, OMP_NUM_THREADS=1",
        "tensorwire/tcp get of the same bytes, one tensor (no gather)",
        "tensorwire's TCP transport alone, the same bytes (no request handling)",
        "gRPC unary",
        "raw TCP socket, the same bytes (no gather)",
        "raw TCP socket, the server gathering as the daemon does (the floor)",
        "local index_select(out=) (no network)",
        "tensorwire/tcp",
        "tensorwire/tcp, OMP_NUM_THREADS=1",
    ]
    assert "x the raw socket's time, " in rows[0] and "x the floor's" in rows[0]
    assert all(row.split("|")[5].strip().endswith("x the raw socket's time") for row in rows[2:4])  # the two between
    assert all("clients at once" in row and " / " in row for row in rows[-2:])  # one client, then two, per daemon
    for op in ("get_rows 1x128 f32 (one row)", "get 4 KiB"):  # small requests: every client and the raw socket
        small = [line.split("|") for line in text.splitlines() if line.startswith(f"| {op} ")]
        assert [c[2].strip() for c in small] == [
            "tensorwire/tcp",
            "tensorwire/tcp, OMP_NUM_THREADS=1",
            "tensorwire's TCP transport alone, the same bytes (no request handling)",
            "raw TCP socket, the same bytes",
        ], op
        assert all(c[3].strip().endswith(" us") for c in small) and "x the raw socket's time" in small[0][5]
        assert "x the transport alone's" in small[0][5] and "x the raw socket's time" in small[2][5]
        for c in small:  # both ends' CPU per call, the client's and its server's (every path has one)
            m = re.search(r"CPU per call: client (\d+) us, server (\d+) us", c[5])
            assert m is not None, c
            assert int(m.group(1)) > 0 and int(m.group(2)) > 0, c  # each end ran something for every call
    assert "The daemon's log: `torch intra-op threads: " in text and "usable CPUs; OMP_NUM_THREADS sets another" in text
    assert "get_rows tensorwire/tcp:" in text and "put 16 MiB tensorwire/tcp:" in text


def test_a_variant_that_is_not_var_equals_value_is_refused():
    r = _run("--remote", "--variant", "OMP_NUM_THREADS")
    assert r.returncode == 2 and "is not VAR=VALUE" in r.stderr
    r = _run("--remote", "--variant", "=3")
    assert r.returncode == 2 and "is not VAR=VALUE" in r.stderr


def test_a_negative_or_non_numeric_count_of_clients_is_refused():
    for bad in ("-1", "many"):
        r = _run("--remote", "--concurrent", bad)
        assert r.returncode == 2 and "is not a number of client processes" in r.stderr


def test_a_process_cpu_counts_every_thread_of_it():
    """The server-side CPU figure: a child that burns CPU in a second thread is seen burning it."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_serve
    finally:
        sys.path.remove(str(ROOT / "bench"))
    code = (
        "import threading, time\n"
        "def burn():\n"
        "    end = time.thread_time() + 0.3\n"
        "    while time.thread_time() < end: pass\n"
        "t = threading.Thread(target=burn); t.start(); print('go', flush=True); t.join(); time.sleep(30)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "go"
        before = bench_serve._process_cpu(p.pid)
        deadline = time.monotonic() + 20
        while bench_serve._process_cpu(p.pid) - before < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bench_serve._process_cpu(p.pid) - before >= 0.2  # the burning thread's CPU, not only the main one's
    finally:
        p.kill()
        p.wait(10)
