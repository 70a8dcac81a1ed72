"""The checks of ``tensorwire doctor``: one function per concern, each a list of :class:`Finding`.

A check takes a :class:`~tensorwire.doctor.probe.Probe` and judges what it
sees (``OK``, ``WARN``, ``FAIL``, ``N/A``), with the fix when something is off.
:data:`CHECKS` lists them in the order the report prints them;
:func:`run_checks` runs them, and a check that crashes becomes a ``WARN``
finding instead of hiding the others. Each check imports only what it checks.
"""

from __future__ import annotations

import dataclasses
import resource
from typing import Callable, Iterable, Literal

from tensorwire.doctor.probe import Probe

__all__ = [
    "Verdict",
    "Finding",
    "CHECKS",
    "run_checks",
    "check_ucx",
    "check_ucx_transports",
    "check_rdma",
    "check_dev_infiniband",
    "check_memlock",
    "check_shm",
    "check_cuda",
    "check_gpudirect",
    "check_container",
    "check_allocator",
    "check_ucx_env",
    "check_tensorwire",
    "check_native",
]

Verdict = Literal["OK", "WARN", "FAIL", "N/A"]


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str
    verdict: Verdict
    detail: str
    fix: str = ""
    choice: str = ""  # what tensorwire will do with what was found, and why ("" where it chooses nothing)

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def _ib_devices(p: Probe) -> list[dict[str, str]]:
    out = []
    for dev in p.listdir("/sys/class/infiniband"):
        for port in p.listdir(f"/sys/class/infiniband/{dev}/ports") or ["1"]:
            base = f"/sys/class/infiniband/{dev}/ports/{port}"
            layer = p.read(f"{base}/link_layer") or "?"
            state = p.read(f"{base}/state") or "?"
            out.append(
                {
                    "dev": dev,
                    "port": port,
                    "link_layer": layer,
                    "state": state,
                    "kind": "RoCE"
                    if layer.lower() == "ethernet"
                    else ("InfiniBand" if layer.lower() == "infiniband" else layer),
                }
            )
    return out


def check_ucx(p: Probe) -> list[Finding]:
    u = p.ucx()
    if u.version is None and u.ucxx_version is None:
        return [
            Finding(
                "ucx",
                "FAIL",
                f"UCX/ucxx not available ({u.error or 'not installed'}): only the TCP transport works",
                "pip install ucxx-cu12 (CUDA 12) or ucxx-cu13 (CUDA 13)",
            )
        ]
    out = [
        Finding(
            "ucx",
            "OK" if u.version else "WARN",
            f"ucxx {u.ucxx_version or '?'}, UCX {u.version or '?'}" + (f" ({u.error})" if u.error else ""),
            "" if u.version else "UCX would not start; see the error",
        )
    ]
    if u.configured:
        no_verbs = "--without-verbs" in u.configured
        has_ib_module = any(m.startswith("libuct_ib") for m in u.modules)
        if no_verbs and not has_ib_module and not p.listdir("/sys/class/infiniband"):
            out.append(
                Finding(
                    "ucx build",
                    "N/A",
                    "this UCX was built --without-verbs (the pip libucx wheel); "
                    "irrelevant here (no RDMA NIC), but on RDMA hosts it would not use the NIC",
                    "on RDMA hosts: a verbs-enabled UCX (RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true)",
                )
            )
        elif no_verbs and not has_ib_module:
            out.append(
                Finding(
                    "ucx build",
                    "WARN",
                    "this UCX was built --without-verbs (the pip libucx wheel): it cannot use InfiniBand/RoCE even "
                    "where the host has RDMA NICs",
                    "on RDMA hosts, use a UCX built with verbs: install it system-wide and set "
                    "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true so ucxx loads it",
                )
            )
        else:
            out.append(Finding("ucx build", "OK", "UCX built with verbs (RDMA capable)"))
    return out


def check_ucx_transports(p: Probe) -> list[Finding]:
    u = p.ucx()
    if not u.transports:
        return [
            Finding(
                "ucx transports",
                "WARN" if u.version else "N/A",
                f"could not list UCX transports ({u.error or 'ucx_info not found'})",
                "run ucx_info -d from the libucx wheel (site-packages/libucx/bin) by hand",
            )
        ]
    by_tl: dict[str, list[str]] = {}
    for tl, dev in u.transports:
        by_tl.setdefault(tl, []).append(dev)
    listing = ", ".join(f"{tl}({'/'.join(devs)})" for tl, devs in by_tl.items())
    out = [Finding("ucx transports", "OK", f"UCX sees: {listing} [{u.source}]")]
    tcp_devs = by_tl.get("tcp", [])
    out.append(
        Finding(
            "tcp",
            "OK" if tcp_devs else "WARN",
            f"UCX tcp on {', '.join(tcp_devs)}"
            if tcp_devs
            else "UCX sees no tcp device: without an RDMA device, UCX reaches no other host",
            "" if tcp_devs else "keep tcp in UCX_TLS / UCX_NET_DEVICES (or rely on RDMA)",
        )
    )
    return out


def check_rdma(p: Probe) -> list[Finding]:
    devs = _ib_devices(p)
    u = p.ucx()
    ucx_rdma = [d for tl, d in u.transports if tl.startswith(("rc", "dc", "ud"))]
    if not devs:
        return [
            Finding(
                "rdma",
                "WARN",
                "NO RDMA on this host: no InfiniBand/RoCE device in /sys/class/infiniband. tensorwire moves "
                "host memory over TCP (loopback/Ethernet) and shared memory; fine on one host, "
                "bandwidth-bound by TCP between hosts",
                "for RDMA between hosts: a RoCE/InfiniBand NIC, its driver (rdma-core / MLNX_OFED) and a "
                "verbs-enabled UCX",
            )
        ]
    active = [d for d in devs if "ACTIVE" in d["state"].upper()]
    desc = ", ".join(f"{d['dev']}:{d['port']} {d['kind']} {d['state']}" for d in devs)
    out = [
        Finding(
            "rdma",
            "OK" if active else "WARN",
            f"RDMA devices: {desc}",
            "" if active else "no port is ACTIVE: check cabling / subnet manager (ibstat)",
        )
    ]
    if not ucx_rdma and u.transports:
        out.append(
            Finding(
                "rdma in ucx",
                "WARN",
                "the host has RDMA devices but UCX lists no rc/dc/ud transport",
                "use a verbs-enabled UCX (see 'ucx build'), check UCX_TLS / UCX_NET_DEVICES",
            )
        )
    elif ucx_rdma:
        out.append(Finding("rdma in ucx", "OK", f"UCX RDMA transports on {', '.join(sorted(set(ucx_rdma)))}"))
    return out


def check_dev_infiniband(p: Probe) -> list[Finding]:
    has_sys = bool(p.listdir("/sys/class/infiniband"))
    entries = p.listdir("/dev/infiniband")
    uverbs = [e for e in entries if e.startswith("uverbs")]
    if not has_sys:
        if uverbs:
            return [
                Finding(
                    "/dev/infiniband",
                    "WARN",
                    f"/dev/infiniband has {', '.join(uverbs)} but "
                    "/sys/class/infiniband is empty (a verbs device node without its HCA)",
                    "check the RDMA driver (ibv_devices) or the container's device list",
                )
            ]
        return [
            Finding(
                "/dev/infiniband",
                "N/A",
                "no RDMA device"
                + (f" (/dev/infiniband has only {', '.join(entries)}: no HCA behind it)" if entries else ""),
            )
        ]
    if not uverbs:
        return [
            Finding(
                "/dev/infiniband",
                "FAIL",
                "RDMA devices exist but /dev/infiniband/uverbs* is missing: verbs cannot be opened "
                "(typical in a container started without the devices)",
                "docker run --device=/dev/infiniband (or --privileged); on Kubernetes an RDMA device "
                "plugin resource (e.g. rdma/hca)",
            )
        ]
    return [Finding("/dev/infiniband", "OK", f"{', '.join(uverbs)} present")]


def check_memlock(p: Probe) -> list[Finding]:
    soft, hard = p.memlock()
    unlimited = soft == resource.RLIM_INFINITY
    rdma = bool(p.listdir("/sys/class/infiniband"))
    text = "unlimited" if unlimited else f"{soft // 1024} KiB"
    if unlimited or soft >= 1 << 40:
        return [Finding("memlock", "OK", f"RLIMIT_MEMLOCK {text}")]
    fix = (
        "ulimit -l unlimited (shell), LimitMEMLOCK=infinity (systemd), docker --ulimit memlock=-1:-1, "
        "or /etc/security/limits.conf '* - memlock unlimited'"
    )
    if rdma:
        return [
            Finding(
                "memlock",
                "WARN" if soft >= 1 << 30 else "FAIL",
                f"RLIMIT_MEMLOCK {text}: RDMA registration pins slot memory and fails past this",
                fix,
            )
        ]
    return [Finding("memlock", "OK", f"RLIMIT_MEMLOCK {text} (only limits RDMA registration; no RDMA here)")]


def check_shm(p: Probe) -> list[Finding]:
    out = []
    u = p.ucx()
    sm = sorted({tl for tl, _ in u.transports if tl in ("posix", "sysv", "cma", "xpmem", "knem")})
    size = p.statvfs_size("/dev/shm")
    if size is None:
        out.append(
            Finding(
                "shared memory",
                "WARN",
                "/dev/shm is missing: UCX posix shared memory cannot work",
                "mount a tmpfs on /dev/shm (docker: --shm-size=8g or --ipc=host)",
            )
        )
    elif size < 1 << 30:
        out.append(
            Finding(
                "shared memory",
                "WARN",
                f"/dev/shm is only {size >> 20} MiB (UCX sm transports: {', '.join(sm) or 'none'}): "
                "large same-host transfers can fail or fall back to tcp",
                "docker --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory on /dev/shm",
            )
        )
    else:
        out.append(
            Finding(
                "shared memory", "OK", f"/dev/shm {size >> 30} GiB; UCX sm transports: {', '.join(sm) or 'none listed'}"
            )
        )
    if "cma" in sm or not u.transports:
        scope = p.read("/proc/sys/kernel/yama/ptrace_scope")
        if scope is not None and scope.strip() not in ("0",) and not p.is_root:
            out.append(
                Finding(
                    "cma",
                    "WARN",
                    f"kernel.yama.ptrace_scope={scope}: UCX cma (single-copy between "
                    "processes) is refused for non-root processes; UCX uses a two-copy path",
                    "sysctl kernel.yama.ptrace_scope=0, or grant CAP_SYS_PTRACE",
                )
            )
        else:
            out.append(Finding("cma", "OK", "cross-memory attach usable" + (" (root)" if p.is_root else "")))
    return out


def check_cuda(p: Probe) -> list[Finding]:
    ok, names = p.cuda()
    u = p.ucx()
    tls = {tl for tl, _ in u.transports}
    if not ok:
        return [
            Finding(
                "cuda",
                "N/A",
                "no CUDA device visible to torch (CPU-only host or CPU torch build): "
                "cuda_copy / cuda_ipc / GPUDirect do not apply",
            )
        ]
    out = [Finding("cuda", "OK", f"{len(names)} GPU(s): {', '.join(names)}")]
    for tl, what in (
        ("cuda_copy", "host<->GPU copies inside UCX"),
        ("cuda_ipc", "GPU<->GPU on one host (NVLink/PCIe)"),
    ):
        if tl in tls:
            out.append(Finding(tl, "OK", f"UCX {tl}: {what}"))
        else:
            out.append(
                Finding(
                    tl,
                    "FAIL" if tl == "cuda_copy" else "WARN",
                    f"UCX lists no {tl}: {what} unavailable",
                    "use a CUDA-enabled UCX (ucxx-cu12/cu13 wheels match the CUDA major version); "
                    "check UCX_TLS includes cuda_copy,cuda_ipc and the driver is loaded",
                )
            )
    reach = u.cuda_support
    out.append(
        Finding(
            "cuda memory in ucx",
            "OK" if reach and "cuda_copy" in tls else "FAIL",
            "UCX can send/receive CUDA memory directly"
            if reach and "cuda_copy" in tls
            else "UCX cannot reach CUDA memory: tensorwire falls back to staging through pinned host slots",
            "" if reach and "cuda_copy" in tls else "install the ucxx wheel matching your CUDA (cu12/cu13)",
        )
    )
    return out


def check_gpudirect(p: Probe) -> list[Finding]:
    ok, _ = p.cuda()
    rdma = bool(p.listdir("/sys/class/infiniband"))
    loaded = p.exists("/sys/module/nvidia_peermem") or "nvidia_peermem" in (p.read("/proc/modules") or "")
    if not (ok and rdma):
        return [
            Finding(
                "gpudirect rdma",
                "N/A",
                "needs both a GPU and an RDMA NIC"
                + (f" (nvidia_peermem {'loaded' if loaded else 'not loaded'})" if ok or rdma else ""),
            )
        ]
    if loaded:
        return [Finding("gpudirect rdma", "OK", "nvidia_peermem loaded: the NIC reads/writes GPU memory directly")]
    return [
        Finding(
            "gpudirect rdma",
            "WARN",
            "nvidia_peermem is not loaded: GPU tensors cross hosts through host memory",
            "modprobe nvidia_peermem (or use a dma-buf capable driver/UCX)",
        )
    ]


def _container(p: Probe) -> str | None:
    if p.exists("/.dockerenv"):
        return "docker"
    if p.exists("/run/.containerenv"):
        return "podman"
    if p.env.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    cg = p.read("/proc/1/cgroup") or ""
    for key in ("kubepods", "docker", "containerd", "lxc"):
        if key in cg:
            return key
    return None


def check_container(p: Probe) -> list[Finding]:
    kind = _container(p)
    if kind is None:
        return [
            Finding("container", "OK", "not in a container (no IPC/PID namespace limits on shared memory / CUDA IPC)")
        ]
    return [
        Finding(
            "container",
            "OK",
            f"running in a container ({kind}): ranks inside it share memory and CUDA IPC; peers in other "
            "containers on this host need a shared IPC namespace (--ipc=host; --pid=host for cma), "
            "else UCX falls back to tcp",
        )
    ]


def check_allocator(p: Probe) -> list[Finding]:
    from tensorwire.cuda import expandable_segments

    rep = expandable_segments(p.env, runtime=False)
    if rep.expandable:
        return [
            Finding(
                "expandable_segments",
                "WARN",
                f"{rep.source}: CUDA IPC handles cannot be made for caching-allocator memory; UCX cuda_ipc "
                "silently falls back to staging (tensorwire's own CUDA slots use cudaMalloc and are not affected)",
                "unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF for processes that send GPU tensors "
                "straight from their own allocations",
            )
        ]
    return [Finding("expandable_segments", "OK", "PyTorch expandable_segments not enabled")]


def check_ucx_env(p: Probe) -> list[Finding]:
    env = {k: v for k, v in sorted(p.env.items()) if k.startswith(("UCX_", "UCXPY_"))}
    u = p.ucx()
    shown = ", ".join(f"{k}={v}" for k, v in env.items()) or "none set"
    extra = (
        f"; ucxx sets at import: {', '.join(f'{k}={v}' for k, v in u.env_set_by_ucxx.items())}"
        if u.env_set_by_ucxx
        else ""
    )
    out = [Finding("UCX_* env", "OK", f"{shown}{extra}")]
    tls = env.get("UCX_TLS")
    if tls and tls.strip().lower() not in ("all", "^") and not tls.startswith("^"):
        names = {t.strip().lower() for t in tls.split(",")}
        if "tcp" not in names and not names & {"rc", "rc_x", "rc_v", "dc", "dc_x", "ud", "ud_x", "ib"}:
            out.append(
                Finding(
                    "UCX_TLS",
                    "FAIL",
                    f"UCX_TLS={tls} has no tcp (nor an RDMA transport): UCX cannot reach ranks on other hosts",
                    f"UCX_TLS={tls},tcp (keep sm/self/cuda_* as wanted)",
                )
            )
        ok, _ = p.cuda()
        if ok and not names & {"cuda_copy", "cuda", "cuda_ipc"}:
            out.append(
                Finding(
                    "UCX_TLS",
                    "WARN",
                    f"UCX_TLS={tls} leaves out cuda_copy/cuda_ipc on a GPU host",
                    f"UCX_TLS={tls},cuda_copy,cuda_ipc",
                )
            )
    nd = env.get("UCX_NET_DEVICES")
    if nd and nd != "all" and u.transports:
        known = {d for _, d in u.transports}
        missing = [
            d for d in nd.split(",") if d.strip() and d.split(":")[0].strip() not in known and d.strip() not in known
        ]
        if missing:
            out.append(
                Finding(
                    "UCX_NET_DEVICES",
                    "WARN",
                    f"UCX_NET_DEVICES names {', '.join(missing)}, which UCX does "
                    f"not see (it sees {', '.join(sorted(known))})",
                    "fix the device names (ucx_info -d)",
                )
            )
    return out


def check_tensorwire(p: Probe) -> list[Finding]:
    from tensorwire.transport.base import available_kinds

    kinds = available_kinds()
    rdma = bool(p.listdir("/sys/class/infiniband"))
    ok_cuda, _ = p.cuda()
    from tensorwire.errors import ConfigError
    from tensorwire.transport.select import auto_picks

    try:
        picks = auto_picks(kinds, env=p.env, rdma=rdma)
    except ConfigError as exc:
        return [Finding("tensorwire", "FAIL", str(exc), "unset it, or give it one of the values it names")]
    detail = f"transports here: {', '.join(kinds)}; {picks.describe(cuda=ok_cuda)}"
    forced = p.env.get("TENSORWIRE_TRANSPORT")
    if forced:
        detail += f"; TENSORWIRE_TRANSPORT={forced} overrides auto"
    return [Finding("tensorwire", "OK" if "tcp" in kinds else "FAIL", detail)]


def check_native(p: Probe) -> list[Finding]:
    """Whether the hot path runs compiled (``tensorwire.native``): same behaviour, less CPU per message."""
    from tensorwire import native

    kinds = native.status()
    compiled = [m for m, k in kinds.items() if k == "compiled"]
    if len(compiled) == len(kinds):
        return [Finding("hot path", "OK", f"compiled by mypyc ({len(compiled)}/{len(kinds)} modules)")]
    fix = (
        "reinstall where a C compiler and Python's headers are (e.g. apt install gcc python3-dev): "
        "TENSORWIRE_NATIVE=1 pip install --force-reinstall --no-deps tensorwire (from its source); "
        "no compiler on this host: build a wheel on a Linux machine with the same Python version and one "
        "(TENSORWIRE_NATIVE=1 pip wheel --no-deps -w dist <source>) and pip install that wheel here"
    )
    if not compiled:
        detail = "pure Python: the same behaviour, with more CPU per message (docs/benchmarks.md: compiled hot path)"
        return [Finding("hot path", "WARN", detail, fix)]
    rest = sorted(m for m in kinds if m not in compiled)
    return [
        Finding(
            "hot path",
            "WARN",
            f"partly compiled ({len(compiled)}/{len(kinds)} modules); Python: {', '.join(rest)}",
            fix,
        )
    ]


CHECKS: tuple[Callable[[Probe], list[Finding]], ...] = (
    check_ucx,
    check_ucx_transports,
    check_rdma,
    check_dev_infiniband,
    check_memlock,
    check_shm,
    check_cuda,
    check_gpudirect,
    check_container,
    check_allocator,
    check_ucx_env,
    check_tensorwire,
    check_native,
)


def run_checks(
    probe: Probe | None = None, checks: Iterable[Callable[[Probe], list[Finding]]] = CHECKS
) -> list[Finding]:
    probe = probe or Probe()
    out: list[Finding] = []
    for check in checks:
        try:
            out.extend(check(probe))
        except Exception as exc:  # noqa: BLE001 - one broken probe must not hide the others
            out.append(Finding(check.__name__.removeprefix("check_"), "WARN", f"check crashed: {exc!r}"))
    return out
