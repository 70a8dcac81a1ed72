"""The committed generated protobuf code is exactly what proto/ generates."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_generated_stubs_match_proto_sources(tmp_path):
    pytest.importorskip("grpc_tools")
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            *protos,
        ],
        check=True,
        cwd=ROOT / "proto",
        timeout=100,
    )
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated from proto/ but not committed"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} differs from what proto/ generates; regenerate with `make proto`"
        )
    committed_stubs = sorted(p.relative_to(ROOT) for p in (ROOT / "tensorwire" / "v1").glob("*_pb2*.py*"))
    assert committed_stubs == generated, "stale generated files in tensorwire/v1"


def test_no_pickle_in_the_package():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "tensorwire").rglob("*.py")
        if "import pickle" in p.read_text() or "pickle.loads" in p.read_text()
    ]
    assert offenders == []
