"""Every code block of the README runs as written and shows its result.

The torchrun blocks run under the real torchrun with two ranks; the serve daemon's command runs with port 0
and a temporary snapshot directory in place of its fixed port and ``/var/lib`` path, and the client block
is pointed at the port the daemon reports. The pipeline command runs with fewer steps.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

pytestmark = [pytest.mark.slow]


def blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block of the README, in order."""
    text = (ROOT / "README.md").read_text()
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w+)\n(.*?)^```$", text, re.M | re.S)]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _one(lang: str, needle: str) -> str:
    found = [code for lg, code in blocks() if lg == lang and needle in code]
    assert len(found) == 1, f"{len(found)} {lang} blocks of the README hold {needle!r}"
    return found[0]


def test_every_readme_block_is_one_these_tests_run():
    needles = {
        "python": ("tw.init()", "init_process_group", "tw.Client("),
        "bash": ("examples/pipeline_parallel.py", "tensorwire serve "),
    }
    for lang, code in blocks():
        assert lang in needles, f"a {lang} block no test runs:\n{code}"
        assert sum(n in code for n in needles[lang]) == 1, f"a block no test here runs (or two would):\n{code}"


def _torchrun(tmp_path: pathlib.Path, code: str, timeout: float) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    out = subprocess.run(
        [*TORCHRUN, str(script)], capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=_env()
    )
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    return out.stdout


@pytest.mark.timeout(300)
def test_the_link_block_moves_activations_forward_and_a_gradient_back(tmp_path):
    stdout = _torchrun(tmp_path, _one("python", "tw.init()"), 280)
    assert "rank 1: activations (64, 1024) in, mean " in stdout
    assert "rank 0: gradient (64, 1024) back, sum 65536" in stdout  # 64 x 1024 ones


@pytest.mark.timeout(300)
def test_the_torch_distributed_block_prints_what_arrived(tmp_path):
    stdout = _torchrun(tmp_path, _one("python", "init_process_group"), 280)
    assert "rank 1 received (64, 1024), every element 7: True" in stdout


@pytest.mark.timeout(400)
def test_the_pipeline_command_trains_and_checks(tmp_path):
    cmd = shlex.split(_one("bash", "examples/pipeline_parallel.py").strip())
    assert cmd[0] == "torchrun" and "--steps" in cmd
    cmd[cmd.index("--steps") + 1] = "3"  # (fewer steps: the same code)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *cmd[1:]],
        capture_output=True,
        text=True,
        timeout=380,
        cwd=ROOT,
        env=_env(),
    )
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])


@pytest.mark.timeout(240)
def test_the_serve_blocks_put_get_and_update_rows_through_a_daemon(tmp_path):
    cmd = shlex.split(_one("bash", "tensorwire serve ").strip())
    assert cmd[:2] == ["tensorwire", "serve"]
    cmd[cmd.index("--port") + 1] = "0"
    cmd[cmd.index("--metrics-port") + 1] = "0"
    cmd[cmd.index("--snapshot-dir") + 1] = str(tmp_path / "snapshots")
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "tensorwire", *cmd[1:]], stdout=err, stderr=subprocess.STDOUT, env=_env()
        )
    try:
        deadline = time.monotonic() + 120
        port = None
        while port is None:
            m = re.search(r"control plane \(gRPC.*?\) listening on [\d.]+:(\d+)", log.read_text())
            if m:
                port = m.group(1)
            elif daemon.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the daemon did not start:\n{log.read_text()[-3000:]}")
            else:
                time.sleep(0.2)
        code = _one("python", "tw.Client(")
        assert '"127.0.0.1:7100"' in code
        script = tmp_path / "client.py"
        script.write_text(code.replace('"127.0.0.1:7100"', f'"127.0.0.1:{port}"'))
        out = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path, env=_env()
        )
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
        assert "weights (1024, 1024) back; rows [3, 14, 159] of emb now start with [1.0, 1.0, 1.0]" in out.stdout
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)
