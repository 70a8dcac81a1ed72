"""backend="tensorwire" for torch.distributed: registration, point-to-point, collectives, failures, pipelining.

Multi-process tests run real processes (tests/harness.py: spawn, store on port 0) or real torchrun.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time

import pytest

import dist_workers as W
from harness import gpu_count, run_ranks
from netns import TORCHRUN, child_env, free_port, run, tail

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed"))]


# -- registration ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_import_tensorwire_registers_the_backend_without_importing_torch():
    code = textwrap.dedent("""
        import sys, time
        t = time.perf_counter()
        import tensorwire
        took = time.perf_counter() - t
        assert "torch" not in sys.modules, "import tensorwire imported torch"
        import torch.distributed as dist
        assert dist.is_backend_available("tensorwire")
        assert dist.Backend.TENSORWIRE == "tensorwire"
        print(took)
    """)
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) < 0.5  # measured ~0.01 s; generous for a loaded machine


@pytest.mark.timeout(60)
def test_backend_registered_when_torch_distributed_was_imported_first():
    code = "import torch.distributed as dist, tensorwire; assert dist.is_backend_available('tensorwire')"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr


# -- point-to-point and collectives --------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_p2p_every_dtype_and_shape_both_ways_tags_in_flight_futures_collectives(transport):
    res = run_ranks(W.p2p_suite, 2, timeout=150, transport=transport)
    assert res[0]["transports"] == {1: transport} and res[1]["transports"] == {0: transport}
    assert res[0]["threads_left"] == [] and res[1]["threads_left"] == [], res
    assert 0.25 <= res[1]["timeout_after_s"] < 5, res[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receive_into_leaves_that_require_grad_contiguous_or_not(transport):
    res = run_ranks(W.into_leaves_requiring_grad, 2, timeout=90, transport=transport)
    assert res[1] == {"flat": True, "strided": True, "leaves": True}, res[1]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_256_mib_tensor_each_way(transport):
    res = run_ranks(W.big, 2, timeout=150, transport=transport, mib=256)
    assert res[0]["seconds"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_messages_sent_right_before_destroy_process_group_still_arrive(transport):
    # destroy_process_group closes each connection so that the peer reads what was sent before: an abort's
    # reset destroyed the bytes the receiver had not read yet
    res = run_ranks(W.send_then_destroy, 2, timeout=90, transport=transport)
    assert res[1]["got"] == [True, True, True]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_four_ranks_ring_of_isends(transport):
    res = run_ranks(W.ring, 4, timeout=150, transport=transport)
    assert all(r["ok"] for r in res.values())


@pytest.mark.timeout(180)
def test_overlapping_new_groups_under_a_gloo_default_group():
    res = run_ranks(W.overlapping_groups, 3, timeout=150, transport="tcp")
    assert res == {0: {}, 1: {1: 1.0}, 2: {2: 2.0}}, res


# -- errors -----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mismatched_receive_raises_on_the_receiver_naming_both_sides(transport):
    res = run_ranks(W.mismatch, 2, timeout=200, transport=transport)
    for name, (s_shape, s_dtype, r_shape, r_dtype) in W.MISMATCHES.items():
        side, kind, *rest = res[1][name]
        assert kind == "SignatureMismatch", (name, res[1][name])
        text = rest[0]
        assert f"receives into {r_dtype}{list(r_shape)}" in text or f"{r_dtype}{list(r_shape)}" in text, text
        if name != "larger" or transport == "ucx":  # TCP refuses a larger message on its frame header
            assert f"{s_dtype}{list(s_shape)}" in text, text
        assert rest[-1] < 15, f"took {rest[-1]} s"
        # the sender never hangs: its send or its next operation fails with a DistBackendError
        s_side, s_kind, *s_rest = res[0][name]
        assert s_kind != "no error" and s_rest[0] is True, (name, res[0][name])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_killed_mid_step_fails_pending_works_with_peer_lost(transport):
    res = run_ranks(W.killed, 2, timeout=150, expect_fail=True, transport=transport)
    assert res[1][0] == "died"
    assert res[0]["errors"] == ["PeerLost", "PeerLost"], res[0]
    assert res[0]["seconds"] < 10, res[0]


# -- pipelining -------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "schedule,transport", [("gpipe", "tcp"), ("1f1b", "ucx"), ("interleaved1f1b", "tcp"), ("gpipe", "ucx")]
)
def test_pipelining_matches_single_process_training(schedule, transport):
    res = run_ranks(W.pipeline, 2, timeout=200, transport=transport, schedule=schedule)
    for r in res.values():
        assert r["backend"] == "tensorwire" and r["worst"] <= 1e-5 and r["moved"] > 1e-4, r


@pytest.mark.timeout(240)
def test_pipelining_four_ranks_1f1b():
    res = run_ranks(W.pipeline, 4, timeout=200, transport="tcp", schedule="1f1b", steps=2)
    assert all(r["worst"] <= 1e-5 for r in res.values()), res


# -- under real torchrun --------------------------------------------------------------------------------------------

_TORCHRUN_WORKER = """
import json, os, sys
sys.path.insert(0, {tests!r})
import dist_workers as W
r = W.pipeline(None, None, None, {transport!r}, {schedule!r}, steps=2)
print("RESULT " + json.dumps(r), flush=True)
"""


def _torchrun_one_node(nproc: int, script, *args: str) -> list[str]:
    """torchrun of ``script args`` with ``nproc`` workers on this host, its rendezvous on a free port."""
    return [
        *TORCHRUN,
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        "0",
        str(script),
        *args,
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport,nproc,schedule", [("tcp", 2, "gpipe"), ("ucx", 4, "interleaved1f1b")])
def test_real_torchrun_init_process_group_tensorwire(tmp_path, transport, nproc, schedule):
    from pathlib import Path

    script = tmp_path / "worker.py"
    support = Path(__file__).resolve().parent.parent / "support"
    script.write_text(_TORCHRUN_WORKER.format(tests=str(support), transport=transport, schedule=schedule))
    cmd = _torchrun_one_node(nproc, script)
    t0 = time.monotonic()
    rc, out = run(cmd, env=child_env(), log=tmp_path / "torchrun.log", timeout=200)
    assert rc == 0, tail(out)
    # counted, not split by line: torchrun relays the workers' output, and two lines can run together
    assert out.count('RESULT {"worst"') == nproc, tail(out)
    assert out.count('"backend": "tensorwire"') == nproc, tail(out)
    assert time.monotonic() - t0 < 200


# -- CUDA (run on a GPU host: two processes sharing one GPU) ------------------------------------------------------


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", [*TRANSPORTS, "ce"])
def test_cuda_isend_after_queued_writes_and_irecv_before_consuming_kernel(transport):
    # (the last isend's copy is still queued behind a long kernel when rank 0 destroys its group: the shutdown
    # must let it run -- over the copy-engine path the close drains the pair)
    res = run_ranks(W.cuda_p2p, 2, timeout=200, transport=transport)
    assert {k for k in res[1] if k.startswith("wait_s")} == {"wait_s_0", "wait_s_1", "wait_s_2"}
    assert res[0]["transports"] == {1: "tcp+ce" if transport == "ce" else transport}


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
@pytest.mark.timeout(240)
def test_cuda_auto_transport_is_ucx_where_ucx_runs():
    """Links of a group are made before any tensor is seen; on CUDA hosts auto must pick UCX (device memory
    moved by UCX's CUDA transports), not TCP staged through pinned host memory."""
    from tensorwire.transport.base import available_kinds

    res = run_ranks(W.cuda_p2p, 2, timeout=200, transport="auto")
    assert res[0]["transports"] == {1: "ucx" if "ucx" in available_kinds() else "tcp"}, res[0]


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="needs two CUDA devices (one per rank)")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved1f1b"])
def test_pipelining_example_on_two_gpus_matches_single_process_training(tmp_path, schedule):
    """The example users run first, on CUDA stages: torch's schedules over backend tensorwire, one GPU per rank."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "pipelining.py"
    cmd = _torchrun_one_node(
        2,
        example,
        "--backend",
        "tensorwire",
        "--device",
        "cuda",
        "--schedule",
        schedule,
        "--check",
    )
    rc, out = run(cmd, env=child_env(), log=tmp_path / "torchrun.log", timeout=200)
    assert rc == 0, tail(out)
    assert out.count("over tensorwire") == 2 and out.count("(check passed)") == 2, tail(out)


# -- two nodes: two network namespaces, torchrun --nnodes 2 ------------------------------------------------------


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_network_namespace_nodes_torchrun_nnodes_2_pipelining(tmp_path):
    from pathlib import Path

    from netns import NetnsPair, Proc, netns_unavailable

    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    example = Path(__file__).resolve().parents[2] / "examples" / "pipelining.py"
    with NetnsPair() as net:
        procs = []
        try:
            for i in (0, 1):
                env = child_env(TENSORWIRE_HOST=net.addr[i], TENSORWIRE_TRANSPORT="tcp")
                cmd = [
                    *net.prefix(i),
                    *TORCHRUN,
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "2",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"{net.addr[0]}:29437",
                    "--rdzv-id",
                    "tw-dist-netns",
                    "--local-addr",
                    net.addr[i],
                    "--rdzv-conf",
                    f"is_host={1 if i == 0 else 0}",
                    "--max-restarts",
                    "0",
                    "--monitor-interval",
                    "0.2",
                    str(example),
                    "--backend",
                    "tensorwire",
                    "--schedule",
                    "1f1b",
                    "--check",
                ]
                procs.append(Proc(cmd, env=env, log=tmp_path / f"agent{i}.log"))
                if i == 0:
                    time.sleep(0.5)
            deadline = time.monotonic() + 200
            rcs = [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]
            text = "\n".join(p.output() for p in procs)
            assert rcs == [0, 0], f"exit codes {rcs}\n{tail(text, 80)}"
            assert text.count("over tensorwire") == 4 and text.count("(check passed)") == 4, tail(text, 80)
        finally:
            for p in procs:
                p.kill()


@pytest.mark.timeout(30)
def test_a_signature_fills_only_its_own_shape_or_one_scalar_with_another():
    from tensorwire.distributed.signatures import Signature

    one = Signature("float32", (1,), "cpu")
    assert Signature("float32", (), "cpu").fills(one) and one.fills(Signature("float32", (), "cpu"))
    assert one.fills(Signature("float32", (1, 1), "cpu"))
    assert not Signature("float32", (), "cpu").fills(Signature("int32", (1,), "cpu"))  # same bytes, other dtype
    assert not Signature("float32", (4, 4), "cpu").fills(Signature("float32", (2, 8), "cpu"))  # same count
    assert not Signature("float32", (), "cpu").fills(Signature("float32", (), "cuda"))
    assert not Signature("float32", (2,), "cpu").fills(Signature("float32", (1,), "cpu"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_small_messages_go_in_the_callers_thread_beyond_the_eager_buffers_and_by_polling(transport):
    res = run_ranks(W.small_messages, 2, timeout=150, transport=transport)
    if transport == "tcp":  # every 4 KiB send of the ping-pong went out inline: no sender thread was needed
        assert res[0]["send_threads"] == [] and res[1]["send_threads"] == [], res
