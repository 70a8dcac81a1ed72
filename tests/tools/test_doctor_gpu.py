"""``tensorwire doctor``'s GPU checks: verdicts from made-up GPU hosts, the JSON form against its schema on this
host, and (marked gpu) the real probes on a GPU host."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from tensorwire import doctor
from tensorwire.doctor import GpuInfo, Probe, UcxInfo, run_checks
from tensorwire.doctor import gpu as gpu_checks
from tensorwire.doctor.probe import UCX_ROUND_TRIP

from harness import gpu_count

pytestmark = pytest.mark.timeout(120)


def _jsonschema():
    """jsonschema (a test dependency) -- imported where used, so a GPU host without it still runs the probes."""
    return pytest.importorskip("jsonschema")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UCX_CUDA = UcxInfo(
    version="1.21.0",
    ucxx_version="0.52.0",
    transports=[("tcp", "lo"), ("cuda_copy", "cuda"), ("cuda_ipc", "cuda")],
    source="fake",
    cuda_support=True,
)
TWO = ["NVIDIA H200", "NVIDIA H200"]


def _probe(gpu: GpuInfo, *, ucx: UcxInfo = UCX_CUDA, memlock: int = resource.RLIM_INFINITY) -> Probe:
    return Probe(env={}, memlock=(memlock, memlock), ucx=ucx, cuda=(bool(gpu.devices), gpu.devices), gpu=gpu)


def _by(findings, check):
    got = [f for f in findings if f.check == check]
    assert len(got) == 1, f"{check!r} in {[f.check for f in findings]}"
    return got[0]


@pytest.fixture(autouse=True)
def _no_copy_engine_probe():
    saved = list(gpu_checks._COPY_ENGINE_PROBE), list(gpu_checks._COPY_ENGINE_WHY_NOT)
    gpu_checks._COPY_ENGINE_PROBE.clear()
    gpu_checks._COPY_ENGINE_WHY_NOT.clear()
    yield saved
    gpu_checks._COPY_ENGINE_PROBE[:], gpu_checks._COPY_ENGINE_WHY_NOT[:] = saved


def test_cpu_only_host_says_so_in_one_line_per_check():
    findings = run_checks(_probe(GpuInfo()), doctor.GPU_CHECKS)
    assert [(f.check, f.verdict) for f in findings] == [
        ("gpu pairs", "N/A"),
        ("copy engine", "N/A"),
        ("ucx cuda", "N/A"),
        ("pinned memory", "N/A"),
    ]
    assert all(f.detail.startswith("CPU-only host (no CUDA device visible)") for f in findings)


def test_each_ordered_pair_reports_peer_access_and_what_tensorwire_does_without_it():
    g = GpuInfo(devices=TWO, peer={(0, 1): True, (1, 0): False})
    findings = run_checks(_probe(g), [gpu_checks.check_gpu_pairs])
    ok, no = _by(findings, "peer access 0->1"), _by(findings, "peer access 1->0")
    assert ok.verdict == "OK" and "cuda_ipc" in ok.choice
    assert no.verdict == "WARN" and "through host memory" in no.choice and "nvidia-smi topo" in no.fix


def test_copy_engine_check_names_its_missing_probe_and_runs_a_registered_one_per_pair():
    g = GpuInfo(devices=TWO, peer={(0, 1): True, (1, 0): True})
    (f,) = run_checks(_probe(g), [gpu_checks.check_copy_engine])
    assert f.verdict == "N/A" and "no copy-engine probe" in f.detail
    calls = []

    def probe(i, j):
        calls.append((i, j))
        return (i == 0, f"mapped copy {i}->{j} and flag round trip" if i == 0 else "flag never arrived")

    doctor.register_copy_engine_probe(probe)
    findings = run_checks(_probe(g), [gpu_checks.check_copy_engine])
    assert calls == [(0, 0), (0, 1), (1, 0), (1, 1)]  # every ordered pair, a GPU with itself included
    good = _by(findings, "copy engine 0->1")
    assert good.verdict == "OK" and good.choice == "copy engine"
    bad = _by(findings, "copy engine 1->0")
    # auto takes the path per process, not per pair: a pair that fails its probe is a failure, with the way out
    assert bad.verdict == "FAIL" and bad.detail == "flag never arrived" and "TENSORWIRE_CUDA_PATH=ucx" in bad.fix
    assert bad.choice.startswith("copy engine") and "would fail" in bad.choice
    assert not doctor.report(findings)["ok"]


def test_copy_engine_choice_is_ucx_with_the_reason_where_the_path_is_off():
    g = GpuInfo(devices=TWO[:1])
    doctor.register_copy_engine_probe(lambda i, j: (False, "cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE (1)"))
    forced = Probe(env={"TENSORWIRE_CUDA_PATH": "ucx"}, memlock=(0, 0), ucx=UCX_CUDA, cuda=(True, TWO[:1]), gpu=g)
    (f,) = run_checks(forced, [gpu_checks.check_copy_engine])
    assert f.check == "copy engine 0->0" and f.verdict == "N/A"  # one GPU: two processes on it are a pair
    assert f.choice == "UCX, because TENSORWIRE_CUDA_PATH=ucx" and "CUDA_ERROR_INVALID_VALUE" in f.detail
    doctor.register_copy_engine_probe(lambda i, j: (True, "bytes equal"), why_not=lambda: "no /dev/shm")
    (f,) = run_checks(_probe(g), [gpu_checks.check_copy_engine])
    assert f.verdict == "OK" and f.choice == "UCX, because no /dev/shm"
    data = doctor.report([f])
    _jsonschema().validate(data, doctor.JSON_SCHEMA)


def test_the_built_in_probe_is_registered_and_a_cpu_only_host_gets_one_line(_no_copy_engine_probe):
    from tensorwire.doctor import ce_probe

    # (the fixture emptied the lists; what it saved is the module's own registration)
    probes, why_nots = _no_copy_engine_probe
    assert probes == [ce_probe.probe_pair] and why_nots == [ce_probe.why_not]
    doctor.register_copy_engine_probe(ce_probe.probe_pair, ce_probe.why_not)
    findings = run_checks(_probe(GpuInfo()), [gpu_checks.check_copy_engine])
    assert [(f.check, f.verdict) for f in findings] == [("copy engine", "N/A")]
    assert findings[0].detail.startswith("CPU-only host (no CUDA device visible)")


def test_ucx_cuda_transports_and_the_round_trip_decide_the_choice():
    g = GpuInfo(devices=TWO, peer={(0, 1): True, (1, 0): True}, ucx_cuda=(True, "1 MiB CUDA tensor ... equal"))
    findings = run_checks(_probe(g), [gpu_checks.check_ucx_cuda])
    tl = _by(findings, "ucx cuda transports")
    assert tl.verdict == "OK" and "no RDMA device" in tl.detail and "UCX cuda_ipc" in tl.choice
    assert _by(findings, "ucx cuda memory").verdict == "OK"
    # no cuda_ipc, an RDMA device without gdr_copy, and a UCX built without CUDA: the silent fallbacks
    ucx = UcxInfo(version="1.21.0", transports=[("tcp", "lo"), ("rc_mlx5", "mlx5_0:1")], cuda_support=False)
    g2 = GpuInfo(devices=TWO, peer={(0, 1): True, (1, 0): True}, ucx_cuda=(True, "1 MiB CUDA tensor ... equal"))
    findings = run_checks(_probe(g2, ucx=ucx), [gpu_checks.check_ucx_cuda])
    tl = _by(findings, "ucx cuda transports")
    assert tl.verdict == "WARN" and "missing cuda_copy, cuda_ipc" in tl.detail
    assert "without gdr_copy" in tl.choice and "mlx5_0:1" in tl.choice
    mem = _by(findings, "ucx cuda memory")
    assert (
        mem.verdict == "FAIL" and "treat GPU memory as host" in mem.detail and "TENSORWIRE_TRANSPORT=tcp" in mem.choice
    )


def test_a_failed_round_trip_fails_and_missing_ucx_warns():
    g = GpuInfo(devices=TWO, peer={}, ucx_cuda=(False, "the UCX CUDA round trip failed (exit -11): Segfault"))
    mem = _by(run_checks(_probe(g), [gpu_checks.check_ucx_cuda]), "ucx cuda memory")
    assert mem.verdict == "FAIL" and "exit -11" in mem.detail
    (f,) = run_checks(_probe(g, ucx=UcxInfo()), [gpu_checks.check_ucx_cuda])
    assert f.verdict == "WARN" and "staged" in f.choice


def test_pinning_and_registration_failures_warn_with_the_memlock_limit():
    g = GpuInfo(
        devices=TWO[:1],
        pinned=(True, "64 MiB pinned with cudaHostAlloc"),
        host_register=(False, "cudaHostRegister of 64 MiB returned error 2"),
    )
    findings = run_checks(_probe(g, memlock=64 << 10), [gpu_checks.check_pinned_memory])
    assert _by(findings, "pinned memory").verdict == "OK"
    reg = _by(findings, "host registration")
    assert reg.verdict == "WARN" and "RLIMIT_MEMLOCK 64 KiB" in reg.detail and "ulimit -l" in reg.fix


def test_the_json_of_a_gpu_host_validates_against_the_schema():
    g = GpuInfo(
        devices=TWO,
        peer={(0, 1): True, (1, 0): False},
        pinned=(True, "ok"),
        host_register=(True, "ok"),
        ucx_cuda=(True, "ok"),
    )
    data = doctor.report(run_checks(_probe(g), doctor.ALL_CHECKS))
    _jsonschema().validate(data, doctor.JSON_SCHEMA)
    assert {f["check"] for f in data["findings"]} >= {"peer access 0->1", "ucx cuda memory", "host registration"}
    with pytest.raises(_jsonschema().ValidationError):
        _jsonschema().validate({"findings": [{"check": "x", "verdict": "MAYBE"}], "ok": True}, doctor.JSON_SCHEMA)


def _cli_json() -> tuple[dict, int]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-m", "tensorwire", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
        cwd=ROOT,
    )
    return json.loads(out.stdout), out.returncode


def test_doctor_json_on_this_host_validates_and_has_every_gpu_check():
    data, rc = _cli_json()
    _jsonschema().validate(data, doctor.JSON_SCHEMA)
    assert rc == (0 if data["ok"] else 1)
    checks = [f["check"] for f in data["findings"]]
    import torch

    if not torch.cuda.is_available():
        gpu = [f for f in data["findings"] if f["check"] in ("gpu pairs", "copy engine", "ucx cuda", "pinned memory")]
        assert [f["verdict"] for f in gpu] == ["N/A"] * 4
    else:
        assert "ucx cuda transports" in checks or "ucx cuda" in checks


def test_the_ucx_round_trip_child_moves_bytes_intact_over_host_memory():
    pytest.importorskip("ucxx")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", UCX_ROUND_TRIP, "cpu"], capture_output=True, text=True, timeout=100, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA device")
def test_real_gpu_probes_on_this_host_validate_and_pin_memory():
    from tensorwire.doctor import probe_gpu

    g = probe_gpu()
    assert g.error is None and len(g.devices) == gpu_count()
    assert g.pinned is not None and g.pinned[0], g.pinned
    assert g.host_register is not None, g
    assert len(g.peer) == len(g.devices) * (len(g.devices) - 1)
    data, _ = _cli_json()
    _jsonschema().validate(data, doctor.JSON_SCHEMA)
    checks = {f["check"]: f for f in data["findings"]}
    assert checks["pinned memory"]["verdict"] == "OK"
    if g.ucx_cuda is not None:  # ucxx installed: the CUDA round trip ran in a child
        assert checks["ucx cuda memory"]["verdict"] == ("OK" if g.ucx_cuda[0] else "FAIL"), checks["ucx cuda memory"]
    if len(g.devices) > 1:
        assert "peer access 0->1" in checks
