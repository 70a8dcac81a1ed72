"""``tensorwire demo``: its table, its byte check, where the gRPC server runs, and what its clocks time."""

from __future__ import annotations

import os
import pathlib
import re
import statistics
import subprocess
import sys

import pytest

from tensorwire import demo
from tensorwire.demo import workers

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAUSE = 0.2  # seconds the receiver sleeps after each check in the small run
SMALL = (demo.Row("4 KiB round trip", 4096, 1, 3, exchanges=8), demo.Row("64 KiB stream", 64 * 1024, 4, 2))


@pytest.fixture(scope="module")
def small_run() -> demo.DemoResult:
    return demo.measure(rows=SMALL, rounds=1, transport="tcp", timeout=90, check_pause=PAUSE)


def test_count_bad_flags_one_changed_byte_and_a_stale_message():
    import torch

    ramp = workers.make_ramp(4096)
    scratch = torch.empty(4096, dtype=torch.uint8)
    msgs = [torch.empty(4096, dtype=torch.uint8) for _ in range(3)]
    for v, m in zip((5, 6, 7), msgs):
        workers.fill(m, ramp, v)
    assert demo.count_bad(msgs, ramp, [5, 6, 7], scratch) == 0
    msgs[1][4095] ^= 1
    assert demo.count_bad(msgs, ramp, [5, 6, 7], scratch) == 1
    assert demo.count_bad(msgs, ramp, [4, 6, 7], scratch) == 2  # the first one is a previous round's message


def test_count_bad_compares_every_piece_of_a_message_longer_than_its_scratch():
    import torch

    size = 3 * 1024 + 512  # three whole pieces of 1 KiB and a half one
    ramp = workers.make_ramp(size)
    scratch = torch.empty(1024, dtype=torch.uint8)
    msg = torch.empty(size, dtype=torch.uint8)
    workers.fill(msg, ramp, 9)
    assert demo.count_bad([msg], ramp, [9], scratch) == 0
    for where in (0, 1500, size - 1):  # the first piece, a middle one, the last (short) one
        msg[where] ^= 0x40
        assert demo.count_bad([msg], ramp, [9], scratch) == 1, where
        msg[where] ^= 0x40
    assert demo.count_bad([msg[:-256]], ramp, [9], scratch) == 1  # a message cut short


def test_consecutive_rounds_expect_different_bytes():
    # a receive buffer still holding a message of one of the last SOURCES - 1 rounds must fail the check
    assert workers.SOURCES >= 3
    for row in range(3):
        for rnd in range(20):
            seen = {workers.message_value(row, rnd + k) for k in range(workers.SOURCES)}
            assert len(seen) == workers.SOURCES


def test_default_rows_run_back_to_back():
    rt = demo.DEFAULT_ROWS[0]
    assert rt.round_trip and rt.exchanges >= 20  # steady state: many round trips per go, not one
    assert demo.DEFAULT_ROWS[1].messages >= 32  # a stream long enough that its start does not dominate


def test_last_in_each_keeps_one_buffer_per_address_in_order_of_first_use():
    import torch

    a, b = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    again = a.view(-1)  # another tensor object over a's memory: the same buffer
    got = workers.last_in_each([a, b, again, b, a])
    assert len(got) == 2 and got[0] is a and got[1] is b


@pytest.mark.timeout(180)
def test_the_demo_receives_into_as_many_buffers_as_tensorwire_bench(small_run):
    from tensorwire.benchmark.backends import tw
    from tensorwire.benchmark.worker import recv_slots
    from tensorwire.p2p.link import DEFAULT_DEPTH

    assert recv_slots("tensorwire") == DEFAULT_DEPTH and recv_slots("raw socket") == recv_slots("gRPC") == 1
    assert tw.recv_slots is recv_slots  # the bench's tensorwire receiver sizes its link by the same function
    for i, row in enumerate(SMALL):
        for p in demo.PATHS:
            assert small_run.slots[i][p] == min(row.per_round, recv_slots(p)), (row.label, p, small_run.slots)


@pytest.mark.timeout(180)
def test_grpc_server_runs_in_the_receivers_process_not_the_clients(small_run):
    pids = small_run.pids
    assert pids["grpc_server"] == pids["receiver"]
    assert len({pids["grpc_server"], pids["sender"], pids["parent"]}) == 3, pids
    assert pids["parent"] == os.getpid()


@pytest.mark.timeout(180)
def test_every_receive_buffer_is_checked_each_round_and_none_is_corrupted(small_run):
    plan = workers.RunPlan(SMALL, 1, "tcp", True, 90, PAUSE)
    from tensorwire.benchmark.worker import recv_slots

    expect = sum(
        (plan.warmup(r) + plan.timed(r)) * min(r.per_round, recv_slots(p)) * r.size for r in SMALL for p in demo.PATHS
    )
    assert small_run.checked_bytes == expect
    assert small_run.bad == {p: 0 for p in demo.PATHS}
    for i, row in enumerate(SMALL):
        for p in demo.PATHS:
            timed = plan.timed(row) * row.exchanges  # one time per exchange
            assert len(small_run.sender[i][p]) == timed == len(small_run.receiver[i][p])


@pytest.mark.timeout(180)
def test_the_receivers_check_is_on_neither_clock(small_run):
    # The receiver sleeps PAUSE after checking each round; a sender clock that ran while the receiver
    # checked (the demo's earlier flaw) would read more than PAUSE for every round.
    for i in range(len(SMALL)):
        for p in demo.PATHS:
            for clock in (small_run.sender, small_run.receiver):
                assert min(clock[i][p]) < PAUSE / 2, (SMALL[i].label, p, clock[i][p])


@pytest.mark.timeout(180)
def test_no_round_of_back_to_back_exchanges_includes_the_check(small_run):
    # Only a round's first exchange follows the go, so the check above would still pass if the check
    # leaked into that one exchange per round. Summed per round, every round would then read more
    # than PAUSE; the median over rounds stays far below it when only the exchanges are timed.
    for i, row in enumerate(SMALL):
        for p in demo.PATHS:
            for clock in (small_run.sender, small_run.receiver):
                times = clock[i][p]
                rounds = [sum(times[k : k + row.exchanges]) for k in range(0, len(times), row.exchanges)]
                assert len(rounds) >= 2
                assert statistics.median(rounds) < PAUSE / 2, (row.label, p, rounds)
                assert statistics.median(times[:: row.exchanges]) < PAUSE / 2, (row.label, p, times)


def test_table_has_one_row_per_size_and_a_column_per_path():
    mib = demo.DEFAULT_ROWS[1].messages * 2**20  # bytes per exchange of the 1 MiB stream
    res = demo.DemoResult(
        rows=demo.DEFAULT_ROWS,
        paths=demo.PATHS,
        transport="ucx",
        sender=[
            {"tensorwire": [1e-5], "raw socket": [2e-5], "gRPC": [4e-4]},
            {"tensorwire": [mib / 4e9], "raw socket": [mib / 2e9], "gRPC": [mib / 0.5e9]},
            {"tensorwire": [2 * 2**26 / 8e9], "raw socket": [2 * 2**26 / 4e9], "gRPC": [2 * 2**26 / 1e9]},
        ],
        receiver=[
            {"tensorwire": [1e-5], "raw socket": [2e-5], "gRPC": [5e-4]},
            {"tensorwire": [1e-3], "raw socket": [2e-3], "gRPC": [8e-3]},
            {"tensorwire": [1e-2], "raw socket": [2e-2], "gRPC": [8e-2]},
        ],
        bad={p: 0 for p in demo.PATHS},
        checked_bytes=1,
        pids={},
    )
    lines = demo.format_table(res)
    assert re.search(r"tensorwire \(ucx\)\s+raw socket\s+gRPC", lines[0])
    assert re.search(r"^4 KiB round trip\s+10\.0 µs\s+20\.0 µs\s+400\.0 µs$", lines[1])
    assert re.search(r"^1 MiB stream\s+4\.00 GB/s\s+2\.00 GB/s\s+0\.50 GB/s$", lines[2])
    assert re.search(r"^64 MiB stream\s+8\.00 GB/s\s+4\.00 GB/s\s+1\.00 GB/s$", lines[3])
    assert lines[6] == "  vs raw socket: 2.00x faster / 2.00x faster / 2.00x faster"
    assert lines[7] == "  vs gRPC:       40.00x faster / 8.00x faster / 8.00x faster"
    assert not any("loses" in line for line in lines)  # it loses nowhere here
    # the receiver's clock: a footnote, not a headline
    assert lines[-1].startswith("  (by the receiver's clock: vs raw socket 2.00x faster / 2.00x faster / 2.00x faster")
    assert "vs gRPC 50.00x faster" in lines[-1]


def _two_rows(tw_rt: float, sock_rt: float, cpu_tw: float, cpu_sock: float, build: str) -> demo.DemoResult:
    rows = demo.DEFAULT_ROWS[:2]
    mib = rows[1].messages * 2**20
    times = [{"tensorwire": [tw_rt], "raw socket": [sock_rt]}, {"tensorwire": [mib / 4e9], "raw socket": [mib / 2e9]}]
    return demo.DemoResult(
        rows=rows,
        paths=demo.PATHS[:2],
        transport="tcp",
        sender=times,
        receiver=times,
        bad={},
        checked_bytes=1,
        pids={},
        cpu=[{"tensorwire": cpu_tw, "raw socket": cpu_sock}, {"tensorwire": 1e-3, "raw socket": 1e-3}],
        build=build,
    )


def test_where_tensorwire_loses_one_line_says_by_how_much_and_what_the_cpu_says():
    lines = demo.format_table(_two_rows(30e-6, 20e-6, 90e-6, 20e-6, "pure Python"))
    assert "  vs raw socket: 1.50x slower / 2.00x faster" in lines
    (loss,) = [line for line in lines if "loses" in line]
    assert loss.startswith("  tensorwire loses on the 4 KiB round trip to the raw socket, 1.50x its time: ")
    assert "90 µs of CPU per round trip (both processes) against 20 µs" in loss
    assert "compiled build" in loss  # the pure-Python build says so
    # same CPU: the time went to waiting, and the line says that instead
    (loss,) = [
        line
        for line in demo.format_table(_two_rows(30e-6, 20e-6, 21e-6, 20e-6, "compiled (6/6 modules)"))
        if "loses" in line
    ]
    assert "with no more CPU per round trip (21 µs against 20 µs): the rest is waiting" in loss


def test_the_demo_and_tensorwire_bench_share_their_socket_and_process_set_up():
    from tensorwire.benchmark import worker
    from tensorwire.benchmark.backends import rawtcp
    from tensorwire.demo import paths

    assert paths.recv_exact is rawtcp.recv_exact and paths.tune is rawtcp.tune
    assert workers.pair_process_setup is worker.pair_process_setup


def test_recv_exact_fills_the_view_across_partial_sends_and_names_a_closed_peer():
    import socket
    import threading

    a, b = socket.socketpair()
    with a, b:
        view = memoryview(bytearray(10))

        def send_in_two() -> None:
            a.sendall(b"01234")
            a.sendall(b"56789")

        t = threading.Thread(target=send_in_two)
        t.start()
        from tensorwire.benchmark.backends.rawtcp import recv_exact

        b.settimeout(10)
        recv_exact(b, view)
        t.join(10)
        assert bytes(view) == b"0123456789"
        a.sendall(b"xy")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="closed"):
            recv_exact(b, view)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_demo_prints_progress_and_the_table():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run(
        [sys.executable, "-m", "tensorwire", "demo", "--rounds", "1", "--timeout", "200"],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    num = r"\d+\.\d+ (?:µs|ms|GB/s)"
    for label in ("4 KiB round trip", "1 MiB stream", "64 MiB stream"):
        assert re.search(rf"^{label}\s+{num}\s+{num}\s+{num}$", out.stdout, re.M), out.stdout
        assert re.search(rf"^  {label}: tensorwire ", out.stderr, re.M), out.stderr  # progress, row by row
    ratio = r"\d+\.\d+x (?:faster|slower)"
    assert re.search(rf"^  vs gRPC:\s+{ratio} / {ratio} / {ratio}$", out.stdout, re.M), out.stdout
    assert re.search(r"^tensorwire: tcp transport \(.*\); hot path (?:compiled|pure Python|partly)", out.stdout, re.M)
    assert "corrupted: 0" in out.stdout
    # gRPC's phase comes after the other two paths' (its threads stay out of their turns), its row lines after it
    assert "then gRPC alone (its server in process" in out.stderr
    grpc_at = out.stderr.index("then gRPC alone")
    assert re.search(r"^  4 KiB round trip: tensorwire ", out.stderr[:grpc_at], re.M), out.stderr
    assert re.search(r"^  4 KiB round trip: gRPC ", out.stderr[grpc_at:], re.M), out.stderr
