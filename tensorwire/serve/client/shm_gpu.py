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

from typing import TYPE_CHECKING, Any

from tensorwire.buffers import as_bytes
from tensorwire.serve.client.context import ClientContext
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.shm_path import ShmMemory
    from tensorwire.serve.client.shm_rows import LeasedTable

__all__ = ["GpuGather"]


class GpuGather:
    """The GPU reads of one shared-memory session (see the module docstring).

    ``mem``: the client's shared-memory state (its mappings; the pinned buffer the index is staged
    through, which outlives the session).
    """

    def __init__(self, ctx: ClientContext, mem: "ShmMemory") -> None:
        self.ctx = ctx
        self.mem = mem
        self.pending: Any = None  # the event ending the last pinned GPU read (torch.cuda.Event)
        self.event: Any = None  # the event a lease read waits on (one, reused)

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
        """A lease's get_rows into CUDA tensor ``out`` (contiguous, of the table's dtype and row shape; ``idx``
        checked): the kernel of :meth:`gather` on the slot's CUDA view, made once per lease and device
        (``t.cuda``, beside the registration it views: a region registered anew gets a new view). The host
        waits for the stream to pass it, so the caller's lease check after it covers what the GPU read.
        False: the slot is not registered for ``out``'s device (nothing was done)."""
        import torch

        dev = out.device
        maps = self.mem.maps
        reg = maps.cuda_mapping(region)  # (a look-up once registered: the view is used only with its registration)
        got = t.cuda.get(dev.index)
        if got is None or got[0] is not reg:
            raw = maps.cuda_view(region, t.table.view(-1).view(torch.uint8), dev)
            if raw is None:
                return False
            word = _word(t.row_bytes)  # pragma: no cover - needs a GPU (from here on)
            got = t.cuda[dev.index] = (reg, raw.view(word).view(t.rows, t.row_bytes // word.itemsize))
        view = got[1]  # pragma: no cover - needs a GPU (from here on)
        n = idx.numel()
        self.wait()  # the index's staging buffer is free again
        index = self._cuda_index(idx, dev)
        torch.index_select(view, 0, index, out=as_bytes(out).view(view.dtype).view(n, view.shape[1]))
        ev = self.event
        if ev is None:
            ev = self.event = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        ev.synchronize()
        return True

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


def _word(row_bytes: int) -> Any:
    """The widest integer dtype whose size divides ``row_bytes``: rows are moved as such words (a warp then reads
    32 x 8 bytes, not 32 x 1)."""
    import torch

    return next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if row_bytes % w.itemsize == 0)
