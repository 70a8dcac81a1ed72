"""The copy-engine path's set-up probe (tensorwire.transport.ce.probe) against the stream simulator, on CPU.

Both sides of a pair run :func:`probe_pair` at once (two threads, as two ranks do at group creation) over an
in-process store; the probe keeps the pair only where both sides got the other's bytes, and a failure on either
side -- wrong bytes, copies that never land, an error before anything was queued -- drops it on both, with the
reason, within the probe's time, and leaves no simulated stream waiting on a flag.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tensorwire.errors import PeerLostError
from tensorwire.transport.ce import CePair, Region, probe_pair

from ce_sim import SimDriver

pytestmark = pytest.mark.timeout(60)


def _mismatch(mine: tuple[int, ...], theirs: tuple[int, ...], sending: bool) -> str | None:
    return None if mine == theirs else f"signatures differ: {mine} vs {theirs}"


class CorruptingDriver(SimDriver):
    """Copies that deliver their bytes with one of them flipped (a mapping that reaches the wrong memory)."""

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        super().copy(stream, dst, src, nbytes)

        def flip() -> None:
            import ctypes

            b = ctypes.c_uint8.from_address(dst + nbytes // 2)
            b.value ^= 0xFF

        self.streams[stream].put(flip)


class LosingDriver(SimDriver):
    """Stream flag writes that never take effect (a driver whose stream memory operations do nothing)."""

    def write(self, stream: int, addr: int, value: int) -> None:
        pass


def _run_both(tmp: str, sim: SimDriver, *, timeout: float = 5.0, fail_alloc: int | None = None) -> dict[str, Any]:
    ra = Region.create(tmp)
    rb = Region.attach(ra.path)
    kw: dict[str, Any] = {"timeout": 10.0, "driver": sim, "mismatch": _mismatch}
    pairs = [CePair(ra, rank=0, peer=1, **kw), CePair(rb, rank=1, peer=0, **kw)]
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout + 5))
    out: dict[str, Any] = {"pairs": pairs, "sim": sim}

    def side(i: int) -> None:
        stream = sim.new_stream()

        def alloc(n: int) -> torch.Tensor:
            if fail_alloc == i:
                raise RuntimeError("CUDA error: out of memory (simulated)")
            return sim.alloc(n)

        t0 = time.monotonic()
        out[f"why{i}"] = probe_pair(
            pairs[i],
            store,
            "probe/0-1",
            device=0,
            stream=stream,
            alloc=alloc,
            idle=lambda: sim.streams[stream].ran >= sim.streams[stream].queued,
            timeout=timeout,
            torch=torch,
        )
        out[f"took{i}"] = time.monotonic() - t0

    threads = [threading.Thread(target=side, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 20)
    assert not any(t.is_alive() for t in threads), "a side of the probe never returned"
    return out


def _close(out: dict[str, Any], *, at_once: bool = False) -> None:
    """Close both sides (``at_once``: before the streams ran dry, as a caller does right after a failed probe --
    the pair must keep its memory mapped while a stream still holds work naming it) and check every stream."""
    if at_once:
        for p in out["pairs"]:
            p.close(PeerLostError("test over"))
    for s in out["sim"].streams.values():
        assert s.drain(), "a simulated stream never finished its work"
        assert not s.hung, "a simulated stream waited on a flag that never came"
    if not at_once:
        for p in out["pairs"]:
            p.close(PeerLostError("test over"))
    out["sim"].stop()


def test_a_working_pair_passes_on_both_sides_and_stays_usable(tmp_path):
    out = _run_both(str(tmp_path), SimDriver())
    try:
        assert out["why0"] is None and out["why1"] is None
        a, b = out["pairs"]
        assert a.error is None and b.error is None
        assert out["sim"].copies == 2  # one message each way, copied by whichever side came second
    finally:
        _close(out)


def test_wrong_bytes_drop_the_pair_on_both_sides_naming_why(tmp_path):
    out = _run_both(str(tmp_path), CorruptingDriver())
    try:
        for i in (0, 1):
            assert out[f"why{i}"] is not None
            assert "differ from what the peer sent" in out[f"why{i}"]
    finally:
        _close(out)


def test_copies_that_never_land_fail_within_the_probe_time_and_release_the_streams(tmp_path):
    out = _run_both(str(tmp_path), LosingDriver(), timeout=0.5)
    try:
        whys = [out["why0"], out["why1"]]
        assert None not in whys  # (the side that waited out the time says so; the other sees its messages fail)
        assert any("did not complete in time" in w for w in whys), whys
        assert out["took0"] < 5.0 and out["took1"] < 5.0
        assert any(p.error is not None for p in out["pairs"])  # failed: every stream waiting on it released
    finally:
        _close(out)


def test_an_error_on_one_side_ends_the_other_sides_wait_early_with_its_reason(tmp_path):
    out = _run_both(str(tmp_path), SimDriver(), timeout=8.0, fail_alloc=0)
    try:
        assert out["why0"] is not None and "out of memory" in out["why0"]
        assert out["why1"] is not None and out["why1"].startswith("rank 0:") and "out of memory" in out["why1"]
        assert out["took1"] < 4.0  # (not the whole 8 s: the peer's word on the store ended the wait)
    finally:
        _close(out, at_once=True)
