"""``bench/perf_split.py`` (a process's CPU split by shared object) and ``bench/bench_serve_cpu.py --perf``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")

from bench_scripts import bench_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "bench_serve_cpu.py")

bench_serve_cpu = bench_script("bench_serve_cpu")
perf_split = bench_script("perf_split")

# what `perf report --sort dso --stdio` prints (its header lines start with '#')
REPORT = """\
# To display the perf.data header info, please use --header/--header-only options.
#
# Samples: 4K of event 'cpu-clock:ppp'
# Overhead  Shared Object
# ........  ..................................................
#
    52.10%  libpython3.11.so.1.0
    26.00%  [kernel.kallsyms]
     5.00%  tensorwire__mypyc.cpython-311-x86_64-linux-gnu.so
     4.00%  libc.so.6
     3.90%  libtorch_cpu.so
     3.00%  _socket.cpython-311-x86_64-linux-gnu.so
     2.00%  [vdso]
     2.00%  python3.11
     2.00%  [unknown]
"""


def test_perf_report_lines_are_summed_by_class():
    got = perf_split.classes(REPORT)
    assert got == pytest.approx(
        {
            "interpreter": 0.541,
            "kernel": 0.28,
            "compiled hot path": 0.05,
            "C library": 0.06,
            "torch": 0.039,
            "other extension modules": 0.03,
        }
    )
    assert perf_split.classes("# nothing sampled\n") == {}


def test_the_perf_table_gives_microseconds_per_class_and_says_why_a_row_is_missing():
    table = bench_serve_cpu.perf_table(
        [("d: shm get", (100.0, {"kernel": 0.25, "interpreter": 0.75})), ("x", "no perf")]
    )
    row = next(line for line in table.splitlines() if line.startswith("| d: shm get |"))
    assert "| 100.0 | 25.0 (25%) | 75.0 (75%) | 0.0 (0%) |" in row
    assert "- x: no perf" in table


@pytest.mark.timeout(60)
def test_a_recorder_that_cannot_sample_says_why_and_leaves_nothing():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(proc.stdout)  # a process that has exited: nothing to sample
    rec = perf_split.Recorder(gone)
    started = rec.start()  # False at once, or (perf slow to give up on a loaded machine) found out by stop()
    why = rec.stop()
    assert isinstance(why, str) and why.startswith(("perf is not on the PATH", "perf record failed (exit ")), why
    assert why == rec.error
    if not started:
        assert rec.error.startswith(("perf is not on the PATH", "perf record failed (exit "))
    assert not rec.dir or not os.path.exists(rec.dir)


def _stand_in_perf(monkeypatch, code: str) -> None:
    """``perf`` found on the PATH, and ``perf record`` run as ``python -c code`` instead."""
    real_popen = subprocess.Popen
    monkeypatch.setattr(perf_split.shutil, "which", lambda name: sys.executable)
    monkeypatch.setattr(
        perf_split.subprocess, "Popen", lambda argv, **kw: real_popen([sys.executable, "-c", code], **kw)
    )


@pytest.mark.timeout(60)
def test_a_recorder_whose_perf_fails_after_start_says_why(monkeypatch):
    rec = perf_split.Recorder(os.getpid())
    # a perf record that gives up only after start() returned (settle 0: not yet looked at)
    _stand_in_perf(monkeypatch, "import sys, time; time.sleep(0.2); sys.stderr.write('no leave'); sys.exit(3)")
    assert rec.start(settle=0) is True
    time.sleep(1.0)
    assert rec.stop() == "perf record failed (exit 3): no leave"
    assert not os.path.exists(rec.dir)


@pytest.mark.timeout(240)
def test_a_short_run_with_perf_reports_the_split_or_why_not(tmp_path):
    out = tmp_path / "report.md"
    args = ["--calls", "20", "--rounds", "1", "--warmup", "5", "--paths", "shm", "--kinds", "get", "--sizes", "small"]
    args += ["--own-rounds", "0", "--perf", "--perf-calls", "100", "--out", str(out)]
    res = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    text = out.read_text()
    assert re.search(r"^\| shm \| get \| small \(4 KiB\) \| 1\.00 \| \d+\.\d \|", text, re.M), text
    assert "Where each process's CPU goes" in text
    row = re.search(r"^\| this tree: shm get \| (\d+\.\d) \|(.*)\|$", text, re.M)
    if row is None:  # no perf here, or not allowed to sample: the report says which
        assert re.search(
            r"^- this tree: shm get: perf (is not on the PATH|record failed \(exit|report gave nothing)", text, re.M
        ), text
    else:
        shares = [float(s) for s in re.findall(r"\((\d+)%\)", row.group(2))]
        assert len(shares) == 6 and 95 <= sum(shares) <= 105, row.group(0)
        assert float(row.group(1)) > 0


@pytest.mark.timeout(300)
def test_bench_distributed_with_perf_splits_each_ranks_round_trip_or_says_why_not(tmp_path):
    out = tmp_path / "report.md"
    args = ["--rounds", "1", "--max-mib", "1", "--act-mib", "1", "--gpipe-steps", "1", "--rss-steps", "4"]
    args += ["--rss-gpipe", "1", "--perf", "--perf-iters", "200", "--out", str(out)]
    env = dict(os.environ)
    env.pop("TENSORWIRE_TRANSPORT", None)
    script = os.path.join(ROOT, "bench", "bench_distributed.py")
    res = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=280, cwd=ROOT, env=env
    )
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-3000:]
    text = out.read_text()
    assert "--perf`" in text  # the command line in the report names it
    section = text.split("## Where a 4 KiB round trip's CPU goes", 1)[1].split("\n## ", 1)[0]
    for rank in (0, 1):
        for group in ("gloo", "tensorwire", "floor"):
            row = re.search(rf"^\| {rank} \| {group} \| (\d+\.\d) µs \| (\d+\.\d) µs \|(.*)\|$", section, re.M)
            if row is None:  # no perf here, or not allowed to sample: the report says which
                assert re.search(rf"^- rank {rank}, {group}: perf", section, re.M), section
                continue
            assert float(row.group(1)) > 0 and float(row.group(2)) > 0, row.group(0)
            shares = [float(s) for s in re.findall(r"\((\d+)%\)", row.group(3))]
            assert len(shares) == 6 and 95 <= sum(shares) <= 105, row.group(0)


def test_a_perf_that_cannot_run_says_why_and_leaves_nothing(monkeypatch):
    def cannot(argv: list, **kw: object) -> None:
        raise PermissionError(13, "Permission denied", argv[0])

    monkeypatch.setattr(perf_split.shutil, "which", lambda name: "/bin/perf")
    monkeypatch.setattr(perf_split.subprocess, "Popen", cannot)
    rec = perf_split.Recorder(os.getpid())
    assert rec.start() is False
    assert rec.error == "perf record could not start: [Errno 13] Permission denied: 'perf'"
    assert rec.stop() == rec.error
    assert not os.path.exists(rec.dir)


@pytest.mark.timeout(60)
def test_a_recorder_whose_perf_ends_without_data_when_stopped_says_why(monkeypatch):
    """perf still running at stop() (slow to give up on a loaded machine), then ending without a perf.data: a
    failed record, not an empty report."""
    rec = perf_split.Recorder(os.getpid())
    _stand_in_perf(
        monkeypatch,
        "import sys, time\ntry:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n"
        "    sys.stderr.write('no such process'); sys.exit(0)",
    )
    assert rec.start(settle=0.3) is True
    why = rec.stop()
    assert why == "perf record failed (exit 0): no such process" and why == rec.error
    assert not os.path.exists(rec.dir)
