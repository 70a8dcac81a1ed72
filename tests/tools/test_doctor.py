"""``tensorwire doctor``: real verdicts from controlled hosts (fake /sys trees, env, limits, UCX info)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from tensorwire import doctor
from tensorwire.doctor import Probe, UcxInfo, run_checks

pytestmark = pytest.mark.timeout(120)

UCX_CPU = UcxInfo(
    version="1.21.0",
    ucxx_version="0.52.0",
    configured="--without-verbs --with-cuda=/usr/local/cuda",
    transports=[
        ("self", "memory"),
        ("tcp", "lo"),
        ("tcp", "eth0"),
        ("posix", "memory"),
        ("sysv", "memory"),
        ("cma", "memory"),
    ],
    source="fake",
    cuda_support=True,
)
UCX_GPU_RDMA = UcxInfo(
    version="1.21.0",
    ucxx_version="0.52.0",
    configured="--with-verbs --with-cuda",
    transports=UCX_CPU.transports + [("rc_mlx5", "mlx5_0:1"), ("cuda_copy", "cuda"), ("cuda_ipc", "cuda")],
    modules=["libuct_ib.so", "libuct_cuda.so"],
    source="fake",
    cuda_support=True,
)


def _write(root, rel: str, text: str = "") -> None:
    path = os.path.join(str(root), rel.lstrip("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _rdma_host(root, *, uverbs: bool = True, layer: str = "Ethernet", state: str = "4: ACTIVE") -> None:
    _write(root, "/sys/class/infiniband/mlx5_0/ports/1/link_layer", layer)
    _write(root, "/sys/class/infiniband/mlx5_0/ports/1/state", state)
    if uverbs:
        _write(root, "/dev/infiniband/uverbs0")


def _probe(root, **kw) -> Probe:
    kw.setdefault("env", {})
    kw.setdefault("memlock", (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    kw.setdefault("ucx", UCX_CPU)
    kw.setdefault("cuda", (False, []))
    kw.setdefault("is_root", True)
    return Probe(root=str(root), **kw)


def _by(findings, check):
    got = [f for f in findings if f.check == check]
    assert got, f"no {check!r} finding in {[f.check for f in findings]}"
    return got[0]


def test_host_without_rdma_says_so_plainly(tmp_path):
    findings = run_checks(_probe(tmp_path))
    rdma = _by(findings, "rdma")
    assert rdma.verdict == "WARN" and "NO RDMA" in rdma.detail
    assert _by(findings, "/dev/infiniband").verdict == "N/A"
    assert _by(findings, "cuda").verdict == "N/A"
    assert _by(findings, "gpudirect rdma").verdict == "N/A"
    assert "RDMA: NO" in doctor.render(findings)
    assert not [f for f in findings if f.verdict == "FAIL"]


def test_roce_device_active_with_uverbs_is_ok(tmp_path):
    _rdma_host(tmp_path)
    findings = run_checks(_probe(tmp_path, ucx=UCX_GPU_RDMA))
    rdma = _by(findings, "rdma")
    assert rdma.verdict == "OK" and "RoCE" in rdma.detail and "mlx5_0" in rdma.detail
    assert _by(findings, "/dev/infiniband").verdict == "OK"
    assert _by(findings, "rdma in ucx").verdict == "OK"
    assert "RDMA: yes" in doctor.render(findings)


def test_rdma_port_down_warns(tmp_path):
    _rdma_host(tmp_path, layer="InfiniBand", state="1: DOWN")
    rdma = _by(run_checks(_probe(tmp_path, ucx=UCX_GPU_RDMA)), "rdma")
    assert rdma.verdict == "WARN" and "InfiniBand" in rdma.detail and "ibstat" in rdma.fix


def test_rdma_device_without_dev_infiniband_fails_with_container_fix(tmp_path):
    _rdma_host(tmp_path, uverbs=False)
    f = _by(run_checks(_probe(tmp_path, ucx=UCX_GPU_RDMA)), "/dev/infiniband")
    assert f.verdict == "FAIL" and "--device=/dev/infiniband" in f.fix


def test_pip_ucx_without_verbs_warns_only_where_rdma_exists(tmp_path):
    assert _by(run_checks(_probe(tmp_path)), "ucx build").verdict == "N/A"
    _rdma_host(tmp_path)
    findings = run_checks(_probe(tmp_path))
    assert _by(findings, "ucx build").verdict == "WARN"
    assert "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY" in _by(findings, "ucx build").fix
    assert _by(findings, "rdma in ucx").verdict == "WARN"


@pytest.mark.parametrize(
    ("soft", "rdma", "verdict"),
    [
        (64 * 1024, True, "FAIL"),
        (8 << 30, True, "WARN"),
        (resource.RLIM_INFINITY, True, "OK"),
        (64 * 1024, False, "OK"),
    ],
)
def test_memlock_matters_only_with_rdma(tmp_path, soft, rdma, verdict):
    if rdma:
        _rdma_host(tmp_path)
    f = _by(run_checks(_probe(tmp_path, memlock=(soft, soft))), "memlock")
    assert f.verdict == verdict
    if verdict != "OK":
        assert "ulimit -l unlimited" in f.fix


def test_ucx_tls_without_tcp_fails(tmp_path):
    f = [x for x in run_checks(_probe(tmp_path, env={"UCX_TLS": "sm,self"})) if x.check == "UCX_TLS"]
    assert f and f[0].verdict == "FAIL" and "tcp" in f[0].fix
    assert not [x for x in run_checks(_probe(tmp_path, env={"UCX_TLS": "tcp,sm,self"})) if x.check == "UCX_TLS"]


def test_ucx_env_lists_what_ucxx_sets_at_import(tmp_path):
    ucx = UcxInfo(**{**UCX_CPU.__dict__, "env_set_by_ucxx": {"UCX_RNDV_THRESH": "8192"}})
    f = _by(run_checks(_probe(tmp_path, env={"UCX_TLS": "tcp"}, ucx=ucx)), "UCX_* env")
    assert "UCX_TLS=tcp" in f.detail and "UCX_RNDV_THRESH=8192" in f.detail


def test_unknown_net_device_warns(tmp_path):
    f = _by(run_checks(_probe(tmp_path, env={"UCX_NET_DEVICES": "mlx5_9:1"})), "UCX_NET_DEVICES")
    assert f.verdict == "WARN" and "mlx5_9" in f.detail


def test_expandable_segments_warns(tmp_path):
    f = _by(
        run_checks(_probe(tmp_path, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})), "expandable_segments"
    )
    assert f.verdict == "WARN" and "cuda_ipc" in f.detail
    assert _by(run_checks(_probe(tmp_path)), "expandable_segments").verdict == "OK"


def test_gpu_host_needs_cuda_transports_and_peermem(tmp_path):
    _rdma_host(tmp_path)
    findings = run_checks(_probe(tmp_path, ucx=UCX_GPU_RDMA, cuda=(True, ["H200", "H200"])))
    assert _by(findings, "cuda").verdict == "OK"
    assert _by(findings, "cuda_copy").verdict == "OK" and _by(findings, "cuda_ipc").verdict == "OK"
    assert _by(findings, "cuda memory in ucx").verdict == "OK"
    assert _by(findings, "gpudirect rdma").verdict == "WARN"
    _write(tmp_path, "/sys/module/nvidia_peermem/refcnt", "0")
    assert _by(run_checks(_probe(tmp_path, ucx=UCX_GPU_RDMA, cuda=(True, ["H200"]))), "gpudirect rdma").verdict == "OK"


def test_gpu_with_ucx_lacking_cuda_fails(tmp_path):
    findings = run_checks(_probe(tmp_path, cuda=(True, ["H200"])))
    assert _by(findings, "cuda_copy").verdict == "FAIL"
    assert _by(findings, "cuda memory in ucx").verdict == "FAIL"


def test_small_dev_shm_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(Probe, "statvfs_size", lambda self, p: 64 << 20)
    f = _by(run_checks(_probe(tmp_path)), "shared memory")
    assert f.verdict == "WARN" and "64 MiB" in f.detail and "--shm-size" in f.fix


def test_ptrace_scope_disables_cma_for_non_root(tmp_path):
    _write(tmp_path, "/proc/sys/kernel/yama/ptrace_scope", "1")
    assert _by(run_checks(_probe(tmp_path, is_root=False)), "cma").verdict == "WARN"
    assert _by(run_checks(_probe(tmp_path, is_root=True)), "cma").verdict == "OK"


def test_container_detected(tmp_path):
    _write(tmp_path, "/.dockerenv")
    assert "docker" in _by(run_checks(_probe(tmp_path)), "container").detail
    assert "not in a container" in _by(run_checks(_probe(tmp_path / "none")), "container").detail


def test_missing_ucx_fails_with_install_hint(tmp_path):
    f = _by(run_checks(_probe(tmp_path, ucx=UcxInfo(error="No module named 'ucxx'"))), "ucx")
    assert f.verdict == "FAIL" and "pip install ucxx" in f.fix


def test_a_crashing_check_does_not_hide_the_others(tmp_path):
    def boom(p):
        raise RuntimeError("broken probe")

    findings = run_checks(_probe(tmp_path), checks=(boom, doctor.check_memlock))
    assert [f.check for f in findings] == ["boom", "memlock"] and "broken probe" in findings[0].detail


def test_parse_ucx_info_and_context_info():
    text = (
        "# Memory domain: tcp\n#     Component: tcp\n#      Transport: tcp\n#         Device: lo\n"
        "#      Transport: tcp\n#         Device: eth0\n# Memory domain: posix\n#      Transport: posix\n"
        "#         Device: memory\n"
    )
    assert doctor.parse_ucx_info_d(text) == [("tcp", "lo"), ("tcp", "eth0"), ("posix", "memory")]
    ctx = (
        "#      resource 1  :  md 1  dev 1  flags -- tcp/eth0\n#      resource 5  :  md 4  dev 0  flags -- cma/memory\n"
    )
    assert doctor.parse_context_info(ctx) == [("tcp", "eth0"), ("cma", "memory")]


def test_doctor_cli_on_this_host_json():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-m", "tensorwire", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=root,
    )
    data = json.loads(out.stdout)
    checks = {f["check"]: f for f in data["findings"]}
    assert {"ucx", "rdma", "memlock", "shared memory", "cuda", "UCX_* env", "tensorwire"} <= set(checks)
    assert all(f["verdict"] in ("OK", "WARN", "FAIL", "N/A") for f in data["findings"])
    assert out.returncode == (0 if data["ok"] else 1)
    if not os.path.isdir("/sys/class/infiniband") or not os.listdir("/sys/class/infiniband"):
        assert "NO RDMA" in checks["rdma"]["detail"]


def test_rdma_cm_node_without_hca_is_not_a_warning(tmp_path):
    _write(tmp_path, "/dev/infiniband/rdma_cm")
    f = _by(run_checks(_probe(tmp_path)), "/dev/infiniband")
    assert f.verdict == "N/A" and "rdma_cm" in f.detail
    _write(tmp_path, "/dev/infiniband/uverbs0")
    assert _by(run_checks(_probe(tmp_path)), "/dev/infiniband").verdict == "WARN"
