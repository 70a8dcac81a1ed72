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

Idle threads sleep: ``tensorwire serve`` sets ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported, unless the
environment sets it (:func:`wait_policy`). With OpenMP's default, a pool's workers spin for a while after every
parallel region, so each remote get_rows left the daemon's gather threads holding cores after its reply had gone:
cores that a client on the same host gathering from the daemon's shared memory with its own 16 threads needed.
On a 16-core host, a lease get_rows of 2 MiB into a CPU tensor beside a TCP client's reads in turns ran at
0.95-0.96x a local ``index_select(out=)`` with the daemon's threads passive, against 0.83-0.90x spinning (four passes
of each, ``bench/probe_serve_rows.py --tcp-client --daemon-env ...``,
``bench/results/probe-serve-rows_h200_2026-12-02-2.md``); the daemon's own TCP get_rows of 2 MiB took 6-14 %
longer in the same turns (1.205 against 1.134 ms, 1.013 against 0.891: each gather wakes its threads). Where the daemon has cores of its own, set
``OMP_WAIT_POLICY`` (``ACTIVE``: spin) or libgomp's ``GOMP_SPINCOUNT`` (OpenMP's default is about 3 ms of spinning).
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, MutableMapping

from tensorwire.cpus import cpu_quota, usable_cpus

__all__ = ["cpu_quota", "describe", "intra_op_threads", "usable_cpus", "wait_policy", "WAIT_POLICY"]

#: What the daemon sets ``OMP_WAIT_POLICY`` to where the environment does not set it: idle OpenMP threads sleep.
WAIT_POLICY = "PASSIVE"


def intra_op_threads(environ: Mapping[str, str] | None = None, cpus: int | None = None) -> int | None:
    """The daemon's torch intra-op threads: None where ``OMP_NUM_THREADS`` is set (torch's choice then), else 1
    below 8 usable CPUs and a quarter of them, at most 8, from 8."""
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    n = usable_cpus() if cpus is None else cpus
    return 1 if n < 8 else min(8, n // 4)


def wait_policy(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``OMP_WAIT_POLICY`` to :data:`WAIT_POLICY` in ``environ`` (default: this process's) unless it is set.

    OpenMP reads it once, when torch's OpenMP runtime is loaded, so for this process it must run before torch is
    imported: where torch is imported already, nothing is set (it would have no effect). Returns whether it set it.
    """
    env = os.environ if environ is None else environ
    if env.get("OMP_WAIT_POLICY", "").strip():
        return False
    if environ is None and "torch" in sys.modules:
        return False
    env["OMP_WAIT_POLICY"] = WAIT_POLICY
    return True


def describe(threads: int | None = None, environ: Mapping[str, str] | None = None) -> str:
    """The daemon's log line: torch's intra-op threads (``threads``, else torch's number now), where the number
    came from, and what its idle threads do (``OMP_WAIT_POLICY``); ``environ``: the daemon's environment
    (default: this process's)."""
    import torch

    env = os.environ if environ is None else environ
    n = torch.get_num_threads() if threads is None else threads
    policy = env.get("OMP_WAIT_POLICY", "").strip()
    idle = f"; idle threads: OMP_WAIT_POLICY={policy}" if policy else "; idle threads: OpenMP's default (spin a while)"
    if env.get("OMP_NUM_THREADS", "").strip():
        return f"torch intra-op threads: {n} (OMP_NUM_THREADS){idle}"
    return f"torch intra-op threads: {n} ({usable_cpus()} usable CPUs; OMP_NUM_THREADS sets another number){idle}"
