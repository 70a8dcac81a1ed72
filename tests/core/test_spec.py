"""TensorSpec: validation, immutability, protobuf round trip, negotiation checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tensorwire as tw
from tensorwire._proto import spec_from_proto, spec_to_proto
from tensorwire.spec import DTYPES, MAX_RANK, check_same_specs

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_allowlisted_dtype_round_trips_through_protobuf(dtype):
    spec = tw.TensorSpec("w", (2, 3), dtype, "cpu")
    back = spec_from_proto(spec_to_proto(spec))
    assert back == spec
    assert back.torch_dtype == getattr(torch, dtype)
    assert spec.nbytes == 6 * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def test_spec_is_immutable_and_hashable():
    spec = tw.TensorSpec("a", [4], torch.float16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "b"  # type: ignore[misc]
    assert {spec: 1}[tw.TensorSpec("a", (4,), "float16")] == 1
    assert spec.shape == (4,) and spec.dtype == "float16"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "", "shape": (1,)}, "1..256"),
        ({"name": "x" * 257, "shape": (1,)}, "1..256"),
        ({"name": "bad\nname", "shape": (1,)}, "non-printable"),
        ({"name": 5, "shape": (1,)}, "must be a str"),
        ({"name": "x", "shape": (1,) * (MAX_RANK + 1)}, "rank 9"),
        ({"name": "x", "shape": (-1, 2)}, "negative"),
        ({"name": "x", "shape": "ab"}, "sequence of ints"),
        ({"name": "x", "shape": (1 << 30, 1 << 30)}, "per-tensor limit"),
        ({"name": "x", "shape": (2,), "dtype": torch.complex128}, "not supported"),
        ({"name": "x", "shape": (2,), "dtype": "uint32"}, "not supported"),
        ({"name": "x", "shape": (2,), "device": "meta"}, "use 'cpu' or 'cuda'"),
        ({"name": "x", "shape": (2,), "dynamic": [3]}, "out of range"),
    ],
)
def test_invalid_specs_are_rejected_with_a_reason(kwargs, message):
    with pytest.raises(tw.SpecError, match=message):
        tw.TensorSpec(**kwargs)


def test_spec_errors_are_value_errors_and_tensorwire_errors():
    with pytest.raises(ValueError):
        tw.TensorSpec("", (1,))
    assert issubclass(tw.SpecError, tw.TensorWireError)


def test_scalar_empty_and_cuda_device_index_are_accepted():
    assert tw.TensorSpec("s", (), "float32").nbytes == 4
    assert tw.TensorSpec("e", (0, 5), "int64").nbytes == 0
    assert tw.TensorSpec("g", (2,), "float32", "cuda:1").device == "cuda"


def test_dynamic_dims_are_maxima():
    spec = tw.TensorSpec("act", (32, 16), "float32", dynamic=[0])
    assert spec.dynamic == (True, False) and spec.is_dynamic
    spec.check_shape((7, 16))
    with pytest.raises(tw.ShapeMismatchError, match="larger than its declared maximum 32"):
        spec.check_shape((33, 16))
    with pytest.raises(tw.ShapeMismatchError):
        spec.check_shape((8, 15))
    assert spec_from_proto(spec_to_proto(spec)) == spec


def test_check_tensor_names_the_tensor_and_both_descriptions():
    spec = tw.TensorSpec("out.0", (2, 3), "float32")
    spec.check_tensor(torch.zeros(2, 3))
    with pytest.raises(tw.ShapeMismatchError, match=r"out.0: got float64\[2, 3\] on cpu, negotiated float32\[2, 3\]"):
        spec.check_tensor(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(tw.ShapeMismatchError, match="got shape"):
        spec.check_tensor(torch.zeros(3, 2))


def test_from_proto_rejects_unknown_enum_values():
    msg = spec_to_proto(tw.TensorSpec("x", (1,)))
    msg.dtype = 99
    with pytest.raises(tw.SpecError, match="unknown dtype code 99"):
        spec_from_proto(msg)


def test_check_same_specs_lists_every_difference():
    a = [tw.TensorSpec("x", (2,)), tw.TensorSpec("y", (3,))]
    b = [tw.TensorSpec("x", (2,), "float16"), tw.TensorSpec("z", (3,))]
    with pytest.raises(tw.ShapeMismatchError) as info:
        check_same_specs(a, b, what="0 -> 1")
    text = str(info.value)
    assert "x: sender declares float32[2] on cpu, receiver expects float16[2] on cpu" in text
    assert "y: sender declares" in text and "z: missing on the sending side" in text
    check_same_specs(a, list(reversed(a)), what="same")


def test_import_is_cheap():
    import subprocess
    import sys

    code = "import sys, tensorwire; print(any(m in sys.modules for m in ('torch', 'grpc', 'ucxx')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
