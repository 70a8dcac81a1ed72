"""``tensorwire doctor``'s copy-engine probe: the child's request checks (no GPU needed), and (marked gpu) the real
mapped copy and flag round trip for every ordered pair of GPUs, a GPU with itself included."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tensorwire.doctor import ce_child, ce_probe

from harness import gpu_count

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REGION_SIZE = 1 << 20
GOOD = {
    "version": ce_child.VERSION,
    "device": 0,
    "handle": "ab" * 64,
    "offset": 0,
    "nbytes": 4096,
    "region": "/dev/shm/tensorwire-ce-1-0123456789abcdef01234567",
    "flag": 4104,
    "seq": 1,
    "seed": 7,
    "timeout": 5.0,
}


def _req(**changes):
    obj = dict(GOOD)
    for k, v in changes.items():
        if v is None:
            obj.pop(k)
        else:
            obj[k] = v
    return json.dumps(obj)


def _child(stdin: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", ce_probe.CHILD_MODULE, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=ROOT,
    )


def test_a_well_formed_request_parses_to_its_fields():
    req = ce_child.parse_request(_req(), region_size=REGION_SIZE)
    assert req.handle == bytes([0xAB]) * 64 and req.nbytes == 4096 and req.flag == 4104 and req.timeout == 5.0


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"handle": "ab" * 63}, "must be 128 hex digits (a 64-byte CUDA IPC handle), got 126"),  # truncated
        ({"handle": "ab" * 64 + "cd"}, "got 130"),
        ({"handle": "zz" * 64}, "not hex digits"),
        ({"handle": "00" * 64}, "all zeros"),
        ({"handle": 12}, "'handle' must be a hex string"),
        ({"handle": None}, "lacks handle"),
        ({"region": "/tmp/elsewhere"}, "does not name a tensorwire copy-engine region"),
        ({"region": "tensorwire-ce-relative"}, "absolute path"),
        ({"flag": 4102}, "multiple of 4"),
        ({"flag": REGION_SIZE}, "'flag' must be in"),
        ({"nbytes": 0}, "'nbytes' must be in"),
        ({"seq": 0}, "'seq' must be in"),
        ({"device": True}, "'device' must be an integer"),
        ({"timeout": 0}, "'timeout' must be"),
        ({"version": 99}, "this child speaks"),
        ({"extra": 1}, "unknown fields: extra"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(changes, says):
    with pytest.raises(ce_child.BadRequest) as info:
        ce_child.parse_request(_req(**changes), region_size=REGION_SIZE)
    assert says in str(info.value)


@pytest.mark.parametrize(("text", "says"), [("", "no request"), ("{not json", "not JSON"), ("[1, 2]", "JSON object")])
def test_a_request_that_is_not_an_object_is_refused(text, says):
    with pytest.raises(ce_child.BadRequest) as info:
        ce_child.parse_request(text, region_size=REGION_SIZE)
    assert says in str(info.value)


def test_the_child_refuses_a_truncated_handle_before_any_cuda_call_with_status_2():
    out = _child(_req(handle="ab" * 40) + "\n")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "bad request: 'handle' must be 128 hex digits" in out.stderr and out.stdout == ""
    empty = _child("")
    assert empty.returncode == 2 and "no request on standard input" in empty.stderr
    args = _child(_req() + "\n", "--handle", "ab")
    assert args.returncode == 2 and "takes no arguments" in args.stderr


def test_the_pattern_is_the_documented_bytes():
    p = ce_child.pattern(300, 5)
    assert [int(x) for x in p[:3]] == [5, 136, 11] and int(p[256]) == (256 * 131 + 5) % 256


def test_the_probe_refuses_a_bad_size_and_reports_a_host_without_cuda():
    with pytest.raises(ValueError, match="at least 1"):
        ce_probe.probe_pair(0, 0, nbytes=0)
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA host: the real probe runs in the gpu test")
    ok, detail = ce_probe.probe_pair(0, 1)
    assert not ok and detail  # no driver or no GPU: said, never raised


@pytest.mark.gpu
@pytest.mark.timeout(1200)
@pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA device")
def test_real_copy_engine_probe_for_every_pair_and_a_forged_handle():
    from tensorwire.transport.ce import Region

    n = gpu_count()
    for i in range(n):
        for j in range(n):
            ok, detail = ce_probe.probe_pair(i, j, timeout=120)
            assert ok, f"{i}->{j}: {detail}"
            assert "bytes equal" in detail
    # a handle of the right length that no process exported: the driver refuses it, the child says so
    region = Region.create()
    try:
        out = _child(_req(region=region.path, handle="5a" * 64, flag=4104, timeout=20.0) + "\n")
    finally:
        region.close()
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr[-2000:])
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["ok"] is False and "cuIpcOpenMemHandle" in answer["detail"]
    # and doctor's own report: one finding per ordered pair, each naming what tensorwire will choose
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, "-m", "tensorwire", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=1000,
        env=env,
        cwd=ROOT,
    )
    data = json.loads(run.stdout)
    found = {f["check"]: f for f in data["findings"]}
    for i in range(n):
        for j in range(n):
            f = found[f"copy engine {i}->{j}"]
            assert f["verdict"] == "OK", f
            assert f["choice"] == "copy engine" or f["choice"].startswith("UCX, because"), f
