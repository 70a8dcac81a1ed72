"""The GPU checks of ``tensorwire doctor``: pairs of GPUs, UCX's CUDA transports, pinning and registration.

Each check reads :meth:`Probe.gpu <tensorwire.doctor.probe.Probe.gpu>` (and
:meth:`Probe.ucx <tensorwire.doctor.probe.Probe.ucx>`), says what works, and
in ``choice`` what tensorwire will do with it and why. On a host without a
CUDA device each check is one ``N/A`` line saying so.

The copy-engine path's set-up probe (a real mapped copy into a peer process's
buffer and a flag round trip, :mod:`tensorwire.doctor.ce_probe`) runs for every
ordered pair of GPUs, a GPU with itself included (two processes on one GPU);
another probe can take its place with :func:`register_copy_engine_probe`. Where
none is registered, the check says so -- it never guesses.
"""

from __future__ import annotations

from typing import Callable

from tensorwire.doctor import ce_probe
from tensorwire.doctor.checks import Finding
from tensorwire.doctor.probe import Probe

__all__ = [
    "GPU_CHECKS",
    "check_gpu_pairs",
    "check_copy_engine",
    "check_ucx_cuda",
    "check_pinned_memory",
    "register_copy_engine_probe",
]

#: ``probe(src_device, dst_device) -> (ok, detail)``: the copy-engine path's set-up probe, and ``why_not() -> reason
#: | None``: why this process cannot take the path at all (None: it can). The built-in one unless replaced.
_COPY_ENGINE_PROBE: list[Callable[[int, int], tuple[bool, str]]] = [ce_probe.probe_pair]
_COPY_ENGINE_WHY_NOT: list[Callable[[], str | None]] = [ce_probe.why_not]


def register_copy_engine_probe(
    probe: Callable[[int, int], tuple[bool, str]], why_not: Callable[[], str | None] | None = None
) -> None:
    """Make :func:`check_copy_engine` run ``probe(i, j)`` for each ordered pair of GPUs, ``i == j`` included (the
    last one given); ``why_not``: why this process cannot take the path at all (default: nothing stops it)."""
    _COPY_ENGINE_PROBE[:] = [probe]
    _COPY_ENGINE_WHY_NOT[:] = [why_not or (lambda: None)]


def _no_gpu(check: str, what: str) -> list[Finding]:
    return [Finding(check, "N/A", f"CPU-only host (no CUDA device visible): {what} not checked")]


def check_gpu_pairs(p: Probe) -> list[Finding]:
    """Peer access for each ordered pair of visible GPUs."""
    g = p.gpu()
    if g.error:
        return [Finding("gpu pairs", "WARN", f"could not query the GPUs: {g.error}", "check the driver (nvidia-smi)")]
    if not g.devices:
        return _no_gpu("gpu pairs", "peer access between GPUs")
    if len(g.devices) == 1:
        return [Finding("gpu pairs", "N/A", f"one GPU ({g.devices[0]}): no pair to check")]
    out = []
    for (i, j), ok in sorted(g.peer.items()):
        if ok:
            out.append(
                Finding(
                    f"peer access {i}->{j}",
                    "OK",
                    f"GPU {i} can map GPU {j}'s memory (NVLink or PCIe peer-to-peer)",
                    choice="ranks on these GPUs exchange CUDA tensors GPU to GPU (UCX cuda_ipc), no host copy",
                )
            )
        else:
            out.append(
                Finding(
                    f"peer access {i}->{j}",
                    "WARN",
                    f"GPU {i} cannot map GPU {j}'s memory",
                    "check the topology (nvidia-smi topo -m), IOMMU/ACS settings, and that both GPUs are in one "
                    "container",
                    choice="CUDA tensors between these GPUs go through host memory (UCX stages them, or tensorwire "
                    "stages through pinned slots over TCP): slower, and it costs host bandwidth",
                )
            )
    return out


def check_copy_engine(p: Probe) -> list[Finding]:
    """The copy-engine path's set-up probe (mapped copy + flag round trip) for each ordered pair of GPUs, a GPU
    with itself included, and what tensorwire does with CUDA tensors between two ranks on those GPUs."""
    g = p.gpu()
    if g.error:
        return [Finding("copy engine", "N/A", f"could not query the GPUs: {g.error}")]
    if not g.devices:
        return _no_gpu("copy engine", "the copy-engine path (GPU to GPU within a host)")
    if not _COPY_ENGINE_PROBE:
        return [
            Finding(
                "copy engine",
                "N/A",
                "this build has no copy-engine probe (the copy-engine path is not part of it)",
                choice="CUDA tensors within a host take UCX (see peer access and cuda_ipc)",
            )
        ]
    probe = _COPY_ENGINE_PROBE[0]
    mode = p.env.get("TENSORWIRE_CUDA_PATH", "").strip().lower() or "auto"
    if mode == "ucx":
        why: str | None = "TENSORWIRE_CUDA_PATH=ucx"
    else:
        try:
            why = (_COPY_ENGINE_WHY_NOT or [lambda: None])[0]()
        except Exception as exc:  # noqa: BLE001 - a failing question is a reason
            why = f"the copy-engine path's own check failed ({exc!r})"
    out = []
    n = len(g.devices)
    for i in range(n):
        for j in range(n):
            try:
                ok, detail = probe(i, j)
            except Exception as exc:  # noqa: BLE001 - a failing probe is a finding
                ok, detail = False, f"probe crashed: {exc!r}"
            out.append(_copy_engine_finding(i, j, ok, detail, why, mode))
    return out


def _copy_engine_finding(i: int, j: int, ok: bool, detail: str, why: str | None, mode: str) -> Finding:
    """What one pair's probe means for a rank on GPU ``i`` sending CUDA tensors to a rank on GPU ``j``."""
    check = f"copy engine {i}->{j}"
    if why is not None:  # the path is off for this process whatever the pair can do
        return Finding(
            check,
            "OK" if ok else "N/A",
            detail if ok else f"the probe failed ({detail}); unused here anyway",
            choice=f"UCX, because {why}",
        )
    if ok:
        return Finding(check, "OK", detail, choice="copy engine")
    # capable() decides per process, not per pair: a pair that fails its probe still gets the path
    return Finding(
        check,
        "FAIL",
        detail,
        "set TENSORWIRE_CUDA_PATH=ucx for jobs with ranks on these GPUs (see the detail for the cause)",
        choice=(
            "copy engine (TENSORWIRE_CUDA_PATH=ce), whose CUDA messages between these GPUs would fail"
            if mode == "ce"
            else "copy engine (auto takes it for every pair of ranks on one host), whose CUDA messages between "
            "these GPUs would fail: UCX only with TENSORWIRE_CUDA_PATH=ucx"
        ),
    )


def check_ucx_cuda(p: Probe) -> list[Finding]:
    """UCX's CUDA transports (cuda_copy, cuda_ipc, gdr_copy, RDMA devices) and a real CUDA round trip over UCX."""
    g = p.gpu()
    if not g.devices:
        return _no_gpu("ucx cuda", "UCX's CUDA transports (cuda_copy, cuda_ipc, gdr_copy)")
    u = p.ucx()
    if u.version is None and u.ucxx_version is None:
        return [
            Finding(
                "ucx cuda",
                "WARN",
                "UCX/ucxx is not available: CUDA tensors cannot travel GPU to GPU",
                "pip install ucxx-cu12 (CUDA 12) or ucxx-cu13 (CUDA 13)",
                choice="CUDA tensors are staged through pinned host slots over TCP",
            )
        ]
    tls = {tl for tl, _ in u.transports}
    rdma = sorted({dev for tl, dev in u.transports if tl.startswith(("rc", "dc", "ud"))})
    have = [tl for tl in ("cuda_copy", "cuda_ipc", "gdr_copy") if tl in tls]
    missing = [tl for tl in ("cuda_copy", "cuda_ipc") if tl not in tls]
    within = (
        "UCX cuda_ipc: GPU to GPU, no host copy"
        if "cuda_ipc" in tls
        else "UCX without cuda_ipc: GPU memory crosses through host buffers"
    )
    if rdma and "gdr_copy" in tls:
        across = f"GPUDirect RDMA over {', '.join(rdma)} with gdr_copy"
    elif rdma:
        across = f"RDMA over {', '.join(rdma)}; without gdr_copy small CUDA messages cost a host copy"
    else:
        across = "no RDMA device: across hosts CUDA tensors go through host memory over TCP"
    out = [
        Finding(
            "ucx cuda transports",
            "OK" if not missing else "WARN",
            f"UCX lists {', '.join(have) or 'no CUDA transport'}"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; RDMA devices: {', '.join(rdma)}" if rdma else "; no RDMA device"),
            ""
            if not missing
            else "use the ucxx wheel matching your CUDA major version (cu12/cu13); keep cuda_copy,cuda_ipc in UCX_TLS",
            choice=f"within this host: {within}; to other hosts: {across}",
        )
    ]
    seen = bool(u.cuda_support) and "cuda_copy" in tls
    if g.ucx_cuda is not None:
        ok, detail = g.ucx_cuda
        out.append(
            Finding(
                "ucx cuda memory",
                "OK" if ok and seen else "FAIL",
                detail + ("" if seen else "; UCX reports no CUDA memory support (it would treat GPU memory as host)"),
                ""
                if ok and seen
                else "install the ucxx wheel built for your CUDA (cu12/cu13); do not mix a system "
                "UCX without CUDA with CUDA tensors",
                choice="CUDA tensors go to UCX as device memory"
                if ok and seen
                else "tensorwire cannot trust UCX with CUDA tensors here: use TENSORWIRE_TRANSPORT=tcp (staged)",
            )
        )
    else:
        out.append(
            Finding(
                "ucx cuda memory",
                "OK" if seen else "FAIL",
                "UCX reports CUDA memory support (cuda_copy detects device memory)"
                if seen
                else "UCX reports no CUDA memory support: it would treat GPU memory as host memory",
                "" if seen else "install the ucxx wheel built for your CUDA (cu12/cu13)",
                choice="CUDA tensors go to UCX as device memory" if seen else "use TENSORWIRE_TRANSPORT=tcp (staged)",
            )
        )
    return out


def check_pinned_memory(p: Probe) -> list[Finding]:
    """A real pinned allocation and a host registration; the memlock limit they and RDMA run into."""
    g = p.gpu()
    if not g.devices:
        return _no_gpu("pinned memory", "pinned host memory for GPU staging")
    out = []
    soft, _ = p.memlock()
    import resource

    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"
    for name, result, use in (
        ("pinned memory", g.pinned, "staging slots (CUDA tensors over TCP) and the daemon's CUDA reads"),
        ("host registration", g.host_register, "registering existing host buffers (UCX, RDMA)"),
    ):
        if result is None:
            out.append(Finding(name, "N/A", "not probed"))
            continue
        ok, detail = result
        out.append(
            Finding(
                name,
                "OK" if ok else "WARN",
                f"{detail} (RLIMIT_MEMLOCK {limit})",
                ""
                if ok
                else "raise the memlock limit (ulimit -l unlimited; docker --ulimit memlock=-1:-1) and check "
                "free memory",
                choice=f"used for {use}" + ("" if ok else "; without it those copies are pageable and slower"),
            )
        )
    return out


GPU_CHECKS: tuple[Callable[[Probe], list[Finding]], ...] = (
    check_gpu_pairs,
    check_copy_engine,
    check_ucx_cuda,
    check_pinned_memory,
)
