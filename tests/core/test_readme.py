"""The README's first lines are the commands CI and users run."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()[:2]]
    # the console script pip installed: it runs the installed (compiled) build, where "python3 -m tensorwire"
    # run from a checkout would import the checkout's own modules first
    assert lines[0].endswith("&& tensorwire demo"), lines[0]
    ci = (ROOT / ".ci" / "run").read_text()
    assert lines[1] in ci, f"README test command {lines[1]!r} not in .ci/run"
    assert "pytest" in lines[1]


def test_cli_help_is_fast_and_lists_commands():
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "tensorwire", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True
    )
    assert "demo" in out.stdout
    assert time.monotonic() - t0 < 10
