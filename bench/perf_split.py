"""Where one process's CPU goes, by shared object: ``perf record`` on the process, ``perf report --sort dso``.

Used by ``bench_serve_cpu.py --perf`` and ``bench_distributed.py --perf``. Each sample is put in a class by the
shared object it fell in (the first pattern of :data:`CLASSES` that matches): the kernel (system calls,
wake-ups, the loopback), the Python interpreter (its eval loop and the C API that compiled code calls too), the
compiled hot path (``tensorwire.native``), torch, the C library, other extension modules. The kernel's share is
what any program making the same system calls pays; the rest is what a change of code can still win.
Needs Linux ``perf`` on the PATH and leave to sample the process (``kernel.perf_event_paranoid``); without
either, :meth:`Recorder.stop` returns why, and the caller prints that instead of a row.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

CLASSES = (
    ("kernel", ("[kernel", "[unknown]")),
    ("interpreter", ("libpython", "python3")),
    ("compiled hot path", ("tensorwire__mypyc",)),
    ("torch", ("libtorch", "libc10", "libgloo")),
    ("C library", ("libc.so", "libc-", "libpthread", "[vdso]", "ld-linux", "libm.so", "libstdc++")),
)
OTHER = "other extension modules"
NAMES = [c for c, _ in CLASSES] + [OTHER]


def classes(report: str) -> dict[str, float]:
    """``perf report --sort dso`` text -> {class: share of the samples (0..1)}."""
    out: dict[str, float] = {}
    for line in report.splitlines():
        parts = line.split()
        if len(parts) < 2 or line.lstrip().startswith("#") or not parts[0].endswith("%"):
            continue
        try:
            share = float(parts[0][:-1]) / 100
        except ValueError:
            continue
        dso = " ".join(parts[1:])
        cls = next((c for c, pats in CLASSES if any(p in dso for p in pats)), OTHER)
        out[cls] = out.get(cls, 0.0) + share
    return out


class Recorder:
    """``perf record`` of one process from :meth:`start` to :meth:`stop` (``-F`` samples per second)."""

    def __init__(self, pid: int, *, freq: int = 2000, tmp: str | None = None) -> None:
        self.pid = pid
        self.freq = freq
        self.tmp = tmp
        self.dir = ""  # made by start(), removed by stop() (or by a start() that fails)
        self.proc: subprocess.Popen[str] | None = None
        self.error = ""

    def start(self, settle: float = 0.5) -> bool:
        """Start sampling (after ``settle`` seconds it is attached); False (and :attr:`error`) if it cannot."""
        if shutil.which("perf") is None:
            self.error = "perf is not on the PATH"
            return False
        self.dir = tempfile.mkdtemp(prefix="tw-perf-", dir=self.tmp)
        argv = ["perf", "record", "-F", str(self.freq), "-p", str(self.pid), "-o", os.path.join(self.dir, "perf.data")]
        try:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        except OSError as exc:  # found on the PATH, but it cannot run
            self.error = f"perf record could not start: {exc}"
            shutil.rmtree(self.dir, ignore_errors=True)
            return False
        time.sleep(settle)
        if self.proc.poll() is not None:
            self._failed()
            return False
        return True

    def stop(self) -> "dict[str, float] | str":
        """Stop sampling: {class: share}, or why there is nothing (also where ``perf record`` failed only after
        :meth:`start` returned: on a loaded machine it may take longer than ``settle`` to give up)."""
        if self.proc is None:
            return self.error or "not started"
        if self.proc.poll() is not None and self.proc.returncode != 0:
            self._failed()
            return self.error
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # perf writes what it has and exits
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not os.path.exists(os.path.join(self.dir, "perf.data")):
            # it gave up without writing anything, only after this looked (the process was gone, say)
            self._failed()
            return self.error
        self._close()
        try:
            rep = subprocess.run(
                ["perf", "report", "-i", os.path.join(self.dir, "perf.data"), "--sort", "dso", "--stdio"],
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        shares = classes(rep.stdout)
        return shares or f"perf report gave nothing: {' '.join(rep.stderr.split())[:200]}"

    def _failed(self) -> None:
        """``perf record`` exited on its own: record why (its exit status and words), remove its folder."""
        assert self.proc is not None
        err = " ".join((self.proc.stderr.read() if self.proc.stderr else "").split())
        self.error = f"perf record failed (exit {self.proc.returncode}): {err[:200] or 'no message'}"
        self._close()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def _close(self) -> None:
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()


def table(
    columns: "list[str]", text: int, rows: "list[tuple[str, list[str], float, dict[str, float] | str]]"
) -> "list[str]":
    """The lines of a markdown table: ``columns`` (the first ``text`` of them text, the rest figures), then one
    column per class of :data:`NAMES`. A row is ``(label, cells, cpu, shares)``: its first cells, its CPU in
    µs and {class: share}; a row whose shares are a string (why there is no split) is listed under the table
    instead, as ``- label: why``."""
    out = [
        "| " + " | ".join([*columns, *NAMES]) + " |",
        "| " + " | ".join(["---"] * text + ["---:"] * (len(columns) - text + len(NAMES))) + " |",
    ]
    notes = []
    for label, first, cpu, shares in rows:
        if isinstance(shares, str):
            notes.append(f"- {label}: {shares}")
        else:
            out.append("| " + " | ".join(first) + f" | {cells(cpu, shares)} |")
    return out + ([""] + notes if notes else [])


def cells(cpu: float, shares: dict[str, float]) -> str:
    """Table cells ``µs (share%)`` for every class of :data:`NAMES`, from ``cpu`` µs in all."""
    return " | ".join(f"{cpu * shares.get(c, 0.0):.1f} ({100 * shares.get(c, 0.0):.0f}%)" for c in NAMES)
