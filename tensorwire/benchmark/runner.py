"""Runs every backend in its own pair of fresh processes, bounded in time; collects what comes back.

A backend that is missing here is *skipped*; one that raises, hangs past its
timeout or fails ``--check`` is *failed* with the reason. Neither stops the run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from typing import Any, Callable

from tensorwire.benchmark.config import BenchConfig

__all__ = ["run_pair", "run_all", "Progress"]

CTX = mp.get_context("spawn")
#: After one side of a pair reported failure, how long the other gets to report its own.
GRACE_S = 3.0


class Progress:
    """A progress bar on stderr (redrawn in place on a terminal, one line per backend otherwise)."""

    def __init__(self, total: int, *, enabled: bool = True, stream: Any = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.index = 0
        self.name = ""
        self.t0 = time.monotonic()

    def start(self, index: int, name: str) -> None:
        self.index, self.name, self.t0 = index, name, time.monotonic()
        if self.enabled and not self.tty:
            print(f"[{index + 1}/{self.total}] {name} ...", file=self.stream, flush=True)
        self.update(0, 1, "")

    def update(self, done: int, of: int, label: str) -> None:
        if not (self.enabled and self.tty):
            return
        width = 30
        fill = int(width * done / max(1, of))
        bar = "#" * fill + "." * (width - fill)
        try:
            from tensorwire.benchmark.config import format_size

            label = format_size(int(label))
        except ValueError:
            pass
        line = f"\r[{self.index + 1}/{self.total}] {self.name:<15} [{bar}] {done}/{of} {label:<10}"
        self.stream.write(line)
        self.stream.flush()

    def finish(self, status: str, detail: str = "") -> None:
        if not self.enabled:
            return
        took = time.monotonic() - self.t0
        msg = f"[{self.index + 1}/{self.total}] {self.name} {status} ({took:.1f} s){': ' + detail if detail else ''}"
        if self.tty:
            self.stream.write("\r" + " " * 78 + "\r")
        print(msg[:300], file=self.stream, flush=True)


def _make_store(host: str, timeout: float):
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(host, 0, 2, True, timedelta(seconds=timeout), wait_for_workers=False)


def run_pair(
    name: str,
    cfg: BenchConfig,
    *,
    on_progress: Callable[[int, int, str], None] | None = None,
    target: Callable[..., None] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Run one backend (or ``target``, same protocol as :func:`tensorwire.benchmark.worker.entry`) in two processes.

    Returns ``{"status": "ok"|"failed"|"skipped", "error": str, "sender": ..., "receiver": ...}``.
    """
    from tensorwire.benchmark.worker import entry

    target = target or entry
    timeout = cfg.backend_timeout() if timeout is None else timeout
    store = _make_store("127.0.0.1", timeout)
    q = CTX.Queue()
    prefix = f"bench/{name}/{os.getpid()}/{time.monotonic_ns()}/"
    procs = [
        CTX.Process(
            target=target,
            args=(name, r, cfg.to_dict(), "127.0.0.1", store.port, prefix, q),
            daemon=True,
            name=f"tw-bench-{name}-{r}",
        )
        for r in (1, 0)
    ]
    out: dict[str, Any] = {"status": "ok", "error": ""}
    results: dict[int, Any] = {}
    problems: list[tuple[str, int, str]] = []  # (kind, rank, message)
    t_start = time.monotonic()
    deadline = t_start + timeout
    grace_end: float | None = None
    last_label = ""
    try:
        for p in procs:
            p.start()
        while len(results) + len(problems) < 2:
            now = time.monotonic()
            limit = deadline if grace_end is None else min(deadline, grace_end)
            if now >= limit:
                if grace_end is None or now >= deadline:
                    problems.append(
                        ("error", -1, f"timed out after {timeout:.0f} s (last progress: {last_label or 'none'})")
                    )
                break
            try:
                msg = q.get(timeout=min(0.5, limit - now))
            except queue.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead and grace_end is None:
                    problems.append(("error", -1, f"{dead[0].name} died with exit code {dead[0].exitcode}"))
                    grace_end = time.monotonic() + GRACE_S
                continue
            kind = msg[0]
            if kind == "progress":
                _, i, n, label = msg
                last_label = label
                if on_progress:
                    on_progress(i, n, label)
            elif kind == "result":
                results[msg[1]] = msg[2]
            elif kind == "skipped":
                problems.append(("skipped", msg[1], msg[2]))
                grace_end = grace_end or time.monotonic() + GRACE_S
            elif kind == "check":
                problems.append(("check", msg[1], msg[2]))
                grace_end = grace_end or time.monotonic() + GRACE_S
            else:
                _, rank, etype, message, tb = msg
                problems.append(("error", rank, f"rank {rank}: {etype}: {message}"))
                out.setdefault("tracebacks", {})[str(rank)] = tb
                grace_end = grace_end or time.monotonic() + GRACE_S
    finally:
        for p in procs:
            p.join(timeout=2.0 if not problems else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
        del store
    out["seconds"] = round(time.monotonic() - t_start, 2)
    if problems:
        kinds = {k for k, _, _ in problems}
        if "check" in kinds:
            out["status"] = "failed"
            out["check_failed"] = True
            out["error"] = "CHECK FAILED: " + "; ".join(m for k, _, m in problems if k == "check")
        elif kinds == {"skipped"}:
            out["status"] = "skipped"
            out["error"] = problems[0][2]
        else:
            out["status"] = "failed"
            # The root cause is usually the first report; the other side then only lost its peer.
            out["error"] = "; ".join(m for k, _, m in problems if k != "skipped") or problems[0][2]
    out["sender"] = results.get(0)
    out["receiver"] = results.get(1)
    return out


def run_all(
    cfg: BenchConfig,
    *,
    progress: Progress | None = None,
    after_each: Callable[[dict[str, dict[str, Any]]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every backend of ``cfg``, in order (``after_each`` sees the results so far, e.g. to save them)."""
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(cfg.backends):
        if progress:
            progress.start(i, name)
        res = run_pair(name, cfg.for_backend(name), on_progress=progress.update if progress else None)
        if progress:
            progress.finish(res["status"], res.get("error", ""))
        out[name] = res
        if after_each:
            after_each(out)
    return out


def execute(
    cfg: BenchConfig,
    *,
    progress: Progress | None = None,
    where: str = "one host, two processes, loopback",
    command: str | None = None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The whole run: environment, every backend, the memory check. Returns the raw result for :mod:`.report`.

    ``checkpoint(raw)`` is called after each backend with what is known so far (a run cut short still
    leaves its finished backends behind).
    """
    from tensorwire.benchmark import environment, memcheck

    raw: dict[str, Any] = {
        "config": cfg.to_dict(),
        "where": where,
        "command": command,
        "environment": environment.collect(device=cfg.device),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }

    def partial(done: dict[str, dict[str, Any]]) -> None:
        if checkpoint:
            checkpoint(
                {
                    **raw,
                    "backends": {
                        n: done.get(n, {"status": "skipped", "error": "not run (cut short)"}) for n in cfg.backends
                    },
                }
            )

    raw["backends"] = run_all(cfg, progress=progress, after_each=partial)
    ucx_env = {
        n: raw["backends"][n]["sender"].get("ucx_env")
        for n in ("raw-ucxx", "raw-ucxx-cm", "nixl")
        if n in raw["backends"] and raw["backends"][n].get("sender")
    }
    if ucx_env:
        # what a UCX-using backend's process really ran with (ucxx writes some UCX_* at import)
        first = next(iter(ucx_env.items()))
        raw["environment"][f"UCX_* in effect ({first[0]} process)"] = first[1]
    if cfg.memcheck:
        transports = ["auto"] + [t for t in ("tcp", "ucx") if f"tensorwire-{t}" in cfg.backends]
        if progress and progress.enabled:
            print(
                f"memory check: {cfg.memcheck_steps} steps x {cfg.memcheck_size} B through a Link "
                f"({', '.join(transports)}) ...",
                file=progress.stream,
                flush=True,
            )
        raw["memcheck"] = memcheck.run(cfg, transports, run_pair=run_pair)
    raw["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    raw["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return raw
