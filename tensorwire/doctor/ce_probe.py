"""``tensorwire doctor``'s copy-engine probe: a real mapped copy and flag round trip for one pair of GPUs.

:func:`probe_pair` (``src``, ``dst``) does, between two processes, what the copy-engine path
(:mod:`tensorwire.transport.ce`) does for a message from a rank on GPU ``src`` to a rank on GPU ``dst``
(``src == dst``: two processes on one GPU):

1. peer access: GPU ``src`` must be able to map GPU ``dst``'s memory (``cuDeviceCanAccessPeer``);
2. this process (``dst``) allocates a buffer with plain ``cudaMalloc``, exports it (``cuIpcGetMemHandle``),
   makes a pair region in shared host memory and registers it with CUDA;
3. a child process (``python -m tensorwire.doctor.ce_child``: a process cannot open its own IPC handle)
   gets the handle (hex) and the region's name over its standard input, opens the handle with GPU
   ``src``'s context current, copies a known pattern into the buffer with ``cuMemcpyAsync`` and writes the
   flag with ``cuStreamWriteValue32`` into the region;
4. this process's stream waits on the flag with ``cuStreamWaitValue32``; the host polls that stream,
   bounded: past the timeout the child is killed and the flag written from the host, so the stream is
   released, as the path's watchdog does;
5. the bytes are compared with the pattern.

:func:`why_not` is the path's own answer to "can this process take it" (``capable()``): where it names a
reason, tensorwire takes UCX whatever the probe says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

__all__ = ["probe_pair", "why_not", "CHILD_MODULE", "PROBE_BYTES"]

#: the module the probe runs as its child
CHILD_MODULE = "tensorwire.doctor.ce_child"
#: bytes of the probe's copy
PROBE_BYTES = 1 << 20
_SEQ = 1


def why_not() -> str | None:
    """Why this process cannot take the copy-engine path at all (None: it can; see ``capable()``)."""
    try:
        from tensorwire.transport.ce import capable
    except Exception as exc:  # noqa: BLE001 - a missing piece is the answer
        return f"the copy-engine path cannot load ({type(exc).__name__}: {exc})"
    return capable()


def _child_env() -> dict[str, str]:
    """The child's environment: this one, with this package importable (a source tree run with PYTHONPATH)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if here not in [os.path.abspath(p or os.curdir) for p in sys.path]:
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([here, *paths])
    return env


def _answer(out: str, err: str, code: int | None) -> str:
    """The child's reason, from its JSON answer, else from the last line of its standard error."""
    for line in reversed(out.strip().splitlines()):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "detail" in obj:
            return str(obj["detail"])
    tail = (err.strip().splitlines() or ["no output"])[-1]
    return f"the child exited with status {code}: {tail}"


def probe_pair(src: int, dst: int, *, nbytes: int = PROBE_BYTES, timeout: float = 60.0) -> tuple[bool, str]:
    """Copy ``nbytes`` from a process on GPU ``src`` into a mapped buffer of this process on GPU ``dst``, flag
    round trip included (see the module docstring). Returns ``(ok, detail)``; never raises for a failed probe.

    ``timeout``: seconds for the whole pair (the child starts Python and torch, and makes a CUDA context).
    """
    if nbytes < 1:
        raise ValueError(f"nbytes must be at least 1, got {nbytes}")
    try:
        import torch

        from tensorwire.transport.ce import CeDriver

        d = CeDriver.get()
        n = torch.cuda.device_count()
        for k in (src, dst):
            if not 0 <= k < n:
                return False, f"no GPU {k} (this process sees {n})"
        if not d.can_access_peer(src, dst):
            return False, f"GPU {src} cannot map GPU {dst}'s memory (cuDeviceCanAccessPeer says no): nothing to map"
    except Exception as exc:  # noqa: BLE001 - a broken driver is a finding
        return False, f"the CUDA driver could not be asked ({type(exc).__name__}: {exc})"
    try:
        return _round_trip(d, src, dst, nbytes, timeout)
    except Exception as exc:  # noqa: BLE001 - every failure is a finding
        return False, f"{type(exc).__name__}: {exc}"


def _round_trip(d: Any, src: int, dst: int, nbytes: int, timeout: float) -> tuple[bool, str]:
    import torch

    from tensorwire.cuda import alloc_cuda
    from tensorwire.doctor.ce_child import VERSION, pattern
    from tensorwire.transport.ce import NotExportable, Region
    from tensorwire.transport.ce.region import LANDED, SIZE

    deadline = time.monotonic() + timeout
    seed = (src * 31 + dst * 7 + 1) & 0xFF
    # the memory the path exports in practice: torch's caching allocator's (else plain cudaMalloc, where legacy
    # IPC cannot export that: expandable segments, as the path stages then)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", dst))
    buf.zero_()
    torch.cuda.synchronize(dst)
    d.context(dst)
    base, _size, _id = d.allocation(buf.data_ptr())
    try:
        handle = d.export(base)
    except NotExportable:
        buf = alloc_cuda(nbytes, dst)
        buf.zero_()
        torch.cuda.synchronize(dst)
        d.context(dst)
        base, _size, _id = d.allocation(buf.data_ptr())
        handle = d.export(base)
    region = Region.create()
    registered = False
    proc: subprocess.Popen[str] | None = None
    stream = 0
    try:
        dev_region = d.register_host(region.addr, SIZE)
        registered = True
        flag = region.entry(region.channel(0), _SEQ) + LANDED
        stream = d.new_stream()
        d.wait(stream, dev_region + flag, _SEQ)  # (the GPU waits for the child's flag; the host polls the stream)
        request = {
            "version": VERSION,
            "device": src,
            "handle": handle.hex(),
            "offset": buf.data_ptr() - base,
            "nbytes": nbytes,
            "region": region.path,
            "flag": flag,
            "seq": _SEQ,
            "seed": seed,
            "timeout": max(1.0, timeout / 2),
        }
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", CHILD_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.close()
        proc.stdin = None  # (communicate() below must not touch it again)
        while not d.idle(stream):
            if time.monotonic() > deadline or proc.poll() not in (None, 0):
                break
            time.sleep(0.001)
        arrived = d.idle(stream)
        waited = time.monotonic() - t0
        if not arrived:
            # release the stream as the path's watchdog does: the flag written from the host
            proc.kill()
            region.release(region.entry(region.channel(0), _SEQ), LANDED, _SEQ)
            out, err = proc.communicate(timeout=10)
            why = (
                f"the flag did not reach GPU {dst}'s stream within {timeout:.0f} s"
                if proc.returncode in (None, -9)
                else _answer(out, err, proc.returncode)
            )
            return False, why
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            return False, _answer(out, err, proc.returncode)
        # the stream passed the flag, which the child wrote after its copy (a write with a memory barrier)
        got, want = buf.cpu(), pattern(nbytes, seed)
        if not torch.equal(got, want):
            wrong = int((got != want).sum())
            return False, f"the flag arrived but {wrong} of {nbytes} bytes differ from what GPU {src} copied"
        where = "two processes on one GPU" if src == dst else f"GPU {src} into GPU {dst}'s memory"
        return True, (
            f"mapped copy of {nbytes >> 10} KiB ({where}, handle opened in the copier's own context) and flag "
            f"round trip: bytes equal, {waited:.1f} s with the child's start-up; per-message driver calls "
            f"through {d.bindings}"
        )
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, OSError, ValueError):
                pass
        if stream:
            _drain(d, region, stream)
        if registered:
            d.unregister_host(region.addr)
        region.close()
        del buf


def _drain(d: Any, region: Any, stream: int) -> None:
    """Let ``stream`` finish (its flag written from the host if need be) before the region goes away."""
    from tensorwire.transport.ce.region import LANDED

    if d.idle(stream):
        return
    region.release(region.entry(region.channel(0), _SEQ), LANDED, _SEQ)
    end = time.monotonic() + 10
    while not d.idle(stream) and time.monotonic() < end:
        time.sleep(0.001)
