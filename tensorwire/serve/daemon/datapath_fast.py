"""The request thread's short way for the commonest remote read: a posted get_rows over the data connection.

A get_rows whose client posted the receive for exactly the rows the daemon
holds (``FLAG_POSTED`` and nothing else) is answered right in the session's
request thread: the index is checked where it lies in the request buffer, the
version pinned without waiting, the rows gathered into the session's row
buffer, the request buffer posted again and the reply and the rows sent in one
write -- what :meth:`~tensorwire.serve.daemon.datapath_reads.ReadRequests._get_rows`
does for such a request, without the job, its closures and the scheduling
around it. That machinery was most of a small request's cost: on a 16-core host
one row took 339 us against 55 us for the same bytes over the same transport
with nothing around it (``bench/results/serve-remote_h200_2026-12-02-4.md``).

Anything else -- another op or flag, a shared-memory session, a write pending
or granted ahead, a draining daemon, a shard layout, an index out of range, a
client that expects another dtype or shape, a version being rewritten, a
session with a job queued or running, more rows than one thread gathers --
goes the usual way, and this module has then changed nothing: every check is
made before the version is pinned and the steps taken.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tensorwire.errors import TensorWireError
from tensorwire.spec import DTYPE_CODES
from tensorwire.serve.daemon import datapath_reads
from tensorwire.serve.daemon.ops import status_of
from tensorwire.serve.protocol.common import TAG_DOWN, TAG_REPLY, TAG_REQUEST, check_index
from tensorwire.serve.protocol.wire import FLAG_POSTED, OP_GET_ROWS, OPS, parse_request

if TYPE_CHECKING:  # pragma: no cover
    import collections

    import torch

    from tensorwire.serve.daemon.datapath_base import RequestHandlers
    from tensorwire.serve.daemon.session import Session

__all__ = ["fast_get_rows"]

#: Offsets of the op and the flags in a request's fixed header (``wire.REQUEST``: magic, version, op, flags).
_OP_AT, _FLAGS_AT = 5, 6


def fast_get_rows(
    h: "RequestHandlers",
    s: "Session",
    buf: "torch.Tensor",
    nbytes: int,
    posted: "collections.deque[torch.Tensor]",
) -> bool:
    """Answer the request in ``buf[:nbytes]`` here if it is a plain posted get_rows (see the module docstring);
    ``buf`` is then posted again and appended to ``posted``. False: not taken, nothing changed.

    A transfer that fails once begun closes the session, as a failed job does.
    """
    view = s.request_view(buf)
    if view[_OP_AT] != OP_GET_ROWS or view[_FLAGS_AT] != FLAG_POSTED:
        return False
    if s.shm or s.pending is not None or s.ahead is not None or s.shm_hello is not None or h.service.draining:
        return False
    t = s.transport
    if t is None or t.kind != "tcp":
        return False
    try:
        req = parse_request(view[:nbytes])
    except ValueError:
        return False  # the usual way says what is wrong (and closes the session)
    try:
        e = h.store.check_layout(req.name, req.layout)
    except TensorWireError:
        return False
    if e is None or e.layout is not None:
        return False
    spec = e.spec
    shape = spec.shape
    n = req.nindex
    if not shape or not n or req.dtype != DTYPE_CODES[spec.dtype] or req.shape != (n, *shape[1:]):
        return False
    rows = shape[0]
    rb = spec.nbytes // rows if rows else 0
    nb = n * rb
    if not nb or nb >= datapath_reads.PARALLEL_MIN_BYTES:  # (two threads gather those: the usual way)
        return False
    import torch

    try:
        s.reserve_scratch(nb)
        index = check_index(s.index_view(buf, req.index_offset, n), rows)
        idx, version = e.acquire_read(time.monotonic())  # no waiting: a row update under way goes the usual way
    except TensorWireError:
        return False
    steps = s.begin_inline()
    if steps is None:  # a job is queued or running (or the session closed): the usual way keeps the order
        e.release_read(idx)
        return False
    down, reply = steps
    t0 = time.monotonic()
    released = False
    try:
        with s.running():
            dst, out = s.rows_out(nb, n, spec.torch_dtype, shape[1:])
            torch.index_select(e.slot(idx).tensor, 0, index, out=dst)
            e.release_read(idx)
            released = True
            t.post_recv(TAG_REQUEST, buf, header=True)  # its credit rides on the reply
            posted.append(buf)
            ok = h._ok_reply(s, req, spec, version=version, step=down, nbytes=nb, chunk=nb)
            deadline = t0 + h._timeout(req)
            t.send_two((TAG_REPLY, ok, reply), (TAG_DOWN, out, down), timeout=max(0.0, deadline - time.monotonic()))
    except BaseException as exc:  # noqa: BLE001 - as a failed job: counted, logged, the session closed
        if not released:
            e.release_read(idx)
        h._record(s, OPS[OP_GET_ROWS], status_of(exc).name, t0)
        s.transfer_failed("get_rows", exc)
        return True
    finally:
        s.end_inline()
    h._record(s, OPS[OP_GET_ROWS], "ok", t0)
    if s.tally is not None:
        s.tally.transfer(s.kind, "out", nb, time.monotonic() - t0)
    return True
