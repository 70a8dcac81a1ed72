"""examples/captured_step.py: its help, its one-line error without a GPU, and (``-m gpu``) the captured run.

Every run is a child process in a session of its own, bounded by a timeout; the whole process tree is killed
when the test ends (``netns.run``), and the logs live in pytest's temporary directory.
"""

from __future__ import annotations

import sys

import pytest

from netns import REPO, TORCHRUN, child_env, run, tail

torch = pytest.importorskip("torch")

EXAMPLE = REPO / "examples" / "captured_step.py"


@pytest.mark.timeout(120)
def test_help_describes_the_options(tmp_path):
    rc, out = run([sys.executable, str(EXAMPLE), "--help"], env=child_env(), log=tmp_path / "help.log", timeout=100)
    assert rc == 0, tail(out)
    for option in ("--backend", "--steps", "--microbatches", "--hidden", "--check", "--eager", "--graphed-callables"):
        assert option in out, option
    assert "torchrun --standalone --nproc-per-node 2 examples/captured_step.py" in out


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_without_a_gpu_it_fails_with_one_clear_line(tmp_path):
    env = child_env(CUDA_VISIBLE_DEVICES="")
    rc, out = run([sys.executable, str(EXAMPLE), "--check"], env=env, log=tmp_path / "nogpu.log", timeout=100)
    assert rc != 0
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert lines[0].startswith("captured_step.py: error:") and "GPU" in lines[0], out
    assert "Traceback" not in out


@pytest.mark.timeout(120)
def test_a_bad_option_value_fails_before_touching_the_gpu(tmp_path):
    rc, out = run(
        [sys.executable, str(EXAMPLE), "--steps", "2"], env=child_env(), log=tmp_path / "steps.log", timeout=100
    )
    assert rc == 2 and "--steps must be more than" in out and "Traceback" not in out, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(300)
def test_captured_steps_match_eager_steps_under_torchrun(tmp_path):
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--backend",
        "tensorwire",
        "--check",
        "--steps",
        "20",
        "--stall-s",
        "200",  # a hang prints every thread's stack before the test's own timeout
    ]
    rc, out = run(cmd, env=child_env(), log=tmp_path / "captured.log", timeout=260)
    assert rc == 0, tail(out, 80)
    assert "CHECK PASSED" in out and "check: max |captured - eager|" in out, tail(out, 80)
    assert "captured" in out and "ms/step" in out, tail(out, 80)
