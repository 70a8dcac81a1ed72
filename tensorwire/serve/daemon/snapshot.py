"""Snapshots of the store in the safetensors format: atomic, checksummed, verified.

What a snapshot promises (docs/durability.md says it for operators):

- **Atomic.** The file is written under a fresh random name in the snapshot
  directory, opened with ``O_CREAT|O_EXCL|O_NOFOLLOW`` (a planted file or
  symlink of that name is refused, never followed), fsync'ed, read back
  (header and tensor list, through the same reader a restore uses), renamed
  over ``store.safetensors`` and the directory fsync'ed. Every step is done
  relative to one open descriptor of the directory. A crash or a failure at
  any point leaves the previous snapshot whole; a failure is raised
  (:class:`~tensorwire.errors.SnapshotError`), never logged and swallowed.
- **Checksummed.** The metadata holds a CRC-32 of every tensor's bytes
  (``tensorwire.checksums``) and one of the header's tensor list
  (``tensorwire.manifest``). Restoring verifies both before the daemon serves
  anything; a mismatch refuses to start, names the file and the tensor, and
  leaves the file where it is. CRC-32 (zlib, in the standard library) was
  measured at ~4 GB/s on the 2-core VM against ~0.8 GB/s for BLAKE2b: it
  detects every burst of up to 32 flipped bits, which is what storage
  corruption looks like; it is not a defence against someone who can write
  the snapshot directory (they could rewrite the checksums too).
- **No reserved names.** safetensors reserves the key ``__metadata__``; the
  store refuses that name at put time (:func:`check_storable_name`) and the
  writer refuses to write it, so a legal put can never make a snapshot that
  does not read back.

Writing streams each tensor straight from its slot (no copy of the store in
memory): the header first with the checksums as fixed-width placeholders,
then the bytes, each chunk checksummed as it is written, then the header is
rewritten in place with the real checksums (same length).

Reading uses the ``safetensors`` library (it validates the header; no pickle).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import stat
import struct
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from tensorwire.errors import (
    ConfigError,
    NotFoundError,
    ResourceExhaustedError,
    SnapshotError,
    SpecError,
    TransferTimeout,
)
from tensorwire.spec import TensorSpec
from tensorwire.serve.protocol.layout import ShardLayout

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.daemon.store import Store

__all__ = [
    "SNAPSHOT_FILE",
    "RESERVED_NAMES",
    "check_storable_name",
    "write_safetensors",
    "write_snapshot",
    "restore_snapshot",
    "read_safetensors_specs",
    "SnapshotResult",
    "ST_DTYPES",
]

log = logging.getLogger(__name__)

SNAPSHOT_FILE = "store.safetensors"
_VERSIONS_KEY = "tensorwire.versions"
_CHECKSUMS_KEY = "tensorwire.checksums"
_MANIFEST_KEY = "tensorwire.manifest"
_ALGO_KEY = "tensorwire.checksum"
_ALGO = "crc32"
#: Keys the safetensors format gives a meaning of its own: no tensor may be called so.
RESERVED_NAMES = frozenset({"__metadata__"})
#: Metadata key of the shard layouts (JSON: name -> ShardLayout.to_json form), for the sharded tensors only.
_LAYOUTS_KEY = "tensorwire.layouts"

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
#: Write (and checksum) in pieces of this size: each piece is checksummed while it is still in cache.
_CHUNK = 4 << 20
_PLACEHOLDER = "0" * 8


def check_storable_name(name: str) -> str:
    """``name`` unless the snapshot format reserves it.

    Raises:
        SpecError: ``name`` is a key safetensors gives a meaning of its own (``__metadata__``).
    """
    if name in RESERVED_NAMES:
        raise SpecError(f"tensor name {name!r} is reserved by the snapshot format (safetensors); choose another name")
    return name


@dataclass(frozen=True)
class SnapshotResult:
    path: str
    tensors: int
    nbytes: int
    seconds: float


def _crc_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def _manifest(header: dict[str, Any]) -> str:
    """CRC-32 of the tensor list (names, dtypes, shapes, offsets) and the versions, in a canonical form."""
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    meta = header.get("__metadata__") or {}
    canon = json.dumps(
        [tensors, meta.get(_VERSIONS_KEY, ""), meta.get(_CHECKSUMS_KEY, "")], sort_keys=True, separators=(",", ":")
    )
    return _crc_hex(zlib.crc32(canon.encode("utf-8")))


def _header_bytes(header: dict[str, Any]) -> bytes:
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return hbytes + b" " * ((-len(hbytes)) % 8)


def _write_all(fd: int, data: "memoryview | bytes", offset: int | None = None) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        if n <= 0:  # pragma: no cover - write(2) reports errors as exceptions
            raise OSError(errno.EIO, "short write")
        view = view[n:]
        if offset is not None:
            offset += n


def _open_dir(directory: str) -> int:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(directory, flags)


def _warn_if_shared(directory: str, dfd: int) -> None:
    try:
        st = os.fstat(dfd)
    except OSError:  # pragma: no cover
        return
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        log.warning(
            "snapshot dir %s is writable by group/others without the sticky bit: anyone who can write it "
            "can replace the snapshot; chmod 700 it",
            directory,
        )


def write_safetensors(
    path: str,
    items: Iterable[tuple[TensorSpec, "torch.Tensor"]],
    metadata: dict[str, str] | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write ``(spec, flat uint8 bytes)`` pairs as a safetensors file at ``path`` atomically.

    ``items`` is listed first: the specs are needed for the header before any
    byte is written. The file carries a CRC-32 of each tensor and of its tensor
    list (see the module docstring) and is read back before it replaces
    ``path``. Returns bytes of data.

    Raises:
        SpecError: a name the format reserves, a name twice, or a dtype it cannot hold; nothing written.
        SnapshotError: writing, syncing, reading back or renaming failed; ``path`` is unchanged.
    """
    items = list(items)
    header: dict[str, Any] = {}
    off = 0
    for spec, _ in items:
        check_storable_name(spec.name)
        if spec.name in header:
            raise SpecError(f"tensor {spec.name!r} listed twice")
        if spec.dtype not in ST_DTYPES:
            raise SpecError(f"{spec.name}: dtype {spec.dtype} cannot be written to safetensors")
        header[spec.name] = {
            "dtype": ST_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [off, off + spec.nbytes],
        }
        off += spec.nbytes
    meta = {"format": "pt"}
    meta.update(metadata or {})
    for key in (_ALGO_KEY, _CHECKSUMS_KEY, _MANIFEST_KEY):
        meta.pop(key, None)
    names = [spec.name for spec, _ in items]
    meta[_ALGO_KEY] = _ALGO
    meta[_CHECKSUMS_KEY] = json.dumps({n: _PLACEHOLDER for n in names}, separators=(",", ":"))
    meta[_MANIFEST_KEY] = _PLACEHOLDER
    header["__metadata__"] = meta
    draft = _header_bytes(header)

    directory = os.path.dirname(os.path.abspath(path))
    final = os.path.basename(path)
    try:
        dfd = _open_dir(directory)
    except OSError as exc:
        raise SnapshotError(f"cannot open the directory of {path}: {exc}") from exc
    # A fresh random name, created exclusively and never through a symlink: a file or link planted
    # in the directory under any name we might pick is refused, never followed or truncated.
    tmp = f".{final}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    fd = -1
    try:
        _warn_if_shared(directory, dfd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
        except OSError:
            tmp = ""  # not ours (planted, or a clash): leave it alone
            raise
        _write_all(fd, struct.pack("<Q", len(draft)))
        _write_all(fd, draft)
        crcs: dict[str, str] = {}
        done = 0
        for spec, raw in items:
            view = memoryview(raw.numpy()).cast("B") if spec.nbytes else memoryview(b"")
            if len(view) != spec.nbytes:
                raise SpecError(f"{spec.name}: {len(view)} bytes to write, its spec says {spec.nbytes}")
            crc = 0
            for i in range(0, len(view), _CHUNK):
                piece = view[i : i + _CHUNK]
                crc = zlib.crc32(piece, crc)
                _write_all(fd, piece)
                done += len(piece)
                if progress is not None:
                    progress(done)
            crcs[spec.name] = _crc_hex(crc)
        meta[_CHECKSUMS_KEY] = json.dumps({n: crcs[n] for n in names}, separators=(",", ":"))
        meta[_MANIFEST_KEY] = _manifest(header)
        hbytes = _header_bytes(header)
        if len(hbytes) != len(draft):  # pragma: no cover - fixed-width placeholders
            raise SnapshotError("internal error: the header changed length")
        _write_all(fd, hbytes, offset=8)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        _verify_written(os.path.join(directory, tmp), header, 8 + len(hbytes) + off)
        os.replace(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)
        tmp = ""
        os.fsync(dfd)
    except OSError as exc:
        raise SnapshotError(f"writing {path} failed: {exc}; the previous snapshot (if any) is unchanged") from exc
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
        os.close(dfd)
    return off


def _verify_written(path: str, header: dict[str, Any], size: int) -> None:
    """Read the file just written back through the reader a restore uses: same tensors, same metadata, same size."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            raise SnapshotError(f"{path}: {st.st_size} bytes on disk, {size} were written")
        specs, meta = read_safetensors_specs(path)
    except SnapshotError:
        raise
    except Exception as exc:
        raise SnapshotError(f"the snapshot just written does not read back ({path}): {exc}") from exc
    want = {k: v for k, v in header.items() if k != "__metadata__"}
    got = {s.name: {"dtype": ST_DTYPES[s.dtype], "shape": list(s.shape)} for s, _ in specs}
    if (
        got != {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in want.items()}
        or meta != header["__metadata__"]
    ):
        raise SnapshotError(f"the snapshot just written reads back differently ({path})")


def write_snapshot(store: "Store", directory: str, *, timeout: float = 600.0) -> SnapshotResult:
    """Snapshot every readable tensor of ``store`` (each one whole) into ``directory``.

    Every tensor's current slot is pinned for the duration of the write (the
    header lists them all before any byte is written): puts keep going into
    staging slots meanwhile; row updates wait for the snapshot. Tensors deleted
    meanwhile or never written are left out; one that cannot be pinned within
    ``timeout`` fails the snapshot (a snapshot never silently leaves a tensor out).

    Raises:
        SnapshotError: nothing was replaced; the previous snapshot (if any) is whole.
        SpecError: a tensor the format cannot hold (never the case for tensors the store accepted).
    """
    t0 = time.monotonic()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise SnapshotError(f"cannot create the snapshot dir {directory}: {exc}") from exc
    path = os.path.join(directory, SNAPSHOT_FILE)
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        items: list[tuple[TensorSpec, "torch.Tensor"]] = []
        versions = {}
        layouts = {}
        for e in store.entries():
            try:
                idx, version = e.acquire_read(deadline)
            except NotFoundError:  # deleted or never written meanwhile
                continue
            except TransferTimeout as exc:
                raise SnapshotError(
                    f"snapshot to {path} failed: {exc}; the previous snapshot (if any) is unchanged"
                ) from exc
            stack.callback(e.release_read, idx)
            items.append((e.spec, e.slot(idx).raw))
            versions[e.spec.name] = version
            if e.layout is not None:
                layouts[e.spec.name] = json.loads(e.layout.to_json())
        meta = {_VERSIONS_KEY: json.dumps(versions)}
        if layouts:
            meta[_LAYOUTS_KEY] = json.dumps(layouts, separators=(",", ":"))
        nbytes = write_safetensors(path, items, meta)
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


def _read_header(path: str) -> dict[str, Any]:
    """The JSON header of a safetensors file, as written (the reader above validated it already)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _expected_checksums(path: str, meta: dict[str, str], keys: list[str]) -> dict[str, str] | None:
    """The per-tensor checksums the file promises (None: a snapshot of an older tensorwire, without them).

    Raises:
        SnapshotError: the checksum metadata or the tensor list does not match what was written.
    """
    if _CHECKSUMS_KEY not in meta and _MANIFEST_KEY not in meta and _ALGO_KEY not in meta:
        return None
    if meta.get(_ALGO_KEY) != _ALGO:
        raise SnapshotError(
            f"snapshot {path}: unknown checksum algorithm {meta.get(_ALGO_KEY)!r}; the file is kept for inspection"
        )
    try:
        sums = json.loads(meta.get(_CHECKSUMS_KEY, ""))
        header = _read_header(path)
    except (ValueError, OSError, struct.error) as exc:
        raise SnapshotError(
            f"snapshot {path}: its checksums cannot be read ({exc}); the file is kept for inspection"
        ) from exc
    if not isinstance(sums, dict) or set(sums) != set(keys):
        raise SnapshotError(
            f"snapshot {path}: the checksums do not list exactly its tensors (corrupt header); "
            "the file is kept for inspection"
        )
    if meta.get(_MANIFEST_KEY) != _manifest(header):
        raise SnapshotError(
            f"snapshot {path}: its tensor list does not match its checksum (corrupt header); "
            "the file is kept for inspection"
        )
    return {k: str(v) for k, v in sums.items()}


def restore_snapshot(store: "Store", directory: str) -> int:
    """Load ``directory/store.safetensors`` into an empty store, verifying every checksum. Returns tensors restored.

    Raises:
        SnapshotError: the file is unreadable, or a checksum does not match (the message names the file and
            the tensor); the file is left as it is, for inspection.
        ConfigError: the snapshot does not fit ``max_bytes``.
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
        raw_layouts = json.loads(meta.get(_LAYOUTS_KEY, "{}"))
        if not isinstance(raw_layouts, dict):
            raise SpecError(f"{_LAYOUTS_KEY} is not a JSON object")
        # a shard restored without its layout would be served as a whole tensor: a bad entry fails the restore
        layouts = {k: ShardLayout.from_json(v) for k, v in raw_layouts.items()}
    except Exception as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}; the file is kept for inspection") from exc
    sums = _expected_checksums(path, meta, [k for _, k in specs])
    if sums is None:
        log.warning(
            "snapshot %s has no checksums (written by an older tensorwire): restored unverified; the next "
            "snapshot will carry them",
            path,
        )
    for spec, _ in specs:
        check_storable_name(spec.name)
    need = sum(2 * s.nbytes for s, _ in specs)
    if need > store.max_bytes - store.reserved:
        raise ConfigError(f"snapshot {path} needs {need} bytes (double-buffered), above --max-bytes {store.max_bytes}")
    import torch

    with safe_open(path, framework="pt") as f:
        for spec, key in specs:
            t = f.get_tensor(key)
            flat = t.contiguous().reshape(-1).view(torch.uint8)
            if sums is not None:
                got = _crc_hex(zlib.crc32(memoryview(flat.numpy())) if flat.numel() else 0)
                if got != sums[key]:
                    raise SnapshotError(
                        f"snapshot {path}: tensor {key!r} is corrupt (its {_ALGO} is {got}, the snapshot recorded "
                        f"{sums[key]}). The file is kept for inspection: move it away to start "
                        "empty, or restore a backup"
                    )

            def fill(raw: "torch.Tensor", flat: "torch.Tensor" = flat) -> None:
                if raw.numel():
                    raw.copy_(flat)

            try:
                v = int(versions.get(key, 1))
            except (TypeError, ValueError):
                v = 1
            try:
                store.restore(spec, v, fill, layout=layouts.get(key))
            except (ResourceExhaustedError, SpecError) as exc:  # over max_bytes: checked above; a layout that
                raise ConfigError(f"cannot restore {path}: {exc}") from exc  # does not fit its tensor
    log.info(
        "snapshot: restored %d tensors from %s in %.2fs%s",
        len(specs),
        path,
        time.monotonic() - t0,
        " (checksums verified)" if sums is not None else "",
    )
    return len(specs)
