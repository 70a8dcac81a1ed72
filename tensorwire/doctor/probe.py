"""What ``tensorwire doctor`` looks at: the host (:class:`Probe`) and what UCX reports (:class:`UcxInfo`).

Every read of ``/sys``, ``/dev``, ``/proc``, the environment, the limits and
CUDA goes through :class:`Probe`, so tests can point it at a fake tree;
:func:`probe_ucx` asks ``ucx_info`` (from the libucx wheel, else ``PATH``) and
ucxx, and leaves ``os.environ`` as it found it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import shutil
import subprocess
from typing import Callable, Mapping

__all__ = ["Probe", "UcxInfo", "probe_ucx", "parse_ucx_info_d", "parse_context_info"]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


@dataclasses.dataclass
class UcxInfo:
    """What UCX reports about itself."""

    version: str | None = None
    ucxx_version: str | None = None
    configured: str = ""  # "Configured with:" line of ucx_info -v
    transports: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (transport, device)
    modules: list[str] = dataclasses.field(default_factory=list)  # uct module files found next to libucp
    source: str = ""
    error: str | None = None
    cuda_support: bool | None = None
    env_set_by_ucxx: dict[str, str] = dataclasses.field(default_factory=dict)


class Probe:
    """Access to the host, injectable for tests.

    Args:
        root: prefix for ``/sys``, ``/dev``, ``/proc`` paths ("" = the real host).
        env: environment to judge (default ``os.environ``).
        memlock: ``(soft, hard)`` RLIMIT_MEMLOCK (default: the real one).
        ucx: :class:`UcxInfo`, or a callable producing it (default: :func:`probe_ucx`).
        cuda: ``(available, [device names])`` (default: asks torch, without initializing a context if absent).
    """

    def __init__(
        self,
        *,
        root: str = "",
        env: Mapping[str, str] | None = None,
        memlock: tuple[int, int] | None = None,
        ucx: "UcxInfo | Callable[[], UcxInfo] | None" = None,
        cuda: tuple[bool, list[str]] | None = None,
        is_root: bool | None = None,
    ) -> None:
        self.root = root
        self.env = dict(os.environ if env is None else env)
        self._memlock = memlock
        self._ucx = ucx
        self._cuda = cuda
        self.is_root = (os.geteuid() == 0) if is_root is None else is_root

    def path(self, p: str) -> str:
        return self.root + p if self.root else p

    def read(self, p: str) -> str | None:
        return _read(self.path(p))

    def exists(self, p: str) -> bool:
        return os.path.exists(self.path(p))

    def listdir(self, p: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(p)))
        except OSError:
            return []

    def memlock(self) -> tuple[int, int]:
        return self._memlock if self._memlock is not None else resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def statvfs_size(self, p: str) -> int | None:
        try:
            st = os.statvfs(self.path(p))
        except OSError:
            return None
        return st.f_blocks * st.f_frsize

    def ucx(self) -> UcxInfo:
        if isinstance(self._ucx, UcxInfo):
            return self._ucx
        self._ucx = (self._ucx or probe_ucx)()
        return self._ucx

    def cuda(self) -> tuple[bool, list[str]]:
        if self._cuda is None:
            try:
                import torch

                ok = bool(torch.cuda.is_available())
                self._cuda = (
                    ok,
                    [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else [],
                )
            except Exception:  # noqa: BLE001 - a broken driver is a finding, not a crash
                self._cuda = (False, [])
        return self._cuda


# -- UCX probing ------------------------------------------------------------------------------


def _libucx_dir() -> str | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def parse_ucx_info_d(text: str) -> list[tuple[str, str]]:
    """``ucx_info -d`` output -> [(transport, device)]."""
    out = []
    transport = None
    for line in text.splitlines():
        m = re.match(r"#\s+Transport:\s+(\S+)", line)
        if m:
            transport = m.group(1)
            continue
        m = re.match(r"#\s+Device:\s+(\S+)", line)
        if m and transport:
            out.append((transport, m.group(1)))
            transport = None
    return out


def parse_context_info(text: str) -> list[tuple[str, str]]:
    """ucxx ``UCXContext.info`` ("resource N : md M dev K flags -- tcp/lo") -> [(transport, device)]."""
    out = []
    for m in re.finditer(r"resource\s+\d+\s*:.*?--\s+(\S+?)/(\S+)", text):
        out.append((m.group(1), m.group(2)))
    return out


def probe_ucx(timeout: float = 20.0) -> UcxInfo:
    """Versions, build flags, transports and devices of the UCX that ucxx loads."""
    info = UcxInfo()
    import importlib.metadata as md

    for pkg in ("ucxx-cu13", "ucxx-cu12", "ucxx"):
        try:
            info.ucxx_version = md.version(pkg)
            break
        except md.PackageNotFoundError:
            continue
    base = _libucx_dir()
    if base:
        exe = os.path.join(base, "bin", "ucx_info")
        libdir = os.path.join(base, "lib")
        info.modules = sorted(os.path.basename(p) for p in _glob(os.path.join(libdir, "ucx", "libuct_*.so")))
        if os.access(exe, os.X_OK):
            env = dict(
                os.environ,
                LD_LIBRARY_PATH=libdir + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
                UCX_WARN_UNUSED_ENV_VARS="n",
            )
            try:
                v = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=timeout, env=env)
                d = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=timeout, env=env)
            except (OSError, subprocess.SubprocessError) as exc:
                info.error = f"ucx_info failed: {exc}"
            else:
                m = re.search(r"Library version:\s*(\S+)", v.stdout)
                info.version = m.group(1) if m else None
                m = re.search(r"Configured with:\s*(.*)", v.stdout)
                info.configured = m.group(1) if m else ""
                info.transports = parse_ucx_info_d(d.stdout)
                info.source = f"{exe} -d"
    elif shutil.which("ucx_info"):
        try:
            d = subprocess.run(["ucx_info", "-d"], capture_output=True, text=True, timeout=timeout)
            info.transports = parse_ucx_info_d(d.stdout)
            info.source = "ucx_info -d (PATH)"
        except (OSError, subprocess.SubprocessError) as exc:
            info.error = f"ucx_info failed: {exc}"
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    try:
        import ucxx._lib.libucxx as u

        info.env_set_by_ucxx = {k: v for k, v in os.environ.items() if k.startswith("UCX_") and before.get(k) != v}
        if info.version is None:
            info.version = ".".join(str(x) for x in u.get_ucx_version())
        ctx = u.UCXContext(feature_flags=(u.Feature.TAG,))
        info.cuda_support = bool(ctx.cuda_support)
        if not info.transports:
            info.transports = parse_context_info(ctx.info)
            info.source = "ucxx UCXContext.info"
    except ImportError as exc:
        info.error = info.error or f"ucxx is not importable: {exc}"
    except Exception as exc:  # noqa: BLE001 - UCX failing to start is a finding
        info.error = info.error or f"UCX context failed: {exc}"
    finally:
        # importing ucxx writes UCX_* into os.environ; doctor reports it, and leaves the environment as it was
        for k in info.env_set_by_ucxx:
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
    return info


def _glob(pattern: str) -> list[str]:
    import glob

    return glob.glob(pattern)
