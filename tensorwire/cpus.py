"""How many CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota.

``os.cpu_count()`` counts the host's cores. In a container under a Kubernetes CPU limit (a cgroup quota) or a
process pinned by ``taskset``/``numactl``, that is many more than the process may run on, and every pool sized
from it (the daemon's torch threads, the clients' copy helpers, cross-memory copy threads) oversubscribes the
CPUs it has: threads that wait on each other's time slices. Everything here sizes its threads from
:func:`usable_cpus` instead.
"""

from __future__ import annotations

import math
import os

__all__ = ["CGROUP_ROOT", "affinity_cpus", "cpu_quota", "usable_cpus"]

#: Where this process's cgroup is mounted (in a container: the container's own cgroup).
CGROUP_ROOT = "/sys/fs/cgroup"


def affinity_cpus() -> int:
    """CPUs this process may run on by its affinity mask (``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cpu_quota(root: str | None = None) -> float | None:
    """CPUs' worth of time the cgroup at ``root`` (None: :data:`CGROUP_ROOT`) may use, or None when unlimited or
    unknown. In a container ``/sys/fs/cgroup`` is the container's own cgroup, where a Kubernetes CPU limit lands;
    on a host outside one the root cgroup has no quota (a systemd ``CPUQuota=`` of a service is not seen there).

    Reads cgroup v2's ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``), else v1's ``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us`` (quota -1: unlimited).
    """
    root = CGROUP_ROOT if root is None else root
    # (bytes, not text: no codec to look up, which a process that dropped its privileges may no longer load)
    try:
        with open(os.path.join(root, "cpu.max"), "rb") as f:
            quota, period = f.read().split()[:2]
        return None if quota == b"max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us"), "rb") as f:
            q = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us"), "rb") as f:
            p = int(f.read())
        return None if q <= 0 or p <= 0 else q / p
    except (OSError, ValueError):
        return None


def usable_cpus(root: str | None = None) -> int:
    """The CPUs this process may run on (:func:`affinity_cpus`), no more than the CPU quota of the cgroup at
    ``root`` rounds up to (2.5 CPUs of time: three may run)."""
    cpus = affinity_cpus()
    quota = cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return cpus
