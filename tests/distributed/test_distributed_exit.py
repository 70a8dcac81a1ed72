"""A two-rank torchrun job with ``backend="tensorwire"`` exits with its own status.

Each job: one send/recv and a barrier, then ``destroy_process_group`` / exit
without it (as many scripts do) / an exception after it. torchrun's status,
the output and each worker's last-moment thread list are checked
(``tests/support/exit_runs.py``); ``-m soak`` runs 100 jobs (``EXIT_RUNS``).
"""

from __future__ import annotations

import pytest

import exit_runs as X
from netns import TORCHRUN, child_env, free_port


def _job(ending: str) -> list[str]:
    return [
        *TORCHRUN,
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        "0",
        str(X.WORKER),
        "dist",
        ending,
    ]


def _jobs(endings: tuple[str, ...], n: int) -> str | None:
    labels = [f"{e} #{i}" for i in range(n) for e in endings]
    out = X.run_all([_job(lab.split()[0]) for lab in labels], env=child_env(), timeout=240, parallel=1)
    # torchrun exits 1 when a worker failed (the "raise" ending), 0 when both exited 0
    results = [(lab, X.judge(rc, o, status=X.STATUS[lab.split()[0]], processes=2)) for lab, (rc, o) in zip(labels, out)]
    return X.summary(results) if any(why for _, why in results) else None


@pytest.mark.timeout(400)
def test_a_torchrun_job_exits_with_its_own_status_whether_it_destroys_exits_or_raises():
    assert _jobs(("close", "exit", "raise"), 1) is None


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_a_hundred_torchrun_jobs_never_abort_at_exit():
    assert _jobs(("exit",), X.runs(100)) is None
