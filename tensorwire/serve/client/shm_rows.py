"""get_rows into host memory from a read lease, with a few microseconds of Python around torch's own gather.

A lease read of 4,096 rows takes what a local ``torch.index_select(table, 0,
idx, out=...)`` takes, so what the client adds around it decides how close to
a local gather it comes (issue 31: at least 0.9x). Measured on the 2-core VM,
the general lease path (:meth:`ShmPath.lease_read` and :meth:`ShmPath.gather`)
spent ~50-90 us of Python per read: a byte view of ``out`` and of the slot, a
numpy min and max of the index, an ``flock`` for the daemon's liveness and a
``/proc/loadavg`` read per call. :func:`lease_rows` keeps what those gave:

- the slot as a tensor of the table's dtype and shape (:class:`LeasedTable`),
  made once per lease (a new version, a new lease) and gathered from with
  ``torch.index_select(table, 0, idx, out=out)``: the kernel and threads of
  the local gather, straight into ``out``;
- the index checked by torch's kernel, row by row as it copies (a row out
  of range raises the general path's ``SpecError``, naming it; ``out`` may
  then hold some rows, as after a local ``index_select(out=)``): a check
  of its own before the gather cost more than its ~5 us on the 2-core VM,
  measured in turns (295 -> 330 us for 4,096 rows with numpy's ``max``,
  345 us with torch's ``aminmax``: any work between two gathers lets torch's
  OpenMP team go idle on a loaded machine);
- the generation checked before and after the gather (a writer meanwhile:
  the read is not used), every call;
- the daemon's liveness, amortised
  (:meth:`LeaseTable.alive_lately <tensorwire.serve.client.shm_maps.LeaseTable.alive_lately>`).

Where numpy's ``take`` over the slot's bytes moves the rows faster than torch's
gather (cores busy with other work, where an OpenMP team spins at its barriers),
the gather is numpy's: the two are timed as the reads go
(:class:`~tensorwire.serve.client.gather_choice.GatherChoice`). Into a CUDA
``out`` the GPU gathers the rows from the slot in place (its registered mapping, a view made once per lease and
device: :meth:`GpuGather.leased <tensorwire.serve.client.shm_gpu.GpuGather.leased>`), the host waiting for the
kernel before the lease is checked again. Anything
else -- a non-contiguous or ill-fitting ``out``, a table of a dtype
outside :data:`TYPED`, a 0-d tensor, an empty index -- returns :data:`MISS` before
anything is read or counted, and takes the general path, which raises the
errors it raises.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any

from tensorwire.errors import SpecError
from tensorwire.serve.client.shm_maps import ClientMaps
from tensorwire.serve.protocol.shm import ShmError
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.shm_path import ShmPath

__all__ = ["MISS", "LeasedTable", "TYPED", "lease_rows", "check_rows"]

#: What a lease read (:func:`lease_rows`, :meth:`ShmPath.lease_read`) returns when the lease cannot serve it.
MISS = object()

#: Dtypes gathered as themselves (every torch this package supports has index_select for them); the others
#: go the general way (as bytes).
TYPED = frozenset(("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"))


#: Tables kept at most (each keeps its mapping alive; one per name read from a lease, dropped with the lease).
MAX_TABLES = 64
#: An index of at most this many rows is checked in Python (numpy's reduction costs ~3 us whatever its size).
SMALL_INDEX = 32


class LeasedTable:
    """The version a read lease names, as a tensor of its dtype and shape over the mapped slot.

    ``lease``: the lease tuple it was made from (:attr:`ShmPath.leases`' value: a new lease, even of the
    same slot, makes a new one); ``tail``: the shape of one row; ``row_bytes``: its size.
    """

    __slots__ = ("lease", "table", "rows", "tail", "dtype", "row_bytes", "as_bytes", "cuda")

    def __init__(self, lease: tuple[int, int, str, int, int, TensorSpec], table: "torch.Tensor") -> None:
        import torch

        self.lease = lease
        self.table = table
        self.rows = int(table.shape[0])
        self.tail = tuple(table.shape[1:])
        self.dtype = table.dtype
        self.row_bytes = lease[4] // self.rows if self.rows else 0
        #: The slot as a numpy uint8 array, rows x row bytes (for numpy's take, where that is the faster gather).
        self.as_bytes = table.view(-1).view(torch.uint8).numpy().reshape(self.rows, self.row_bytes)
        #: device -> the slot's reader on that GPU (:class:`~tensorwire.serve.client.shm_gpu.LeaseRows`)
        self.cuda: dict[int, Any] = {}

    @staticmethod
    def of(maps: ClientMaps, lease: tuple[int, int, str, int, int, TensorSpec]) -> "LeasedTable | None":
        """The table of ``lease`` (None: a dtype outside :data:`TYPED`, a 0-d tensor, no rows or no bytes, or
        a slot whose size is not the spec's).

        Raises:
            ShmError: the region cannot be mapped.
        """
        _, _, region, offset, nbytes, spec = lease
        if spec.dtype not in TYPED or not spec.shape or not spec.shape[0] or not nbytes or nbytes != spec.nbytes:
            return None
        raw = maps.get(region, offset, nbytes)
        return LeasedTable(lease, raw.view(spec.torch_dtype).view(spec.shape))


def check_rows(idx: "torch.Tensor", rows: int) -> None:
    """Every row of ``idx`` (int64, 1-D, not empty) in ``[0, rows)``; one pass over it in the usual case.

    Raises:
        SpecError: naming the first row out of range that the general path names (the lowest if negative,
            else the highest).
    """
    if idx.numel() <= SMALL_INDEX:
        rs = idx.tolist()
        lo, hi = min(rs), max(rs)
        if lo >= 0 and hi < rows:
            return
    else:
        import numpy as np

        inp = idx.numpy()
        if int(inp.view(np.uint64).max()) < rows:  # a negative row, as unsigned, is past any table
            return
        lo, hi = int(inp.min()), int(inp.max())
    raise SpecError(f"index: row {lo if lo < 0 else hi} out of range for a tensor of {rows} rows")


def lease_rows(path: "ShmPath", name: str, idx: "torch.Tensor", out: "torch.Tensor | None") -> Any:
    """Rows ``idx`` of ``name`` into ``out`` (a contiguous host or CUDA tensor of the right shape and dtype) or
    a pooled result buffer, from ``path``'s lease on ``name``; MISS when this path cannot serve it (see the
    module docstring: nothing was written or counted then, except when a writer came during the gather).

    Raises:
        SpecError: a row out of range, named as the general path names it. torch's kernel finds it as it
            copies, so ``out`` may hold some of the rows by then, as after a local ``index_select(out=)``.
    """
    lease = path.leases.get(name)
    tab = path.lease_tab
    n = idx.numel()
    if lease is None or tab is None or not n:
        return MISS
    mem = path.mem
    t = mem.leased.get(name)
    if t is None or t.lease is not lease:
        try:
            t = LeasedTable.of(mem.maps, lease)
        except ShmError:
            return MISS  # the general path finds the same and drops the lease
        if t is None:
            return MISS
        if len(mem.leased) >= MAX_TABLES:
            mem.leased.clear()
        mem.leased[name] = t
    cuda = out is not None and out.is_cuda
    nbytes = n * t.row_bytes
    if out is not None:
        if not ((cuda or out.is_cpu) and out.dtype == t.dtype and out.shape == (n, *t.tail) and out.is_contiguous()):
            return MISS
        dest = out
    else:
        dest = path.ctx.pool(name, "rows").acquire(nbytes).view(t.dtype).view((n, *t.tail))
    cell, gen = lease[0], lease[1]
    cells = tab.cells
    if cells[cell] != gen or not tab.alive_lately():
        path.drop_lease(name)
        return MISS
    import torch

    if cuda:  # the GPU gathers from the slot in place (a slot not registered for out's device: the general path)
        if not path.gpu.leased(t, lease[2], idx, dest):  # (checks the rows first: a device-side assert else)
            return MISS
    else:
        copier = mem.copier
        use = copier.torch_gather(nbytes)
        t0 = perf_counter()
        if use:
            try:
                torch.index_select(t.table, 0, idx, out=dest)  # checks every row before it reads it
            except IndexError:
                check_rows(idx, t.rows)  # the general path's error, naming the row
                raise
        else:  # numpy's single thread: faster where torch's OpenMP team spins at its barriers on busy cores
            check_rows(idx, t.rows)  # (numpy's take with mode="clip" would clamp a row out of range)
            copier.take(t.as_bytes, idx.numpy(), dest.view(-1).view(torch.uint8).numpy().reshape(n, t.row_bytes))
        copier.gathered(use, nbytes, perf_counter() - t0)
    if cells[cell] != gen:  # a writer came meanwhile: what was copied may be mixed
        path.drop_lease(name)
        return MISS
    mem.shm_bytes += nbytes
    mem.lease_reads += 1
    path.page.add("get_rows", nbytes)
    return dest
