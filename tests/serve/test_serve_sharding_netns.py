"""Three ``tensorwire serve`` daemons in three network namespaces, one sharded client in a fourth (a bridge
joins them): a table sharded by rows over real links, token and TLS on every daemon, a daemon's link cut and
healed under the same client. Needs root and ``ip netns`` (skipped otherwise)."""

from __future__ import annotations

import json
import sys
import textwrap
import time

import pytest

from netns import NetnsStar, Proc, child_env, netns_unavailable, tail
from serve_common import make_pki

pytestmark = [pytest.mark.netns]

TOKEN = "netns-sharded-token-0123456789"
PORT = 7100  # each daemon in its own namespace: the same port everywhere

CLIENT = textwrap.dedent("""
    import json, subprocess, sys, time
    import torch
    import tensorwire as tw

    cfg = json.loads(sys.argv[1])
    out = {}
    c = tw.Client(cfg["daemons"], token=cfg["token"], tls={"ca": cfg["ca"], "server_name": "localhost"},
                  transport="tcp", timeout=3.0, connect_timeout=3.0)
    out["paths"] = sorted(set(c.data_paths.values()))
    rows, dim = 200_000, 64
    g = torch.Generator().manual_seed(1)
    table = torch.randn(rows, dim, generator=g)
    c.put("emb", table, shard="rows")
    idx = torch.randint(0, rows, (4096,), generator=g)
    out["get_rows"] = bool(torch.equal(c.get_rows("emb", idx), table[idx]))
    dup = torch.cat([idx[:1000], idx[:500]])
    vals = torch.randn(dup.numel(), dim, generator=g)
    c.add_rows("emb", dup, vals)
    table.index_add_(0, dup, vals)
    out["add_rows"] = bool(torch.allclose(c.get("emb"), table, atol=1e-5))

    victim = 2
    start = rows * victim // 3
    subprocess.run(["ip", "-n", cfg["ns"][victim], "link", "set", cfg["dev"][victim], "down"], check=True)
    t0 = time.monotonic()
    try:
        c.get_rows("emb", [0, start + 1])
        out["cut"] = "no error"
    except tw.ShardLostError as exc:
        out["cut"] = exc.address
    out["cut_seconds"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:  # again: now its session has to be opened anew, over the cut link
        c.get("emb")
        out["cut_again"] = "no error"
    except tw.ShardLostError as exc:
        out["cut_again"] = exc.address
    out["cut_again_seconds"] = time.monotonic() - t0
    mine = torch.tensor([0, 1, start - 1])
    out["others_while_cut"] = bool(torch.equal(c.get_rows("emb", mine), table[mine]))
    subprocess.run(["ip", "-n", cfg["ns"][victim], "link", "set", cfg["dev"][victim], "up"], check=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            got = c.get_rows("emb", [start + 1, rows - 1])
            break
        except tw.ShardLostError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    out["healed"] = bool(torch.equal(got, table[[start + 1, rows - 1]]))
    c.delete("emb")
    c.close()
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.timeout(240)
def test_three_daemons_in_network_namespaces_behind_one_sharded_client(tmp_path):
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    pki = make_pki(tmp_path)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    procs: list[Proc] = []
    with NetnsStar(3) as net:
        try:
            ready = []
            for i in range(3):
                rf = tmp_path / f"ready{i}.json"
                ready.append(rf)
                procs.append(
                    Proc(
                        [
                            *net.prefix(i),
                            sys.executable,
                            "-m",
                            "tensorwire",
                            "serve",
                            "--host",
                            net.addr[i],
                            "--port",
                            str(PORT),
                            "--transport",
                            "tcp",
                            "--token-file",
                            str(token),
                            "--tls-cert",
                            pki["server.pem"],
                            "--tls-key",
                            pki["server.key"],
                            "--max-bytes",
                            "256MiB",
                            "--ready-file",
                            str(rf),
                        ],
                        env=child_env(),
                        log=tmp_path / f"daemon{i}.log",
                    )
                )
            deadline = time.monotonic() + 60
            while not all(r.exists() for r in ready):
                for p in procs:
                    assert p.popen.poll() is None, tail(p.output())
                assert time.monotonic() < deadline, "daemons did not become ready"
                time.sleep(0.1)
            daemons = [f"{a}:{PORT}" for a in net.addr]
            cfg = {"daemons": daemons, "token": TOKEN, "ca": pki["ca1.pem"], "ns": list(net.ns), "dev": list(net.dev)}
            client = Proc(
                [*net.client_prefix(), sys.executable, str(script), json.dumps(cfg)],
                env=child_env(),
                log=tmp_path / "client.log",
            )
            procs.append(client)
            rc = client.wait(180)
            text = client.output()
            assert rc == 0, tail(text) + "".join(tail(p.output(), 20) for p in procs[:3])
            line = next(ln for ln in text.splitlines() if ln.startswith("RESULT "))
            res = json.loads(line[len("RESULT ") :])
            assert res["paths"] == ["tcp"]
            assert res["get_rows"] and res["add_rows"]
            assert res["cut"] == daemons[2], res
            assert res["cut"] == res["cut_again"] == daemons[2], res
            # within the client's timeout (3 s), a session to open again included (plus scheduling)
            assert res["cut_seconds"] < 3.0 + 1.0 and res["cut_again_seconds"] < 3.0 + 1.0, res
            assert res["others_while_cut"] and res["healed"], res
        finally:
            for p in procs:
                p.kill()
