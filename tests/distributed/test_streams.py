"""CUDA stream semantics of backend "tensorwire", checked without a GPU.

- flags: the cyclic sequence comparison, releases that never go back, the process-wide pool;
- :class:`tensorwire.cuda.StreamMemOps` against a stand-in CUDA driver library compiled here (the ctypes
  signatures, the probe, context push/pop), when a C compiler is present;
- two :class:`tensorwire.distributed.channel.Peer` over an in-memory (and a TCP) transport pair, with the
  CUDA calls replaced by a lazy stream simulator (``tests/support/stream_sim.py``): isend reads after the
  work queued before it, irecv lands after the work queued before it, wait() returns at once and orders the
  stream after the bytes, a lost peer or a timeout releases the waiting stream and reports the error; each
  check is shown to fail against a mutant that leaves out what it checks;
- the group: an asynchronous error makes its next call raise.

The real CUDA calls run in ``tests/distributed/test_cuda_streams.py`` on a GPU host.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from stream_sim import NoEventOps, NoStreamWaitOps, SimOps  # noqa: E402
from tcp_pairs import tcp_pair  # noqa: E402

from tensorwire.cuda import StreamMemOps  # noqa: E402
from tensorwire.distributed.channel import Peer, SlotPool  # noqa: E402
from tensorwire.distributed.errors import PeerLost, WorkTimeout  # noqa: E402
from tensorwire.distributed.streams import FLAG_PAGE, FLAG_STRIDE, Flag, FlagPool, seq_reached  # noqa: E402
from tensorwire.distributed.work import Completer  # noqa: E402
from tensorwire.transport.memory import MemoryTransport, memory_pair  # noqa: E402
from tensorwire.transport.tcp import TcpListener  # noqa: E402

pytestmark = pytest.mark.timeout(60)

# -- flags ----------------------------------------------------------------------------------------------------


def test_seq_reached_is_the_drivers_cyclic_geq():
    assert seq_reached(5, 5) and seq_reached(6, 5) and not seq_reached(4, 5)
    # across the wrap: 2 is "after" 0xFFFFFFFE, and 0xFFFFFFFE is "before" 2
    assert seq_reached(2, 0xFFFFFFFE) and not seq_reached(0xFFFFFFFE, 2)
    assert seq_reached(0x7FFFFFFF, 0) and not seq_reached(0x80000000, 0)  # half the circle ahead is behind


def _word_flag(start: int) -> tuple[Flag, ctypes.Array]:
    buf = ctypes.create_string_buffer(64)
    ctypes.c_uint32.from_address(ctypes.addressof(buf)).value = start
    return Flag(ctypes.addressof(buf), ctypes.addressof(buf)), buf


def test_a_flag_issues_numbers_in_order_and_its_word_only_moves_forward_across_the_wrap():
    flag, _buf = _word_flag(0xFFFFFFFD)
    seqs = [flag.issue() for _ in range(5)]
    assert seqs == [0xFFFFFFFE, 0xFFFFFFFF, 0, 1, 2]
    flag.release(0)
    assert flag.value == 0
    flag.release(0xFFFFFFFF)  # a late release of an older number does not take it back
    assert flag.value == 0
    flag.release(2)
    flag.release(1)
    assert flag.value == 2
    flag.release_all()
    assert flag.value == flag.issued == 2


def test_concurrent_releases_leave_the_highest_number():
    flag, _buf = _word_flag(100)
    seqs = [flag.issue() for _ in range(4000)]
    threads = [threading.Thread(target=lambda part=seqs[i::4]: [flag.release(s) for s in part]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert flag.value == seqs[-1]


def test_the_flag_pool_carves_pages_reuses_flags_with_their_numbers_and_never_frees():
    pages = []

    def alloc(n):
        buf = ctypes.create_string_buffer(n)
        pages.append(buf)
        return ctypes.addressof(buf), ctypes.addressof(buf) + (1 << 40)  # a device address of its own

    pool = FlagPool(alloc)
    flags = [pool.take() for _ in range(FLAG_PAGE // FLAG_STRIDE + 1)]
    assert pool.pages == 2 and len(pages) == 2
    first = flags[0]
    assert first.device_addr - first.host_addr == 1 << 40
    assert len({f.host_addr for f in flags}) == len(flags)
    assert all((f.host_addr - ctypes.addressof(pages[0])) % FLAG_STRIDE == 0 for f in flags[:-1])
    first.issue()
    first.issue()  # issued 2, released 0: a stream may still wait for 1 and 2
    pool.give(first)
    assert first.value == 2  # given back with everything released
    again = pool.take()
    assert again is first and again.issue() == 3  # the next owner goes on from there: no stale wait can pass early


# -- the driver bindings against a stand-in libcuda -------------------------------------------------------------

FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef struct { uint64_t addr; uint32_t value; int queued; } stream_t;
static int pushes, pops, current_ctx, wait_fails, v1_enabled, ignore_host;
static stream_t legacy;
int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int *v) { *v = 12080; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = ordinal + 100; return 0; }
int cuDeviceGetAttribute(int *v, int attr, int dev) { *v = (attr == 92 && dev >= 100) ? v1_enabled : -1; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(intptr_t)(0x1000 + dev); return 0; }
int cuCtxGetCurrent(void **ctx) { *ctx = (void *)(intptr_t)current_ctx; return 0; }
int cuCtxPushCurrent_v2(void *ctx) { pushes++; current_ctx = (int)(intptr_t)ctx; return 0; }
int cuCtxPopCurrent_v2(void **ctx) { pops++; current_ctx = 0; return 0; }
int cuMemHostAlloc(void **p, size_t n, unsigned flags) { if (flags != 3) return 1; *p = calloc(1, n); return 0; }
int cuMemHostGetDevicePointer_v2(uint64_t *d, void *p, unsigned f) { *d = (uint64_t)(uintptr_t)p; return 0; }
int cuStreamCreate(void **s, unsigned flags) { if (flags != 1) return 1; *s = calloc(1, sizeof(stream_t)); return 0; }
int cuStreamDestroy_v2(void *s) { free(s); return 0; }
static int waitv(void *s, uint64_t addr, uint32_t value, unsigned flags) {
    if (wait_fails) return 801;
    if (flags != 0) return 1;
    stream_t *st = s ? (stream_t *)s : &legacy;
    st->addr = addr; st->value = value; st->queued = 1;
    return current_ctx ? 0 : 201;
}
int cuStreamWaitValue32_v2(void *s, uint64_t addr, uint32_t value, unsigned flags) { return waitv(s, addr, value, flags); }
int cuStreamWaitValue32(void *s, uint64_t addr, uint32_t value, unsigned flags) { return waitv(s, addr, value, flags); }
int cuStreamQuery(void *s) {
    stream_t *st = (stream_t *)s;
    if (!st->queued) return 0;
    if (ignore_host) return 600;
    return (int32_t)(*(volatile uint32_t *)(uintptr_t)st->addr - st->value) >= 0 ? 0 : 600;
}
int cuGetErrorName(int code, const char **s) { *s = code == 801 ? "CUDA_ERROR_NOT_SUPPORTED" : "CUDA_ERROR_X"; return 0; }
void fake_set(int wf, int v1, int ih) { wait_fails = wf; v1_enabled = v1; ignore_host = ih; }
int fake_pushes(void) { return pushes; }
int fake_pops(void) { return pops; }
uint32_t fake_legacy_value(void) { return legacy.value; }
uint64_t fake_legacy_addr(void) { return legacy.addr; }
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in CUDA driver")
    d = tmp_path_factory.mktemp("fakecuda")
    out = {}
    # "v1": a driver older than CUDA 11.7, without the v2 entry point
    for name, text in (("v2", FAKE_LIBCUDA), ("v1", FAKE_LIBCUDA.replace("cuStreamWaitValue32_v2", "unused_v2"))):
        (d / f"{name}.c").write_text(text)
        out[name] = str(d / f"libfake{name}.so")
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", out[name], str(d / f"{name}.c")], check=True, timeout=60)
    return out


def _load(path: str, *, wait_fails: int = 0, v1_enabled: int = 0, ignore_host: int = 0):
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    lib.fake_set(wait_fails, v1_enabled, ignore_host)
    lib.fake_legacy_addr.restype = ctypes.c_uint64
    lib.fake_legacy_value.restype = ctypes.c_uint32
    return lib


def test_stream_mem_ops_probe_alloc_and_wait_through_the_v2_entry_point(fake_libcuda, tmp_path):
    path = tmp_path / "a.so"
    shutil.copy(fake_libcuda["v2"], path)  # a private copy: the fake keeps its state in globals
    lib = _load(str(path))
    mem = StreamMemOps(lib)
    assert mem.api == "v2"
    assert mem.unusable(0) is None  # the probe: a stream waited for a host word and saw the host write it
    host, dev = mem.alloc_words(4096, 0)
    assert host == dev and ctypes.c_uint32.from_address(host).value == 0
    assert mem.wait_geq(0, 0, dev + 64, 0xFFFFFFFF + 8) == 0  # legacy default stream; value taken modulo 2**32
    assert lib.fake_legacy_addr() == dev + 64 and lib.fake_legacy_value() == 7
    assert lib.fake_pushes() == lib.fake_pops() > 0  # every pushed context popped again


def test_stream_mem_ops_refuses_disabled_v1_failing_waits_and_a_stream_that_never_sees_the_host(
    fake_libcuda, tmp_path, monkeypatch
):
    import tensorwire.cuda as twcuda

    for i, (which, kw, words) in enumerate(
        [
            ("v1", {"v1_enabled": 0}, "NVreg_EnableStreamMemOPs"),
            ("v2", {"wait_fails": 1}, "CUDA_ERROR_NOT_SUPPORTED"),
            ("v2", {"ignore_host": 1}, "did not see the host's write"),
        ]
    ):
        path = tmp_path / f"b{i}.so"
        shutil.copy(fake_libcuda[which], path)
        monkeypatch.setattr(twcuda, "_PROBE_S", 0.2)
        mem = StreamMemOps(_load(str(path), **kw))
        assert mem.api == which
        why = mem.unusable(0)
        assert why is not None and words in why, why
    path = tmp_path / "c.so"
    shutil.copy(fake_libcuda["v1"], path)
    assert StreamMemOps(_load(str(path), v1_enabled=1)).unusable(1) is None  # v1, enabled by the driver


# -- two peers over an in-memory pair, CUDA calls simulated --------------------------------------------------


class BytesMemoryTransport(MemoryTransport):
    """The in-memory transport, taking the flat byte views backend "tensorwire" hands a host transport."""

    def post_recv(self, tag, buf, *, header=False):
        super().post_recv(tag, _u8(buf), header=header)

    def send(self, tag, buf, **kw):
        super().send(tag, _u8(buf), **kw)


class _Sent:
    """A send of :class:`AsyncMemoryTransport`: out when it was posted."""

    def done(self) -> bool:
        return True


class AsyncMemoryTransport(BytesMemoryTransport):
    """The in-memory transport with UCX's asynchronous send (post now, complete in ``wait_send``)."""

    async_send = True

    def start_send(self, tag, buf, *, step=None, shape=None, timeout):
        self.send(tag, buf, step=step, shape=shape, timeout=timeout)
        return _Sent()

    def wait_send(self, op, *, timeout):
        return None


def _u8(buf):
    return torch.frombuffer(buf, dtype=torch.uint8) if isinstance(buf, memoryview) else buf


def _memory_pair(cls=None):
    a, b = memory_pair()
    a.__class__ = b.__class__ = cls or BytesMemoryTransport
    return a, b


class FakeLink:
    def __init__(self, transport, peer: int) -> None:
        self.connection = transport
        self.peer = peer

    def close(self, *, linger: float | None = None) -> None:
        self.connection.close()


class Pair:
    """Rank 0 and rank 1 of a group, one Peer each, each with its own simulated stream."""

    def __init__(self, ops0, ops1, *, timeout: float = 10.0, transports=None) -> None:
        a, b = transports or _memory_pair()
        self.async_errors: dict[int, list[BaseException]] = {0: [], 1: []}
        self.peers = [
            Peer(
                FakeLink(t, 1 - r),
                rank=r,
                group="test",
                timeout=timeout,
                pool=SlotPool(),
                completer=Completer(str(r)),
                ops=ops,
                on_async_error=self.async_errors[r].append,
            )
            for r, (t, ops) in enumerate(((a, ops0), (b, ops1)))
        ]
        self.ops = [ops0, ops1]

    def close(self) -> None:
        from tensorwire.distributed.errors import GroupClosed

        for p in self.peers:
            p.close(GroupClosed("test over"))


@pytest.fixture
def pairs():
    made = []

    def make(ops0=None, ops1=None, **kw):
        p = Pair(ops0 or SimOps(), ops1 or SimOps(), **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def _tcp_pair():
    lst = TcpListener("127.0.0.1", port=0)
    try:
        return tcp_pair(lst)
    finally:
        lst.close()


def _send_later(peer, tensor, delay: float):
    th = threading.Thread(target=lambda: (time.sleep(delay), peer.isend(tensor, 0).wait(timedelta(seconds=10))))
    th.start()
    return th


@pytest.mark.parametrize("ops_cls,expect", [(SimOps, 7.0), (NoEventOps, 0.0)])
def test_isend_reads_the_tensor_only_after_the_work_queued_before_it(pairs, ops_cls, expect):
    pair = pairs(ops_cls(), SimOps())
    x = torch.zeros(1000)
    pair.ops[0].kernel(lambda: x.fill_(7.0))  # queued before isend, not run yet (a busy GPU)
    w = pair.peers[0].isend(x, 0)
    y = torch.full((1000,), -1.0)
    r = pair.peers[1].irecv(y, 0)
    r.wait(timedelta(seconds=10))
    assert torch.all(y == expect), y[:3]  # the mutant sends the stale zeros
    w.wait(timedelta(seconds=10))


def _sender_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tw-dist-send-")]


def test_a_cuda_isend_on_an_idle_stream_goes_out_in_the_callers_thread(pairs):
    """Without stream waits, a CUDA message whose stream is idle is posted by isend itself, as a host one is:
    no hand-off to the sender thread (it cost ~100 us per round trip on two H100s)."""
    before = set(_sender_threads())
    pair = pairs(SimOps(stream_wait=False), SimOps(stream_wait=False), transports=_memory_pair(AsyncMemoryTransport))
    y = torch.zeros(4096)
    r = pair.peers[1].irecv(y, 0)
    w = pair.peers[0].isend(torch.full((4096,), 3.0), 0)
    assert w._op is not None and w._chan is None  # posted by isend, not queued
    r.wait(timedelta(seconds=10))
    w.wait(timedelta(seconds=10))
    assert torch.all(y == 3.0)
    assert set(_sender_threads()) == before


@pytest.mark.parametrize("credit_first", [True, False])
def test_a_cuda_isend_behind_queued_work_still_waits_for_it(pairs, credit_first):
    """The same send with a kernel queued before isend (a busy GPU): queued until the stream reaches the isend,
    never sent from the stale tensor -- whether the receiver's credit is there at isend or comes later."""
    pair = pairs(SimOps(stream_wait=False), SimOps(stream_wait=False), transports=_memory_pair(AsyncMemoryTransport))
    x = torch.zeros(4096)
    y = torch.full((4096,), -1.0)
    r = pair.peers[1].irecv(y, 0) if credit_first else None
    pair.ops[0].kernel(lambda: x.fill_(7.0))
    w = pair.peers[0].isend(x, 0)
    assert w._op is None and w._chan is not None  # queued behind the kernel
    if r is None:
        r = pair.peers[1].irecv(y, 0)
    r.wait(timedelta(seconds=10))
    w.wait(timedelta(seconds=10))
    assert torch.all(y == 7.0), y[:3]


def test_wait_of_a_receive_through_a_slot_blocks_the_host_until_the_bytes_are_in(pairs):
    """Over TCP a CUDA receive lands in a pinned slot and a thread copies it into the tensor: GPU work that thread
    queued while the stream waited on a flag could hang (see test_streamed_operations_queue_no_gpu_work_...), so
    its wait() blocks the host -- and the consumer queued after it sees the bytes."""
    pair = pairs(SimOps(), SimOps(), transports=_tcp_pair())
    rx = pair.ops[1]
    y = torch.zeros(1 << 16)
    r = pair.peers[1].irecv(y, 0)
    sender = _send_later(pair.peers[0], torch.full((1 << 16,), 5.0), 0.5)
    t0 = time.perf_counter()
    r.wait()
    took = time.perf_counter() - t0
    sender.join(10)
    assert r.is_completed() and not r._streamed and took > 0.3, took
    seen = []
    rx.kernel(lambda: seen.append(y.clone()))
    rx.stream.flush()
    assert torch.all(seen[0] == 5.0) and rx.waits == [] and rx.copies == 1


@pytest.mark.parametrize("ops_cls,transport", [(SimOps, "memory"), (NoStreamWaitOps, "memory")])
def test_wait_of_a_receive_returns_at_once_and_orders_the_consumer_after_the_bytes(pairs, ops_cls, transport):
    pair = pairs(SimOps(), ops_cls(), transports=_tcp_pair() if transport == "tcp" else None)
    rx = pair.ops[1]
    y = torch.zeros(1 << 16)
    r = pair.peers[1].irecv(y, 0)
    sender = _send_later(pair.peers[0], torch.full((1 << 16,), 5.0), 0.5)
    t0 = time.perf_counter()
    r.wait()
    took = time.perf_counter() - t0
    pending = not r.is_completed()
    seen = []
    rx.kernel(lambda: seen.append(y.clone()))  # a kernel consuming it right after wait()
    assert pending and took < 0.25, took  # wait() returned before the bytes, which come 0.5 s later
    rx.stream.flush()  # "the GPU" runs: the stream wait holds the consumer until the flag says the bytes are in
    sender.join(10)
    if ops_cls is NoStreamWaitOps:
        assert torch.all(seen[0] == 0.0)  # the mutant's consumer ran before the bytes landed
        return
    assert torch.all(seen[0] == 5.0)
    assert rx.waits == [1] and r.is_completed() and r.exception() is None


@pytest.mark.parametrize("ops_cls", [SimOps, NoEventOps])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "tcp"])
def test_irecv_lands_only_after_the_work_queued_before_it_read_the_old_bytes(pairs, ops_cls, layout):
    pair = pairs(SimOps(), ops_cls(), transports=_tcp_pair() if layout == "tcp" else None)
    rx = pair.ops[1]
    base = torch.ones(64, 2)
    y = base[:, 0] if layout == "strided" else base[:, 0].contiguous()
    snap = []
    rx.kernel(lambda: snap.append(y.clone()))  # earlier work still reading y when irecv is called
    r = pair.peers[1].irecv(y, 0)
    w = pair.peers[0].isend(torch.full((64,), 9.0), 0)  # sent as soon as a buffer is posted
    r.wait()
    w.wait(timedelta(seconds=10))
    done = []
    rx.kernel(lambda: done.append(y.clone()))
    rx.stream.flush()
    assert torch.all(done[0] == 9.0)
    if ops_cls is NoEventOps and layout == "contiguous":
        assert torch.all(snap[0] == 9.0)  # the mutant posted y at once: the bytes overtook the earlier reader
    elif ops_cls is SimOps:
        assert torch.all(snap[0] == 1.0), snap[0][:4]


def test_wait_of_a_send_makes_the_stream_wait_until_the_bytes_are_out(pairs):
    for ops_cls, expect in ((SimOps, 3.0), (NoStreamWaitOps, 4.0)):
        pair = pairs(ops_cls(), SimOps())
        tx = pair.ops[0]
        x = torch.full((256,), 3.0)
        w = pair.peers[0].isend(x, 0)
        t0 = time.perf_counter()
        w.wait()  # returns before the bytes are out (no receive is posted yet)
        assert not w.is_completed() and time.perf_counter() - t0 < 0.2
        tx.kernel(lambda x=x: x.fill_(4.0))  # overwrites the tensor: must run after the send read it
        gpu = threading.Thread(target=tx.stream.flush)
        gpu.start()
        time.sleep(0.2)
        y = torch.zeros(256)
        pair.peers[1].irecv(y, 0).wait(timedelta(seconds=10))
        gpu.join(10)
        assert not gpu.is_alive()
        assert torch.all(y == expect), (ops_cls.__name__, y[:3])


def test_a_lost_peer_releases_the_waiting_stream_and_reports_the_error_on_the_work_and_the_group(pairs):
    pair = pairs()
    rx = pair.ops[1]
    y = torch.zeros(128)
    r = pair.peers[1].irecv(y, 0)
    r.wait()
    after = []
    rx.kernel(lambda: after.append(True))
    time.sleep(0.1)
    pair.peers[0].transport.close()  # the peer dies mid-receive
    t0 = time.monotonic()
    rx.stream.flush()  # returns: the flag was released although no byte came
    assert after == [True] and time.monotonic() - t0 < 5
    assert r.is_completed() and isinstance(r.exception(), PeerLost)
    assert len(pair.async_errors[1]) == 1 and isinstance(pair.async_errors[1][0], PeerLost)
    again = pair.peers[1].irecv(torch.zeros(128), 0)
    assert again.is_completed() and isinstance(again.exception(), PeerLost)  # the pair stays failed


@pytest.mark.parametrize("sent", [(8, 8), (128,)], ids=["same-size-other-shape", "larger"])
def test_a_mismatch_after_wait_releases_the_stream_and_names_both_sides(pairs, sent):
    from tensorwire.distributed.errors import SignatureMismatch

    pair = pairs()
    rx = pair.ops[1]
    r = pair.peers[1].irecv(torch.zeros(64), 0)
    r.wait()
    w = pair.peers[0].isend(torch.ones(sent), 0)
    rx.stream.flush()  # returns: released on the error
    if sent == (128,):  # refused on the sender, which raises; the receiver learns it from the sender's notice,
        # or, when the in-memory pair drops the notice with the connection, from the closed connection
        with pytest.raises(SignatureMismatch):
            w.wait(timedelta(seconds=10))
        assert isinstance(r.exception(), (SignatureMismatch, PeerLost)), r.exception()
        assert type(pair.async_errors[1][0]) is type(r.exception())
        return
    assert isinstance(r.exception(), SignatureMismatch), r.exception()
    assert "float32[64]" in str(r.exception()) and "float32[8, 8]" in str(r.exception())
    assert isinstance(pair.async_errors[1][0], SignatureMismatch)
    w.wait(timedelta(seconds=10))  # delivered: the sender learns from its next operation (the pair is closed)
    with pytest.raises(PeerLost):
        pair.peers[0].isend(torch.ones(4), 0).wait(timedelta(seconds=10))


def test_a_receive_a_stream_waits_for_that_never_comes_fails_the_pair_at_the_timeout(pairs):
    pair = pairs(timeout=0.5)
    rx = pair.ops[1]
    r = pair.peers[1].irecv(torch.zeros(16), 0)
    r.wait()
    t0 = time.monotonic()
    rx.stream.flush()
    assert 0.4 < time.monotonic() - t0 < 5
    assert isinstance(r.exception(), WorkTimeout) and "a CUDA stream waits" in str(r.exception())
    assert isinstance(pair.async_errors[1][0], WorkTimeout)


def test_without_stream_waits_wait_blocks_until_the_bytes_are_in_the_tensor(pairs):
    pair = pairs(SimOps(), SimOps(stream_wait=False))
    y = torch.zeros(1024)
    r = pair.peers[1].irecv(y, 0)
    sender = _send_later(pair.peers[0], torch.full((1024,), 2.0), 0.3)
    t0 = time.perf_counter()
    r.wait()
    took = time.perf_counter() - t0
    assert took > 0.25 and torch.all(y == 2.0)
    assert pair.ops[1].waits == []
    sender.join(10)


def test_many_stream_waited_receives_in_flight_complete_in_order_with_one_flag(pairs):
    pair = pairs()
    rx = pair.ops[1]
    ys = [torch.zeros(32) for _ in range(8)]
    works = [pair.peers[1].irecv(y, 0) for y in ys]
    for w in works:
        w.wait()
    got = []
    rx.kernel(lambda: got.extend(float(y[0]) for y in ys))
    for i in range(8):
        pair.peers[0].isend(torch.full((32,), float(i)), 0)
    rx.stream.flush()
    assert got == [float(i) for i in range(8)]
    assert rx.waits == list(range(1, 9)) and rx.pool.pages == 1
    flag = pair.peers[1]._recv[1].flag
    assert flag is not None and flag.value == 8


# -- the group: an asynchronous error makes the next call raise -------------------------------------------------


def test_an_asynchronous_error_makes_every_later_call_on_the_group_raise():
    from torch.distributed import DistBackendError, TCPStore

    from tensorwire.distributed.process_group import ProcessGroupTensorwire

    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
    pg = ProcessGroupTensorwire(store, 0, 1, timedelta(seconds=30), transport="tcp")
    try:
        pg._async_failed(PeerLost("rank 1 died"))
        pg._async_failed(WorkTimeout("a later one"))  # the first error is the one reported
        for call in (lambda: pg.send([torch.zeros(1)], 0, 0), lambda: pg.allreduce([torch.zeros(1)])):
            with pytest.raises(PeerLost, match="earlier CUDA operation .* rank 1 died") as info:
                call()
            assert isinstance(info.value, DistBackendError)
    finally:
        pg.shutdown()


# -- CudaOps' decisions, with a stand-in for the driver bindings ------------------------------------------------


class FakeMem:
    def __init__(self, why=None, wait_err=0):
        self.why, self.wait_err = why, wait_err
        self.probes, self.waits, self.pages = 0, [], []

    def unusable(self, device):
        self.probes += 1
        return self.why

    def alloc_words(self, n, device):
        buf = ctypes.create_string_buffer(n)
        self.pages.append(buf)
        return ctypes.addressof(buf), ctypes.addressof(buf)

    def wait_geq(self, device, stream, addr, value):
        self.waits.append((device, stream, addr, value))
        return self.wait_err

    def error_text(self, code):
        return f"error {code}"


def test_cuda_ops_use_stream_waits_only_where_the_driver_can_and_say_so_once(monkeypatch, caplog):
    import tensorwire.distributed.streams as S

    monkeypatch.setattr(S, "current_raw_stream", lambda index: 0xABC)
    monkeypatch.setattr(S, "_WARNED", set())
    monkeypatch.setattr(S, "_POOL", None)  # the process-wide pool, made here from the stand-in's pages
    dev = torch.device("cpu")  # stands for cuda:0 (index 0)
    t = torch.zeros(1)

    ops = S.CudaOps(stream_wait=True, mem=FakeMem())
    assert ops.usable(dev) and ops.usable(dev)
    flag = ops.new_flag(dev)
    assert flag is not None and ops.order_after(flag, 5, t)
    assert ops._mem.waits == [(0, 0xABC, flag.device_addr, 5)] and ops._mem.probes == 1

    with caplog.at_level("WARNING", logger="tensorwire.distributed.streams"):
        for _ in range(2):  # two groups: one log line
            refused = S.CudaOps(stream_wait=True, mem=FakeMem(why="v1 disabled"))
            assert not refused.usable(dev)
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "v1 disabled" in caplog.records[0].getMessage()

    assert not S.CudaOps(stream_wait=False, mem=FakeMem()).usable(dev)  # TENSORWIRE_CUDA_STREAM_WAIT=0

    failing = S.CudaOps(stream_wait=True, mem=FakeMem(wait_err=801))
    assert failing.usable(dev)
    assert not failing.order_after(failing.new_flag(dev), 1, t)  # refused: the caller blocks instead
    assert not failing.usable(dev)  # and from now on


@pytest.mark.parametrize("transport", ["ucx-like", "tcp"])
def test_no_kernel_copies_in_tensorwire_threads_for_non_contiguous_tensors(pairs, transport):
    """While a caller's stream waits on a flag, a kernel launched by the thread that releases it may never run (it
    hung on an H100): copies out of and into non-contiguous CUDA tensors are kernels, so the sender queues its copy
    on the caller's stream at isend and a non-contiguous receive's wait() blocks the host instead of the stream."""
    pair = pairs(SimOps(), SimOps(), transports=_tcp_pair() if transport == "tcp" else None)
    tx, rx = pair.ops
    src = torch.full((64, 2), 3.0)[:, 1]
    dst = torch.zeros(64, 2)[:, 0]
    for step in range(2):
        src.fill_(float(step + 3))
        r = pair.peers[1].irecv(dst, 0)
        w = pair.peers[0].isend(src, 0)
        w.wait()  # the send's wait() only queues a stream wait (its slot was filled on the stream)
        assert w._streamed or w.is_completed()
        tx.stream.flush()
        r.wait()  # blocks until the bytes are in dst
        assert not r._streamed and r.is_completed()
        assert torch.all(dst == float(step + 3))
    assert all(tx.thread_copies) and all(rx.thread_copies), (tx.thread_copies, rx.thread_copies)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("stream_wait", [True, False], ids=["stream-wait", "blocking"])
def test_streamed_operations_queue_no_gpu_work_in_tensorwire_threads(pairs, stream_wait, layout):
    """While a caller's stream waits on a flag, GPU work that the thread releasing it queues may never run (on an
    H100 a copy kernel never did, and now and then a copy on a stream of its own): with stream waits on, a send's
    copy into its pinned slot goes on the caller's stream at isend, and the threads copy nothing. Blocking (the
    instrument's control): the sender's thread makes that copy."""
    pair = pairs(SimOps(stream_wait=stream_wait), SimOps(stream_wait=stream_wait), transports=_tcp_pair())
    tx, rx = pair.ops
    src = torch.full((64, 2), 3.0)[:, 1] if layout == "strided" else torch.full((64,), 3.0)
    dst = torch.zeros(64)
    early = 0  # sends complete before their wait() (a loaded machine's "GPU" thread can get there first)
    for step in range(2):
        src.fill_(float(step + 3))
        r = pair.peers[1].irecv(dst, 0)
        w = pair.peers[0].isend(src, 0)
        gpu = threading.Thread(target=tx.stream.flush)  # "the GPU" runs the sender's stream meanwhile
        gpu.start()
        if stream_wait:
            early += w.done
            w.wait()
            r.wait()
        else:  # the receive first: the sender's thread sends (a caller waiting on the send would help it out)
            r.wait()
            w.wait()
        gpu.join(10)
        tx.stream.flush()
        assert torch.all(dst == float(step + 3))
    if stream_wait:  # (a send complete before its wait() queues no stream wait: nothing to wait for)
        assert tx.thread_copies == [] and (tx.waits or early == 2), (tx.thread_copies, tx.waits, early)
    else:
        assert len(tx.thread_copies) == 2, tx.thread_copies


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream_wait", [False, True], ids=["blocking", "stream-wait"])
def test_ranks_waiting_on_their_sends_first_do_not_hold_back_each_others_receives(pairs, stream_wait):
    """Each rank queues GPU work, then isend + irecv, then waits on the send first (batch_isend_irecv and
    pipelining's schedules do). Each irecv is posted once its caller's stream reached it, by tensorwire, not
    when its caller waits on it: otherwise each send waits for a credit the other rank never posts (this
    deadlocked on two GPUs over UCX until the timeout)."""
    pair = pairs(SimOps(stream_wait=stream_wait), SimOps(stream_wait=stream_wait), timeout=6.0)
    xs = [torch.full((4096,), float(r + 1)) for r in range(2)]
    ys = [torch.zeros(4096) for _ in range(2)]
    for r in range(2):
        pair.ops[r].kernel(lambda: None)  # earlier work on each caller's stream: its irecv waits for it
    took: dict[int, float] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            s = pair.peers[r].isend(xs[r], 0)
            rv = pair.peers[r].irecv(ys[r], 0)
            t0 = time.perf_counter()
            s.wait(timedelta(seconds=5))
            rv.wait(timedelta(seconds=5))
            took[r] = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    gpus = [threading.Thread(target=lambda r=r: (time.sleep(0.1), pair.ops[r].stream.flush())) for r in range(2)]
    ranks = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in ranks + gpus:
        th.start()
    for th in ranks + gpus:
        th.join(20)
    assert not errors, errors
    assert set(took) == {0, 1} and max(took.values()) < 3.0, took
    for r in range(2):
        pair.ops[r].stream.flush()
        assert torch.all(ys[r] == float(2 - r)), (r, ys[r][:3])
