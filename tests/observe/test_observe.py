"""tensorwire.observe on real links in this process (a TCP pair on loopback): counts, ranges, the endpoint, the summary."""

from __future__ import annotations

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tcp_pairs import tcp_pair
from tensorwire import observe
from tensorwire.errors import ConfigError, ShapeMismatchError
from tensorwire.observe.registry import BUCKETS_US, NBUCKETS, bucket
from tensorwire.p2p.link import Link
from tensorwire.spec import TensorSpec
from tensorwire.transport.tcp import TcpListener

pytestmark = pytest.mark.timeout(60)

SIZE = 4096


@pytest.fixture
def links():
    """(a, b): two Links over one TCP connection, a sends ``x`` (4 KiB) to b and b sends ``ack`` (1 byte) back;
    a is rank 0 and b rank 1. Counting is reset around the test, and every message is timed (a test of the
    sample sets its own rate)."""
    observe.reset()
    observe.set_enabled(True)
    every = observe.sample_every()
    observe.set_sample_every(1)
    lst = TcpListener("127.0.0.1", port=0)
    ta, tb = tcp_pair(lst)
    x, ack = TensorSpec("x", (SIZE,), "uint8", "cpu"), TensorSpec("ack", (1,), "uint8", "cpu")
    a = Link(node_rank=0, peer=1, name="t", transport=ta, send=[x], recv=[ack], timeout=10.0, device=None)
    b = Link(node_rank=1, peer=0, name="t", transport=tb, send=[ack], recv=[x], timeout=10.0, device=None)
    try:
        yield a, b
    finally:
        a.close()
        b.close()
        lst.close()
        observe.reset()
        observe.set_enabled(True)
        observe.set_sample_every(every)


def _flow(peer: str, direction: str, path: str = "tcp") -> dict:
    flows = [f for f in observe.metrics()["flows"] if (f["peer"], f["direction"], f["path"]) == (peer, direction, path)]
    assert len(flows) == 1, observe.metrics()["flows"]
    return flows[0]


def _exchange(a: Link, b: Link, n: int) -> None:
    src = torch.arange(SIZE, dtype=torch.int64).to(torch.uint8)
    one = torch.ones(1, dtype=torch.uint8)
    for _ in range(n):
        a.send("x", src)
        assert torch.equal(b.recv("x"), src)
        b.send("ack", one)
        a.recv("ack")


def test_bucket_k_holds_latencies_from_2_to_the_k_minus_1_up_to_2_to_the_k_microseconds():
    assert bucket(0) == 0 and bucket(999) == 0
    assert bucket(1000) == 1 and bucket(1999) == 1
    assert bucket(2000) == 2 and bucket(3999) == 2
    assert bucket(BUCKETS_US[-1] * 1000 - 1) == len(BUCKETS_US) - 1
    assert bucket(BUCKETS_US[-1] * 1000) == NBUCKETS - 1  # +Inf
    assert bucket(10**15) == NBUCKETS - 1


def test_n_messages_count_n_and_their_bytes_per_peer_path_and_direction(links):
    a, b = links
    _exchange(a, b, 25)
    sent, got = _flow("1", "send"), _flow("0", "recv")
    assert sent["messages"] == got["messages"] == 25
    assert sent["bytes"] == got["bytes"] == 25 * SIZE
    acks = _flow("0", "send")
    assert acks["messages"] == 25 and acks["bytes"] == 25
    # blocking calls: one call-time and one completion sample per message, summing to the time counted
    assert sum(sent["call_buckets"]) == sent["completed"] == 25
    assert sent["call_buckets"] == sent["completion_buckets"]
    assert 0 < sent["call_seconds"] < 25 * 10.0
    totals = observe.metrics()["totals"]
    assert totals["send"] == {"messages": 50, "bytes": 25 * SIZE + 25}
    assert totals["recv"] == {"messages": 50, "bytes": 25 * SIZE + 25}


def test_isend_counts_its_post_and_its_completion_once_seen(links):
    a, b = links
    src = torch.ones(SIZE, dtype=torch.uint8)
    handles = [a.isend("x", src) for _ in range(2)]
    posted = _flow("1", "send")
    assert posted["messages"] == 2 and posted["bytes"] == 2 * SIZE
    for _ in range(2):
        b.recv("x")
    for h in handles:
        h.wait(timeout=10)
        h.wait(timeout=10)  # a second wait counts nothing more
    done = _flow("1", "send")
    assert done["completed"] == 2 and sum(done["call_buckets"]) == 2
    assert done["completion_seconds"] >= 0


def test_tw_metrics_is_the_same_snapshot_and_does_not_import_torch():
    import os
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import sys, tensorwire as tw; m = tw.metrics(); assert 'torch' not in sys.modules; print(sorted(m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(
        ["ce", "enabled", "errors", "fallbacks", "flows", "held", "negotiations", "totals"]
    )


def test_counting_off_counts_nothing_and_on_again_counts_from_there(links):
    a, b = links
    observe.set_enabled(False)
    _exchange(a, b, 3)
    assert observe.metrics()["totals"]["send"]["messages"] == 0
    assert observe.metrics()["enabled"] is False
    observe.set_enabled(True)
    _exchange(a, b, 2)
    assert _flow("1", "send")["messages"] == 2


def test_a_refused_send_counts_as_an_error_of_its_class_and_no_message(links):
    a, _ = links
    with pytest.raises(ShapeMismatchError):
        a.send("x", torch.ones(SIZE + 1, dtype=torch.uint8))
    errors = observe.metrics()["errors"]
    assert errors == [{"peer": "1", "path": "tcp", "kind": "ShapeMismatchError", "count": 1}]
    assert observe.metrics()["totals"]["send"]["messages"] == 0


def test_slots_are_held_while_the_links_live(links):
    a, b = links
    held = {(h["peer"], h["path"]): h for h in observe.metrics()["held"]}
    # a: 1 send slot (x) + 2 receive slots (ack); b: 1 send slot (ack) + 2 receive slots (x)
    assert held[("1", "tcp")]["slots"] == 3 and held[("1", "tcp")]["slot_bytes"] == SIZE + 2
    assert held[("0", "tcp")]["slots"] == 3 and held[("0", "tcp")]["slot_bytes"] == 1 + 2 * SIZE
    a.close()
    b.close()
    held = {(h["peer"], h["path"]): h for h in observe.metrics()["held"]}
    assert held[("1", "tcp")]["slots"] == 0 and held[("0", "tcp")]["slot_bytes"] == 0


def test_a_profiler_trace_holds_one_range_per_call_naming_peer_name_bytes_and_path(links, tmp_path):
    a, b = links
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _exchange(a, b, 3)
        h = a.isend("x", torch.ones(SIZE, dtype=torch.uint8))
        b.recv("x")
        h.wait(timeout=10)
    names = [e.name for e in prof.events() if e.name.startswith("tensorwire.")]
    assert names.count(f"tensorwire.link.send x peer=1 bytes={SIZE} path=tcp") == 3
    assert names.count(f"tensorwire.link.recv x peer=0 bytes={SIZE} path=tcp") == 4
    assert names.count("tensorwire.link.send ack peer=0 bytes=1 path=tcp") == 3
    assert names.count(f"tensorwire.link.isend x peer=1 bytes={SIZE} path=tcp") == 1
    # counting goes on under the profiler
    assert _flow("1", "send")["messages"] == 4
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    assert f"tensorwire.link.send x peer=1 bytes={SIZE} path=tcp" in trace.read_text()


def test_no_range_is_made_outside_a_profiler_session(links, monkeypatch):
    a, b = links
    import torch.autograd.profiler as P

    made = []

    class Spy(P.record_function):
        def __init__(self, name, args=None):
            made.append(name)
            super().__init__(name, args)

    monkeypatch.setattr(P, "record_function", Spy)
    _exchange(a, b, 2)
    assert made == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        _exchange(a, b, 1)
    assert len(made) == 4


def test_the_prometheus_text_parses_and_matches_the_counts(links):
    a, b = links
    _exchange(a, b, 7)
    observe.note_fallback(1, "ucx", "tcp", "ucx_unavailable_at_peer")
    families = {f.name: f for f in text_string_to_metric_families(observe.render().decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in families.values() for s in fam.samples}
    key = tuple(sorted({"peer": "1", "path": "tcp", "direction": "send"}.items()))
    assert samples[("tensorwire_p2p_messages_total", key)] == 7
    assert samples[("tensorwire_p2p_bytes_total", key)] == 7 * SIZE
    assert samples[("tensorwire_p2p_call_seconds_count", key)] == 7
    assert samples[("tensorwire_p2p_completion_seconds_count", key)] == 7
    inf = tuple(sorted({"peer": "1", "path": "tcp", "direction": "send", "le": "+Inf"}.items()))
    assert samples[("tensorwire_p2p_call_seconds_bucket", inf)] == 7
    fb = tuple(sorted({"peer": "1", "wanted": "ucx", "taken": "tcp", "reason": "ucx_unavailable_at_peer"}.items()))
    assert samples[("tensorwire_p2p_fallbacks_total", fb)] == 1
    assert families["tensorwire_p2p_call_seconds"].type == "histogram"
    assert families["tensorwire_p2p_slots"].type == "gauge"


def test_the_endpoint_serves_the_same_text_on_the_port_asked_for_plus_the_local_rank(links):
    a, b = links
    _exchange(a, b, 2)
    try:
        port = observe.start_endpoint("127.0.0.1", environ={"TENSORWIRE_METRICS_PORT": "0"})
        assert port is not None and port == observe.endpoint_port()
        # one endpoint per process: asking again returns it
        assert observe.start_endpoint("127.0.0.1", environ={"TENSORWIRE_METRICS_PORT": "0"}) == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        sent = [s for s in fams["tensorwire_p2p_messages"].samples if s.labels["direction"] == "send"]
        assert sorted((s.labels["peer"], s.value) for s in sent) == [("0", 2.0), ("1", 2.0)]
    finally:
        observe.stop_endpoint()
    assert observe.endpoint_port() is None
    assert observe.start_endpoint("127.0.0.1", environ={}) is None  # not asked for
    with pytest.raises(ConfigError, match="TENSORWIRE_METRICS_PORT"):
        observe.start_endpoint("127.0.0.1", environ={"TENSORWIRE_METRICS_PORT": "70000"})


def test_the_endpoint_port_is_the_base_plus_local_rank_and_a_taken_port_is_a_config_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"127.0.0.1:{taken}"):
            observe.start_endpoint("127.0.0.1", environ={"TENSORWIRE_METRICS_PORT": str(taken - 2), "LOCAL_RANK": "2"})
    assert observe.endpoint_port() is None


def test_summary_line_is_written_at_info_and_not_otherwise(links, monkeypatch, capsys):
    a, b = links
    _exchange(a, b, 4)
    monkeypatch.delenv("TENSORWIRE_LOG", raising=False)
    observe.log_summary(0)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("TENSORWIRE_LOG", "info")
    observe.log_summary(0)
    line = capsys.readouterr().err.strip()
    assert line.startswith("tensorwire rank 0: send 8 msgs")
    assert "tcp->1 4" in line and "fallbacks: none" in line and "errors: none" in line
    monkeypatch.setenv("TENSORWIRE_LOG", "loud")
    with pytest.raises(ConfigError, match="TENSORWIRE_LOG"):
        observe.log_summary(0)


def test_a_link_times_one_message_in_n_and_counts_every_one(links):
    """TENSORWIRE_METRICS_SAMPLE on a link: blocking calls and isends, each name a route of its own."""
    a, b = links
    observe.set_sample_every(3)
    _exchange(a, b, 7)  # messages 1, 4 and 7 of each name are timed
    src = torch.zeros(SIZE, dtype=torch.uint8)
    handles = [a.isend("x", src) for _ in range(2)]  # the 8th (not timed) and 9th (not timed) of "x"
    for h in handles:
        h.wait()
        b.recv("x")
    sent, acks = _flow("1", "send"), _flow("0", "send")
    assert sent["messages"] == 9 and sent["bytes"] == 9 * SIZE and sent["completed"] == 9
    assert sent["timed"] == 3 and sum(sent["call_buckets"]) == sum(sent["completion_buckets"]) == 3
    assert acks["messages"] == 7 and acks["timed"] == 3 and acks["completed"] == 7
    text = observe.render().decode()
    assert 'tensorwire_p2p_messages_total{direction="send",path="tcp",peer="1"} 9.0' in text
    assert 'tensorwire_p2p_call_seconds_count{direction="send",path="tcp",peer="1"} 3.0' in text


def test_untimed_messages_of_a_fixed_route_count_before_and_after_a_timed_one(links):
    """A static spec's untimed messages are counted by the route's countdown: every read sees them, between
    two timed messages too."""
    a, b = links
    observe.set_sample_every(16)
    for n in (1, 2, 15, 16, 17, 40):
        observe.reset()
        _exchange(a, b, n)
        sent = _flow("1", "send")
        assert (sent["messages"], sent["bytes"], sent["completed"]) == (n, n * SIZE, n), n
        assert _flow("1", "recv")["messages"] == n


def test_a_refused_untimed_send_counts_no_message_and_a_reset_drops_what_was_counted(links):
    a, b = links
    observe.set_sample_every(16)
    _exchange(a, b, 3)  # the first is timed, two are on the countdown
    with pytest.raises(ShapeMismatchError):
        a.send("x", torch.ones(SIZE + 1, dtype=torch.uint8))
    assert _flow("1", "send")["messages"] == 3
    assert observe.metrics()["errors"][0]["count"] == 1
    observe.reset()
    assert observe.metrics()["totals"]["send"]["messages"] == 0
    _exchange(a, b, 2)
    assert _flow("1", "send")["messages"] == 2


def test_a_closed_links_counts_stay(links):
    a, b = links
    observe.set_sample_every(16)
    _exchange(a, b, 5)
    a.close()
    b.close()
    sent = _flow("1", "send")
    assert (sent["messages"], sent["bytes"]) == (5, 5 * SIZE)
    assert _flow("0", "send")["messages"] == 5
