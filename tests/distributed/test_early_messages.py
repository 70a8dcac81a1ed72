"""backend="tensorwire": every message kind completes its receive whether it came before or after the receive
was posted, through send/recv, isend/irecv and batch_isend_irecv both ways at once (tests/support/early_workers.py
forces the orders). In one process pair on loopback, and across two network-namespace nodes under torchrun.

The cross-node count (``TW_EARLY_RUNS``, default 3; the target is 50 of 50) runs one torchrun job per run and
counts those in which both ranks finished every exchange.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path

import pytest

import early_workers as W
import tensorwire
from tensorwire import native
from harness import run_ranks
from netns import TORCHRUN, NetnsPair, Proc, child_env, netns_unavailable, tail

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed"))]
WORKER = Path(W.__file__).resolve()
#: the tensorwire this test imported (the checkout, or the compiled build): the nodes' workers import the same
PACKAGE_ROOT = Path(tensorwire.__file__).resolve().parents[1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_kind_every_way_before_and_after_its_receive_in_one_process_pair(transport):
    res = run_ranks(W.exchange, 2, timeout=200, transport=transport, rounds=2)
    assert res[0] == {"rounds": 2, "transports": {1: transport}}, res[0]
    assert res[1] == {"rounds": 2, "transports": {0: transport}}, res[1]


def _two_node_run(net: NetnsPair, log_dir: Path, run: int, transport: str, rounds: int, port: int) -> tuple[bool, str]:
    """One torchrun job of two nodes (one rank each): (both ranks finished every exchange, the output)."""
    procs = []
    for i in (0, 1):
        env = child_env(TENSORWIRE_HOST=net.addr[i], TENSORWIRE_TRANSPORT=transport, TENSORWIRE_TIMEOUT="60")
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env["PYTHONPATH"]])
        if transport == "ucx":
            env.update(UCX_TLS="tcp,self", UCX_NET_DEVICES=net.dev[i])
        cmd = [
            *net.prefix(i),
            *TORCHRUN,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{net.addr[0]}:{port}",
            "--rdzv-id",
            f"tw-early-{run}",
            "--local-addr",
            net.addr[i],
            "--rdzv-conf",
            f"is_host={1 if i == 0 else 0}",
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.2",
            str(WORKER),
            "--rounds",
            str(rounds),
        ]
        procs.append(Proc(cmd, env=env, log=log_dir / f"run{run}-node{i}.log"))
        if i == 0:
            time.sleep(0.3)  # the host agent opens the rendezvous store first
    try:
        deadline = time.monotonic() + 240
        rcs = [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]
        outs = [p.output() for p in procs]
    finally:
        for p in procs:
            p.kill()
    done = re.findall(
        rf"early-exchange rank=\d ok rounds={rounds} links=\{{\d: '{transport}'\}} build={re.escape(native.summary())}$",
        "\n".join(outs),
        re.M,
    )
    ok = rcs == [0, 0] and len(done) == 2
    return ok, f"exit codes {rcs}\n" + "\n".join(f"== node {i}\n{tail(out, 40)}" for i, out in enumerate(outs))


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_kind_every_way_across_two_network_namespace_nodes(tmp_path, transport):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    runs = int(os.environ.get("TW_EARLY_RUNS", "3"))
    passed, failures = 0, []
    with NetnsPair(subnet="10.207.0") as net:
        for run in range(runs):
            ok, out = _two_node_run(net, tmp_path, run, transport, rounds=1, port=29471 + run % 20)
            passed += ok
            if not ok:
                failures.append(out)
    print(f"early-exchange across two nodes over {transport}: {passed} of {runs} runs passed")
    assert passed == runs, f"{passed} of {runs} runs passed; first failure:\n{failures[0]}"
