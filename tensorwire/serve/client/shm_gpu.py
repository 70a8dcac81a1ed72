"""get_rows into a CUDA tensor through shared memory: the GPU reads the rows in the daemon's memory in place.

A shared-memory session (:class:`~tensorwire.serve.client.shm_path.ShmPath`)
whose get_rows has a CUDA ``out`` hands it to its :class:`GpuGather`: the
daemon's region is registered with CUDA once per mapping
(:meth:`~tensorwire.serve.client.shm_maps.ClientMaps.cuda_view`, through
:func:`tensorwire.hostmap.map_host`), the index goes to the device through a
reused pinned buffer, and one ``index_select`` kernel on the caller's current
stream copies the rows from host memory into ``out`` over PCIe / C2C: no
staging copy in this process.

A region registered for another device, or one CUDA refused to register,
makes :meth:`GpuGather.gather` return False: the session then stages through
pinned memory, as for any other destination.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from tensorwire.buffers import as_bytes
from tensorwire.hostmap import map_host
from tensorwire.serve.client.context import ClientContext
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.shm_path import ShmMemory
    from tensorwire.serve.client.shm_rows import LeasedTable

__all__ = ["GpuGather", "HostIndex", "LeaseRows"]

log = logging.getLogger(__name__)


class GpuGather:
    """The GPU reads of one shared-memory session (see the module docstring).

    ``mem``: the client's shared-memory state (its mappings; the pinned buffer the index is staged
    through, which outlives the session).
    """

    def __init__(self, ctx: ClientContext, mem: "ShmMemory") -> None:
        self.ctx = ctx
        self.mem = mem
        self.pending: Any = None  # the event ending the last pinned GPU read (torch.cuda.Event)

    def gather(
        self,
        idx: "torch.Tensor",
        out: "torch.Tensor",
        got: TensorSpec,
        src: "torch.Tensor",
        region: str,
        *,
        lease: bool,
    ) -> bool:
        """A get_rows into CUDA tensor ``out``: one ``index_select`` kernel on the caller's current stream reads
        the rows straight from the daemon's memory (registered with CUDA: :meth:`ClientMaps.cuda_view`) into
        ``out``. The version read stays whole: a lease read waits for the stream to pass the kernel (an event)
        before the lease is checked; a pinned read's pin goes back only once it has (:meth:`wait`, before
        the next request or RELEASE). False: the region is not mapped for ``out``'s device (staged instead).

        Raises:
            ShapeMismatchError: ``out`` does not fit (nothing written).
        """
        import torch

        n, rows = idx.numel(), got.shape[0]
        shape = (n, *got.shape[1:])
        self.ctx.check_out(got, out, shape)
        view = self.mem.maps.cuda_view(region, src, out.device)
        if view is None:
            return False
        row_bytes = got.nbytes // rows  # pragma: no cover - needs a GPU (from here on)
        if not (n and row_bytes):
            return True
        self.wait()  # the index's staging buffer is free again
        dest = out if out.is_contiguous() else torch.empty(shape, dtype=out.dtype, device=out.device)
        word = _word(row_bytes)
        width = row_bytes // word.itemsize
        stream = torch.cuda.current_stream(out.device)
        index = self._cuda_index(idx, out.device)
        torch.index_select(view.view(word).view(rows, width), 0, index, out=as_bytes(dest).view(word).view(n, width))
        if dest is not out:
            out.copy_(dest)
        ev = torch.cuda.Event()
        ev.record(stream)
        if lease:
            ev.synchronize()  # the lease is checked once the GPU has read the rows
        else:
            self.pending = ev
            self.mem.maps.gpu_read(region, ev)
        return True

    def leased(self, t: "LeasedTable", region: str, idx: "torch.Tensor", out: "torch.Tensor") -> bool:
        """A lease's get_rows into CUDA tensor ``out`` (contiguous, of the table's dtype and row shape):
        :meth:`LeaseRows.read` of the slot's reader for ``out``'s device, made once per lease and device
        (``t.cuda``, beside the registration it views: a region registered anew gets a new reader). The host
        waits for the stream to pass the gather, so the caller's lease check after it covers what the GPU
        read. False: the slot is not registered for ``out``'s device (nothing was done).

        Raises:
            SpecError: a row of ``idx`` out of range (checked before any kernel runs; nothing written).
        """
        dev = out.get_device()  # (an int: a torch.device costs a microsecond more)
        got = t.cuda.get(dev)
        reg = self.mem.maps.cuda_mapping(region)  # (a look-up once registered)
        if got is None or got.reg is not reg:
            got = self._reader(t, region, out.device)
            if got is None:
                return False
        got.read(idx, out)  # pragma: no cover - needs a GPU
        return True  # pragma: no cover - needs a GPU

    def _reader(self, t: "LeasedTable", region: str, device: "torch.device") -> "LeaseRows | None":
        import torch

        maps = self.mem.maps
        raw = maps.cuda_view(region, t.table.view(-1).view(torch.uint8), device)
        if raw is None:
            return None
        mem = self.mem  # pragma: no cover - needs a GPU (from here on)
        index = mem.cuda_index.get(device.index)
        if index is None:
            try:
                index = HostIndex(device.index)
            except OSError as exc:  # CUDA refused to register it: this client's lease reads go the general way
                log.warning("get_rows into CUDA: the index buffer could not be registered (%s); staging instead", exc)
                index = False
            mem.cuda_index[device.index] = index
        if not isinstance(index, HostIndex):
            return None
        word = _word(t.row_bytes)
        view = raw.view(word).view(t.rows, t.row_bytes // word.itemsize)
        got = t.cuda[device.index] = LeaseRows(maps.cuda_mapping(region), view, t.rows, index)
        return got

    def wait(self) -> None:
        """Wait for the stream to pass the last pinned GPU read (its pin may go back after that)."""
        ev, self.pending = self.pending, None
        if ev is not None:  # pragma: no cover - needs a GPU
            ev.synchronize()

    def _cuda_index(self, idx: "torch.Tensor", device: "torch.device") -> "torch.Tensor":  # pragma: no cover
        """``idx`` (int64, CPU) on ``device``, copied through the client's reused pinned buffer on the current
        stream (the caller waited for the last copy out of it to pass)."""
        import torch

        mem = self.mem
        n = idx.numel()
        buf = mem.index_pinned
        if buf is None or buf.numel() < n:
            buf = mem.index_pinned = torch.empty(max(n, 4096), dtype=torch.int64).pin_memory()
        buf[:n].copy_(idx)
        return buf[:n].to(device, non_blocking=True)


class HostIndex:
    """Page-locked host memory the GPU reads a gather's index from in place (registered and mapped once per
    client and device, :func:`tensorwire.hostmap.map_host`): the host writes the index into it, a kernel reads
    it over PCIe / C2C -- no host-to-device copy to queue, no device buffer to allocate. Measured on an H200
    host (``bench/probe_gpu_rows.py``), 4,096 rows: 83.6 us per gather against 95.4 us through a pinned
    buffer and ``.to(device)``. One read at a time: the caller waits for the kernel before the next write.
    """

    def __init__(self, device: int, rows: int = 1 << 16) -> None:
        self.device = device
        self.mm: Any = None
        self.reg: Any = None
        self._grow(rows)

    def _grow(self, rows: int) -> None:  # pragma: no cover - needs a GPU
        import mmap

        import numpy as np
        import torch

        self.close()
        nbytes = -(-rows * 8 // mmap.PAGESIZE) * mmap.PAGESIZE
        self.mm = mmap.mmap(-1, nbytes)
        raw = np.frombuffer(self.mm, dtype=np.uint8)
        try:
            self.reg = map_host(raw.ctypes.data, nbytes, self.device)
        except BaseException:
            del raw
            self.mm.close()
            raise
        #: The host side (int64 and, for the range check, the same bytes as uint64) and the device side.
        self.host: Any = raw.view(np.int64)
        self.unsigned: Any = raw.view(np.uint64)
        self.cuda: Any = self.reg.tensor.view(torch.int64)
        self.rows = nbytes // 8
        self.slices: dict[int, Any] = {}

    def of(self, n: int) -> Any:  # pragma: no cover - needs a GPU
        """The first ``n`` entries as a CUDA tensor (made once per ``n``)."""
        got = self.slices.get(n)
        if got is None:
            if n > self.rows:
                self._grow(n)
            if len(self.slices) >= 16:
                self.slices.clear()
            got = self.slices[n] = self.cuda[:n]
        return got

    def close(self) -> None:
        """Unregister and unmap (no kernel may read it after: the caller has synchronized)."""
        if self.reg is not None:  # pragma: no cover - needs a GPU
            self.slices = {}
            self.cuda = self.host = self.unsigned = None
            self.reg.close()
            self.reg = None
        if self.mm is not None:  # pragma: no cover - needs a GPU
            self.mm.close()
            self.mm = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process's mappings go with it
            pass


class LeaseRows:
    """A lease's slot read by one GPU (:meth:`GpuGather.leased`): what each read needs, made once per lease
    and device, so a read is a copy of the index, its range check, one kernel and a wait.

    ``reg``: the region's CUDA registration (the reader is used only with it); ``view``: the slot as a CUDA
    tensor of ``rows`` rows of words (:func:`_word`); ``index``: the device's :class:`HostIndex`.
    """

    __slots__ = ("reg", "view", "rows", "index", "word", "width", "out", "out_key", "out_words", "stream_key", "stream")

    def __init__(self, reg: Any, view: "torch.Tensor", rows: int, index: HostIndex) -> None:
        self.reg, self.view, self.rows, self.index = reg, view, rows, index
        self.word, self.width = view.dtype, int(view.shape[1])
        self.out: Any = None  # the last destination (a weak reference), its (address, rows) and word view
        self.out_key = (0, 0)
        self.out_words: Any = None
        self.stream_key: Any = None  # the last current stream (torch's key for it) and the stream
        self.stream: Any = None

    def read(self, idx: "torch.Tensor", out: "torch.Tensor") -> None:  # pragma: no cover - needs a GPU
        """Rows ``idx`` (int64, 1-D, not empty) into ``out`` on the caller's current stream; returns once the
        GPU has them.

        Raises:
            SpecError: a row out of range (named as the general path names it; nothing written).
        """
        import torch

        from tensorwire.serve.client.shm_rows import check_rows

        n = idx.numel()
        index = self.index
        on_gpu = index.of(n)
        host = index.host[:n]
        host[...] = idx.numpy()
        if int(index.unsigned[:n].max()) >= self.rows:  # a negative row, as unsigned, is past any table
            check_rows(idx, self.rows)  # raises, naming the row
        key = (out.data_ptr(), n)
        words = self.out_words
        if key != self.out_key or self.out() is not out:  # (reused while they hold; out itself is not kept)
            words = as_bytes(out).view(self.word).view(n, self.width)
            self.out, self.out_key, self.out_words = weakref.ref(out), key, words
        dev = index.device
        torch.index_select(self.view, 0, on_gpu, out=words)
        key = _current_stream_key(dev)
        stream = self.stream
        if key != self.stream_key:
            stream = self.stream = torch.cuda.current_stream(dev)
            self.stream_key = key
        stream.synchronize()


def _current_stream_key(device: int) -> Any:  # pragma: no cover - needs a GPU
    """torch's key for ``device``'s current stream, without making a Stream object (~10 us less per read)."""
    import torch

    return torch._C._cuda_getCurrentStream(device)


def _word(row_bytes: int) -> Any:
    """The widest integer dtype whose size divides ``row_bytes``: rows are moved as such words (a warp then reads
    32 x 8 bytes, not 32 x 1)."""
    import torch

    return next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if row_bytes % w.itemsize == 0)
