"""What the figures were measured on: CPU, GPUs and topology, library versions, effective ``UCX_*``.

Nothing here imports ucxx in the calling process (importing it writes
``UCX_*`` into the environment); the UCX settings a backend really ran with
are reported by its own processes (``ucx_env`` in the results).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import re
import shutil
import subprocess
from typing import Any

__all__ = ["collect", "cpu_model", "versions", "env_vars", "nvidia_smi", "ucx_env_effective"]

_PKGS = (
    "torch",
    "numpy",
    "grpcio",
    "ucxx-cu12",
    "ucxx-cu13",
    "libucx-cu12",
    "libucx-cu13",
    "nixl",
    "nixl-cu12",
    "nixl-cu13",
    "cupy-cuda12x",
    "cupy-cuda13x",
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi topo underlines its header
ENV_PREFIXES = (
    "UCX_",
    "UCXPY_",
    "TENSORWIRE_",
    "NCCL_",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCH_SYMM_MEM",
    "CUDA_VISIBLE_DEVICES",
    "RAPIDS_LIBUCX",
)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in _PKGS:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    return out


def env_vars(environ: "os._Environ[str] | dict[str, str] | None" = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)}


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    exe = shutil.which(cmd[0])
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *cmd[1:]], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return _ANSI.sub("", out.stdout).strip() if out.returncode == 0 else None


def nvidia_smi() -> dict[str, Any]:
    """GPU list and topology matrix from ``nvidia-smi``, when present."""
    gpus = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"])
    if gpus is None:
        return {}
    out: dict[str, Any] = {"gpus": [g.strip() for g in gpus.splitlines() if g.strip()]}
    topo = _run(["nvidia-smi", "topo", "-m"])
    if topo:
        out["topology"] = topo
    return out


def ucx_env_effective() -> dict[str, str]:
    """``UCX_*`` as this process sees it now (call it in a process that imported ucxx)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "UCXPY_"))}


def collect(*, device: str) -> dict[str, Any]:
    """A flat-ish dict for the report header (strings, lists, small dicts)."""
    env: dict[str, Any] = {
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "kernel": platform.release(),
        "versions": versions(),
    }
    try:
        with open("/proc/meminfo") as f:
            total_kb = int(f.readline().split()[1])
        env["memory"] = f"{total_kb / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    if device == "cuda":
        import torch

        env["torch CUDA"] = str(torch.version.cuda)
        env["cuda devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    smi = nvidia_smi()
    if smi:
        env["nvidia-smi"] = smi.get("gpus", [])
        if "topology" in smi:
            env["topology"] = smi["topology"].replace("\t", " ")
    env["env (user-set)"] = env_vars()
    return env
