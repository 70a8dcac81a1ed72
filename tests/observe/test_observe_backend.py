"""tensorwire.observe across two processes: backend="tensorwire" traffic in torch.profiler traces, in
tw.metrics() and on the Prometheus endpoint; a forced fallback as a labelled counter."""

from __future__ import annotations

import importlib.util

import pytest
from prometheus_client.parser import text_string_to_metric_families

import observe_workers as W
from harness import gpu_count, run_ranks

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
TRANSPORTS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed"))]
BYTES = W.ELEMS * 4


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_backend_ranges_counts_endpoint_and_summary_of_a_two_rank_exchange(transport):
    n = 40
    res = run_ranks(W.profiled_backend_exchange, 2, timeout=150, transport=transport, n=n)
    r0, r1 = res[0], res[1]
    # ranges: send, isend and the batch's isend on rank 0 (3 sends of 4 KiB to rank 1 on tag 3), one receive
    # back on tag 4; a wait range per wait() (isend's, and the batch's two)
    sends = f"tensorwire.send peer=1 tag=3 bytes={BYTES} path={transport}"
    assert r0["names"].count(sends) == 3, r0["names"]
    assert r0["names"].count(f"tensorwire.recv peer=1 tag=4 bytes={BYTES} path={transport}") == 1
    assert r1["names"].count(f"tensorwire.recv peer=0 tag=3 bytes={BYTES} path={transport}") == 3, r1["names"]
    assert r1["names"].count(f"tensorwire.send peer=0 tag=4 bytes={BYTES} path={transport}") == 1
    assert sum(name.startswith("tensorwire.wait isend") for name in r0["names"]) >= 2
    assert sum(name.startswith("tensorwire.wait irecv") for name in r1["names"]) >= 2
    # counts: 3 + n messages each way on the flow of the peer and path, every one completed
    (sent,) = [f for f in r0["metrics"]["flows"] if (f["peer"], f["direction"]) == ("1", "send")]
    assert sent["path"] == transport
    assert sent["messages"] == 3 + n and sent["bytes"] == (3 + n) * BYTES
    assert sent["completed"] == 3 + n
    (got,) = [f for f in r1["metrics"]["flows"] if (f["peer"], f["direction"]) == ("0", "recv")]
    assert got["messages"] == 3 + n and got["bytes"] == (3 + n) * BYTES and got["completed"] == 3 + n
    assert r0["metrics"]["negotiations"] == [{"peer": "1", "path": transport, "count": 1}]
    assert r0["metrics"]["errors"] == []
    # the endpoint: the same counts, parsed by prometheus_client
    s = _samples(r0["text"])
    key = tuple(sorted({"peer": "1", "path": transport, "direction": "send"}.items()))
    assert s[("tensorwire_p2p_messages_total", key)] == 3 + n
    assert s[("tensorwire_p2p_bytes_total", key)] == (3 + n) * BYTES
    # the histograms hold the sample: the 3 messages under the profiler (all timed), then one in 16 (the default
    # TENSORWIRE_METRICS_SAMPLE: each route's 16th message after a timed one)
    assert sent["timed"] == 3 + n // 16
    assert s[("tensorwire_p2p_completion_seconds_count", key)] == s[("tensorwire_p2p_call_seconds_count", key)]
    assert s[("tensorwire_p2p_completion_seconds_count", key)] == 3 + n // 16
    assert s[("tensorwire_p2p_negotiations_total", (("path", transport), ("peer", "1")))] == 1
    # the summary line at destroy_process_group() (TENSORWIRE_LOG=info)
    assert f"tensorwire rank 0: send {4 + n} msgs" not in r0["summary"]  # (the batch's receive is a recv)
    assert f"tensorwire rank 0: send {3 + n} msgs" in r0["summary"], r0["summary"]
    assert f"{transport}->1 {3 + n}" in r0["summary"]


@pytest.mark.timeout(120)
def test_ucx_missing_on_one_rank_shows_as_a_labelled_fallback_on_both():
    res = run_ranks(W.link_with_ucx_missing_on_one_side, 2, timeout=100)
    assert res[0]["transport"] == res[1]["transport"] == "tcp"
    f1 = {(e["peer"], e["wanted"], e["taken"], e["reason"]): e["count"] for e in res[1]["fallbacks"]}
    assert f1 == {("any", "ucx", "tcp", "ucx_unavailable"): 1, ("0", "ucx", "tcp", "ucx_unavailable_here"): 1}
    f0 = {(e["peer"], e["wanted"], e["taken"], e["reason"]): e["count"] for e in res[0]["fallbacks"]}
    assert f0 == {("1", "ucx", "tcp", "ucx_unavailable_at_peer" if HAVE_UCX else "ucx_unavailable_here"): 1}
    s = _samples(res[1]["text"])
    labels = (("peer", "0"), ("reason", "ucx_unavailable_here"), ("taken", "tcp"), ("wanted", "ucx"))
    assert s[("tensorwire_p2p_fallbacks_total", labels)] == 1


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA device")
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "transport,path", [("tcp", "staged"), ("ce", "ce"), pytest.param("ucx", "ucx", marks=TRANSPORTS[1].marks)]
)
def test_cuda_exchange_ranges_and_counts_carry_the_cuda_path(transport, path):
    n = 20
    res = run_ranks(W.profiled_backend_exchange, 2, timeout=200, transport=transport, n=n, device="cuda")
    r0, r1 = res[0], res[1]
    assert r0["names"].count(f"tensorwire.send peer=1 tag=3 bytes={BYTES} path={path}") == 3, r0["names"]
    assert r1["names"].count(f"tensorwire.recv peer=0 tag=3 bytes={BYTES} path={path}") == 3, r1["names"]
    (sent,) = [f for f in r0["metrics"]["flows"] if (f["peer"], f["direction"], f["path"]) == ("1", "send", path)]
    assert sent["messages"] == 3 + n and sent["bytes"] == (3 + n) * BYTES and sent["completed"] == 3 + n
    if path == "staged":  # CUDA tensors over TCP: the fallback is counted, with its reason
        fallbacks = [
            f
            for f in r0["metrics"]["fallbacks"]
            if (f["peer"], f["wanted"], f["taken"], f["reason"]) == ("1", "ucx", "staged", "tcp_cannot_reach_cuda")
        ]
        assert len(fallbacks) == 1 and fallbacks[0]["count"] >= 1, r0["metrics"]["fallbacks"]
