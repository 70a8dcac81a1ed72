"""Links under attack: a process that is not a rank of the job tries to negotiate or connect a link.

Hole 4 of the attack report: ``Control.Negotiate`` answered anyone with the peer's nonce and data
ports, and the data listeners admitted whoever presented that nonce, so a stranger could feed a
rank its own tensors. Now every rank holds the job's link secret and proves it on the control
plane (an HMAC of its declaration) and in every data hello (an HMAC of the nonce).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.p2p import control
from tensorwire.p2p.linkauth import resolve_link_secret
from tensorwire.settings import Settings
from tensorwire.transport.base import get_factory, new_nonce

from harness import run_ranks
from serve_common import ROOT, clean_env, ucx_usable

pytestmark = pytest.mark.attack

KINDS = ["tcp"] + (["ucx"] if ucx_usable() else [])
SPEC = tw.TensorSpec("x", (1000,), "int64")

# A process that is not a rank of the job: calls rank 1's Negotiate posing as rank 0 (with no
# secret, then a wrong one), then dials rank 1's data listeners with a leaked nonce (no proof,
# then a wrong one). Prints what each attempt got as JSON.
_STRANGER = r"""
import json, os, sys
import tensorwire as tw
from tensorwire.p2p import control
from tensorwire.transport.base import get_factory, new_nonce
ctrl, leaked, ports = sys.argv[1], bytes.fromhex(sys.argv[2]), json.loads(sys.argv[3])
spec = tw.TensorSpec("x", (1000,), "int64")
res = {}
def attempt(name, fn):
    try:
        res[name] = ["answered", repr(fn())]
    except tw.TensorWireError as exc:
        res[name] = [type(exc).__name__, str(exc)]
offer = control.make_offer(run_id="tensorwire/default/0/", from_rank=0, to_rank=1, link_name="default",
                           send=[spec], recv=[], data={"tcp": ("127.0.0.1", 9)}, transport="auto",
                           nonce=new_nonce(), has_cuda=False, host_id="stranger")
attempt("negotiate-no-secret", lambda: control.negotiate(ctrl, offer, timeout=10))
attempt("negotiate-wrong-secret", lambda: control.negotiate(ctrl, offer, timeout=10, secret=os.urandom(32)))
for kind, port in ports.items():
    f = get_factory(kind)
    attempt(kind + "-no-secret", lambda: f.connect("127.0.0.1", port, leaked, timeout=10))
    attempt(kind + "-wrong-secret", lambda: f.connect("127.0.0.1", port, leaked, timeout=10, secret=os.urandom(32)))
print(json.dumps(res), flush=True)
"""


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.timeout(90)
def test_a_stranger_gets_auth_error_everywhere_and_the_real_ranks_link_meanwhile():
    from torch.distributed import HashStore

    store = HashStore()
    transport = "auto" if "ucx" in KINDS else "tcp"
    n0 = tw.Node(rank=0, world_size=2, store=store, transport=transport, timeout=40)
    n1 = tw.Node(rank=1, world_size=2, store=store, transport=transport, timeout=40)
    got: dict = {}

    def rank1() -> None:
        try:
            link = n1.link(0, recv=[SPEC])
            got["x"] = link.recv("x").clone()
        except BaseException as exc:  # noqa: BLE001 - reported below
            got["error"] = exc

    th = threading.Thread(target=rank1, daemon=True)
    try:
        th.start()
        # rank 1 has declared its side of the link and waits for rank 0: the moment the stranger strikes
        _wait(lambda: (0, "default") in n1._control._declared, 20, "rank 1's declaration")
        nonce = bytes(n1._control._declared[(0, "default")].nonce)
        ports = {k: lst.address[1] for k, lst in n1._listeners.items()}
        assert set(ports) == set(KINDS)
        p = subprocess.run(
            [sys.executable, "-c", _STRANGER, n1.control_address, nonce.hex(), json.dumps(ports)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=clean_env(),
        )
        assert p.returncode == 0, p.stderr[-3000:]
        res = json.loads(p.stdout.strip().splitlines()[-1])
        expected = ["negotiate-no-secret", "negotiate-wrong-secret"]
        expected += [f"{k}-{w}" for k in KINDS for w in ("no-secret", "wrong-secret")]
        assert sorted(res) == sorted(expected)
        for name, (etype, message) in res.items():
            assert etype == "AuthError", (name, etype, message)
        for name in ("negotiate-no-secret", "negotiate-wrong-secret"):
            message = res[name][1]
            assert nonce.hex() not in message and all(str(port) not in message for port in ports.values())
        assert n1._control.refused == 2
        # the stranger took nothing away: rank 1's declaration and nonce are still there for rank 0
        assert bytes(n1._control._declared[(0, "default")].nonce) == nonce
        assert n1._listeners["tcp"].rejected >= 2
        # the real rank 0 links and its bytes arrive
        link = n0.link(1, send=[SPEC])
        link.send("x", torch.arange(1000) * 3)
        th.join(30)
        assert "error" not in got, got.get("error")
        assert torch.equal(got["x"], torch.arange(1000) * 3)
    finally:
        n0.close()
        n1.close()
        th.join(10)


@pytest.mark.parametrize("kind", KINDS)
def test_a_leaked_nonce_without_the_proof_is_refused_and_not_used_up(kind):
    factory = get_factory(kind)
    secret = secrets.token_bytes(32)
    lst = factory("127.0.0.1", port=0, secret=secret)
    try:
        nonce = new_nonce()
        lst.expect(nonce)
        port = lst.address[1]
        for wrong in (None, secrets.token_bytes(32)):
            with pytest.raises(tw.AuthError):
                factory.connect("127.0.0.1", port, nonce, timeout=10, secret=wrong)
        out: dict = {}
        dialler = threading.Thread(
            target=lambda: out.setdefault("t", factory.connect("127.0.0.1", port, nonce, timeout=20, secret=secret)),
            daemon=True,
        )
        dialler.start()
        server = lst.accept(nonce, timeout=20)
        dialler.join(20)
        client = out["t"]
        try:
            buf = torch.zeros(64, dtype=torch.uint8)
            server.post_recv(5, buf)
            client.send(5, torch.arange(64, dtype=torch.uint8), step=1, timeout=10)
            server.wait_recv(5, timeout=10)
            assert torch.equal(buf, torch.arange(64, dtype=torch.uint8))
        finally:
            client.close()
            server.close()
    finally:
        lst.close()


def test_a_tcp_listener_without_a_secret_still_admits_a_nonce_alone():
    """The serve daemon's data listener: its nonces are session credentials, it holds no link secret."""
    factory = get_factory("tcp")
    lst = factory("127.0.0.1", port=0)
    try:
        nonce = new_nonce()
        lst.expect(nonce)
        out: dict = {}
        th = threading.Thread(
            target=lambda: out.setdefault("t", factory.connect("127.0.0.1", lst.address[1], nonce, timeout=10)),
            daemon=True,
        )
        th.start()
        lst.accept(nonce, timeout=10).close()
        th.join(10)
        out["t"].close()
    finally:
        lst.close()


def _offer(frm: int, to: int, nonce: bytes) -> object:
    return control.make_offer(
        run_id="r/",
        from_rank=frm,
        to_rank=to,
        link_name="l",
        send=[SPEC],
        recv=[],
        data={"tcp": ("127.0.0.1", 9)},
        transport="tcp",
        nonce=nonce,
        has_cuda=False,
        host_id="h",
    )


def test_a_replayed_negotiate_request_is_refused():
    secret = secrets.token_bytes(32)
    srv = control.ControlServer(secret=secret)
    try:
        mine = _offer(0, 1, new_nonce())
        srv.declare(_offer(1, 0, new_nonce()))
        assert control.negotiate(srv.address, mine, timeout=10, secret=secret).from_rank == 1
        srv.declare(_offer(1, 0, new_nonce()))  # the next declaration must not go to a replay
        with pytest.raises(tw.AuthError, match="presented again"):
            control.negotiate(srv.address, mine, timeout=10, secret=secret)
        assert (0, "l") in srv._declared
    finally:
        srv.close()


def test_an_answer_without_proof_of_the_secret_is_refused_by_the_caller():
    """A control server that does not hold the secret (an impostor at the peer's address)."""
    srv = control.ControlServer()
    try:
        srv.declare(_offer(1, 0, new_nonce()))
        with pytest.raises(tw.AuthError, match="without proof"):
            control.negotiate(srv.address, _offer(0, 1, new_nonce()), timeout=10, secret=secrets.token_bytes(32))
    finally:
        srv.close()


@pytest.mark.timeout(120)
def test_a_job_with_a_token_file_links_and_a_rank_with_another_token_gets_auth_error(tmp_path):
    good, bad = tmp_path / "token", tmp_path / "other-token"
    good.write_text(secrets.token_hex(32) + "\n")
    bad.write_text(secrets.token_hex(32) + "\n")
    from auth_workers import token_file_job

    res = run_ranks(
        token_file_job,
        world=3,
        timeout=100,
        expect_fail=False,
        token_file=str(good),
        per_rank={2: {"token_file": str(bad)}},
    )
    assert res[1]["bytes_ok"] is True
    assert res[0]["other"] == "AuthError" and res[2]["other"] == "AuthError"
    assert not any(r["store_secret"] for r in res.values())  # the token file took precedence over the store


def test_link_secret_sources_and_their_errors(tmp_path, monkeypatch):
    from torch.distributed import HashStore

    store = HashStore()
    a = resolve_link_secret(store=store, key="p/link/secret", environ={})
    b = resolve_link_secret(store=store, key="p/link/secret", environ={})
    assert a == b and len(a) == 32  # written once, read by every rank
    assert resolve_link_secret(store=store, key="q/link/secret", environ={}) != a  # another attempt, another one
    token = secrets.token_hex(16)
    via_env = resolve_link_secret(store=store, key="p/link/secret", environ={"TENSORWIRE_LINK_TOKEN": token})
    path = tmp_path / "t"
    path.write_text(token + "\n")
    via_file = resolve_link_secret(store=store, key="p/link/secret", environ={"TENSORWIRE_LINK_TOKEN_FILE": str(path)})
    assert via_env == via_file != a
    with pytest.raises(tw.ConfigError, match="both"):
        resolve_link_secret(
            store=store, key="k", environ={"TENSORWIRE_LINK_TOKEN": token, "TENSORWIRE_LINK_TOKEN_FILE": str(path)}
        )
    with pytest.raises(tw.ConfigError, match="at least 16"):
        resolve_link_secret(store=store, key="k", environ={"TENSORWIRE_LINK_TOKEN": "short"})
    with pytest.raises(tw.ConfigError, match="cannot be read"):
        resolve_link_secret(store=store, key="k", environ={"TENSORWIRE_LINK_TOKEN_FILE": str(tmp_path / "none")})
    assert token not in repr(Settings.from_env({"TENSORWIRE_LINK_TOKEN": token}))
