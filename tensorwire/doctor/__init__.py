"""``tensorwire doctor``: can this host move tensors fast, and if not, what to change.

Each check prints one line with a plain verdict and, when something is off,
the fix::

    OK    the thing works
    WARN  works, but slower or riskier than it could be (the fix says how)
    FAIL  will not work as configured (the fix says how)
    N/A   does not apply here (no GPU, no RDMA NIC, ...)

Checks: UCX / ucxx versions and how UCX was built, the transports and devices
UCX sees (``ucx_info -d`` from the libucx wheel, else ucxx's context info),
RDMA (InfiniBand/RoCE in ``/sys/class/infiniband``, ``/dev/infiniband``),
tcp, shared memory (incl. ``/dev/shm`` size and cma/ptrace), CUDA transports
(cuda_copy/cuda_ipc), GPUDirect RDMA (``nvidia_peermem``), whether UCX can
reach CUDA memory, the memlock limit, container / IPC-namespace hints,
PyTorch ``expandable_segments``, the effective ``UCX_*`` variables, and what
``transport=auto`` will pick.

Every probe of the host goes through :class:`Probe`, so tests can point it at
a fake ``/sys`` tree, environment and limits. Exit status: 1 if any FAIL.

The package: :mod:`~tensorwire.doctor.probe` reads the host and UCX,
:mod:`~tensorwire.doctor.checks` judges what it read; this module prints the
report and registers the ``doctor`` subcommand.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tensorwire.doctor.checks import (
    CHECKS,
    Finding,
    Verdict,
    check_allocator,
    check_container,
    check_cuda,
    check_dev_infiniband,
    check_gpudirect,
    check_memlock,
    check_native,
    check_rdma,
    check_shm,
    check_tensorwire,
    check_ucx,
    check_ucx_env,
    check_ucx_transports,
    run_checks,
)
from tensorwire.doctor.gpu import (
    GPU_CHECKS,
    check_copy_engine,
    check_gpu_pairs,
    check_pinned_memory,
    check_ucx_cuda,
    register_copy_engine_probe,
)
from tensorwire.doctor.probe import (
    GpuInfo,
    Probe,
    UcxInfo,
    parse_context_info,
    parse_ucx_info_d,
    probe_gpu,
    probe_ucx,
)

__all__ = [
    "Finding",
    "Verdict",
    "Probe",
    "UcxInfo",
    "probe_ucx",
    "parse_ucx_info_d",
    "parse_context_info",
    "run_checks",
    "render",
    "register",
    "main",
    "CHECKS",
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
    "GPU_CHECKS",
    "ALL_CHECKS",
    "GpuInfo",
    "probe_gpu",
    "check_gpu_pairs",
    "check_copy_engine",
    "check_ucx_cuda",
    "check_pinned_memory",
    "register_copy_engine_probe",
    "JSON_SCHEMA",
    "report",
]

#: Every check ``tensorwire doctor`` runs, in the order it prints them: the host's, then the GPUs'.
ALL_CHECKS = CHECKS + GPU_CHECKS

#: The JSON Schema of ``tensorwire doctor --json`` (tests validate the output against it).
JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["findings", "ok"],
    "additionalProperties": False,
    "properties": {
        "ok": {"type": "boolean"},
        "findings": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["check", "verdict", "detail", "fix", "choice"],
                "additionalProperties": False,
                "properties": {
                    "check": {"type": "string", "minLength": 1},
                    "verdict": {"enum": ["OK", "WARN", "FAIL", "N/A"]},
                    "detail": {"type": "string", "minLength": 1},
                    "fix": {"type": "string"},
                    "choice": {"type": "string"},
                },
            },
        },
    },
}


def render(findings: list[Finding]) -> str:
    lines = ["tensorwire doctor"]
    for f in findings:
        lines.append(f"  {f.verdict:<5} {f.check:<20} {f.detail}")
        if f.fix and f.verdict != "OK":
            lines.append(f"  {'':<5} {'':<20} fix: {f.fix}")
        if f.choice:
            lines.append(f"  {'':<5} {'':<20} tensorwire: {f.choice}")
    counts = {v: sum(1 for f in findings if f.verdict == v) for v in ("OK", "WARN", "FAIL", "N/A")}
    rdma = next((f for f in findings if f.check == "rdma"), None)
    lines.append("")
    lines.append(
        "summary: "
        + ", ".join(f"{n} {v}" for v, n in counts.items())
        + (f"; RDMA: {'yes' if rdma.verdict == 'OK' else 'NO'}" if rdma else "")
    )
    return "\n".join(lines) + "\n"


def report(findings: list[Finding]) -> dict[str, Any]:
    """The ``--json`` form of ``findings`` (it validates against :data:`JSON_SCHEMA`)."""
    return {"findings": [f.to_dict() for f in findings], "ok": not any(f.verdict == "FAIL" for f in findings)}


def main(args: argparse.Namespace) -> int:
    findings = run_checks(checks=ALL_CHECKS)
    if args.json:
        json.dump(report(findings), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(findings))
    return 1 if any(f.verdict == "FAIL" for f in findings) else 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check UCX, RDMA, GPU and system settings for fast transfers",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=main)
