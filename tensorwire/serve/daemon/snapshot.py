"""Snapshots of the store in the safetensors format, written atomically.

Writing streams each tensor straight from its slot (no copy of the store in
memory): the header first (JSON: dtype, shape, data offsets; metadata holds
the versions), then the bytes. The file is written to a temporary name in the
same directory, fsync'ed, renamed over ``store.safetensors`` and the directory
fsync'ed, so a crash at any point leaves the previous snapshot intact.

Reading uses the ``safetensors`` library (it validates the header; no pickle).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from tensorwire.errors import ConfigError, ResourceExhaustedError, SpecError
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.daemon.store import Store

__all__ = ["SNAPSHOT_FILE", "write_safetensors", "write_snapshot", "restore_snapshot", "SnapshotResult", "ST_DTYPES"]

log = logging.getLogger(__name__)

SNAPSHOT_FILE = "store.safetensors"
_VERSIONS_KEY = "tensorwire.versions"

ST_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "uint8": "U8",
    "bool": "BOOL",
}
_FROM_ST = {v: k for k, v in ST_DTYPES.items()}
_CHUNK = 64 << 20


@dataclass(frozen=True)
class SnapshotResult:
    path: str
    tensors: int
    nbytes: int
    seconds: float


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(
    path: str,
    items: Iterable[tuple[TensorSpec, "torch.Tensor"]],
    metadata: dict[str, str] | None = None,
    *,
    progress=None,
) -> int:
    """Write ``(spec, flat uint8 bytes)`` pairs as a safetensors file at ``path`` atomically.

    ``items`` is consumed twice conceptually: the specs are needed for the
    header before any byte is written, so pass a list (or see
    :func:`write_snapshot`, which streams from the store). Returns bytes of data.
    """
    items = list(items)
    header: dict[str, object] = {}
    off = 0
    for spec, _ in items:
        header[spec.name] = {"dtype": ST_DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": [off, off + spec.nbytes]}
        off += spec.nbytes
    meta = {"format": "pt"}
    meta.update(metadata or {})
    header["__metadata__"] = meta
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((-len(hbytes)) % 8)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    done = 0
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hbytes)))
            f.write(hbytes)
            for spec, raw in items:
                view = memoryview(raw.numpy()) if spec.nbytes else memoryview(b"")
                for i in range(0, len(view), _CHUNK):
                    f.write(view[i : i + _CHUNK])
                    done += min(_CHUNK, len(view) - i)
                    if progress is not None:
                        progress(done)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return off


def write_snapshot(store: "Store", directory: str, *, timeout: float = 600.0) -> SnapshotResult:
    """Snapshot every readable tensor of ``store`` (each one whole) into ``directory``.

    Every tensor's current slot is pinned for the duration of the write (the
    header lists them all before any byte is written): puts keep going into
    staging slots meanwhile; row updates wait for the snapshot.
    """
    t0 = time.monotonic()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SNAPSHOT_FILE)
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        items: list[tuple[TensorSpec, "torch.Tensor"]] = []
        versions = {}
        for e in store.entries():
            try:
                idx, version = e.acquire_read(deadline)
            except Exception:  # noqa: BLE001 - deleted or never written meanwhile
                continue
            stack.callback(e.release_read, idx)
            items.append((e.spec, e.slot(idx).raw))
            versions[e.spec.name] = version
        nbytes = write_safetensors(path, items, {_VERSIONS_KEY: json.dumps(versions)})
    dt = time.monotonic() - t0
    log.info("snapshot: %d tensors, %d bytes -> %s in %.2fs", len(items), nbytes, path, dt)
    return SnapshotResult(path, len(items), nbytes, dt)


def read_safetensors_specs(path: str) -> tuple[list[tuple[TensorSpec, str]], dict[str, str]]:
    """Validated (spec, key) list and metadata of a safetensors file (no data read)."""
    from safetensors import safe_open

    out = []
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        for key in f.keys():
            sl = f.get_slice(key)
            dtype = sl.get_dtype()
            if dtype not in _FROM_ST:
                raise SpecError(f"{path}: tensor {key!r} has unsupported dtype {dtype}")
            out.append((TensorSpec(key, tuple(sl.get_shape()), _FROM_ST[dtype]), key))
    return out, meta


def restore_snapshot(store: "Store", directory: str) -> int:
    """Load ``directory/store.safetensors`` into an empty store. Returns tensors restored.

    Raises:
        ConfigError: the file is unreadable/corrupt or does not fit ``max_bytes``.
    """
    from safetensors import safe_open

    path = os.path.join(directory, SNAPSHOT_FILE)
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith(f".{SNAPSHOT_FILE}.") and name.endswith(".tmp"):
            log.warning("snapshot: removing %s left by an interrupted snapshot", name)
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
    if not os.path.exists(path):
        return 0
    t0 = time.monotonic()
    try:
        specs, meta = read_safetensors_specs(path)
        versions = json.loads(meta.get(_VERSIONS_KEY, "{}"))
        if not isinstance(versions, dict):
            versions = {}
    except Exception as exc:
        raise ConfigError(f"cannot read snapshot {path}: {exc}") from exc
    need = sum(2 * s.nbytes for s, _ in specs)
    if need > store.max_bytes - store.reserved:
        raise ConfigError(f"snapshot {path} needs {need} bytes (double-buffered), above --max-bytes {store.max_bytes}")
    import torch

    with safe_open(path, framework="pt") as f:
        for spec, key in specs:
            t = f.get_tensor(key)

            def fill(raw: "torch.Tensor", t: "torch.Tensor" = t) -> None:
                if raw.numel():
                    raw.copy_(t.contiguous().reshape(-1).view(torch.uint8))

            try:
                v = int(versions.get(key, 1))
            except (TypeError, ValueError):
                v = 1
            try:
                store.restore(spec, v, fill)
            except ResourceExhaustedError as exc:  # pragma: no cover - checked above
                raise ConfigError(str(exc)) from exc
    log.info("snapshot: restored %d tensors from %s in %.2fs", len(specs), path, time.monotonic() - t0)
    return len(specs)
