"""Run many short processes of ``exit_workers.py`` and judge each one's end (the exit tests' shared part).

A process is judged by its exit status (SIGABRT at exit reads as -6 here, 134 in a shell), by the
``EXIT-PROBE`` line the worker prints last (no thread left alive after tensorwire's exit handler,
the operation's bytes right) and by the absence of ``terminate called`` in its output.
"""

from __future__ import annotations

import json
import re
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

WORKER = pathlib.Path(__file__).resolve().parent / "exit_workers.py"

#: What exit_workers.WEIGHTS holds (the worker checks the bytes it gets against it).
WEIGHTS = torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256)

#: Expected exit status of each ending.
STATUS = {"close": 0, "exit": 0, "raise": 1}


def runs(n: int) -> int:
    """``n``, or ``EXIT_RUNS`` from the environment when set (the slow tests' count, for a measurement)."""
    env = os.environ.get("EXIT_RUNS")
    return max(1, int(env)) if env else n


def worker_cmd(*args: str) -> list[str]:
    return [sys.executable, str(WORKER), *args]


def run_all(
    cmds: Sequence[Sequence[str]], *, env: dict[str, str], timeout: float, parallel: int = 2
) -> list[tuple[int, str]]:
    """(exit status, output) of each command, ``parallel`` at a time; one past ``timeout`` is killed (-9)."""

    def one(cmd: Sequence[str]) -> tuple[int, str]:
        try:
            p = subprocess.run(
                list(cmd), env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or b""
            text = out.decode("utf-8", "replace") if isinstance(out, bytes) else out
            return -9, f"(killed after {timeout}s)\n{text}"
        return p.returncode, p.stdout + p.stderr

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(one, cmds))


_PROBE = re.compile(r"EXIT-PROBE (\{[^{}]*\})")


def probes(out: str) -> list[dict]:
    """The EXIT-PROBE records in ``out`` (one per worker process; torchrun relays several)."""
    # (two ranks' lines can run into each other in torchrun's relay: find each record, not each line)
    return [json.loads(m.group(1)) for m in _PROBE.finditer(out)]


def judge(rc: int, out: str, *, status: int, processes: int = 1) -> str | None:
    """None if the run ended as it should: ``status``, ``processes`` clean probes, no abort; else why not."""
    if "terminate called" in out or rc in (-6, 134):
        return f"aborted (status {rc}): {out[-600:]}"
    if rc != status:
        return f"status {rc}, expected {status}: {out[-600:]}"
    got = probes(out)
    if len(got) != processes:
        return f"{len(got)} EXIT-PROBE lines, expected {processes}: {out[-600:]}"
    for p in got:
        if p["threads"]:
            return f"threads alive after tensorwire's exit handler: {p['threads']}"
        if not p["ok"]:
            return "the operation's bytes were wrong"
    if status == 1 and "the script failed on purpose" not in out:
        return f"the script's own exception is not in its output: {out[-600:]}"
    return None


def summary(results: list[tuple[str, str | None]]) -> str:
    """``"<n> runs, <k> bad"`` and the first few reasons (``results``: (label, judge's verdict))."""
    bad = [(label, why) for label, why in results if why is not None]
    lines = [f"{len(results)} runs, {len(bad)} bad"]
    lines += [f"  {label}: {why}" for label, why in bad[:5]]
    return "\n".join(lines)
