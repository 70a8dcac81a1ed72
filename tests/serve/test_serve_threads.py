"""The daemon's torch intra-op threads: one below 8 usable CPUs, a quarter of them (at most 8) from 8, fewer under a
cgroup CPU quota (a Kubernetes limit), OMP_NUM_THREADS deciding when set; idle ones sleep (OMP_WAIT_POLICY=PASSIVE
unless the environment says otherwise); the daemon says what it chose."""

from __future__ import annotations

import pytest
import torch

from tensorwire import native
from tensorwire.serve import cli
from tensorwire.serve.daemon import threads
from tensorwire.serve.daemon.threads import cpu_quota, intra_op_threads, usable_cpus

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("cpus, expected", [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (31, 7), (32, 8), (128, 8)])
def test_threads_follow_the_usable_cpus(cpus, expected):
    assert intra_op_threads({}, cpus=cpus) == expected


def test_omp_num_threads_decides_when_set():
    assert intra_op_threads({"OMP_NUM_THREADS": "3"}, cpus=64) is None
    assert intra_op_threads({"OMP_NUM_THREADS": "  "}, cpus=64) == 8  # blank: unset


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    "files, quota",
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "250000 100000\n"}, 2.5),
        ({"cpu.max": "50000 100000"}, 0.5),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # cgroup v1, unlimited
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({"cpu.max": "garbage"}, None),
        ({}, None),
    ],
)
def test_the_cgroup_cpu_quota_is_read_from_either_cgroup_version(tmp_path, files, quota):
    for name, text in files.items():
        _write(tmp_path / name, text)
    assert cpu_quota(str(tmp_path)) == quota


def test_a_quota_caps_the_usable_cpus(tmp_path, monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert usable_cpus(str(tmp_path)) == 64  # no quota
    _write(tmp_path / "cpu.max", "250000 100000\n")
    assert usable_cpus(str(tmp_path)) == 3  # 2.5 CPUs of time: three may run
    _write(tmp_path / "cpu.max", "10000 100000\n")
    assert usable_cpus(str(tmp_path)) == 1


@pytest.mark.parametrize("omp", [None, "2"])
def test_the_daemon_sets_them_and_says_so(monkeypatch, omp):
    before = torch.get_num_threads()
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(threads, "usable_cpus", lambda root="": 16)
    try:
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        torch.set_num_threads(3)
        cli._intra_op_threads()
        if omp is None:
            assert torch.get_num_threads() == 4
            assert threads.describe() == (
                "torch intra-op threads: 4 (16 usable CPUs; OMP_NUM_THREADS sets another number); "
                "idle threads: OMP_WAIT_POLICY=PASSIVE"
            )
        else:
            assert torch.get_num_threads() == 3  # left to torch
            assert threads.describe() == (
                "torch intra-op threads: 3 (OMP_NUM_THREADS); idle threads: OMP_WAIT_POLICY=PASSIVE"
            )
        monkeypatch.delenv("OMP_WAIT_POLICY")
        assert threads.describe().endswith("; idle threads: OpenMP's default (spin a while)")
        # another process's environment (a daemon about to be started)
        assert threads.describe(5, {"OMP_NUM_THREADS": "5", "OMP_WAIT_POLICY": "ACTIVE"}) == (
            "torch intra-op threads: 5 (OMP_NUM_THREADS); idle threads: OMP_WAIT_POLICY=ACTIVE"
        )
    finally:
        torch.set_num_threads(before)


def test_idle_threads_sleep_unless_the_environment_says_otherwise():
    env: dict[str, str] = {}
    assert threads.wait_policy(env) is True
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for given in ("ACTIVE", "passive", "active"):
        env = {"OMP_WAIT_POLICY": given}
        assert threads.wait_policy(env) is False
        assert env == {"OMP_WAIT_POLICY": given}  # the user's choice stands
    env = {"OMP_WAIT_POLICY": "  "}  # blank: unset
    assert threads.wait_policy(env) is True and env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_no_wait_policy_is_set_once_torch_is_loaded(monkeypatch):
    """This process has torch (and its OpenMP runtime) loaded: setting the variable now would change nothing, so
    nothing is set and the caller is told."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert threads.wait_policy() is False
    assert "OMP_WAIT_POLICY" not in threads.os.environ


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", [None, "ACTIVE"])
def test_the_daemon_sets_the_wait_policy_before_torch_loads(policy):
    """``tensorwire serve`` sets it before torch is imported (where OpenMP reads it), and leaves a given one alone."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    code = (
        "import os, sys\n"
        "from tensorwire.serve import cli\n"
        "cli.config_from_args = lambda args: sys.exit(0 if 'torch' not in sys.modules else 3)\n"
        "import atexit\n"
        "atexit.register(lambda: print(os.environ.get('OMP_WAIT_POLICY')))\n"
        "cli.cmd_serve(None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=100)
    assert out.returncode == 0, out.stderr  # (3: torch was loaded before the policy was set)
    assert out.stdout.strip() == (policy or "PASSIVE")


@pytest.mark.timeout(120)
def test_the_daemons_log_says_how_many(tmp_path):
    """A daemon started as users start it logs the number among its start-up lines (not before an error)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorwire", "serve", "--port", "0", "--no-shm"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline()  # the ready line: started
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    expected = intra_op_threads({})
    assert f"torch intra-op threads: {expected} ({usable_cpus()} usable CPUs" in err, err
    assert "idle threads: OMP_WAIT_POLICY=PASSIVE" in err, err
    assert f"hot path: {native.summary()} (tensorwire.native)" in err, err  # (the build it runs: the same here)
