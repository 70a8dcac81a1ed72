"""tensorwire.lifecycle: what is still open at exit is closed, in stages, the last opened first.

The exit handler runs in a fresh interpreter (a subprocess): it marks the process as exiting.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from tensorwire import lifecycle
from serve_common import ROOT, clean_env

pytestmark = pytest.mark.timeout(60)

_SCRIPT = """
import sys
from tensorwire import lifecycle

class Thing:
    def __init__(self, name, fail=False):
        self.name, self.fail = name, fail
    def close(self):
        print("close", self.name, lifecycle.exiting(), flush=True)
        if self.fail:
            raise RuntimeError("close failed")
    def abort(self):
        print("abort", self.name, flush=True)

engine = Thing("engine")
lifecycle.track(engine, lifecycle.ENGINES)
a, b, c = Thing("a"), Thing("b", fail=True), Thing("c")
for t in (a, b, c):
    lifecycle.track(t)
group = Thing("group")
lifecycle.track(group, close="abort")
transport = Thing("transport")
lifecycle.track(transport, lifecycle.TRANSPORTS)
closed = Thing("closed")
lifecycle.track(closed)
lifecycle.untrack(closed)
dropped = Thing("dropped")  # never closed by the script, no other reference: still closed at exit
lifecycle.track(dropped)
del dropped
print("tracked", [t.name for t in lifecycle.tracked()], flush=True)
sys.exit(3 if sys.argv[1] == "exit" else 0)
"""


@pytest.mark.parametrize("how", ["exit", "end"])
def test_open_objects_are_closed_at_exit_users_first_the_last_opened_first_and_the_status_kept(how):
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, how], env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert r.returncode == (3 if how == "exit" else 0), r.stderr
    assert r.stdout.splitlines() == [
        "tracked ['a', 'b', 'c', 'group', 'dropped']",
        "close dropped True",
        "abort group",
        "close c True",
        "close b True",  # its failure does not stop the others
        "close a True",
        "close transport True",
        "close engine True",
    ], r.stdout + r.stderr


def test_track_refuses_an_unknown_stage_or_a_missing_close_method():
    with pytest.raises(ValueError, match="stage"):
        lifecycle.track(object(), 7)
    with pytest.raises(ValueError, match="no method 'shutdown'"):
        lifecycle.track(object(), close="shutdown")


def test_join_joins_other_threads_and_skips_the_current_one_and_unstarted_ones():
    done = threading.Event()
    th = threading.Thread(target=done.wait, args=(10,), daemon=True)
    th.start()
    done.set()
    assert lifecycle.join(th, 5) is True and not th.is_alive()
    assert lifecycle.join(threading.Thread(target=print)) is True  # never started: nothing to join
    assert lifecycle.join(None) is True
    seen = []
    me = threading.Thread(target=lambda: seen.append(lifecycle.join(threading.current_thread(), 1)))
    me.start()
    me.join(5)
    assert seen == [False]  # a thread cannot join itself: reported as not ended, without waiting


def test_join_reports_a_thread_that_does_not_end_in_time():
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, args=(10,), daemon=True)
    th.start()
    try:
        assert lifecycle.join(th, 0.05) is False
    finally:
        stop.set()
        th.join(5)
