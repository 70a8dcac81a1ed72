"""``tw.init()`` and the torchrun contract: env parsing, the bootstrap store, binding, real torchrun."""

from __future__ import annotations

import json
import socket
import sys
from datetime import timedelta

import types

import pytest

import tensorwire as tw
from tensorwire.p2p.bootstrap import published_addresses, reachable_address
from tensorwire.p2p.torchrun import REQUIRED_VARS, TorchrunEnv, bootstrap_store, store_prefix

from netns import TORCHRUN, child_env, free_port, run


def good_env(**over: str) -> dict[str, str]:
    env = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "job-7",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


# -- parsing ------------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_parses_every_variable_into_a_typed_object():
    tr = TorchrunEnv.from_environ(good_env())
    assert (tr.rank, tr.local_rank, tr.world_size, tr.local_world_size, tr.group_rank) == (1, 1, 4, 2, 0)
    assert (tr.master_addr, tr.master_port, tr.run_id, tr.restart_count) == ("localhost", 29500, "job-7", 2)
    assert tr.use_agent_store is True and tr.group_world_size == 2 and tr.max_restarts == 3
    assert tr.multi_node
    assert tr.prefix == "tensorwire/job-7/2/"
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        tr.rank = 3  # frozen


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", REQUIRED_VARS)
def test_each_missing_variable_is_named(name):
    env = good_env()
    del env[name]
    with pytest.raises(tw.ConfigError) as ei:
        TorchrunEnv.from_environ(env)
    assert name in str(ei.value)
    others = [v for v in REQUIRED_VARS if v != name and v not in name]
    assert not any(f"{v} " in str(ei.value) or f"{v}," in str(ei.value) for v in others), str(ei.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", REQUIRED_VARS)
def test_an_empty_variable_counts_as_missing(name):
    with pytest.raises(tw.ConfigError, match=name):
        TorchrunEnv.from_environ(good_env(**{name: "  "}))


@pytest.mark.timeout(10)
def test_all_missing_variables_are_named_at_once():
    with pytest.raises(tw.ConfigError) as ei:
        TorchrunEnv.from_environ({})
    for name in REQUIRED_VARS:
        assert name in str(ei.value)
    assert "torchrun" in str(ei.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "name,value",
    [
        ("RANK", "one"),
        ("RANK", "1.0"),
        ("RANK", "-1"),
        ("RANK", "4"),
        ("LOCAL_RANK", "x"),
        ("LOCAL_RANK", "2"),
        ("WORLD_SIZE", "0"),
        ("WORLD_SIZE", "four"),
        ("LOCAL_WORLD_SIZE", "0"),
        ("LOCAL_WORLD_SIZE", "5"),
        ("GROUP_RANK", "-2"),
        ("GROUP_RANK", "2"),
        ("GROUP_WORLD_SIZE", "0"),
        ("GROUP_WORLD_SIZE", "many"),
        ("MASTER_PORT", "0"),
        ("MASTER_PORT", "65536"),
        ("MASTER_PORT", "http"),
        ("MASTER_PORT", "-5"),
        ("MASTER_ADDR", "local host"),
        ("TORCHELASTIC_RUN_ID", "a b"),
        ("TORCHELASTIC_RESTART_COUNT", "-1"),
        ("TORCHELASTIC_RESTART_COUNT", "again"),
        ("TORCHELASTIC_MAX_RESTARTS", "lots"),
        ("TORCHELASTIC_USE_AGENT_STORE", "maybe"),
    ],
)
def test_malformed_values_are_named(name, value):
    with pytest.raises(tw.ConfigError) as ei:
        TorchrunEnv.from_environ(good_env(**{name: value}))
    assert name in str(ei.value)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "raw,expected", [("True", True), ("true", True), ("1", True), ("False", False), ("0", False), (None, False)]
)
def test_use_agent_store_flag(raw, expected):
    env = good_env(TORCHELASTIC_USE_AGENT_STORE=raw) if raw is not None else good_env()
    if raw is None:
        del env["TORCHELASTIC_USE_AGENT_STORE"]
    assert TorchrunEnv.from_environ(env).use_agent_store is expected


@pytest.mark.timeout(10)
def test_single_node_and_prefix_per_attempt():
    tr = TorchrunEnv.from_environ(good_env(WORLD_SIZE="2", GROUP_WORLD_SIZE="1", RANK="0", LOCAL_RANK="0"))
    assert not tr.multi_node
    assert store_prefix("r", 0) != store_prefix("r", 1) != store_prefix("s", 1)
    assert store_prefix("r", 3) == "tensorwire/r/3/"


# -- binding address ------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_loopback_master_gives_loopback_on_one_node():
    tr = TorchrunEnv.from_environ(good_env(WORLD_SIZE="2", GROUP_WORLD_SIZE="1", RANK="0", LOCAL_RANK="0"))
    assert reachable_address(tr) == "127.0.0.1"
    tr = TorchrunEnv.from_environ(
        good_env(WORLD_SIZE="2", GROUP_WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    )
    assert reachable_address(tr) == "127.0.0.1"


@pytest.mark.timeout(10)
def test_loopback_master_in_a_multi_node_job_asks_for_tensorwire_host():
    with pytest.raises(tw.ConfigError, match="TENSORWIRE_HOST"):
        reachable_address(TorchrunEnv.from_environ(good_env()))


@pytest.mark.timeout(10)
def test_unresolvable_master_addr_is_a_config_error():
    tr = TorchrunEnv.from_environ(
        good_env(MASTER_ADDR="no-such-host.invalid", GROUP_WORLD_SIZE="1", WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    )
    with pytest.raises(tw.ConfigError, match="MASTER_ADDR"):
        reachable_address(tr)


# -- bootstrap store -------------------------------------------------------------------------------------


def _agent_store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False, multi_tenant=True)


@pytest.mark.timeout(30)
def test_agent_store_is_used_as_a_client_on_master_port():
    agent = _agent_store()
    s = bootstrap_store(
        master_addr="127.0.0.1", master_port=agent.port, rank=0, world_size=2, use_agent_store=True, timeout=5
    )
    s.set("k", "v")
    assert agent.get("k") == b"v"


@pytest.mark.timeout(30)
def test_without_agent_store_rank0_hosts_on_master_port_shared_with_torch_distributed():
    from torch.distributed import TCPStore

    port = free_port()
    host = bootstrap_store(
        master_addr="127.0.0.1", master_port=port, rank=0, world_size=2, use_agent_store=False, timeout=5
    )
    client = bootstrap_store(
        master_addr="127.0.0.1", master_port=port, rank=1, world_size=2, use_agent_store=False, timeout=5
    )
    client.set("from-1", "x")
    assert host.get("from-1") == b"x"
    # What init_process_group("env://") does on rank 0 without the agent store: same port, multi-tenant.
    torch_side = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=5), multi_tenant=True, wait_for_workers=False)
    assert torch_side.get("from-1") == b"x"
    # ... and nothing is hosted on MASTER_PORT + 1.
    with socket.socket() as probe:
        probe.settimeout(1)
        assert probe.connect_ex(("127.0.0.1", port + 1)) != 0


@pytest.mark.timeout(30)
def test_unreachable_store_is_a_connect_timeout_naming_the_address():
    port = free_port()
    with pytest.raises(tw.ConnectTimeout, match=f"127.0.0.1:{port}"):
        bootstrap_store(
            master_addr="127.0.0.1", master_port=port, rank=1, world_size=2, use_agent_store=True, timeout=1
        )


# -- tw.init in this process (world of one) -----------------------------------------------------------------


def _init_env(port: int, **over: str) -> dict[str, str]:
    base = dict(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="localhost",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
    )
    base.update(over)
    return good_env(**base)


@pytest.mark.timeout(60)
def test_init_binds_the_reachable_address_and_publishes_under_the_attempt_prefix():
    agent = _agent_store()
    node = tw.init(env=_init_env(agent.port), transport="tcp", timeout=10)
    try:
        assert node.rank == 0 and node.world_size == 1 and node.torchrun.run_id == "job-7"
        assert node.prefix == "tensorwire/job-7/0/"
        assert node.control_address.startswith("127.0.0.1:")
        rec = published_addresses(node, 0)
        assert rec["control"] == node.control_address
        assert set(rec["data"]) == {"tcp"} and rec["data"]["tcp"].startswith("127.0.0.1:")
        assert not any(a.startswith("0.0.0.0") for a in [rec["control"], *rec["data"].values()])
        assert agent.get("tensorwire/job-7/0/ctrl/0").decode() == node.control_address
    finally:
        node.close()
    # The next attempt publishes under a new prefix and removes this attempt's records.
    node2 = tw.init(env=_init_env(agent.port, TORCHELASTIC_RESTART_COUNT="1"), transport="tcp", timeout=10)
    try:
        assert node2.prefix == "tensorwire/job-7/1/"
        assert agent.get("tensorwire/job-7/1/ctrl/0").decode() == node2.control_address
        assert not agent.check(["tensorwire/job-7/0/ctrl/0"])
    finally:
        node2.close()


@pytest.mark.timeout(60)
def test_init_honours_host_and_rejects_wildcards():
    agent = _agent_store()
    node = tw.init(env=_init_env(agent.port, TENSORWIRE_HOST="127.0.0.1"), transport="tcp", timeout=10)
    try:
        assert node.host == "127.0.0.1"
    finally:
        node.close()
    for bad in ("0.0.0.0", "::"):
        with pytest.raises(tw.ConfigError, match="wildcard"):
            tw.init(env=_init_env(agent.port, TENSORWIRE_HOST=bad), transport="tcp", timeout=10)
    with pytest.raises(tw.ConfigError, match="TENSORWIRE_TIMEOUT"):
        tw.init(env=_init_env(agent.port, TENSORWIRE_TIMEOUT="soon"), transport="tcp")
    with pytest.raises(tw.ConfigError, match="TENSORWIRE_TRANSPORT"):
        tw.init(env=_init_env(agent.port, TENSORWIRE_TRANSPORT="carrier-pigeon"))


@pytest.mark.timeout(10)
def test_tw_init_and_discover_stay_functions_after_importing_their_modules():
    import tensorwire.p2p.bootstrap
    import tensorwire.discovery  # noqa: F401

    assert isinstance(tw.init, types.FunctionType) and isinstance(tw.discover, types.FunctionType)
    with pytest.raises(tw.ConfigError, match="MASTER_PORT"):
        tw.init(env={k: v for k, v in _init_env(1).items() if k != "MASTER_PORT"})


@pytest.mark.timeout(10)
def test_loopback_host_is_refused_in_a_multi_node_job():
    env = good_env(MASTER_ADDR="10.203.9.9")  # multi-node; nothing is contacted: the check comes first
    for kwargs in ({"host": "127.0.0.1"}, {}):
        e = dict(env, TENSORWIRE_HOST="localhost") if not kwargs else env
        with pytest.raises(tw.ConfigError, match="loopback"):
            tw.init(env=e, transport="tcp", timeout=1, **kwargs)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("local_rank,count,expected", [(1, 4, 1), (3, 4, 3), (1, 1, 0), (5, 4, 1)])
def test_gpu_is_picked_from_local_rank(monkeypatch, local_rank, count, expected):
    import torch

    import tensorwire.buffers
    from tensorwire.p2p.bootstrap import _pick_device

    chosen = []
    monkeypatch.setattr(tensorwire.buffers, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(i))
    tr = TorchrunEnv.from_environ(
        good_env(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE="8", WORLD_SIZE="8", RANK=str(local_rank))
    )
    dev = _pick_device(tr)
    assert dev == torch.device("cuda", expected) and chosen == [expected]


@pytest.mark.timeout(10)
def test_init_outside_torchrun_names_the_missing_variables():
    with pytest.raises(tw.ConfigError, match="RANK.*MASTER_ADDR"):
        tw.init(env={})


# -- what torchrun 2.x really sets, end to end -----------------------------------------------------------------

PROBE = r"""
import json, os, sys
import tensorwire as tw
from tensorwire.p2p.bootstrap import published_addresses
from tensorwire.p2p.torchrun import TorchrunEnv
tr = TorchrunEnv.from_environ()
node = tw.init(transport="tcp", timeout=30)
peer = 1 - node.rank
spec = tw.TensorSpec("x", (3,))
import torch
link = node.link(peer, send=[spec], recv=[spec])
link.send("x", torch.full((3,), float(node.rank)))
got = link.recv("x").tolist()
rec = published_addresses(node, peer)
sys.stdout.write("PROBE " + json.dumps({"rank": node.rank, "got": got, "prefix": node.prefix, "host": node.host,
      "use_agent_store": tr.use_agent_store, "master": [tr.master_addr, tr.master_port],
      "peer_record": rec, "env": {k: os.environ[k] for k in sorted(os.environ)
      if k.startswith(("TORCHELASTIC_", "MASTER_", "GROUP_", "LOCAL_")) or k in ("RANK", "WORLD_SIZE")}}) + "\n")
sys.stdout.flush()  # one write per line: torchrun runs workers with python -u
node.close()
"""


def _probe(tmp_path, extra_args, **env):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    rc, out = run(
        [
            *TORCHRUN,
            *extra_args,
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.2",
            str(script),
        ],
        env=child_env(**env),
        log=tmp_path / "log.txt",
        timeout=90,
    )
    assert rc == 0, out[-4000:]
    recs = {}
    for line in out.splitlines():
        if line.startswith("PROBE "):
            r = json.loads(line[6:])
            recs[r["rank"]] = r
    assert set(recs) == {0, 1}, out[-4000:]
    for r in recs.values():
        print(json.dumps(r["env"], sort_keys=True))
        assert r["got"] == [float(1 - r["rank"])] * 3
        assert r["host"] == "127.0.0.1"
        assert r["peer_record"]["control"].startswith("127.0.0.1:")
        assert r["prefix"] == f"tensorwire/{r['env']['TORCHELASTIC_RUN_ID']}/0/"
        for name in REQUIRED_VARS:
            assert name in r["env"], name
    return recs


@pytest.mark.timeout(120)
def test_real_torchrun_standalone_uses_the_agent_store(tmp_path):
    recs = _probe(tmp_path, ["--standalone"])
    assert all(r["use_agent_store"] for r in recs.values())
    assert recs[0]["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"


@pytest.mark.timeout(120)
def test_real_torchrun_c10d_agent_store_is_not_the_rendezvous_endpoint(tmp_path):
    port = free_port()
    recs = _probe(tmp_path, ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"])
    assert all(r["use_agent_store"] for r in recs.values())
    assert recs[0]["master"][1] != port  # c10d hosts the workers' store on a fresh port
    assert recs[0]["env"]["TORCHELASTIC_RUN_ID"] == "none"  # no --rdzv-id: the prefix still isolates attempts


@pytest.mark.timeout(120)
def test_real_torchrun_without_shared_store_rank0_hosts_it(tmp_path):
    port = free_port()
    recs = _probe(
        tmp_path,
        ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "probe-job"],
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    assert not any(r["use_agent_store"] for r in recs.values())
    assert recs[0]["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    assert recs[0]["prefix"] == "tensorwire/probe-job/0/"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
