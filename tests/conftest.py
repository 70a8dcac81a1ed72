"""Hooks for the whole suite: which hot path it runs against (see :mod:`tensorwire.native`), and a last-resort
watchdog for tests that hang where pytest-timeout cannot end them."""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tensorwire import native


def pytest_report_header(config: pytest.Config) -> str:
    return f"tensorwire hot path: {native.summary()} (tensorwire.native)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``pure_python`` replace a method of a class, which compiled code calls directly: they run
    against the pure-Python modules only (the same source, so what they check holds for both)."""
    if "compiled" not in native.status().values():
        return
    skip = pytest.mark.skip(reason="patches a method of a class that is compiled here (tensorwire.native)")
    for item in items:
        if item.get_closest_marker("pure_python"):
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_of_the_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every temporary file of the run -- this process's and its children's (``TMPDIR``): torchrun's agents
    leave a ``torchelastic_*`` folder per job behind, daemons and benchmarks their scratch -- goes into one
    folder, removed when the run ends."""
    folder = tmp_path_factory.mktemp("tmp")
    saved_env, saved_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = saved_dir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(folder, ignore_errors=True)


#: Seconds past a test's own timeout (pytest-timeout) after which the watchdog ends the run.
WATCHDOG_GRACE_S = 120


def _timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    if marker is not None and "timeout" in marker.kwargs:
        return float(marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)


_watchdog_fd = [2]


def pytest_configure(config: pytest.Config) -> None:
    # the terminal's stderr, kept before a test's output capture points fd 2 elsewhere (capture is suspended
    # while plugins configure)
    _watchdog_fd[0] = os.dup(2)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _watchdog_fd[0] != 2:
        os.close(_watchdog_fd[0])
        _watchdog_fd[0] = 2


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """pytest-timeout's signal handler is Python code: a test whose threads wait in C with the GIL held (a
    deadlock) never lets it run, and the whole run hangs until CI's own limit. faulthandler's watchdog is a C
    thread: past the test's timeout plus :data:`WATCHDOG_GRACE_S` it prints every thread's stack and ends the
    process, so such a hang fails the run in minutes and says where."""
    timeout = _timeout_of(item)
    armed = timeout > 0 and not item.config.getoption("usepdb", False)
    if armed:
        faulthandler.dump_traceback_later(timeout + WATCHDOG_GRACE_S, exit=True, file=_watchdog_fd[0])
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()
