"""Arrays of any library through a serve client (tensorwire/serve/client/arrays.py): NumPy always, CuPy on a GPU
host (marked gpu), JAX where installed. Inputs are read where they lie (checked through the data pointer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client.client import Client
from tensorwire.serve.client.context import ClientContext
from tensorwire.serve.client.shm_path import ShmPath

from serve_common import ALL_DTYPES, in_process, shm_room

#: The dtypes NumPy has (no bfloat16).
NP_DTYPES = [d for d in ALL_DTYPES if d != torch.bfloat16]
PATHS = ["tcp", pytest.param("shm", marks=pytest.mark.skipif(not shm_room(), reason="no room in /dev/shm"))]


@pytest.fixture(scope="module")
def srv():
    with in_process(transport="tcp", max_bytes="256MiB") as s:
        yield s


def _array(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype).numpy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", PATHS)
def test_numpy_arrays_in_and_out_are_bit_exact_for_every_dtype(srv, transport):
    with Client(srv.address, transport=transport, timeout=20) as c:
        assert c.data_path == transport
        for k, dtype in enumerate(NP_DTYPES):
            name = f"np/{transport}/{dtype}"
            a = _array(dtype, (300, 7), k)
            c.put(name, a)
            got = c.get(name, as_="numpy")
            assert isinstance(got, np.ndarray) and got.dtype == a.dtype and got.tobytes() == a.tobytes()
            assert torch.equal(c.get(name), torch.from_numpy(a))  # a torch tensor by default
            out = np.zeros_like(a)
            assert c.get(name, out=out) is out and out.tobytes() == a.tobytes()
            idx = np.array([299, 0, 5, 5], dtype=np.int32)
            rows = c.get_rows(name, idx, as_="numpy")
            assert isinstance(rows, np.ndarray) and rows.tobytes() == a[idx].tobytes()
            rout = np.zeros((4, 7), dtype=a.dtype)
            assert c.get_rows(name, idx, out=rout) is rout and rout.tobytes() == a[idx].tobytes()
            new = _array(dtype, (2, 7), 100 + k)
            c.put_rows(name, [3, 1], new)
            a[[3, 1]] = new
            assert c.get(name, as_="numpy").tobytes() == a.tobytes()
            if dtype not in (torch.bool,):
                inc = np.ones((3, 7), dtype=a.dtype)
                c.add_rows(name, np.array([2, 2, 9]), inc)
                a[2] += 2 * inc[0]
                a[9] += inc[0]
                assert c.get(name, as_="numpy").tobytes() == a.tobytes()
            c.delete(name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", PATHS)
def test_a_numpy_input_is_read_where_it_lies(srv, transport, monkeypatch):
    # the bytes a put or put_rows sends (or copies into shared memory) are the array's own: no copy first
    seen: list[int] = []
    if transport == "shm":
        real_fill = ShmPath.fill_put
        monkeypatch.setattr(
            ShmPath,
            "fill_put",
            lambda self, dst, region, t, n: seen.append(t.data_ptr()) or real_fill(self, dst, region, t, n),
        )
    else:
        real_source = ClientContext.source
        monkeypatch.setattr(
            ClientContext,
            "source",
            lambda self, key, t: seen.append(real_source(self, key, t).data_ptr()) or real_source(self, key, t),
        )
    a = _array(torch.float32, (64, 33), 1)
    with Client(srv.address, transport=transport, timeout=20) as c:
        c.put(f"zc/{transport}", a)
        assert seen and seen[-1] == a.ctypes.data
        assert c.get(f"zc/{transport}", as_="numpy").tobytes() == a.tobytes()
        seen.clear()
        v = _array(torch.float32, (2, 33), 2)
        c.put_rows(f"zc/{transport}", [4, 0], v)
        if transport == "tcp":
            assert seen and seen[-1] == v.ctypes.data
        a[[4, 0]] = v
        assert c.get(f"zc/{transport}", as_="numpy").tobytes() == a.tobytes()
        c.delete(f"zc/{transport}")


@pytest.mark.timeout(60)
def test_bad_arrays_and_choices_are_clear_errors_and_write_nothing(srv):
    a = _array(torch.float32, (10, 4), 3)
    with Client(srv.address, transport="tcp", timeout=20) as c:
        c.put("bad", a)
        with pytest.raises(tw.SpecError, match="__dlpack__"):
            c.put("bad2", [[1.0, 2.0]])
        with pytest.raises(tw.SpecError, match="negative strides"):
            c.put("bad", a[::-1])  # torch would abort the process on such an array: refused first
        ro = np.zeros_like(a)
        ro.flags.writeable = False
        with pytest.raises(tw.SpecError, match="read-only"):
            c.get("bad", out=ro)
        wrong = np.full((10, 5), 7.0, dtype=np.float32)
        with pytest.raises(tw.ShapeMismatchError):
            c.get("bad", out=wrong)
        assert (wrong == 7.0).all()
        wrong_dtype = np.full((10, 4), 7, dtype=np.int32)
        with pytest.raises(tw.ShapeMismatchError):
            c.get_rows("bad", list(range(10)), out=wrong_dtype)
        assert (wrong_dtype == 7).all()
        meta = torch.empty(10, 4, device="meta")
        with pytest.raises(tw.SpecError, match="meta"):
            c.get("bad", out=meta)
        with pytest.raises(tw.SpecError, match="meta"):
            c.put("bad", meta)
        with pytest.raises(tw.ConfigError, match="as_ must be"):
            c.get("bad", as_="pandas")
        with pytest.raises(tw.ConfigError, match="not both"):
            c.get("bad", out=np.zeros_like(a), as_="numpy")
        c.put("bf", torch.zeros(3, dtype=torch.bfloat16))
        with pytest.raises(tw.SpecError, match="NumPy has no bfloat16"):
            c.get("bf", as_="numpy")
        assert c.get("bad", as_="numpy").tobytes() == a.tobytes()  # the session is fine after all of it
        c.delete("bad")
        c.delete("bf")


@pytest.mark.timeout(120)
def test_a_sharded_client_takes_and_gives_numpy_arrays():
    with in_process(transport="tcp") as s1, in_process(transport="tcp") as s2, in_process(transport="tcp") as s3:
        a = _array(torch.float32, (1000, 6), 4)
        with tw.Client([s1.address, s2.address, s3.address], timeout=20) as c:
            c.put("sh", a, shard="rows")
            idx = np.array([999, 0, 400, 401, 700])
            assert c.get_rows("sh", idx, as_="numpy").tobytes() == a[idx].tobytes()
            out = np.zeros((5, 6), dtype=np.float32)
            assert c.get_rows("sh", idx, out=out) is out and out.tobytes() == a[idx].tobytes()
            full = np.zeros_like(a)
            assert c.get("sh", out=full) is full and full.tobytes() == a.tobytes()
            c.add_rows("sh", idx, np.ones((5, 6), dtype=np.float32))
            a[idx] += 1
            assert c.get("sh", as_="numpy").tobytes() == a.tobytes()
            c.delete("sh")


@pytest.mark.timeout(60)
def test_jax_arrays_go_in_and_are_refused_as_destinations(srv):
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.arange(24, dtype=jnp.float32).reshape(6, 4)
    with Client(srv.address, transport="tcp", timeout=20) as c:
        c.put("jax", x)
        assert c.get("jax", as_="numpy").tobytes() == np.asarray(x).tobytes()
        with pytest.raises(tw.SpecError, match="immutable"):
            c.get("jax", out=jnp.zeros((6, 4), dtype=jnp.float32))
        c.delete("jax")


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cupy_arrays_in_and_out_through_the_gpu():
    cp = pytest.importorskip("cupy")
    with in_process(transport="auto") as s, Client(s.address, transport="auto", timeout=20) as c:
        for k, dtype in enumerate(NP_DTYPES):
            a = cp.asarray(_array(dtype, (256, 16), k))
            name = f"cupy/{dtype}"
            c.put(name, a)
            out = cp.zeros_like(a)
            assert c.get(name, out=out) is out and bool((out == a).all())
            got = c.get(name, as_="cupy")
            assert isinstance(got, cp.ndarray) and got.dtype == a.dtype and bool((got == a).all())
            idx = cp.asarray([255, 0, 17])
            rows = c.get_rows(name, idx, as_="cupy")
            assert isinstance(rows, cp.ndarray) and bool((rows == a[idx]).all())
            rout = cp.zeros((3, 16), dtype=a.dtype)
            assert c.get_rows(name, idx, out=rout) is rout and bool((rout == a[idx]).all())
            c.delete(name)
