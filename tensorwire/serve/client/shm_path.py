"""The shared-memory path: data-plane requests whose bytes this process copies in and out of the daemon's memory.

With a daemon on the same host (``tensorwire serve`` with ``--shm``, the
default), ``transport="auto"`` offers shared memory when it opens a session;
the daemon names a region it created under ``/dev/shm``, this client maps it
and echoes the nonce it holds over the data connection
(:func:`tensorwire.serve.client.session.prove_shm`), and from then on the hot operations move their bytes
with one copy in this process: ``get`` copies the pinned version out of the
daemon's slot, ``get_rows`` gathers the rows from it (no index is sent, no
second copy), ``put`` copies into the staging slot the daemon reserved, and
``put_rows`` / ``add_rows`` into the session's scratch region (numpy copies:
no OpenMP team; big ones split with one helper thread unless the machine is
oversubscribed, see :class:`tensorwire.serve.client.shm_maps.Copier`). Each
operation still is a data-plane request (the daemon pins, reserves, commits,
validates), so the guarantees are the request path's; a read's pin goes back
with the next request, or with a RELEASE the client's :class:`Releaser` sends
once the client has been idle for :data:`RELEASE_AFTER`.

Read leases (x86 only; ``TENSORWIRE_SHM_LEASES=0`` turns them off): until a
writer or the daemon's exit changes the tensor's generation in the daemon's
lease table, the next get / get_rows of it reads the same slot with no
request at all, checking the generation before and after its copy
(:class:`tensorwire.serve.daemon.shm.Leases`); a get_rows into host memory from
a lease is :func:`tensorwire.serve.client.shm_rows.lease_rows`, torch's gather
with a few microseconds of Python around it. Write-ahead grants
(``TENSORWIRE_SHM_AHEAD=0`` turns them off): a put's COMMIT reply may reserve
the staging slot for this session's next put of the same name and spec,
which then writes there and sends only a COMMIT.

A get_rows into a CUDA tensor is one kernel reading the daemon's memory in
place (:mod:`tensorwire.serve.client.shm_gpu`). What outlives a session (the
mappings, the copier, the counters) is the client's :class:`ShmMemory`.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from tensorwire import lifecycle
from tensorwire.buffers import as_bytes
from tensorwire.errors import PeerLostError, ProtocolError, SpecError, TensorWireError
from tensorwire.serve.client.common import TensorStat
from tensorwire.serve.client.context import Progress, typed
from tensorwire.serve.client.request_path import RequestPath
from tensorwire.serve.client.shm_gpu import GpuGather
from tensorwire.serve.client.shm_rows import MISS, LeasedTable, check_rows, lease_rows
from tensorwire.serve.client.window import ShardView
from tensorwire.serve.client import shm_maps
from tensorwire.serve.protocol import shm, wire
from tensorwire.settings import setting
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ShmPath", "ShmMemory", "Releaser", "MISS", "RELEASE_AFTER", "LEASES_ENV", "AHEAD_ENV", "leases_wanted"]

log = logging.getLogger(__name__)

#: The read pin of the last get / get_rows goes back to the daemon with this client's next request; a
#: client idle this long sends a RELEASE of its own (from a helper thread), so a writer waits at most
#: about this long for an idle reader. Measured on the 2-core VM: a RELEASE per read cost the client
#: ~40 us and the daemon ~60 us before it answered the next request.
RELEASE_AFTER = 0.002
#: ``TENSORWIRE_SHM_LEASES=0`` turns read leases off (every shared-memory read asks the daemon).
LEASES_ENV = "TENSORWIRE_SHM_LEASES"
#: ``TENSORWIRE_SHM_AHEAD=0`` turns write-ahead grants off (every shared-memory put reserves its slot first).
AHEAD_ENV = "TENSORWIRE_SHM_AHEAD"


def leases_wanted() -> bool:
    """Whether a client made now takes read leases (the setting, on a machine where they are safe)."""
    if not setting("shm_leases"):
        return False
    return platform.machine().lower() in shm.LEASE_MACHINES


class ShmMemory:
    """A client's shared-memory state across its sessions: mappings, the copier, the counters, and why
    shared memory is not used (``why``; ``broken``: a region could not be mapped mid-operation)."""

    def __init__(self, releaser: "Releaser", *, why: str) -> None:
        self.releaser = releaser
        self.maps: Any = None  # shm_maps.ClientMaps, made on first use
        self.copier: Any = None  # shm_maps.Copier, made on first use
        self.regions_of: dict[str, set[str]] = {}  # tensor name -> region names mapped for it
        #: name -> (key, the slot as uint8 [rows, row bytes]: a numpy array, a tensor)
        self.rows_views: dict[str, tuple[tuple[str, int, int], Any, Any]] = {}
        #: name -> the slot its read lease names, as a table (shm_rows.lease_rows; made once per lease)
        self.leased: dict[str, LeasedTable] = {}
        self.index_pinned: Any = None  # pinned staging of a GPU gather's index (shm_gpu.GpuGather)
        self.cuda_index: dict[int, Any] = {}  # device -> the index a lease read's GPU reads (shm_gpu.HostIndex)
        self.broken = False
        self.why = why
        self.use_leases = leases_wanted()
        self.use_ahead = bool(setting("shm_ahead"))
        #: Bytes copied through shared memory (all sessions).
        self.shm_bytes = 0
        #: Reads served from a read lease, without a request, and leases found stale.
        self.lease_reads = 0
        self.lease_misses = 0
        #: Puts written into a write-ahead grant's slot.
        self.ahead_puts = 0

    def ensure(self) -> None:
        if self.maps is None:
            self.maps = shm_maps.ClientMaps()
            self.copier = shm_maps.Copier()

    def forget(self, name: str) -> None:
        """``name`` was deleted: unmap its regions (the daemon unlinked them: the memory goes back)."""
        regions = self.regions_of.pop(name, ())
        self.rows_views.pop(name, None)
        self.leased.pop(name, None)  # (a view keeps a mapping alive)
        if self.maps is not None:
            for r in regions:
                self.maps._drop(r)

    def close(self) -> None:
        self.rows_views.clear()
        self.leased.clear()
        for index in self.cuda_index.values():
            if index:  # (lease reads wait for their kernels: no GPU reads these any more)
                index.close()
        self.cuda_index.clear()
        if self.maps is not None:
            self.maps.close()
            self.copier.close()


class Releaser:
    """The helper thread of a client: RELEASE a read pin held for :data:`RELEASE_AFTER` with nothing sent.

    ``lock``: the client's (an operation under way sends a request, which gives the pin back anyway);
    ``current()``: the client's shared-memory path now, if any; ``drop()``: drop its session.
    """

    def __init__(self, lock: Any, current: Callable[[], "ShmPath | None"], drop: Callable[[], None]) -> None:
        self.cond = threading.Condition(threading.Lock())
        self._lock = lock
        self._current = current
        self._drop = drop
        self._thread: threading.Thread | None = None
        self._parked = False
        self.closed = False

    def held(self, path: "ShmPath", name: str) -> None:
        """``path``'s daemon holds a read pin of ``name`` from now on."""
        with self.cond:
            path.pin, path.pin_at = name, time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tensorwire-client-release", daemon=True)
                self._thread.start()
            elif self._parked:
                self.cond.notify()

    def _pinned(self) -> "ShmPath | None":
        p = self._current()
        return p if p is not None and p.pin is not None else None

    def _loop(self) -> None:
        cond = self.cond
        while True:
            with cond:
                while not self.closed and self._pinned() is None:
                    self._parked = True
                    cond.wait()
                self._parked = False
                if self.closed:
                    return
                p = self._pinned()
                wait = p.pin_at + RELEASE_AFTER - time.monotonic() if p is not None else 0.0
                p = None  # (no path object outlives its use in this thread's frame)
                if wait > 0:
                    cond.wait(wait)
                    continue
            if not self._lock.acquire(blocking=False):
                time.sleep(RELEASE_AFTER)  # an operation is under way: its request gives the pin back
                continue
            try:
                p = self._pinned()
                if p is not None and time.monotonic() >= p.pin_at + RELEASE_AFTER:
                    try:
                        p.release()
                    except TensorWireError as exc:
                        log.debug("releasing a shared-memory read failed (%s); the session is dropped", exc)
                        self._drop()
            except Exception:
                log.exception("releasing a shared-memory read failed")
            finally:
                p = None
                self._lock.release()

    def close(self) -> None:
        """End the helper thread and join it (call without the client's lock: the thread may wait for it)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            th, self._thread = self._thread, None
        lifecycle.join(th)


class ShmPath(RequestPath):
    """The hot operations of one session through shared memory (see the module docstring)."""

    shm = True
    flags = wire.FLAG_SHM

    def __init__(self, base: RequestPath, mem: ShmMemory) -> None:
        super().__init__(base.ctx, base.session)
        self._take_over(base)
        self.mem = mem
        self.releaser = mem.releaser
        self.pin: str | None = None  # the name whose read pin the daemon holds for this session
        self.pin_at = 0.0
        # read leases: name -> (cell, generation, region, offset, nbytes, spec)
        self.leases: dict[str, tuple[int, int, str, int, int, TensorSpec]] = {}
        self.lease_tab: Any = None  # shm_maps.LeaseTable of the daemon
        self.page: Any = None  # shm_maps.SessionPage: lease-read counts for the daemon, the write-ahead ticket
        # write-ahead grant (see tensorwire.serve.protocol.shm.PageLock): name, (dtype, shape), region, ticket
        self.ahead: tuple[str, tuple[int, tuple[int, ...]], str, int] | None = None
        self.gpu = GpuGather(self.ctx, mem)  # get_rows into CUDA tensors, read in place

    def close(self) -> None:
        self.gpu.wait()
        self.leases.clear()
        self.mem.leased.clear()
        self.ahead = None
        self.pin = None  # the daemon releases what a closed session held
        tab, self.lease_tab = self.lease_tab, None
        page, self.page = self.page, None
        if tab is not None:
            tab.close()
        if page is not None:
            page.close()
        super().close()

    @property
    def copier(self) -> Any:
        return self.mem.copier

    def call(self, pr: Progress, op: int, name: str, *, flags: int = 0, **kw: Any) -> "wire.Reply":
        if not flags & wire.FLAG_AHEAD:
            self.ahead = None  # any other request ends the session's write-ahead grant (the daemon's side too)
        self.gpu.wait()  # a GPU still reading the pinned version keeps the pin until it is done
        self.pin = None  # any request gives the last read's pin back (the daemon releases it first)
        return super().call(pr, op, name, flags=flags, **kw)

    def release(self) -> None:
        """RELEASE the read pin of the last SHM reply (no reply comes back). Under the client's lock."""
        self.gpu.wait()
        name, self.pin = self.pin, None
        if name is not None:
            self.send_request(wire.OP_RELEASE, name)

    # -- reads ---------------------------------------------------------------------------------------
    def view(self, pr: Progress, rep: "wire.Reply", name: str) -> "torch.Tensor":
        """The bytes an SHM reply names (a uint8 view of the daemon's region, mapped on first use)."""
        mem = self.mem
        mem.ensure()
        try:
            view = mem.maps.get(rep.message, rep.chunk, rep.nbytes)
        except shm.ShmError as exc:
            # Mapped once (the proof) but not now: stop using shared memory; the operation runs
            # once more on a new session over the data connection (nothing was read or written).
            mem.broken = True
            mem.why = f"a region of the daemon could not be mapped ({exc})"
            lost = PeerLostError(f"shared memory: {exc}")
            pr.lost = lost
            raise lost from None
        mem.regions_of.setdefault(name, set()).add(rep.message)
        return view

    def shm_read(self, pr: Progress, rep: "wire.Reply", name: str, use: Callable[["torch.Tensor"], Any]) -> Any:
        """Run ``use(bytes)`` on the region an SHM read reply names; its pin goes back with the next request
        (or the releaser's RELEASE once this client is idle)."""
        view = self.view(pr, rep, name)
        try:
            result = use(view)
            self.keep_lease(name, rep)
            return result
        finally:
            self.releaser.held(self, name)

    def keep_lease(self, name: str, rep: "wire.Reply") -> None:
        """Keep the read lease an SHM read reply hands out (if any)."""
        if rep.lease and self.lease_tab is not None and rep.lease < self.lease_tab.size:
            spec = self.ctx.reply_spec(name, rep)
            self.leases[name] = (rep.lease, rep.step, rep.message, rep.chunk, rep.nbytes, spec)

    def drop_lease(self, name: str) -> None:
        """The lease on ``name`` no longer holds (a writer came, the daemon is gone): read by request next."""
        self.leases.pop(name, None)
        self.mem.leased.pop(name, None)
        self.mem.lease_misses += 1

    def lease_read(self, name: str, use: Callable[[TensorSpec, "torch.Tensor", str], Any], op: str) -> Any:
        """A read served from this session's lease on ``name`` (no request), or :data:`MISS`.

        ``use(spec, bytes, region)`` copies out of the region the lease names; the result counts only
        if the lease's generation is the same before and after (else the lease is dropped and the
        caller asks the daemon). Errors ``use`` raises (a wrong ``out``, a row out of range) are the
        caller's, as they would be on the pinned path.
        """
        lease = self.leases.get(name)
        tab = self.lease_tab
        if lease is None or tab is None:
            return MISS
        mem = self.mem
        cell, gen, region, offset, nbytes, spec = lease
        cells = tab.cells
        if cells[cell] != gen or not tab.alive_lately():
            self.drop_lease(name)
            return MISS
        try:
            view = mem.maps.get(region, offset, nbytes)
        except shm.ShmError:
            del self.leases[name]
            mem.leased.pop(name, None)
            return MISS
        before = mem.shm_bytes
        result = use(spec, view, region)
        if cells[cell] != gen:  # a writer came meanwhile: what was copied may be mixed
            self.drop_lease(name)
            mem.shm_bytes = before
            return MISS
        mem.lease_reads += 1
        self.page.add(op, mem.shm_bytes - before)
        return result

    def copy_out(
        self, name: str, spec: TensorSpec, src: "torch.Tensor", region: str, out: "torch.Tensor | None"
    ) -> "torch.Tensor":
        """A get: from the daemon's pinned slot into ``out`` or a receive buffer, one copy."""
        mem, ctx = self.mem, self.ctx
        if out is not None:
            ctx.check_out(spec, out, spec.shape)
            if out.device.type == "cpu" and out.is_contiguous():
                if spec.nbytes:
                    mem.copier.copy(as_bytes(out).numpy(), src.numpy())
            else:
                if out.is_cuda:
                    mem.maps.pin_for_cuda(region)
                if spec.nbytes:
                    out.copy_(typed(src, spec.torch_dtype, spec.shape))
            result = out
        else:
            raw = ctx.pool(name, "get").acquire(spec.nbytes)
            if spec.nbytes:
                mem.copier.copy(raw.numpy(), src.numpy())
            result = typed(raw, spec.torch_dtype, spec.shape)
        mem.shm_bytes += spec.nbytes
        return result

    def gather(
        self,
        name: str,
        idx: "torch.Tensor",
        out: "torch.Tensor | None",
        got: TensorSpec,
        src: "torch.Tensor",
        region: str,
        *,
        pool: bool,
    ) -> "torch.Tensor":
        """A get_rows: the rows, gathered by this process from the daemon's pinned version, one copy.
        ``pool``: torch's thread pool may do it (a lease read: no request follows at once)."""
        if not got.shape:
            raise SpecError(f"{name}: a 0-d tensor has no rows")
        import torch

        mem = self.mem
        rows = got.shape[0]
        n = idx.numel()
        inp = idx.numpy()
        if n:
            check_rows(idx, rows)
        if out is not None and out.is_cuda and self.gpu.gather(idx, out, got, src, region, lease=pool):
            mem.shm_bytes += got.nbytes // rows * n
            return out
        dest, dest_raw, row_bytes = self.ctx.rows_dest(name, got, n, out)
        if n and row_bytes:
            key = (region, rows, row_bytes)
            cached = mem.rows_views.get(name)
            if cached is None or cached[0] != key:
                if len(mem.rows_views) >= 64:
                    mem.rows_views.clear()
                cached = mem.rows_views[name] = (key, src.numpy().reshape(rows, row_bytes), src.view(rows, row_bytes))
            # rows as bytes: any dtype. A lease read is torch's own index_select over a tensor view of the
            # mapped slot (the kernel and threads of a local gather) or numpy's take, whichever is faster here
            # now (shm_maps.Copier.torch_gather); after a request, numpy's take (no OpenMP team left spinning
            # on the daemon's cores)
            copier, nbytes = mem.copier, n * row_bytes
            use = pool and copier.torch_gather(nbytes)
            t0 = time.perf_counter()
            if use:
                torch.index_select(cached[2], 0, idx, out=dest_raw.view(n, row_bytes))
            else:
                copier.take(cached[1], inp, dest_raw.numpy().reshape(n, row_bytes), pool=False)
            if pool:
                copier.gathered(use, nbytes, time.perf_counter() - t0)
        mem.shm_bytes += n * row_bytes
        return self.ctx.result(dest, out)

    def get(self, name: str, out: "torch.Tensor | None", pr: Progress) -> "torch.Tensor":
        if self.leases:
            got = self.lease_read(name, lambda spec, src, region: self.copy_out(name, spec, src, region, out), "get")
            if got is not MISS:
                return got
        return super().get(name, out, pr)

    def read_shm(
        self, pr: Progress, rep: "wire.Reply", name: str, spec: TensorSpec, out: "torch.Tensor | None"
    ) -> "torch.Tensor":
        return self.shm_read(pr, rep, name, lambda src: self.copy_out(name, spec, src, rep.message, out))

    def get_rows(self, name: str, idx: "torch.Tensor", out: "torch.Tensor | None", pr: Progress) -> "torch.Tensor":
        if self.leases:
            got = lease_rows(self, name, idx, out)  # the usual case, into host memory: a few microseconds
            if got is not MISS:
                return got
            got = self.lease_read(
                name, lambda spec, src, region: self.gather(name, idx, out, spec, src, region, pool=True), "get_rows"
            )
            if got is not MISS:
                return got
        rep = self.call(pr, wire.OP_GET_ROWS, name, shape=(idx.numel(),), flags=wire.FLAG_SHM)
        if rep.status == wire.SHM:
            got = self.ctx.reply_spec(name, rep)
            if rep.nbytes != got.nbytes:
                raise self.lost(pr, f"get_rows {name}: the server names {rep.nbytes} bytes of {got.describe()}")
            return self.shm_read(
                pr, rep, name, lambda src: self.gather(name, idx, out, got, src, rep.message, pool=False)
            )
        if rep.status != wire.FALLBACK:
            raise self.lost(pr, f"get_rows {name}: reply status {rep.status} to a shared-memory request")
        # the tensor is not in shared memory: the request again, with the index, over the connection
        return super().get_rows(name, idx, out, pr)

    # -- writes --------------------------------------------------------------------------------------
    def fill_put(self, dst: "torch.Tensor", region: str, tensor: "torch.Tensor", nbytes: int) -> None:
        """A put's bytes into the slot the daemon reserved: one copy, straight from the caller's tensor."""
        src = tensor.detach()
        if src.device.type == "cpu" and src.is_contiguous():
            if nbytes:
                self.mem.copier.copy(dst.numpy(), as_bytes(src).numpy())
            return
        if src.is_cuda:
            self.mem.maps.pin_for_cuda(region)
        typed(dst, src.dtype, tuple(src.shape)).copy_(src)

    def put(self, name: str, tensor: "torch.Tensor", spec: TensorSpec, pr: Progress) -> TensorStat:
        if self.ahead is not None:
            st = self.put_ahead(pr, spec, tensor)
            if st is not None:
                return st
        rep = self.call(pr, wire.OP_PUT, name, dtype=wire.dtype_code(spec.dtype), shape=spec.shape, flags=self.flags)
        if rep.status == wire.SHM:
            return self.write_shm(
                pr,
                wire.OP_PUT,
                rep,
                name,
                spec.nbytes,
                lambda dst: self.fill_put(dst, rep.message, tensor, spec.nbytes),
            )
        return self.write(pr, wire.OP_PUT, rep, self.ctx.source(name, tensor), name)

    def write_shm(
        self, pr: Progress, op: int, rep: "wire.Reply", name: str, nbytes: int, fill: Callable[[Any], None]
    ) -> TensorStat:
        """After an SHM reply to a write: ``fill`` the region, COMMIT, return the committed stat."""
        if rep.nbytes != nbytes:
            raise self.lost(pr, f"the server reserved {rep.nbytes} bytes, this client has {nbytes}")
        try:
            fill(self.view(pr, rep, name))
        except BaseException as exc:
            if pr.lost is None:
                # The daemon holds the reservation until COMMIT or the session's end: end the session.
                pr.lost = exc if isinstance(exc, TensorWireError) else ProtocolError(f"write abandoned: {exc!r}")
                if not isinstance(exc, TensorWireError):
                    self.ctx.drop_session()
            raise
        pr.sent = True  # from here on the daemon may commit: never repeated
        done = self.call(pr, wire.OP_COMMIT, name)
        return self.committed(pr, name, nbytes, done, put=op == wire.OP_PUT)

    def committed(self, pr: Progress, name: str, nbytes: int, done: "wire.Reply", *, put: bool) -> TensorStat:
        """The stat of a shared-memory write from its COMMIT's OK reply (a put's may carry a write-ahead grant)."""
        if done.status != wire.OK:
            raise self.lost(pr, f"reply to a commit has status {done.status}")
        self.mem.shm_bytes += nbytes
        if put:
            ok = done.message and done.step > 0 and done.nbytes == nbytes and self.page is not None
            ok = ok and self.mem.use_ahead
            self.ahead = (name, (done.dtype, tuple(done.shape)), done.message, int(done.step)) if ok else None
        spec = self.ctx.reply_spec(name, done)
        return TensorStat(spec, int(done.version), spec.nbytes)

    def put_ahead(self, pr: Progress, spec: TensorSpec, tensor: "torch.Tensor") -> TensorStat | None:
        """A put into the slot of the session's write-ahead grant: one copy, one COMMIT. None: not this put
        (another name or spec: the daemon's answer to the ordinary request is what the caller gets), or the
        grant has ended (nothing was written that anyone will see); put the ordinary way."""
        grant, self.ahead = self.ahead, None
        page, name, nbytes = self.page, spec.name, spec.nbytes
        if (
            grant is None
            or page is None
            or grant[0] != name
            or grant[1] != (wire.dtype_code(spec.dtype), tuple(spec.shape))
        ):
            return None
        region, ticket = grant[2], grant[3]
        if not page.lock.try_lock():  # the daemon is revoking it right now
            return None
        try:
            if int(page.ahead[0]) != ticket:  # revoked (another writer, a delete)
                return None
            try:
                dst = self.mem.maps.get(region, 0, nbytes)
            except shm.ShmError:
                return None
            self.mem.regions_of.setdefault(name, set()).add(region)
            self.fill_put(dst, region, tensor, nbytes)
            pr.sent = True  # from here on the daemon may commit: never repeated
            done = self.call(pr, wire.OP_COMMIT, name, shape=(ticket,), flags=wire.FLAG_AHEAD)
        finally:
            page.lock.unlock()
        if done.status == wire.FALLBACK:  # the grant had ended before the COMMIT: nothing changed
            pr.sent = False
            return None
        st = self.committed(pr, name, nbytes, done, put=True)
        self.mem.ahead_puts += 1
        return st

    # -- one gather over several daemons (the sharded client) ----------------------------------------
    def lease_view(self, name: str) -> ShardView | None:
        """Where the version this session's lease on ``name`` names lies, if the lease holds now."""
        lease = self.leases.get(name)
        tab = self.lease_tab
        if lease is None or tab is None:
            return None
        cell, gen, region, offset, nbytes, spec = lease
        if tab.cells[cell] != gen or not tab.alive_lately():
            self.drop_lease(name)
            return None
        return ShardView(region, offset, nbytes, spec, tab.cells, cell, gen)

    def pin_view(self, name: str, rows: int, pr: Progress) -> ShardView | None:
        """A shared-memory get_rows request without an index: the daemon pins its version of ``name``
        for this process to gather ``rows`` rows from. None: the tensor is not in shared memory."""
        rep = self.call(pr, wire.OP_GET_ROWS, name, shape=(rows,), flags=wire.FLAG_SHM)
        if rep.status == wire.FALLBACK:
            return None
        if rep.status != wire.SHM:
            raise self.lost(pr, f"get_rows {name}: reply status {rep.status} to a shared-memory request")
        got = self.ctx.reply_spec(name, rep)
        if rep.nbytes != got.nbytes or not got.shape:
            raise self.lost(pr, f"get_rows {name}: the server names {rep.nbytes} bytes of {got.describe()}")
        self.keep_lease(name, rep)
        self.releaser.held(self, name)
        return ShardView(rep.message, rep.chunk, rep.nbytes, got)

    def count(self, nbytes: int, *, leased: bool) -> None:
        """A gather of ``nbytes`` out of a view of this session (a lease read: counted for the daemon too)."""
        mem = self.mem
        mem.shm_bytes += nbytes
        if leased:
            mem.lease_reads += 1
            if self.page is not None:
                self.page.add("get_rows", nbytes)
