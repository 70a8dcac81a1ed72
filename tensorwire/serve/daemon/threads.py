"""How many torch intra-op threads ``tensorwire serve`` runs with, from the CPUs it may use.

The daemon parallelises with its own threads (a request thread per session, the gather helper for big get_rows),
so an OpenMP pool competes with them and with the transports for the cores (its idle workers spin): on the 2-core
VM one turned a 0.5 ms gather into 5-8 ms whenever another process was busy. So below 8 CPUs the daemon runs torch
with one thread. From 8 it runs a quarter of them (at most 8): one ``index_select`` of random rows is a thread
waiting on memory (4,096 rows of 512 B of a 1,000,000-row table: 0.36 ms with one thread, 0.09 with 4, 0.04 with 8
on a 16-core host). There a get_rows over TCP of those 2 MiB took 1.14 ms with 4 threads against 1.36 ms with one
(``bench/bench_serve.py --remote --variant OMP_NUM_THREADS=1 --concurrent 16``, daemons side by side,
``bench/results/archive/serve-remote_h200_2026-12-01-4.md``; 1.19-1.20 against 1.38-1.45 ms in the runs before it); one
client moved 12-47 % more in every run, sixteen at once between 10 % less and 8 % more. The daemon's own helper
threads splitting the gather, tried instead, were slower than one thread (1.78 against 1.38 ms: the GIL handed
between them on every part).

``OMP_NUM_THREADS``, when set, decides instead (torch reads it itself).
"""

from __future__ import annotations

import os
from typing import Mapping

from tensorwire.cpus import cpu_quota, usable_cpus

__all__ = ["cpu_quota", "describe", "intra_op_threads", "usable_cpus"]


def intra_op_threads(environ: Mapping[str, str] | None = None, cpus: int | None = None) -> int | None:
    """The daemon's torch intra-op threads: None where ``OMP_NUM_THREADS`` is set (torch's choice then), else 1
    below 8 usable CPUs and a quarter of them, at most 8, from 8."""
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    n = usable_cpus() if cpus is None else cpus
    return 1 if n < 8 else min(8, n // 4)


def describe(threads: int | None = None) -> str:
    """The daemon's log line: torch's intra-op threads (``threads``, else torch's number now) and where the number
    came from."""
    import torch

    n = torch.get_num_threads() if threads is None else threads
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return f"torch intra-op threads: {n} (OMP_NUM_THREADS)"
    return f"torch intra-op threads: {n} ({usable_cpus()} usable CPUs; OMP_NUM_THREADS sets another number)"
