"""Which bindings make the copy-engine path's per-message driver calls (TENSORWIRE_CE_BINDINGS), on CPU.

The choice (:func:`pick_bindings`) and the driver's calls through cuda-python's bindings are checked against a
stand-in module that records what it is asked; the GPU suite runs both kinds of call on real devices
(tests/distributed/test_copyengine_gpu.py).
"""

from __future__ import annotations

import types

import pytest

from tensorwire.errors import ConfigError
from tensorwire.settings import setting
from tensorwire.transport.ce.driver import BindingsCalls, DriverError, pick_bindings

pytestmark = pytest.mark.timeout(60)


class _Result(int):
    """A CUresult stand-in: an int that compares as one (as the real enum's members do)."""


class _Handle:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Handle) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def _fake_bindings(version: str = "13.0.2", fail: set[str] | None = None) -> types.SimpleNamespace:
    calls: list[tuple] = []
    fail = fail or set()
    ok, bad = _Result(0), _Result(1)

    def call(name: str):
        def fn(*args):
            calls.append((name, *args))
            return (bad if name in fail else ok,)

        return fn

    mod = types.SimpleNamespace(
        __version__=version,
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=ok),
        CUstream=lambda v: _Handle(v),
        CUevent=lambda v: _Handle(v),
        calls=calls,
    )
    for name in ("cuMemcpyAsync", "cuStreamWriteValue32", "cuStreamWaitValue32", "cuEventRecord", "cuStreamWaitEvent"):
        setattr(mod, name, call(name))
    return mod


def _missing():
    raise ImportError("No module named 'cuda'")


def test_ctypes_when_asked_for_even_where_the_bindings_are_installed():
    mod, why = pick_bindings("ctypes", lambda: _fake_bindings(), 13)
    assert mod is None
    assert "TENSORWIRE_CE_BINDINGS=ctypes" in why


def test_auto_takes_the_bindings_of_the_drivers_major_or_an_older_one():
    fake = _fake_bindings("13.0.2")
    mod, why = pick_bindings("auto", lambda: fake, 13)
    assert mod is fake and "13.0.2" in why
    older = _fake_bindings("12.9.1")
    assert pick_bindings("auto", lambda: older, 13)[0] is older


@pytest.mark.parametrize(
    ("load", "major", "said"),
    [
        (_missing, 13, "not installed"),
        (lambda: _fake_bindings("13.1.0"), 12, "newer than the driver's CUDA 12"),
        (lambda: _fake_bindings("nightly"), 13, "unknown version"),
    ],
)
def test_auto_falls_back_to_ctypes_and_says_why_while_asking_for_them_fails(load, major, said):
    mod, why = pick_bindings("auto", load, major)
    assert mod is None
    assert why.startswith("ctypes: ") and said in why
    with pytest.raises(DriverError, match="TENSORWIRE_CE_BINDINGS=cuda-python, but") as err:
        pick_bindings("cuda-python", load, major)
    assert said in str(err.value)


def test_the_setting_refuses_a_choice_it_does_not_know(monkeypatch):
    monkeypatch.setenv("TENSORWIRE_CE_BINDINGS", "cython")
    with pytest.raises(ConfigError, match="TENSORWIRE_CE_BINDINGS"):
        setting("ce_bindings")
    monkeypatch.setenv("TENSORWIRE_CE_BINDINGS", "cuda-python")
    assert setting("ce_bindings") == "cuda-python"


def _text(code: int) -> str:
    return f"CUDA driver error {code}"


def test_the_per_message_calls_go_through_the_bindings_with_their_arguments():
    fake = _fake_bindings()
    calls = BindingsCalls(fake, _text)
    calls.copy(7, 0x1000, 0x2000, 4096)
    calls.write(7, 0x3000, (1 << 32) + 5)  # (a sequence number past 32 bits: its low word, as the flag holds)
    calls.wait(0, 0x3000, 6)
    calls.order(8, 7, 99)
    assert fake.calls == [
        ("cuMemcpyAsync", 0x1000, 0x2000, 4096, _Handle(7)),
        ("cuStreamWriteValue32", _Handle(7), 0x3000, 5, 0),
        ("cuStreamWaitValue32", _Handle(0), 0x3000, 6, 0),
        ("cuEventRecord", _Handle(99), _Handle(7)),
        ("cuStreamWaitEvent", _Handle(8), _Handle(99), 0),
    ]
    assert calls.stream(7) is calls.stream(7)  # one wrapper per stream, made once


def test_a_failed_call_through_the_bindings_raises_naming_the_call():
    calls = BindingsCalls(_fake_bindings(fail={"cuStreamWaitValue32"}), _text)
    calls.write(1, 0x10, 1)
    with pytest.raises(DriverError, match=r"cuStreamWaitValue32: CUDA driver error 1"):
        calls.wait(1, 0x10, 1)
