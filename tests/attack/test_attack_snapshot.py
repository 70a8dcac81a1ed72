"""Attacks on snapshots: reserved names, a full disk, corrupt and truncated files, planted symlinks.

What the daemon promises (docs/durability.md): a snapshot either replaces the previous one whole or
leaves it untouched, and a failure is never reported as success; a snapshot that fails its checksums
is never restored (the daemon refuses to start, names the file and the tensor, and keeps the file).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client.client import Client
from tensorwire.serve.daemon.server import EXIT_SNAPSHOT_FAILED, EXIT_SNAPSHOT_UNREADABLE
from tensorwire.serve.daemon.snapshot import SNAPSHOT_FILE, restore_snapshot, write_safetensors
from tensorwire.serve.daemon.store import Store

from serve_common import Daemon, in_process

pytestmark = pytest.mark.attack


def _header(path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _flip(path, offset: int, bit: int = 3) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def _data_offset(path, name: str) -> tuple[int, int]:
    n, h = _header(path)
    a, b = h[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _tmp_files(d) -> list[str]:
    return [p for p in os.listdir(d) if p.endswith(".tmp")]


# -- reserved names ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_tensor_named_metadata_is_refused_at_put_and_the_snapshot_stays_readable(tmp_path):
    snap = tmp_path / "snap"
    x = torch.arange(12.0)
    with in_process(snapshot_dir=str(snap)) as s, Client(s.address, transport="tcp") as c:
        c.put("good", x)
        for call in (
            lambda: c.put("__metadata__", torch.ones(4)),
            lambda: c.declare(tw.TensorSpec("__metadata__", (4,))),
        ):
            with pytest.raises(tw.SpecError, match="reserved by the snapshot format"):
                call()
        assert "__metadata__" not in c.list()
        assert c.snapshot().tensors == 1
    with in_process(snapshot_dir=str(snap)) as s2, Client(s2.address, transport="tcp") as c:
        assert s2.restored == 1 and torch.equal(c.get("good"), x)


def test_the_writer_refuses_reserved_and_duplicate_names_and_leaves_the_file_alone(tmp_path):
    path = tmp_path / "f.safetensors"
    write_safetensors(str(path), [(tw.TensorSpec("a", (2,), "uint8"), torch.tensor([1, 2], dtype=torch.uint8))])
    before = path.read_bytes()
    raw = torch.zeros(4, dtype=torch.uint8)
    # a spec made around the store's check (as an older daemon's store might hold)
    bad = tw.TensorSpec("__metadata__", (4,), "uint8")
    with pytest.raises(tw.SpecError, match="reserved"):
        write_safetensors(str(path), [(bad, raw)])
    with pytest.raises(tw.SpecError, match="twice"):
        ok = tw.TensorSpec("b", (4,), "uint8")
        write_safetensors(str(path), [(ok, raw), (ok, raw)])
    assert path.read_bytes() == before and not _tmp_files(tmp_path)


def test_a_snapshot_that_does_not_read_back_is_not_installed(tmp_path, monkeypatch):
    import tensorwire.serve.daemon.snapshot as snapshot

    path = tmp_path / SNAPSHOT_FILE
    write_safetensors(str(path), [(tw.TensorSpec("a", (2,), "uint8"), torch.tensor([1, 2], dtype=torch.uint8))])
    before = path.read_bytes()

    def unreadable(p):
        raise ValueError("header does not parse")

    monkeypatch.setattr(snapshot, "read_safetensors_specs", unreadable)
    with pytest.raises(tw.SnapshotError, match="does not read back"):
        write_safetensors(str(path), [(tw.TensorSpec("b", (3,), "uint8"), torch.zeros(3, dtype=torch.uint8))])
    assert path.read_bytes() == before and not _tmp_files(tmp_path)


# -- a full disk ---------------------------------------------------------------------------------

LIMIT = 1 << 20  # RLIMIT_FSIZE of the "full disk" daemon: no file it writes may grow past 1 MiB


def _small_fs() -> None:  # in the daemon's child, before exec (Python ignores SIGXFSZ: writes fail with EFBIG)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


@pytest.mark.timeout(120)
def test_a_failed_shutdown_snapshot_exits_non_zero_and_keeps_the_previous_snapshot_whole(tmp_path):
    snap = tmp_path / "snap"
    x = torch.arange(1000, dtype=torch.float32)
    _write_store(snap, {"x": x})
    good = (snap / SNAPSHOT_FILE).read_bytes()

    with Daemon("--snapshot-dir", str(snap), "--no-shm", preexec_fn=_small_fs) as d:
        assert d.info["restored"] == 1
        with Client(d.address, transport="tcp") as c:
            c.put("big", torch.ones(LIMIT // 2, dtype=torch.float32))  # 2 MiB: the snapshot cannot fit
            with pytest.raises(tw.SnapshotError, match="previous snapshot"):
                c.snapshot()  # the RPC and the CLI report the failure, never success
        d.signal(signal.SIGTERM)
        rc = d.wait(60)
        log = d.log()
    assert rc == EXIT_SNAPSHOT_FAILED, log
    assert "snapshot on shutdown failed" in log
    assert (snap / SNAPSHOT_FILE).read_bytes() == good
    assert not _tmp_files(snap)
    store = Store(1 << 30)
    try:
        assert restore_snapshot(store, str(snap)) == 1
        e = store.get("x")
        assert torch.equal(e.slot(e.cur).raw, x.view(torch.uint8))
    finally:
        store.close()


# -- corrupt files -------------------------------------------------------------------------------


def _write_store(directory, tensors: dict[str, torch.Tensor]) -> None:
    from tensorwire.serve.daemon.snapshot import write_snapshot

    store = Store(1 << 30)
    try:
        for name, t in tensors.items():
            store.restore(
                tw.TensorSpec(name, tuple(t.shape), t.dtype),
                1,
                lambda raw, t=t: raw.copy_(t.reshape(-1).view(torch.uint8)),
            )
        write_snapshot(store, str(directory))
    finally:
        store.close()


TENSORS = {"a": torch.arange(64, dtype=torch.int32), "w": torch.linspace(0, 1, 4096), "z": torch.zeros(0)}


@pytest.mark.timeout(120)
def test_a_flipped_data_bit_refuses_to_start_names_file_and_tensor_and_keeps_the_file(tmp_path):
    snap = tmp_path / "snap"
    _write_store(snap, TENSORS)
    path = snap / SNAPSHOT_FILE
    lo, hi = _data_offset(path, "w")
    _flip(path, (lo + hi) // 2)
    corrupt = path.read_bytes()
    import subprocess
    import sys

    from serve_common import ROOT, clean_env

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorwire",
            "serve",
            "--port",
            "0",
            "--transport",
            "tcp",
            "--snapshot-dir",
            str(snap),
            "--no-shm",
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == EXIT_SNAPSHOT_UNREADABLE, proc.stderr
    assert not proc.stdout.strip(), "it must not report ready"
    assert str(path) in proc.stderr and "'w'" in proc.stderr and "corrupt" in proc.stderr
    assert path.read_bytes() == corrupt  # kept, byte for byte, for inspection


@pytest.mark.parametrize("damage", ["bit in each tensor", "checksum value", "truncated", "shape in header"])
def test_restore_verifies_every_tensor_and_the_header(tmp_path, damage):
    snap = tmp_path / "snap"
    _write_store(snap, TENSORS)
    path = snap / SNAPSHOT_FILE
    if damage == "bit in each tensor":
        for name in ("a", "w"):
            lo, _ = _data_offset(path, name)
            _write_store(snap, TENSORS)
            _flip(path, lo, bit=0)
            store = Store(1 << 30)
            try:
                with pytest.raises(tw.SnapshotError, match=f"tensor '{name}' is corrupt"):
                    restore_snapshot(store, str(snap))
            finally:
                store.close()
        return
    if damage == "checksum value":
        n, h = _header(path)
        raw = path.read_bytes()
        sums = json.loads(h["__metadata__"]["tensorwire.checksums"])
        i = raw.index(sums["a"].encode(), 8, 8 + n)
        new = b"0" if raw[i : i + 1] != b"0" else b"1"
        path.write_bytes(raw[:i] + new + raw[i + 1 :])
        match = "corrupt"
    elif damage == "truncated":
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) - 100])
        match = "cannot read snapshot"
    else:  # [64] -> [32]: the sizes no longer add up, or the manifest no longer matches
        raw = path.read_bytes()
        n, _ = _header(path)
        i = raw.index(b'"shape":[64]', 8, 8 + n)
        path.write_bytes(raw[:i] + b'"shape":[16]' + raw[i + 12 :])
        match = "snapshot"
    before = path.read_bytes()
    store = Store(1 << 30)
    try:
        with pytest.raises(tw.SnapshotError, match=match) as ei:
            restore_snapshot(store, str(snap))
        assert str(path) in str(ei.value)
    finally:
        store.close()
    assert path.read_bytes() == before


def test_an_intact_snapshot_restores_every_tensor_bit_for_bit(tmp_path):
    snap = tmp_path / "snap"
    _write_store(snap, TENSORS)
    _, h = _header(snap / SNAPSHOT_FILE)
    assert set(json.loads(h["__metadata__"]["tensorwire.checksums"])) == set(TENSORS)
    store = Store(1 << 30)
    try:
        assert restore_snapshot(store, str(snap)) == len(TENSORS)
        for name, t in TENSORS.items():
            e = store.get(name)
            got = e.slot(e.cur).raw
            assert torch.equal(got, t.reshape(-1).view(torch.uint8))
    finally:
        store.close()


def test_a_snapshot_without_checksums_from_an_older_daemon_is_restored_with_a_warning(tmp_path, caplog):
    from safetensors.torch import save_file

    snap = tmp_path / "snap"
    snap.mkdir()
    save_file({"old": torch.arange(5.0)}, str(snap / SNAPSHOT_FILE), metadata={"tensorwire.versions": '{"old": 3}'})
    store = Store(1 << 30)
    try:
        with caplog.at_level("WARNING", logger="tensorwire.serve.daemon.snapshot"):
            assert restore_snapshot(store, str(snap)) == 1
        assert "no checksums" in caplog.text and store.get("old").version == 3
    finally:
        store.close()


# -- planted files -------------------------------------------------------------------------------


def test_symlinks_planted_at_the_old_predictable_and_the_final_names_are_never_followed(tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    with in_process(snapshot_dir=str(snap)) as s, Client(s.address, transport="tcp") as c:
        # planted while the daemon runs: the temp name the writer used to pick (pid-based), and the
        # snapshot's own name
        os.symlink(victim, snap / f".{SNAPSHOT_FILE}.{os.getpid()}.tmp")
        os.symlink(victim, snap / SNAPSHOT_FILE)
        c.put("payload", torch.full((1000,), 7, dtype=torch.uint8))
        c.snapshot()
        assert victim.read_bytes() == b"precious"
    assert victim.read_bytes() == b"precious"
    final = snap / SNAPSHOT_FILE
    assert not final.is_symlink() and final.is_file()
    assert (final.stat().st_mode & 0o777) == 0o600


def test_a_symlink_planted_at_the_exact_temp_name_is_refused_not_followed(tmp_path, monkeypatch):
    import tensorwire.serve.daemon.snapshot as snapshot

    snap = tmp_path / "snap"
    _write_store(snap, {"a": torch.arange(4)})
    before = (snap / SNAPSHOT_FILE).read_bytes()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    monkeypatch.setattr(snapshot.secrets, "token_hex", lambda n: "f" * (2 * n))  # an attacker who guessed it
    planted = snap / f".{SNAPSHOT_FILE}.{os.getpid()}.{'f' * 16}.tmp"
    os.symlink(victim, planted)
    with pytest.raises(tw.SnapshotError, match="previous snapshot"):
        _write_store(snap, {"b": torch.arange(8)})
    assert victim.read_bytes() == b"precious"
    assert (snap / SNAPSHOT_FILE).read_bytes() == before
    assert planted.is_symlink()  # not ours: left alone
