"""Two processes joined by a Link exit with their own status, whatever they closed.

Each pair: rank 0 sends one tensor to rank 1, then both close their node /
``sys.exit(0)`` without closing / let an exception escape the ``with``. Both
statuses, outputs and last-moment thread lists are checked
(``tests/support/exit_runs.py``); ``-m soak`` makes many pairs (``EXIT_RUNS``).
"""

from __future__ import annotations

import importlib.util

import pytest

import exit_runs as X
from harness import make_store
from netns import child_env

TRANSPORTS = [
    "tcp",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="UCX transport not available"),
    ),
]


def _pairs(transport: str, endings: tuple[str, ...], n: int) -> str | None:
    results = []
    for i in range(n):
        for ending in endings:
            store = make_store()  # a fresh one per pair: the workers' keys are not prefixed
            cmds = [X.worker_cmd("link", ending, str(r), str(store.port), transport) for r in (0, 1)]
            out = X.run_all(cmds, env=child_env(), timeout=120, parallel=2)
            for r, (rc, o) in enumerate(out):
                results.append((f"{transport} {ending} #{i} rank {r}", X.judge(rc, o, status=X.STATUS[ending])))
            del store
    return X.summary(results) if any(why for _, why in results) else None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_link_pair_exits_with_its_own_status_whether_it_closes_exits_or_raises(transport):
    assert _pairs(transport, ("close", "exit", "raise"), 1) is None


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_many_link_pairs_never_abort_at_exit(transport):
    assert _pairs(transport, ("close", "exit"), X.runs(50)) is None
