"""The command-line helpers (ls, get, put) and the embedding example, against a real daemon."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from serve_common import ROOT, Daemon, clean_env, run_cli


@pytest.mark.timeout(180)
def test_put_ls_get_roundtrip_through_safetensors_files(tmp_path):
    src = tmp_path / "in.safetensors"
    w = torch.randn(300, 20)
    save_file({"weights": w, "other": torch.arange(5)}, str(src))
    token = tmp_path / "token"
    token.write_text("cli-token-0123456789abcdef")
    token.chmod(0o600)
    with Daemon("--token-file", str(token)) as d:
        common = ["--token-file", str(token), "--transport", "tcp"]
        r = run_cli("put", d.address, "w", str(src), "--key", "weights", "--progress", *common)
        assert r.returncode == 0, r.stderr
        assert "version 1" in r.stderr and "put w [" in r.stderr  # the progress bar went to stderr
        r = run_cli("put", d.address, "weights", str(src), *common)  # key defaults to NAME
        assert r.returncode == 0, r.stderr
        r = run_cli("put", d.address, "nokey", str(src), *common)  # two tensors in the file: must pick
        assert r.returncode == 1 and "--key" in r.stderr
        r = run_cli("ls", d.address, *common)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert lines[0].split()[:3] == ["NAME", "DTYPE", "SHAPE"]
        assert any(line.split()[:4] == ["w", "float32", "300x20", "1"] for line in lines[1:]), r.stdout
        r = run_cli("ls", d.address, "--json", *common)
        assert json.loads(r.stdout)["w"]["shape"] == [300, 20]
        out = tmp_path / "out.safetensors"
        r = run_cli("get", d.address, "w", "-o", str(out), *common)
        assert r.returncode == 0, r.stderr
        assert "get w [" not in r.stderr  # no TTY and no --progress: no bar
        assert torch.equal(load_file(str(out))["w"], w)
        r = run_cli("get", d.address, "missing", "-o", str(out), *common)
        assert r.returncode == 1 and "missing" in r.stderr
        r = run_cli("ls", d.address, "--transport", "tcp")  # no token
        assert r.returncode == 1 and "token" in r.stderr.lower()


@pytest.mark.timeout(240)
def test_embedding_example_trains_and_finishes_by_itself():
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "embedding_server.py"),
            "--rows",
            "20000",
            "--dim",
            "16",
            "--batch",
            "512",
            "--steps",
            "12",
            "--transport",
            "tcp",
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=200,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(line.split()[3]) for line in r.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 12
    assert losses[-1] < losses[0], losses
    assert "emb version 13" in r.stdout
