"""Lookups of a message's path that are made once, not per call.

- The group answers ``rank()`` and ``size()`` in Python (``dist.send`` asks ``rank()`` every time; torch's own
  goes through pybind11's check for a Python override, ~1.3 us on the 2-core VM).
- :func:`tensorwire.cuda.current_raw_stream` looks torch's stream function up once (it runs twice per CUDA
  message of the backend).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import tensorwire  # noqa: E402,F401  (registers the backend)
import tensorwire.cuda as twcuda  # noqa: E402
from tensorwire.distributed.process_group import ProcessGroupTensorwire  # noqa: E402


@pytest.mark.timeout(60)
def test_the_group_answers_rank_and_size_in_python_with_torchs_values(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_HOST", "127.0.0.1")
    dist.init_process_group("tensorwire", store=dist.HashStore(), rank=0, world_size=1)
    try:
        pg = dist.distributed_c10d._get_default_group()
        assert isinstance(pg, ProcessGroupTensorwire)
        # defined on the class itself (not torch's pybind11 methods) ...
        assert "rank" in ProcessGroupTensorwire.__dict__ and "size" in ProcessGroupTensorwire.__dict__
        # ... and saying what torch's say
        assert (pg.rank(), pg.size()) == (0, 1)
        assert (dist.ProcessGroup.rank(pg), dist.ProcessGroup.size(pg)) == (0, 1)
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        # torch's own check before a send reads it (a send to this rank itself is refused by it)
        with pytest.raises(ValueError, match="should not be the same"):
            dist.send(torch.ones(1), 0)
    finally:
        dist.destroy_process_group()


def test_current_raw_stream_looks_torchs_function_up_once(monkeypatch):
    seen: list[int] = []

    def first(device: int) -> int:
        seen.append(device)
        return 0x1000 + device

    monkeypatch.setattr(twcuda, "_RAW_STREAM", [None])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", first, raising=False)
    assert twcuda.current_raw_stream(0) == 0x1000
    assert twcuda.current_raw_stream(3) == 0x1003
    # replaced in torch afterwards: the function looked up at the first call is the one still called
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: -1)
    assert twcuda.current_raw_stream(1) == 0x1001
    assert seen == [0, 3, 1]


def test_current_raw_stream_without_torchs_function_asks_the_current_stream(monkeypatch):
    class Stream:
        cuda_stream = 0xBEEF

    monkeypatch.setattr(twcuda, "_RAW_STREAM", [None])
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: Stream())
    assert twcuda.current_raw_stream(0) == 0xBEEF
