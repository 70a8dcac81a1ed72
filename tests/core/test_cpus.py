"""Every thread pool sizes itself from the CPUs the process may use -- its affinity mask capped by its cgroup's CPU
quota (a Kubernetes CPU limit) -- not from the host's core count."""

from __future__ import annotations

import pytest

from tensorwire import cpus
from tensorwire.serve.client.shm_maps import Copier
from tensorwire.transport.cma import syscalls

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A 64-core affinity mask and a cgroup directory of our own; ``machine(quota)`` writes its ``cpu.max``."""
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(cpus, "CGROUP_ROOT", str(tmp_path))

    def limit(quota: str) -> None:
        (tmp_path / "cpu.max").write_text(quota)

    return limit


def test_the_quota_caps_the_affinity(machine):
    assert cpus.usable_cpus() == 64  # no cpu.max: unlimited
    machine("max 100000\n")
    assert cpus.usable_cpus() == 64
    machine("250000 100000\n")
    assert cpus.usable_cpus() == 3  # 2.5 CPUs of time: three may run
    machine("5000 100000\n")
    assert cpus.usable_cpus() == 1


def test_an_affinity_below_the_quota_wins(machine, monkeypatch):
    machine("1600000 100000\n")  # 16 CPUs of time
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert cpus.usable_cpus() == 3


@pytest.mark.parametrize(
    "quota, threads", [(None, 4), ("1600000 100000", 4), ("800000 100000", 2), ("100000 100000", 1)]
)
def test_cross_memory_copy_threads_follow_the_quota(machine, quota, threads):
    if quota is not None:
        machine(quota)
    assert syscalls.default_threads() == threads


@pytest.mark.parametrize("quota, parallel", [(None, True), ("200000 100000", True), ("100000 100000", False)])
def test_the_clients_copy_helpers_follow_the_quota(machine, quota, parallel):
    if quota is not None:
        machine(quota)
    c = Copier()
    try:
        assert c.parallel is parallel
    finally:
        c.close()
