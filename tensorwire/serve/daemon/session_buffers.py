"""A session's own memory: its row buffer, the request thread's request and reply buffers, and their charge
against ``--max-bytes`` (the :class:`SessionBuffers` part of :class:`tensorwire.serve.daemon.session.Session`).

The request buffers are charged when the session opens (by the service); the row
buffer's capacity as it grows (:meth:`SessionBuffers.reserve_scratch`). Everything
is freed, and the charge given back, when the session ends: the row and reply
buffers by the worker (:meth:`SessionBuffers._release_buffers`), the request
buffers by the request thread, the request buffers' charge by whichever of the two
finishes last.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.buffers import allocate_host
from tensorwire.errors import ClosedError, ProtocolError
from tensorwire.serve.protocol.common import MAX_ROWS_BYTES
from tensorwire.serve.protocol.wire import REPLY_BYTES

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SessionBuffers"]


def _free(t: "torch.Tensor | None") -> None:
    """Give ``t``'s memory back now, whoever still holds a view of it (they must not touch it again)."""
    if t is None:
        return
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError:  # pragma: no cover - a storage that cannot be resized (pinned): dropped by reference
        pass


class SessionBuffers:
    """The buffers of a session (see the module docstring); a part of
    :class:`~tensorwire.serve.daemon.session.Session`."""

    # what the session provides
    kind: str
    close_reason: str
    _lock: threading.Lock
    _exec: threading.Lock
    fold_tally: Callable[[], None]

    def _init_buffers(self, store: Any, charged: int) -> None:
        self._scratch: "torch.Tensor | None" = None
        # --max-bytes accounting of this session's own buffers (see _release_buffers): the store they are
        # charged to, what was charged at open (the request buffers), and the row buffer's charged capacity
        self._store = store
        self._fixed_charge = charged
        self._scratch_charge_cap = 0
        self._released = False
        self._req_bufs: "list[torch.Tensor]" = []
        self._holders = 1  # threads that use the charged buffers: the worker, and the request thread once started
        self.reply_buf: "torch.Tensor | None" = None  # the request path's reply buffer (jobs run one at a time)
        self._reply: "tuple[memoryview, Any] | None" = None  # (view to pack into, what to send): reply_buffer()
        self._req_views: "dict[int, tuple[torch.Tensor, memoryview]]" = {}  # request buffer -> its bytes
        #: index_view() and rows_out(): the views of a read, by where its index lies and by its rows' layout
        self._index_views: "dict[tuple[int, int, int], tuple[Any, ...]]" = {}
        self._rows_out: "dict[tuple[Any, ...], tuple[Any, ...]]" = {}

    @staticmethod
    def _scratch_cap(nbytes: int) -> int:
        return min(1 << max(16, (nbytes - 1).bit_length()), MAX_ROWS_BYTES)

    def reserve_scratch(self, nbytes: int) -> None:
        """Charge the row buffer's growth to ``nbytes`` against ``--max-bytes`` now (a handler, before it
        schedules the job that uses it): a request that does not fit is refused before anything is done.

        Raises:
            ResourceExhaustedError: it does not fit (what is charged already stays).
            ClosedError: the session is closed.
        """
        if nbytes > MAX_ROWS_BYTES:
            raise ProtocolError(f"{nbytes} bytes of rows exceeds the per-request limit of {MAX_ROWS_BYTES}")
        store = self._store
        if store is None or nbytes == 0:
            return
        with self._lock:
            cap = self._scratch_cap(nbytes)
            if self._released:
                raise ClosedError(f"session closed: {self.close_reason}")
            grow = cap - self._scratch_charge_cap
            if grow <= 0:
                return
            store.charge(grow, f"a {nbytes}-byte row buffer for this session", buffers=True)
            self._scratch_charge_cap = cap

    def scratch(self, nbytes: int) -> "torch.Tensor":
        """A per-session host buffer of at least ``nbytes`` (grown, never shrunk; the thread running a job only).

        Its capacity is charged against ``--max-bytes`` (by :meth:`reserve_scratch`, or here) and the
        memory is freed when the session ends (:meth:`_release_buffers`).
        """
        if self._scratch is None or self._scratch.numel() < nbytes:
            self.reserve_scratch(nbytes)
            old, self._scratch = self._scratch, None
            _free(old)  # before the bigger one: the two never coexist
            self._scratch = allocate_host(self._scratch_cap(nbytes))
        return self._scratch[:nbytes]

    def index_view(self, buf: "torch.Tensor", at: int, n: int) -> "torch.Tensor":
        """The int64 index of ``n`` rows at byte ``at`` of request buffer ``buf``, as a tensor view made once per
        such place (a session repeats its reads; the request thread only)."""
        key = (id(buf), at, n)
        got = self._index_views.get(key)
        if got is not None and got[1] is buf:
            return got[0]
        import torch

        index = buf[at : at + 8 * n].view(torch.int64)
        if len(self._index_views) >= 64:
            self._index_views.clear()
        self._index_views[key] = (index, buf)
        return index

    def rows_out(
        self, nbytes: int, n: int, dtype: "torch.dtype", row_shape: tuple[int, ...]
    ) -> "tuple[torch.Tensor, memoryview]":
        """The row buffer's first ``nbytes`` as ``n`` rows of ``row_shape`` and ``dtype`` (a gather's destination)
        and as a memoryview (what is sent), made once per such read while the row buffer stays (the thread
        running a job only)."""
        key = (nbytes, n, dtype, row_shape)
        got = self._rows_out.get(key)
        if got is not None and got[2] is self._scratch:
            return got[0], got[1]
        out = self.scratch(nbytes)
        dst = out.view(dtype).view((n, *row_shape))
        mv = memoryview(out.numpy())
        if len(self._rows_out) >= 64:
            self._rows_out.clear()
        self._rows_out[key] = (dst, mv, self._scratch)
        return dst, mv

    def request_buffer(self, nbytes: int) -> "torch.Tensor":
        """A request buffer of the request thread (charged at open; freed when the session ends)."""
        import torch

        b = torch.empty(nbytes, dtype=torch.uint8)
        self._req_bufs.append(b)
        self._req_views[id(b)] = (b, memoryview(b.numpy()))
        return b

    def request_view(self, buf: "torch.Tensor") -> memoryview:
        """The bytes of request buffer ``buf`` (made once per buffer, not per request)."""
        v = self._req_views.get(id(buf))
        return v[1] if v is not None and v[0] is buf else memoryview(buf.numpy())

    def reply_buffer(self) -> "tuple[memoryview, Any]":
        """The request path's reply buffer (made on first use; the thread running a job only): a view to pack
        into and what to send -- on TCP that same view (its send takes one as it is), else the tensor."""
        r = self._reply
        if r is None:
            import torch

            self.reply_buf = buf = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
            mv = memoryview(buf.numpy())
            r = self._reply = (mv, mv if self.kind == "tcp" else buf)
        return r

    def _release_buffers(self) -> None:
        """The worker, once the session is closed: free the jobs' buffers now (not at the next garbage
        collection: views of them may sit in reference cycles) and give their charge back."""
        with self._exec:  # the job running now, if any, finishes first; no other starts on a closed session
            with self._lock:
                if self._released:
                    return
                self._released = True
                charge, self._scratch_charge_cap = self._scratch_charge_cap, 0
                bufs = [self._scratch, self.reply_buf]
                self._rows_out = {}
                self._scratch = self.reply_buf = None
                self._reply = None
            for b in bufs:
                _free(b)
            # the last of this session's counts: no job runs on it any more (and none after)
            self.fold_tally()
        if charge and self._store is not None:
            self._store.uncharge(charge, buffers=True)
        self._drop_holder()

    def _drop_holder(self) -> None:
        """A thread that used the request buffers' charge is done; the last one gives it back."""
        with self._lock:
            self._holders -= 1
            charge = self._fixed_charge if self._holders == 0 else 0
            if charge:
                self._fixed_charge = 0
        if charge and self._store is not None:
            self._store.uncharge(charge, buffers=True)

    def _free_request_buffers(self) -> None:
        """The request thread, once it ends: its own buffers (nothing else reads them), then its holder's share."""
        bufs, self._req_bufs = self._req_bufs, []
        self._req_views = {}
        self._index_views = {}
        for b in bufs:
            _free(b)
        self._drop_holder()
