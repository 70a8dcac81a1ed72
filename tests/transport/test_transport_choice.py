"""The transport rule of ``auto`` (tensorwire.transport.select.choose_transport) and the host identity it uses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tensorwire.errors import ConfigError
from tensorwire.transport.select import carries_cuda, choose_transport, host_id
from tensorwire.v1 import control_pb2, types_pb2

pytestmark = pytest.mark.timeout(60)


def _offer(transport: str = "auto", kinds=("ucx", "tcp"), hid: str = "h1") -> control_pb2.LinkOffer:
    return control_pb2.LinkOffer(
        transport=transport,
        host_id=hid,
        data=[types_pb2.TransportAddress(kind=k, host="127.0.0.1", port=1) for k in kinds],
    )


@pytest.fixture(autouse=True)
def _no_rdma(monkeypatch):
    monkeypatch.setattr("tensorwire.transport.select.ucx_has_rdma", lambda: False)
    monkeypatch.delenv("TENSORWIRE_AUTO_PREFER", raising=False)


def test_same_host_prefers_ucx_only_where_it_may_use_shared_memory_and_cma(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_UCX_ERROR_HANDLING", "none")
    assert choose_transport(_offer(), _offer(), needs_cuda=False) == ["ucx", "tcp"]
    # with peer error handling (the default) UCX has no single-copy path for host memory: the socket wins
    monkeypatch.setenv("TENSORWIRE_UCX_ERROR_HANDLING", "peer")
    assert choose_transport(_offer(), _offer(), needs_cuda=False) == ["tcp"]
    monkeypatch.delenv("TENSORWIRE_UCX_ERROR_HANDLING")
    assert choose_transport(_offer(), _offer(), needs_cuda=False) == ["tcp"]
    assert choose_transport(_offer(), _offer(), needs_cuda=True) == ["ucx", "tcp"]  # cuda_ipc stays
    assert choose_transport(_offer(hid="h1"), _offer(hid="h2"), needs_cuda=False) == ["tcp"]
    # an unknown identity never counts as "same host"
    assert choose_transport(_offer(hid=""), _offer(hid=""), needs_cuda=False) == ["tcp"]


def test_cuda_specs_or_rdma_prefer_ucx_between_hosts(monkeypatch):
    assert choose_transport(_offer(hid="a"), _offer(hid="b"), needs_cuda=True) == ["ucx", "tcp"]
    monkeypatch.setattr("tensorwire.transport.select.ucx_has_rdma", lambda: True)
    assert choose_transport(_offer(hid="a"), _offer(hid="b"), needs_cuda=False) == ["ucx", "tcp"]


def test_a_cuda_hint_counts_only_where_both_sides_have_cuda():
    # the torch.distributed backend makes its links before it sees a tensor: it passes the hint
    assert carries_cuda(False, hint=True, mine_has_cuda=True, theirs_has_cuda=True)
    assert not carries_cuda(False, hint=True, mine_has_cuda=True, theirs_has_cuda=False)
    assert not carries_cuda(False, hint=True, mine_has_cuda=False, theirs_has_cuda=True)
    assert not carries_cuda(False, hint=False, mine_has_cuda=True, theirs_has_cuda=True)
    assert carries_cuda(True, hint=False, mine_has_cuda=False, theirs_has_cuda=False)  # declared CUDA specs


def test_auto_prefer_env_overrides(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_AUTO_PREFER", "tcp")
    assert choose_transport(_offer(), _offer(), needs_cuda=False) == ["tcp"]
    monkeypatch.setenv("TENSORWIRE_AUTO_PREFER", "ucx")
    assert choose_transport(_offer(hid="a"), _offer(hid="b"), needs_cuda=False) == ["ucx", "tcp"]


def test_explicit_choice_wins_and_conflicts_are_errors():
    assert choose_transport(_offer("tcp"), _offer(), needs_cuda=True) == ["tcp"]
    assert choose_transport(_offer(), _offer("ucx", hid="x"), needs_cuda=False) == ["ucx"]
    with pytest.raises(ConfigError, match="different transports"):
        choose_transport(_offer("tcp"), _offer("ucx"), needs_cuda=False)
    with pytest.raises(ConfigError, match="cannot use it"):
        choose_transport(_offer("ucx"), _offer(kinds=("tcp",)), needs_cuda=False)
    # UCX missing on one side: auto uses what both have
    assert choose_transport(_offer(), _offer(kinds=("tcp",)), needs_cuda=False) == ["tcp"]


def test_host_id_is_stable_and_shared_by_processes_of_this_host_but_not_other_ipc_namespaces():
    me = host_id()
    assert me and me == host_id()
    code = "from tensorwire.transport.select import host_id; print(host_id())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert other.stdout.strip() == me
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/unshare"):
        return
    # A new IPC namespace (a separate container/pod) cannot share memory with us: another identity.
    r = subprocess.run(["unshare", "--ipc", sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if r.returncode == 0:
        assert r.stdout.strip() and r.stdout.strip() != me


def test_a_bad_auto_preference_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_AUTO_PREFER", "fastest")
    with pytest.raises(ConfigError, match="TENSORWIRE_AUTO_PREFER='fastest'"):
        choose_transport(_offer(), _offer(), needs_cuda=False)
    from tensorwire.transport.select import auto_preference

    assert auto_preference({"TENSORWIRE_AUTO_PREFER": " TCP "}) == "tcp"
    assert auto_preference({}) == ""


@pytest.mark.parametrize("value", ["abc", "-5", "nan"])
def test_bad_ucx_spin_settings_are_clear_errors_at_import(value):
    code = "import tensorwire.transport.ucx"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TENSORWIRE_UCX_CUDA_SPIN_US": value},
    )
    assert r.returncode != 0 and "ConfigError" in r.stderr and "TENSORWIRE_UCX_CUDA_SPIN_US" in r.stderr, r.stderr


def test_cuda_in_use_only_once_the_process_initialized_cuda():
    """What the torch.distributed backend's links read: a CPU job on a GPU host keeps the host-memory choice."""
    code = (
        "import tensorwire.buffers as b; print(b.cuda_in_use())\n"
        "import torch; print(b.cuda_in_use())\n"
        "if torch.cuda.is_available():\n"
        "    torch.cuda.set_device(0); print(b.cuda_in_use())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True).stdout
    lines = out.split()
    assert lines[:2] == ["False", "False"], out
    assert lines[2:] in ([], ["True"]), out


def test_auto_picks_says_what_choose_transport_picks_for_each_kind_of_peer():
    from tensorwire.transport.select import auto_picks

    picks = auto_picks(["tcp", "ucx"], env={}, rdma=False)
    assert (picks.same_host, picks.other_host, picks.cuda) == ("tcp", "tcp", "ucx")
    assert picks.describe(cuda=False) == (
        "auto picks tcp for host tensors between processes of this host, tcp to other hosts"
    )
    assert picks.describe().endswith(", ucx for CUDA tensors")
    # each setting the rule reads moves the answer as choose_transport moves it
    assert auto_picks(["tcp", "ucx"], env={"TENSORWIRE_UCX_ERROR_HANDLING": "none"}, rdma=False).same_host == "ucx"
    assert auto_picks(["tcp", "ucx"], env={}, rdma=True).other_host == "ucx"
    assert auto_picks(["tcp", "ucx"], env={"TENSORWIRE_AUTO_PREFER": "tcp"}, rdma=True).cuda == "tcp"
    assert auto_picks(["tcp"], env={}, rdma=True) == type(picks)("tcp", "tcp", "tcp")
    with pytest.raises(ConfigError, match="TENSORWIRE_AUTO_PREFER"):
        auto_picks(["tcp", "ucx"], env={"TENSORWIRE_AUTO_PREFER": "fast"})


def test_doctor_prints_the_line_of_auto_picks(monkeypatch):
    from tensorwire.doctor.checks import check_tensorwire
    from tensorwire.transport.base import available_kinds
    from tensorwire.transport.select import auto_picks

    class Probe:
        env = {"TENSORWIRE_UCX_ERROR_HANDLING": "none"}

        def listdir(self, path):
            return []

        def cuda(self):
            return False, "no CUDA"

    (finding,) = check_tensorwire(Probe())
    want = auto_picks(available_kinds(), env=Probe.env, rdma=False).describe(cuda=False)
    assert finding.detail.endswith(want)


def test_serve_auto_picks_ucx_for_clients_on_this_host_and_tcp_for_remote_ones_without_rdma():
    from tensorwire.transport.select import serve_auto_picks

    picks = serve_auto_picks(["ucx", "tcp"], env={}, rdma=False)
    assert (picks.same_host, picks.other_host) == ("ucx", "tcp")
    assert serve_auto_picks(["ucx", "tcp"], env={}, rdma=True).other_host == "ucx"
    assert serve_auto_picks(["ucx", "tcp"], env={"TENSORWIRE_AUTO_PREFER": "tcp"}, rdma=False).same_host == "tcp"
    assert serve_auto_picks(["tcp"], env={}, rdma=True) == type(picks)("tcp", "tcp", "tcp")


def test_the_serve_daemon_s_primary_listener_is_the_one_serve_auto_picks_names_for_remote_clients(monkeypatch):
    from tensorwire.serve.daemon import server
    from tensorwire.transport.select import serve_auto_picks

    for rdma in (False, True):
        monkeypatch.setattr(server, "ucx_has_rdma", lambda rdma=rdma: rdma)
        primary = "ucx" if server._ucx_first() else "tcp"
        assert serve_auto_picks(["ucx", "tcp"], env={}, rdma=rdma).other_host == primary
