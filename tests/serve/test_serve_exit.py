"""A script that uses a client exits with its own status, whatever it closed.

Before the fix, ``with tw.Client(addr) as c: c.get(name)`` ended with SIGABRT
("terminate called without an active exception") in a few runs of every
hundred: a thread of the client was still alive as the interpreter
finalized (see ``tensorwire/lifecycle.py``). Each run here is a fresh process:
open, one get, then close / ``sys.exit(0)`` without closing / an exception out
of the ``with``; its status, its output and its last-moment thread list are
checked (``tests/support/exit_runs.py``). The default suite makes a few runs
(the thread list catches a thread left behind in every run, not only in the
runs that abort); ``-m soak`` makes hundreds (``EXIT_RUNS`` sets how many).
"""

from __future__ import annotations

import pytest

import exit_runs as X
from serve_common import Daemon, clean_env

ENDINGS = ("close", "exit", "raise")


def _runs(per_ending: int) -> str | None:
    with Daemon(transport="auto") as d:
        import tensorwire as tw

        with tw.Client(d.address) as c:
            c.put("weights", X.WEIGHTS)
        cmds = [X.worker_cmd("client", e, d.address) for _ in range(per_ending) for e in ENDINGS]
        labels = [f"client {e} #{i}" for i in range(per_ending) for e in ENDINGS]
        out = X.run_all(cmds, env=clean_env(), timeout=90)
    results = [(lab, X.judge(rc, o, status=X.STATUS[lab.split()[1]])) for lab, (rc, o) in zip(labels, out)]
    bad = [r for r in results if r[1] is not None]
    return X.summary(results) if bad else None


@pytest.mark.timeout(300)
def test_a_client_script_exits_with_its_own_status_whether_it_closes_exits_or_raises():
    assert _runs(2) is None


@pytest.mark.soak
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_hundreds_of_client_scripts_never_abort_at_exit():
    assert _runs(X.runs(100)) is None
