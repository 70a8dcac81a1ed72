"""The copy-engine path on a GPU host: two ranks on one GPU or on two (run with ``pytest -m gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(*args: str, timeout: float = 240, **extra: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")]),
        **extra,
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _have_bindings() -> bool:
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("bindings", ["ctypes", "cuda-python"])  # (auto is one of the two)
def test_every_kind_of_tensor_arrives_bit_exact_in_stream_order(bindings):
    if bindings == "cuda-python" and not _have_bindings():
        pytest.skip("cuda-python's bindings (cuda-bindings) are not installed")
    p = _torchrun("bench/bench_ce_gpu.py", "--check", TENSORWIRE_CE_BINDINGS=bindings)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "CHECKS PASSED" in out, out[-6000:]
    said = {"ctypes": "driver calls: ctypes (", "cuda-python": "driver calls: cuda-python's bindings"}
    assert said[bindings] in out, out[-3000:]


def test_a_killed_peer_fails_the_waiting_rank_within_the_timeout():
    # two plain processes (torchrun would stop the survivor as soon as its peer dies), rank 0's store here
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        WORLD_SIZE="2",
        TORCHELASTIC_USE_AGENT_STORE="False",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")]),
    )
    script = str(ROOT / "tests" / "support" / "ce_workers.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, "killed_peer"],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out = procs[0].communicate(timeout=120)[0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "ERROR AFTER" in out, out[-6000:]
    secs = float(out.split("ERROR AFTER ")[1].split("s:")[0])
    assert secs < 5, out[-3000:]  # the watchdog saw the death itself, long before the 20 s timeout


@pytest.mark.parametrize("style", ["eager", "lazy"])
def test_new_group_tensorwire_under_both_default_group_styles(style):
    p = _torchrun("tests/support/ce_workers.py", "default_groups", style, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and out.count(f"style {style}: OK") == 2, out[-6000:]
    # the rank chose its GPU before making the groups: the copy-engine path's set-up probe ran and passed
    assert out.count("probe passed") == 2, out[-6000:]


def test_a_captured_training_step_replays_bit_exact_against_eager_steps():
    p = _torchrun("bench/bench_graph_gpu.py", "--check", timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "GRAPH CHECKS PASSED" in out, out[-6000:]
