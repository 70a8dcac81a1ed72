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

__all__ = ["Probe", "UcxInfo", "GpuInfo", "probe_ucx", "probe_gpu", "parse_ucx_info_d", "parse_context_info"]


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
        gpu: :class:`GpuInfo`, or a callable producing it (default: :func:`probe_gpu`, run only where
            ``cuda`` says there is a GPU).
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
        gpu: "GpuInfo | Callable[[], GpuInfo] | None" = None,
    ) -> None:
        self.root = root
        self.env = dict(os.environ if env is None else env)
        self._memlock = memlock
        self._ucx = ucx
        self._cuda = cuda
        self._gpu = gpu
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

    def gpu(self) -> "GpuInfo":
        """The GPU probes (peer access, pinning, UCX round trip); an empty GpuInfo without a GPU."""
        if isinstance(self._gpu, GpuInfo):
            return self._gpu
        if self._gpu is None and not self.cuda()[0]:
            self._gpu = GpuInfo()
            return self._gpu
        self._gpu = (self._gpu or probe_gpu)()
        return self._gpu

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


# -- GPUs --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GpuInfo:
    """What the GPU checks read (:func:`probe_gpu`); tests build one by hand.

    ``peer``: ``{(i, j): can device i access device j's memory}`` for each ordered pair of visible GPUs.
    ``pinned``: ``(ok, detail)`` of a real 64 MiB pinned host allocation; ``host_register``: the same for
    ``cudaHostRegister`` of 64 MiB of ordinary host memory (what a transport does to existing memory).
    ``ucx_cuda``: ``(ok, detail)`` of a 1 MiB CUDA tensor sent and received over a UCX connection in a
    child process (None: not run, e.g. ucxx is missing).
    """

    devices: list[str] = dataclasses.field(default_factory=list)
    peer: dict[tuple[int, int], bool] = dataclasses.field(default_factory=dict)
    pinned: tuple[bool, str] | None = None
    host_register: tuple[bool, str] | None = None
    ucx_cuda: tuple[bool, str] | None = None
    error: str | None = None


_PROBE_BYTES = 64 << 20

#: A child process: two tensorwire UCX transports connected in it, 1 MiB of CUDA memory sent from one into
#: a CUDA buffer of the other, compared. A UCX that takes device memory for host memory crashes or corrupts
#: here, in the child, not in doctor.
UCX_ROUND_TRIP = r"""
import sys, threading, torch
from tensorwire.transport.base import new_nonce
from tensorwire.transport.ucx import UcxListener
device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
lst = UcxListener()
nonce = new_nonce()
lst.expect(nonce)
box = []
th = threading.Thread(target=lambda: box.append(UcxListener.connect("127.0.0.1", lst.address[1], nonce, timeout=20)))
th.start()
b = lst.accept(nonce, timeout=20)
th.join(20)
a = box[0]
src = torch.arange(1 << 18, dtype=torch.int32, device=device)
dst = torch.zeros_like(src)
b.post_recv(1, dst)
a.send(1, src, timeout=20)
b.wait_recv(1, timeout=20)
if device != "cpu":
    torch.cuda.synchronize()
ok = torch.equal(src, dst)
a.close()
b.close()
lst.close()
print("ok" if ok else "corrupt")
"""


def probe_gpu(*, timeout: float = 60.0, ucx: bool = True) -> GpuInfo:
    """Peer access between every pair of visible GPUs, a pinned allocation, a host registration and (with
    ``ucx``) a CUDA round trip over UCX in a child process. No GPU: an empty :class:`GpuInfo`."""
    info = GpuInfo()
    try:
        import torch

        if not torch.cuda.is_available():
            return info
        n = torch.cuda.device_count()
        info.devices = [torch.cuda.get_device_name(i) for i in range(n)]
        for i in range(n):
            for j in range(n):
                if i != j:
                    info.peer[(i, j)] = bool(torch.cuda.can_device_access_peer(i, j))
    except Exception as exc:  # noqa: BLE001 - a broken driver is a finding
        info.error = f"{type(exc).__name__}: {exc}"
        return info
    try:
        t = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
        info.pinned = (bool(t.is_pinned()), f"{_PROBE_BYTES >> 20} MiB pinned with cudaHostAlloc")
        del t
    except Exception as exc:  # noqa: BLE001
        info.pinned = (False, f"pinning {_PROBE_BYTES >> 20} MiB failed: {exc}")
    try:
        host = torch.empty(_PROBE_BYTES, dtype=torch.uint8)
        rt = torch.cuda.cudart()
        code = rt.cudaHostRegister(host.data_ptr(), _PROBE_BYTES, 0)
        code = int(getattr(code, "value", code))
        if code == 0:
            rt.cudaHostUnregister(host.data_ptr())
            info.host_register = (True, f"cudaHostRegister of {_PROBE_BYTES >> 20} MiB of ordinary host memory")
        else:
            info.host_register = (False, f"cudaHostRegister of {_PROBE_BYTES >> 20} MiB returned error {code}")
    except Exception as exc:  # noqa: BLE001
        info.host_register = (False, f"cudaHostRegister failed: {exc}")
    if ucx:
        try:
            import importlib.util

            have = importlib.util.find_spec("ucxx") is not None
        except (ImportError, ValueError):
            have = False
        if have:
            import sys

            try:
                out = subprocess.run(
                    [sys.executable, "-c", UCX_ROUND_TRIP, "cuda"], capture_output=True, text=True, timeout=timeout
                )
                last = (out.stdout.strip().splitlines() or [""])[-1]
                if out.returncode == 0 and last == "ok":
                    info.ucx_cuda = (True, "1 MiB CUDA tensor sent and received over UCX, bytes equal")
                elif out.returncode == 0:
                    info.ucx_cuda = (False, "1 MiB CUDA tensor over UCX arrived with different bytes")
                else:
                    tail = (out.stderr.strip().splitlines() or ["?"])[-1]
                    info.ucx_cuda = (False, f"the UCX CUDA round trip failed (exit {out.returncode}): {tail}")
            except subprocess.TimeoutExpired:
                info.ucx_cuda = (False, f"the UCX CUDA round trip did not finish in {timeout:.0f} s")
    return info
