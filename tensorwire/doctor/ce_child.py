"""The child of ``tensorwire doctor``'s copy-engine probe: the peer process of one pair of GPUs.

Run as ``python -m tensorwire.doctor.ce_child`` by :mod:`tensorwire.doctor.ce_probe`; it reads one JSON
request from its standard input (one line) and answers with one JSON line on its standard output::

    request: {"version": 1, "device": 1, "handle": "<128 hex digits>", "offset": 0, "nbytes": 1048576,
              "region": "/dev/shm/tensorwire-ce-...", "flag": 4104, "seq": 1, "seed": 7, "timeout": 20.0}
    answer:  {"ok": true, "detail": "..."}

What it does is what the copy-engine path does on the side that comes second: with its own device's
context current it opens the parent's IPC handle (a process cannot open its own), maps the pair's shared
host region and registers it with CUDA, queues one ``cuMemcpyAsync`` of a known pattern from its device
into the mapped buffer and then ``cuStreamWriteValue32`` of ``seq`` into the flag word, and waits (bounded)
for its stream. The parent's stream waits on that flag.

Every field of the request is checked before any CUDA call: a malformed request (a truncated or
non-hex handle, a region that is not a tensorwire copy-engine region, ...) exits with status 2 and one
line on standard error naming what is wrong. A CUDA failure (a forged handle the driver refuses, no
peer access) answers ``ok: false`` with the driver's error and exits with status 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

__all__ = ["Request", "BadRequest", "parse_request", "pattern", "main", "HANDLE_HEX", "MAX_BYTES", "VERSION"]

#: the version of the request's layout (the parent and the child come from one install)
VERSION = 1
#: hex digits of a CUDA IPC memory handle (64 bytes)
HANDLE_HEX = 128
#: the largest copy the probe asks for
MAX_BYTES = 256 << 20
_REGION_PREFIX = "tensorwire-ce-"
_FIELDS = ("version", "device", "handle", "offset", "nbytes", "region", "flag", "seq", "seed", "timeout")


class BadRequest(ValueError):
    """The request on standard input is malformed (the message says which field and why)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One checked request (see the module docstring)."""

    device: int
    handle: bytes
    offset: int
    nbytes: int
    region: str
    flag: int
    seq: int
    seed: int
    timeout: float


def _int(obj: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{key!r} must be an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise BadRequest(f"{key!r} must be in [{lo}, {hi}], got {v}")
    return v


def parse_request(line: str, *, region_size: int) -> Request:
    """The request in ``line`` (one JSON object), checked field by field; no CUDA call and no file access.

    ``region_size``: the size of a copy-engine region (the flag word must lie inside it).

    Raises:
        BadRequest: naming the first field that is missing, of the wrong type or out of range.
    """
    if not line.strip():
        raise BadRequest("no request on standard input (the parent closed it before writing one)")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the request is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request must be a JSON object, got {type(obj).__name__}")
    missing = [k for k in _FIELDS if k not in obj]
    if missing:
        raise BadRequest(f"the request lacks {', '.join(missing)}")
    extra = sorted(set(obj) - set(_FIELDS))
    if extra:
        raise BadRequest(f"the request has unknown fields: {', '.join(extra)}")
    if obj["version"] != VERSION:
        raise BadRequest(f"request version {obj['version']!r}, this child speaks {VERSION}")
    text = obj["handle"]
    if not isinstance(text, str):
        raise BadRequest(f"'handle' must be a hex string, got {type(text).__name__}")
    if len(text) != HANDLE_HEX:
        raise BadRequest(f"'handle' must be {HANDLE_HEX} hex digits (a 64-byte CUDA IPC handle), got {len(text)}")
    try:
        handle = bytes.fromhex(text)
    except ValueError:
        raise BadRequest("'handle' holds characters that are not hex digits") from None
    if not any(handle):
        raise BadRequest("'handle' is all zeros: not an exported allocation")
    region = obj["region"]
    if not isinstance(region, str) or not os.path.isabs(region):
        raise BadRequest(f"'region' must be an absolute path, got {region!r}")
    if not os.path.basename(region).startswith(_REGION_PREFIX) or "\0" in region:
        raise BadRequest(f"'region' {region!r} does not name a tensorwire copy-engine region")
    flag = _int(obj, "flag", 0, region_size - 4)
    if flag % 4:
        raise BadRequest(f"'flag' must be a multiple of 4 (a 32-bit word), got {flag}")
    timeout = obj["timeout"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 600:
        raise BadRequest(f"'timeout' must be a number of seconds in (0, 600], got {timeout!r}")
    return Request(
        device=_int(obj, "device", 0, 1023),
        handle=handle,
        offset=_int(obj, "offset", 0, 1 << 48),
        nbytes=_int(obj, "nbytes", 1, MAX_BYTES),
        region=region,
        flag=flag,
        seq=_int(obj, "seq", 1, 0xFFFFFFFF),
        seed=_int(obj, "seed", 0, 255),
        timeout=float(timeout),
    )


def pattern(nbytes: int, seed: int) -> Any:
    """The bytes the child copies (a uint8 CPU tensor): ``(k * 131 + seed) mod 256`` at byte ``k``."""
    import torch

    return ((torch.arange(nbytes, dtype=torch.int64) * 131 + seed) & 0xFF).to(torch.uint8)


def run(req: Request) -> str:
    """Open, map, copy, write the flag, wait: the detail of a success.

    Raises:
        TensorWireError: a driver call failed (its message names the call and the error), or the stream did not
            finish within the request's timeout.
    """
    import torch

    from tensorwire.errors import TensorWireError
    from tensorwire.transport.ce import CeDriver, Region
    from tensorwire.transport.ce.region import SIZE

    if not torch.cuda.is_available() or req.device >= torch.cuda.device_count():
        raise TensorWireError(f"this child sees no CUDA device {req.device}")
    src = pattern(req.nbytes, req.seed).to(f"cuda:{req.device}")
    torch.cuda.synchronize(req.device)  # (torch's copy ran on its stream; the driver's stream below is another)
    d = CeDriver.get()
    d.context(req.device)
    region = Region.attach(req.region)
    mapped = 0
    registered = False
    try:
        dev_region = d.register_host(region.addr, SIZE)
        registered = True
        mapped = d.open(req.handle)
        stream = d.new_stream()
        d.copy(stream, mapped + req.offset, src.data_ptr(), req.nbytes)
        d.write(stream, dev_region + req.flag, req.seq)
        deadline = time.monotonic() + req.timeout
        while not d.idle(stream):
            if time.monotonic() > deadline:
                raise TensorWireError(f"the child's copy and flag write did not finish in {req.timeout:.0f} s")
            time.sleep(0.0005)
    finally:
        if mapped:
            d.close(mapped)
        if registered:
            d.unregister_host(region.addr)
        region.close()
    return f"GPU {req.device} opened the handle in its own context and copied {req.nbytes} bytes, then the flag"


def main(argv: list[str] | None = None) -> int:
    """Read the request, run it, answer. Exit status: 0 done, 1 a CUDA failure, 2 a malformed request."""
    if argv:
        sys.stderr.write("tensorwire.doctor.ce_child takes no arguments: it reads its request on standard input\n")
        return 2
    from tensorwire.transport.ce.region import SIZE

    try:
        req = parse_request(sys.stdin.readline(), region_size=SIZE)
    except BadRequest as exc:
        sys.stderr.write(f"tensorwire.doctor.ce_child: bad request: {exc}\n")
        return 2
    try:
        detail = run(req)
    except Exception as exc:  # noqa: BLE001 - every failure is the answer
        sys.stdout.write(json.dumps({"ok": False, "detail": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    sys.stdout.write(json.dumps({"ok": True, "detail": detail}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
