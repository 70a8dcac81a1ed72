"""Server side of data-plane requests (the format is in :mod:`tensorwire.serve.protocol.wire`).

A session's request thread (:class:`tensorwire.serve.daemon.session.Session`) hands
every request it receives on tag 4 to :class:`DataRequests`, which checks it
as completely as the gRPC handler of the same operation does -- with the same
helpers (:func:`~tensorwire.serve.daemon.ops.plan_rows` and friends), before it
reserves, pins or allocates anything -- and returns a
:class:`~tensorwire.serve.daemon.jobs.Job`: either the operation (its reply on
tag 5, then its bytes on tag 1 or 2) or an ERROR reply naming the error class.
The session runs the job at once in the request thread when nothing else is
queued (the usual case: a client runs one operation at a time), so an
operation costs no thread hand-off and no gRPC call.

:class:`DataRequests` parses a request and calls the handler of its kind: reads
(get, get_rows) are :class:`~tensorwire.serve.daemon.datapath_reads.ReadRequests`,
writes (put, put_rows, add_rows, COMMIT) are
:class:`~tensorwire.serve.daemon.datapath_writes.WriteRequests`, the shared-memory
hello is here; what they all answer with (replies, jobs, errors) is
:class:`~tensorwire.serve.daemon.datapath_base.RequestHandlers`. One class, made of
these parts, so calling a handler is a plain method call (no table lookup per request).

Consistency is the gRPC path's: a read pins the version it reads
(``acquire_read``) from validation until its bytes are out of the slot (get)
or gathered (get_rows); a put receives into the staging slot and commits only
once every byte has arrived; row updates commit under the entry's exclusive
row lock.

get_rows: the request thread sends the OK reply first (the client posts its
receives while the rows are gathered), lets the transport progress once
(:meth:`Session.nudge`: on UCX the client's request, a rendezvous when it
carries thousands of row numbers, may complete only then), gathers the rows
into the session's scratch buffer and sends them. A client that posted its
receive before the request (``FLAG_POSTED``: TCP clients) waits for the rows
already: they are gathered first, then the reply and the rows (one message)
go out back to back. How was chosen by measurement
on the 2-core VM (figures with the constants below; the end-to-end result is in
bench/results/archive/serve_cpu2_2026-11-22.md):

- on UCX, in chunks of ``ROWS_CHUNK_BYTES``, each posted (``start_send``) as
  soon as it is gathered: the client's process copies chunk i out of this
  process's memory (cma) while chunk i + 1 is gathered, so the two processes
  use both cores; the reply's ``chunk`` tells the client how to post;
- from ``PARALLEL_MIN_BYTES``, gathered by two threads (this one and the
  session's helper thread, :class:`Gatherer`, made on first use), one message,
  where torch runs one intra-op thread (the daemon below 8 CPUs; above, torch's
  own threads split every gather: :mod:`tensorwire.serve.daemon.threads`);
- otherwise (TCP, where the sender is the one copying into the socket) one
  gather, one message.

Shared memory (requests with ``FLAG_SHM`` on a session whose client proved it
maps this daemon's memory, see :mod:`tensorwire.serve.protocol.shm`): no tensor bytes
cross the data connection.

- get: the version is pinned and the SHM reply names its slot's region; the
  client copies it out. The pin is released by the session's next request (or
  a RELEASE the client sends once idle, or close): a RELEASE after every read
  cost ~0.1 ms per operation on the 2-core VM (the client's send, the
  daemon's handling before the next request).
- both carry a read lease (sessions of shm version >= 2): the tensor's cell in
  the store's lease table and its generation for the pinned version, read
  with the pin under the tensor's lock; the client reads that version again
  without a request while the generation holds (:class:`tensorwire.serve.daemon.shm.Leases`).
- get_rows: the same pin and reply (the whole table); the client gathers the
  rows itself, from the mapping straight into its destination: one copy, no
  index sent, no scratch -- a gather by the daemon into a shared scratch
  buffer, then the client's copy out, would move every row twice.
- put: the staging slot is reserved as for the socket path and its region
  named; the client writes into it and sends COMMIT, which swaps the version
  in (a session closed before that aborts: the previous version stays).
  The COMMIT's reply may carry a write-ahead grant (shm version >= 3,
  :meth:`Session.grant_ahead`): the next staging slot, already reserved for
  this session's next put of the tensor, which is then just a COMMIT with
  ``FLAG_AHEAD`` (:meth:`DataRequests._commit_ahead`). Any other request of
  the session ends its grant first (revoking needs the client's page lock: a
  client that holds it while asking something else is broken, and its session
  is closed).
- put_rows / add_rows: validated as usual (the index travels in the request),
  the values go into the session's scratch region (charged against
  ``--max-bytes``), and COMMIT applies them under the row lock.

A slot in ordinary memory (``/dev/shm`` full, say) is answered over the data
connection as without the flag, except a shared-memory get_rows (it carries no
index): FALLBACK tells the client to send it again without the flag.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tensorwire import errors
from tensorwire.serve.daemon.ops import Draining
from tensorwire.serve.daemon.jobs import Job
from tensorwire.serve.protocol.shm import LEASE_VERSION
from tensorwire.serve.protocol.wire import (
    OK,
    OP_ADD_ROWS,
    OP_COMMIT,
    OP_GET,
    OP_GET_ROWS,
    OP_PUT,
    OP_RELEASE,
    OP_SHM_HELLO,
    OPS,
    MalformedRequest,
    Request,
    parse_request,
)
from tensorwire.serve.daemon.datapath_base import error_class
from tensorwire.serve.daemon.datapath_fast import fast_get_rows
from tensorwire.serve.daemon.datapath_reads import Gatherer, ReadRequests
from tensorwire.serve.daemon.datapath_writes import WriteRequests

if TYPE_CHECKING:  # pragma: no cover
    import collections

    import torch

    from tensorwire.transport.base import Transport
    from tensorwire.serve.daemon.session import Session

__all__ = ["DataRequests", "Gatherer", "error_class"]

log = logging.getLogger(__name__)


class DataRequests(ReadRequests, WriteRequests):
    """Turns a request received on tag 4 into the job that answers it (see the module docstring)."""

    # -- entry point (the session's request thread) -------------------------------------------
    def fast_read(
        self, s: "Session", buf: "torch.Tensor", nbytes: int, posted: "collections.deque[torch.Tensor]"
    ) -> bool:
        """A plain posted get_rows answered in the request thread (:func:`~.datapath_fast.fast_get_rows`); False:
        not one (nothing changed), call this object."""
        return fast_get_rows(self, s, buf, nbytes, posted)

    def __call__(self, s: "Session", buf: "torch.Tensor", nbytes: int) -> Job | None:
        """Validate the request in ``buf[:nbytes]`` and return its job (which may read ``buf`` until it is done).

        Returns None for a request answered by nothing (RELEASE), done already.

        Raises:
            MalformedRequest: the request does not follow the format (the session is closed).
        """
        t0 = time.monotonic()
        req = parse_request(s.request_view(buf)[:nbytes])
        if req.op == OP_RELEASE:
            if not s.shm or not s.release_pin(req.name):
                raise MalformedRequest(f"RELEASE of {req.name!r}, which this session does not hold")
            return None
        if s.holds_pin:
            s.release_pin()  # a client sends its next request once it is done with the last read
        if s.ahead is not None and not (req.op == OP_COMMIT and req.ahead):
            g = s.take_ahead()  # the client went on to something else: its grant ends
            if not g.revoke():
                raise MalformedRequest(f"{OPS[req.op]} request while writing the slot of a write-ahead grant")
        if s.shm_hello is not None and req.op != OP_SHM_HELLO:
            s.withdraw_hello()  # the client went on without shared memory
        if (req.shm or req.op == OP_COMMIT) and not s.shm:
            raise MalformedRequest(f"shared-memory {OPS[req.op]} on a session without shared memory")
        try:
            if req.op == OP_COMMIT:  # finishes a write already under way: taken while draining
                return self._commit(s, req, t0)
            if self.service.draining:
                raise Draining("the server is shutting down and takes no new work")
            if s.pending is not None:
                raise errors.ProtocolError("a write is pending on this session: commit or abort it first")
            held = None
            if req.op != OP_SHM_HELLO:  # a shard is served only to a request built for its very layout
                held = self.store.check_layout(req.name, req.layout)
            if req.op == OP_GET:
                return self._get(s, req, t0, held)
            if req.op == OP_GET_ROWS:
                if req.shm:
                    return self._get_rows_shm(s, req, t0)
                return self._get_rows(s, req, buf, t0)
            if req.op == OP_PUT:
                return self._put(s, req, t0, held)
            if req.op == OP_SHM_HELLO:
                return self._hello(s, req, t0)
            return self._put_rows(s, req, buf, t0, add=req.op == OP_ADD_ROWS)
        except errors.TensorWireError as exc:
            return self._error_job(s, req, exc, t0)
        except Exception as exc:
            log.exception("%s request: internal error", OPS[req.op])
            return self._error_job(s, req, exc, t0)

    def _hello(self, s: "Session", req: Request, t0: float) -> Job:
        """The client's proof that it maps this daemon's memory: the nonce of the session's hello region."""
        import hmac

        nonce = s.shm_nonce
        offered = s.shm_hello is not None and bool(nonce)
        ok = offered and hmac.compare_digest(req.name.encode("ascii", "replace"), nonce.hex().encode())
        s.withdraw_hello(
            keep=ok and s.shm_version >= LEASE_VERSION
        )  # one try; kept: the client counts lease reads there
        if not offered:
            raise errors.ProtocolError("no shared-memory offer is open on this session")
        if not ok:
            raise errors.AuthError("shared-memory proof failed: the client read other bytes than the daemon wrote")
        s.shm = True
        deadline = time.monotonic() + self._timeout(req)
        table = ""
        if s.shm_version >= LEASE_VERSION:
            leases = self.store.lease_table()
            table = leases.name if leases is not None else ""
        log.debug("session %s: shared memory on%s", s.id[:8], ", read leases" if table else "")

        def body(t: "Transport", job: Job) -> BaseException | None:
            self._reply(s, t, job.reply_step, deadline, status=OK, op=req.op, req_id=req.req_id, message=table)
            return None

        return self._job(s, req, t0, "shm hello", body, deadline=deadline, messages=(0, 0, 1), direction="", nbytes=0)
