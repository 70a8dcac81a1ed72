"""Data-plane requests: the binary format a client and ``tensorwire serve`` exchange on tags 4 and 5.

Once a session's data connection is up, a client whose server announced
``OpenSessionResponse.data_requests >= 1`` sends the hot operations (get,
get_rows, put, put_rows, add_rows) as small binary **requests** on the data
connection instead of gRPC calls; the server answers each with a fixed-size
**reply** and moves the tensor bytes on tags 1 and 2 as before. No gRPC call is
made per operation. The connection is the session's, authenticated by the
nonce of the (token/TLS-authenticated) OpenSession, so a request needs no
credential of its own. Stdlib only (this module is imported by the client).

All integers little-endian.

Request (client -> server, tag 4 ``TAG_REQUEST``; variable length, at most
:data:`MAX_REQUEST_BYTES`; the server posts its receive with a header so the
transports report the length)::

    offset size field
    0      4    magic      b"TWRQ"
    4      1    version    DATA_REQUESTS_VERSION (1)
    5      1    op         1 GET, 2 GET_ROWS, 3 PUT, 4 PUT_ROWS, 5 ADD_ROWS; 6 SHM_HELLO, 7 RELEASE, 8 COMMIT
    6      1    flags      0, or FLAG_SHM (1), FLAG_AHEAD (2), FLAG_LAYOUT (4), FLAG_POSTED (8) (see below)
    7      1    ndim       PUT: rank of the tensor; PUT_ROWS/ADD_ROWS: rank of the values; GET_ROWS + FLAG_SHM: 1;
                           GET / GET_ROWS + FLAG_POSTED: rank of the expected payload; else 0
    8      8    req_id     the client's number for the request, echoed in its replies (the client counts 1, 2, ...)
    16     4    timeout_ms 0 = the server's default
    20     4    dtype      PUT, *_ROWS: tensorwire.v1.DType of the tensor / values; GET / GET_ROWS + FLAG_POSTED:
                           the expected one; else 0
    24     4    name_len   bytes of the UTF-8 tensor name (1..1024)
    28     4    nindex     GET_ROWS, *_ROWS: rows in the index (<= MAX_INDEX_ROWS); else 0
    32     64   dims       8 x int64: the shape of ndim dims, then zeros
    96     ..   name       name_len bytes, zero-padded to a multiple of 8
    ..     48   layout     only with FLAG_LAYOUT: the shard layout the client expects (tensorwire.serve.protocol.layout)
    ..     ..   index      nindex x int64 (row numbers of dim 0)

A request whose length, magic, version, op, flags, sizes or padding do not
match is *malformed*: the server closes that session (only that one) and
logs why. Anything else that is wrong (no such name, rows out of range, a
shape mismatch, over a limit, the server draining) is answered by an ERROR
reply naming the tensorwire error class, exactly as the gRPC call would have
raised it, and the session stays open.

Reply (server -> client, tag 5 ``TAG_REPLY``; always :data:`REPLY_BYTES`)::

    offset size field
    0      4    magic      b"TWRP"
    4      1    version    DATA_REQUESTS_VERSION
    5      1    status     0 OK, 1 ERROR, 2 GO (writes: send the payload now), 3 SHM, 4 FALLBACK (shared memory)
    6      1    op         the request's op
    7      1    ndim       rank of the stored tensor
    8      8    req_id     the request's req_id
    16     8    version    OK: the version read (GET, GET_ROWS) or committed (writes)
    24     8    step       first step of the payload: on tag 1 (reads) / tag 2 (GO); SHM read with a lease:
                           the lease's generation
    32     8    nbytes     payload bytes: sent on tag 1 (reads) / to send on tag 2 (GO)
    40     8    chunk      reads: bytes per tag-1 message (the last one may be shorter); 0 if nbytes is 0;
                           SHM: the payload's offset in the region
    48     4    dtype      tensorwire.v1.DType of the stored tensor
    52     2    msg_len    ERROR, SHM: bytes of the message
    54     2    lease      SHM read on a session of shm version >= 2: the tensor's cell in the daemon's lease
                           table (``step`` is then the cell's generation); 0: no lease
    56     64   dims       8 x int64: the stored tensor's shape
    120    32   error      ERROR: the error class name, ASCII, zero-padded (e.g. b"NotFoundError")
    152    360  message    ERROR: msg_len bytes of UTF-8; SHM: the region's name (ASCII)

Exchanges (each side serialises its operations, so every tag is FIFO):

- GET / GET_ROWS: request -> OK reply (spec, version, nbytes, chunk) ->
  ``ceil(nbytes / chunk)`` messages on tag 1 of exactly ``chunk`` bytes (the
  last: the rest). The client posts those receives after reading the reply.
  GET_ROWS sends rows ``[len(index), *shape[1:]]``; when the server sends
  them in several messages it gathers chunk i + 1 while chunk i is on its way.
- PUT / PUT_ROWS / ADD_ROWS: request -> GO reply (step, nbytes; the server has
  reserved the slot and posted its receive) -> the client sends ``nbytes`` on
  tag 2 with that step -> OK reply (the committed version) or ERROR (for
  example the tensor was deleted meanwhile). A write whose GO never came,
  or whose payload was never sent, changes nothing (a GO of 0 bytes --
  an empty tensor -- is followed by no payload: the server commits at once).
- Any request -> ERROR reply: nothing follows, nothing changed.
- Posted reads (sessions whose OpenSession answered ``data_requests`` >= 2):
  ``flags`` bit 3 ``FLAG_POSTED`` (0x08) on GET or GET_ROWS (not with
  ``FLAG_SHM``) says the client posted, before it sent the request, one
  receive on tag 1 of exactly the bytes of the payload it expects, which the
  request describes: ``dtype`` and ``dims`` (``ndim`` of them) are the payload's
  -- the stored tensor (GET) or the rows ``[nindex, *shape[1:]]`` (GET_ROWS,
  ``dims[0]`` = ``nindex``). The credit of that receive rides on the request,
  so the payload can follow the reply at once: no round trip for it. If the
  read succeeds with exactly that dtype and shape, and at least one byte, the
  payload is one message (``chunk`` = ``nbytes``) into the posted receive
  (a GET_ROWS's reply then comes after the rows are gathered, just before
  them). Otherwise -- another spec, no bytes, or an ERROR reply -- the server
  first sends one message of no bytes on tag 1, which completes the posted
  receive, and then answers as without the flag (the reply's ``step`` is then
  the step after that empty message's).

Steps: tag 1 and tag 2 steps are the session's (shared with the gRPC-scheduled
transfers); tag 5 replies and tag 4 requests count 1, 2, 3, ... each.

Shared memory (a session whose OpenSession negotiated ``shm`` and whose client
then proved it maps the daemon's memory; see :mod:`tensorwire.serve.protocol.shm`):

- ``SHM_HELLO`` (op 6): ``name`` = the hex of the nonce the client read from
  the session's hello region -> OK (the session uses shared memory from now
  on) or ERROR ``AuthError`` (it does not; the socket path keeps working).
  With shm version >= 2 the OK reply's ``message`` names the daemon's lease
  table (empty: no leases) and the hello region stays the session's *page*:
  the client counts there the reads its leases served (four uint64 at offset
  64: get operations, get bytes, get_rows operations, get_rows bytes), which
  the daemon adds to its metrics.
- Read leases (shm version >= 2, x86 clients): an SHM read reply with
  ``lease`` != 0 lets the client read that same region again without a
  request while cell ``lease`` of the lease table still holds generation
  ``step`` before and after its copy (see :class:`tensorwire.serve.daemon.shm.Leases`);
  otherwise it sends the request as usual.
- ``flags`` bit 0 ``FLAG_SHM`` on GET, GET_ROWS, PUT, PUT_ROWS, ADD_ROWS asks
  for the shared-memory path. The server may answer it as usual (OK + bytes on
  tag 1, GO) -- for a slot it keeps in ordinary memory, say -- or with an SHM
  reply (status 3): the payload is ``nbytes`` bytes at offset ``chunk`` of the
  region named by the reply's ``message`` (a name, never a path).
  - reads (GET, GET_ROWS): the server pinned the version it names; the client
    copies out of the region. The pin ends with the session's next request
    (of any op), a ``RELEASE`` (op 7, no reply: what a client that has gone
    idle sends), or the session's close -- a writer waits for it, as for a
    read over the connection.
  - GET_ROWS with ``FLAG_SHM`` carries no index: ``ndim`` is 1, ``dims[0]``
    the number of rows the client will gather itself from the pinned version
    (``nindex`` 0). The reply names the whole tensor. A server that cannot
    answer it from shared memory replies ``FALLBACK`` (status 4): send the
    request again without the flag.
  - writes: the server reserved the region (the staging slot of a PUT, the
    session's scratch for PUT_ROWS / ADD_ROWS, whose request carries the index
    as usual); the client writes the bytes there and sends ``COMMIT`` (op 8)
    -> OK (the committed version) or ERROR. Until COMMIT nothing is visible;
    a session closed before it (client gone) changes nothing.
  - ``RELEASE`` and ``COMMIT`` carry the tensor's name and no other field
    (but see write-ahead grants); they, and ``FLAG_SHM``, on a session
    without shared memory are malformed.
- ``flags`` bit 2 ``FLAG_LAYOUT`` (0x04) on GET, GET_ROWS, PUT, PUT_ROWS,
  ADD_ROWS (sessions whose OpenSession answered ``layouts`` >= 1): the request
  carries, after the name, the 48-byte shard layout the client expects the
  tensor to have; without it, a whole tensor is expected. A tensor held with
  another layout is answered by an ERROR ``LayoutMismatchError`` (nothing read
  or written); a PUT that creates the name creates it with that layout.
- Write-ahead grants (shm version >= 3): the OK reply to the COMMIT of a put
  may name, in ``message``, the region of the tensor's staging slot, which
  the daemon has reserved for this session's next put of that tensor
  (``nbytes`` bytes at offset 0; ``step`` = the grant's *ticket*, > 0; an
  empty message: no grant). The client may then, holding its session page's
  ``flock`` (:class:`tensorwire.serve.protocol.shm.PageLock`) and finding the ticket
  at :data:`tensorwire.serve.protocol.shm.PAGE_AHEAD_OFFSET` of the page, write the
  tensor there and send ``COMMIT`` with ``FLAG_AHEAD`` (0x02; ``ndim`` 1,
  ``dims[0]`` the ticket), keeping the lock until the reply: OK (committed;
  it may carry the next grant), ERROR, or ``FALLBACK`` (the grant had ended:
  nothing changed, put the ordinary way). A ticket of 0, or a lock it cannot
  take, means the grant has ended. Any other request (but ``RELEASE``) ends
  the session's grant.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from tensorwire import errors
from tensorwire.spec import DTYPE_BY_CODE, DTYPE_CODES
from tensorwire.serve.protocol.common import DATA_REQUESTS_VERSION, MAX_INDEX_ROWS
from tensorwire.serve.protocol.layout import LAYOUT_BYTES, ShardLayout

__all__ = [
    "REQUEST",
    "REPLY",
    "REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "MAX_NAME_BYTES",
    "OP_GET",
    "OP_GET_ROWS",
    "OP_PUT",
    "OP_PUT_ROWS",
    "OP_ADD_ROWS",
    "OP_SHM_HELLO",
    "OP_RELEASE",
    "OP_COMMIT",
    "OPS",
    "FLAG_SHM",
    "FLAG_AHEAD",
    "FLAG_LAYOUT",
    "FLAG_POSTED",
    "OK",
    "ERROR",
    "GO",
    "SHM",
    "FALLBACK",
    "Request",
    "Reply",
    "pack_request",
    "request_size",
    "parse_request",
    "pack_reply",
    "parse_reply",
    "dtype_code",
    "dtype_name",
    "MalformedRequest",
]

REQ_MAGIC = b"TWRQ"
REPLY_MAGIC = b"TWRP"
MAX_DIMS = 8
#: The fixed part of a request.
REQUEST = struct.Struct("<4sBBBBQIIII8q")
#: The fixed part of a reply (the message follows, up to REPLY_BYTES).
REPLY = struct.Struct("<4sBBBBQQQQQIHH8q32s")
REPLY_BYTES = 512
MAX_MESSAGE = REPLY_BYTES - REPLY.size
#: Bytes of a UTF-8 name (256 characters of up to 4 bytes).
MAX_NAME_BYTES = 1024
#: The largest request: the fixed part, the longest name, a layout, the most rows.
MAX_REQUEST_BYTES = REQUEST.size + MAX_NAME_BYTES + LAYOUT_BYTES + 8 * MAX_INDEX_ROWS

OP_GET, OP_GET_ROWS, OP_PUT, OP_PUT_ROWS, OP_ADD_ROWS = 1, 2, 3, 4, 5
OP_SHM_HELLO, OP_RELEASE, OP_COMMIT = 6, 7, 8
#: op -> the name metrics and logs use (the gRPC method doing the same).
OPS = {
    OP_GET: "Get",
    OP_GET_ROWS: "GetRows",
    OP_PUT: "Put",
    OP_PUT_ROWS: "PutRows",
    OP_ADD_ROWS: "AddRows",
    OP_SHM_HELLO: "ShmHello",
    OP_RELEASE: "Release",
    OP_COMMIT: "Commit",
}
_INDEXED = (OP_GET_ROWS, OP_PUT_ROWS, OP_ADD_ROWS)
_SHAPED = (OP_PUT, OP_PUT_ROWS, OP_ADD_ROWS)
#: Ops that may carry FLAG_SHM.
_SHM_CAPABLE = (OP_GET, OP_GET_ROWS, OP_PUT, OP_PUT_ROWS, OP_ADD_ROWS)
#: Request flag: answer through shared memory if you can.
FLAG_SHM = 0x01
#: COMMIT flag (shm version >= 3): commit the put written into the slot of a write-ahead grant.
FLAG_AHEAD = 0x02
#: Request flag (GET, GET_ROWS, PUT, PUT_ROWS, ADD_ROWS): the expected shard layout follows the name.
FLAG_LAYOUT = 0x04
#: Request flag (GET, GET_ROWS; ``data_requests`` >= 2): a receive for the payload of the dtype and shape the
#: request carries is posted on tag 1 already (see the module docstring).
FLAG_POSTED = 0x08
OK, ERROR, GO, SHM, FALLBACK = 0, 1, 2, 3, 4

assert REQUEST.size == 96 and REPLY.size == 152
#: Zeros to clear a reply's message area with (no allocation per reply).
_ZEROS = memoryview(bytes(REPLY_BYTES))


class MalformedRequest(ValueError):
    """A request that does not follow the format (the server closes the session)."""


def dtype_code(dtype: str) -> int:
    """The tensorwire.v1.DType number of a spec's dtype name."""
    return DTYPE_CODES[dtype]


def dtype_name(code: int) -> str:
    """The dtype name of a tensorwire.v1.DType number.

    Raises:
        SpecError: not a dtype tensorwire moves.
    """
    try:
        return DTYPE_BY_CODE[code]
    except KeyError:
        raise errors.SpecError(f"unknown dtype code {code}") from None


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class Request(NamedTuple):
    """A parsed request header; the index stays in the receive buffer at ``index_offset``.

    (A named tuple: a parse per request, and a tuple is made for a fraction of a frozen dataclass.)
    """

    op: int
    req_id: int
    timeout_ms: int
    dtype: int
    name: str
    shape: tuple[int, ...]
    nindex: int
    index_offset: int
    flags: int = 0
    #: The shard layout the client expects (FLAG_LAYOUT); None: a whole tensor.
    layout: ShardLayout | None = None

    @property
    def shm(self) -> bool:
        return bool(self.flags & FLAG_SHM)

    @property
    def posted(self) -> bool:
        """The client posted the payload's receive before it sent this read (FLAG_POSTED)."""
        return bool(self.flags & FLAG_POSTED)

    @property
    def ahead(self) -> int:
        """The ticket of a write-ahead COMMIT; 0: not one."""
        return self.shape[0] if self.flags & FLAG_AHEAD else 0


def request_size(name_bytes: int, nindex: int, *, layout: bool = False) -> int:
    return REQUEST.size + _pad8(name_bytes) + (LAYOUT_BYTES if layout else 0) + 8 * nindex


def pack_request(
    buf: memoryview,
    *,
    op: int,
    req_id: int,
    name: bytes,
    timeout_ms: int = 0,
    dtype: int = 0,
    shape: tuple[int, ...] = (),
    nindex: int = 0,
    flags: int = 0,
    layout: bytes = b"",
) -> int:
    """Write the fixed part, the name and the ``layout`` (packed; with ``FLAG_LAYOUT``) into ``buf``; returns the
    offset of the index (the caller fills it)."""
    if bool(layout) != bool(flags & FLAG_LAYOUT) or (layout and len(layout) != LAYOUT_BYTES):
        raise ValueError("FLAG_LAYOUT goes with a packed layout of LAYOUT_BYTES bytes")
    if len(shape) > MAX_DIMS:
        raise ValueError(f"rank {len(shape)} exceeds {MAX_DIMS}")
    dims = tuple(shape) + (0,) * (MAX_DIMS - len(shape))
    REQUEST.pack_into(
        buf,
        0,
        REQ_MAGIC,
        DATA_REQUESTS_VERSION,
        op,
        flags,
        len(shape),
        req_id,
        min(max(0, int(timeout_ms)), 0xFFFFFFFF),
        dtype,
        len(name),
        nindex,
        *dims,
    )
    off = REQUEST.size
    buf[off : off + len(name)] = name
    end = off + _pad8(len(name))
    buf[off + len(name) : end] = bytes(end - off - len(name))
    if layout:
        buf[end : end + LAYOUT_BYTES] = layout
        end += LAYOUT_BYTES
    return end


#: Ops that carry a shape (PUT, PUT_ROWS, ADD_ROWS): op -> True; and the other sets, as frozensets (one hash).
_SHAPED_SET = frozenset(_SHAPED)
_INDEXED_SET = frozenset(_INDEXED)
_SHM_CAPABLE_SET = frozenset(_SHM_CAPABLE)
_OK_FLAGS = FLAG_SHM | FLAG_LAYOUT | FLAG_POSTED
_POSTED_OPS = frozenset((OP_GET, OP_GET_ROWS))
_ZERO_DIMS = tuple((0,) * (MAX_DIMS - n) for n in range(MAX_DIMS + 1))
_NO_DIMS: tuple[int, ...] = ()


def parse_request(data: memoryview) -> Request:
    """Check the format of a received request (not its meaning: the server validates that).

    Raises:
        MalformedRequest: saying what is wrong.
    """
    n = len(data)
    if n < 96:  # REQUEST.size
        raise MalformedRequest(f"request of {n} bytes is shorter than its {REQUEST.size}-byte header")
    fields = REQUEST.unpack_from(data)
    magic, version, op, flags, ndim, req_id, timeout_ms, dtype, name_len, nindex = fields[:10]
    if magic != REQ_MAGIC:
        raise MalformedRequest(f"bad request magic {bytes(magic)!r}")
    if version != DATA_REQUESTS_VERSION:
        raise MalformedRequest(f"request format v{version}, this server speaks v{DATA_REQUESTS_VERSION}")
    if op not in OPS:
        raise MalformedRequest(f"unknown request op {op}")
    ahead = False
    rows_shm = False
    posted = False
    if flags:
        ahead = op == OP_COMMIT and flags == FLAG_AHEAD  # carries the grant's ticket as its shape
        if not ahead and (flags & ~_OK_FLAGS or op not in _SHM_CAPABLE_SET):
            raise MalformedRequest(f"request flags {flags:#x} for op {OPS[op]}")
        if ahead and (ndim != 1 or fields[10] <= 0):
            raise MalformedRequest("a write-ahead COMMIT has rank 1 (the grant's ticket, > 0)")
        rows_shm = op == OP_GET_ROWS and bool(flags & FLAG_SHM)  # carries the row count as its shape, no index
        if rows_shm and (ndim != 1 or nindex or fields[10] < 0):
            raise MalformedRequest("a shared-memory GET_ROWS has rank 1 (the row count) and no index")
        posted = bool(flags & FLAG_POSTED)  # carries the expected payload's dtype and shape
        if posted and (op not in _POSTED_OPS or flags & FLAG_SHM):
            raise MalformedRequest(f"FLAG_POSTED on a {'shared-memory ' if flags & FLAG_SHM else ''}{OPS[op]}")
        if posted and (ndim > MAX_DIMS or any(d < 0 for d in fields[10 : 10 + ndim])):
            raise MalformedRequest("a posted read's expected shape has negative dims or too many")
        if posted and op == OP_GET_ROWS and (ndim < 1 or fields[10] != nindex):
            raise MalformedRequest("a posted GET_ROWS expects [nindex, ...] rows")
    shaped = op in _SHAPED_SET or posted
    if ndim:
        if ndim > MAX_DIMS or not (shaped or rows_shm or ahead):
            raise MalformedRequest(f"request rank {ndim} for op {OPS[op]}")
        dims = fields[10 : 10 + ndim]
    else:
        dims = _NO_DIMS
    if fields[10 + ndim :] != _ZERO_DIMS[ndim]:
        raise MalformedRequest("request dims past its rank are not zero")
    if (dtype != 0) != shaped:
        raise MalformedRequest(f"request dtype {dtype} for op {OPS[op]}")
    if not 1 <= name_len <= MAX_NAME_BYTES:
        raise MalformedRequest(f"request name of {name_len} bytes (1..{MAX_NAME_BYTES})")
    if nindex:
        if op not in _INDEXED_SET:
            raise MalformedRequest(f"request index of {nindex} rows for op {OPS[op]}")
        if nindex > MAX_INDEX_ROWS:
            raise MalformedRequest(f"request index of {nindex} rows exceeds the limit of {MAX_INDEX_ROWS}")
    has_layout = not ahead and bool(flags & FLAG_LAYOUT)
    end = 96 + ((name_len + 7) & ~7)
    want = end + (LAYOUT_BYTES if has_layout else 0) + 8 * nindex
    if n != want:
        raise MalformedRequest(f"request of {n} bytes, its header describes {want}")
    raw_name = bytes(data[96:end])  # the name and its padding
    if name_len != end - 96 and raw_name[name_len:].count(0) != end - 96 - name_len:
        raise MalformedRequest("request name padding is not zero")
    try:
        name = raw_name[:name_len].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedRequest(f"request name is not UTF-8: {exc}") from None
    layout = None
    if has_layout:
        try:
            layout = ShardLayout.unpack(data[end : end + LAYOUT_BYTES])
        except errors.SpecError as exc:
            raise MalformedRequest(f"request layout: {exc}") from None
        end += LAYOUT_BYTES
    return Request(op, req_id, timeout_ms, dtype, name, dims, nindex, end, flags, layout)


@dataclass(frozen=True)
class Reply:
    status: int
    op: int
    req_id: int
    version: int
    step: int
    nbytes: int
    chunk: int
    dtype: int
    shape: tuple[int, ...]
    error: str
    message: str
    lease: int = 0


def pack_reply(
    buf: memoryview,
    *,
    status: int,
    op: int,
    req_id: int,
    version: int = 0,
    step: int = 0,
    nbytes: int = 0,
    chunk: int = 0,
    dtype: int = 0,
    shape: tuple[int, ...] = (),
    error: str = "",
    message: str = "",
    lease: int = 0,
) -> None:
    """Fill ``buf`` (REPLY_BYTES) with a reply; a long message is cut to fit (at a character boundary)."""
    ndim = len(shape)
    if ndim > MAX_DIMS:
        raise ValueError(f"rank {ndim} exceeds {MAX_DIMS}")
    if message:
        msg = message.encode("utf-8")
        if len(msg) > MAX_MESSAGE:
            msg = msg[: MAX_MESSAGE - 3].decode("utf-8", "ignore").encode("utf-8") + b"..."
    else:
        msg = b""
    REPLY.pack_into(
        buf,
        0,
        REPLY_MAGIC,
        DATA_REQUESTS_VERSION,
        status,
        op,
        len(shape),
        req_id,
        version,
        step,
        nbytes,
        chunk,
        dtype,
        len(msg),
        lease,
        *shape,
        *_ZERO_DIMS[ndim],
        error.encode("ascii", "replace")[:32] if error else b"",
    )
    end = 152 + len(msg)  # REPLY.size
    if msg:
        buf[152:end] = msg
    buf[end:REPLY_BYTES] = _ZEROS[: REPLY_BYTES - end]


def parse_reply(data: memoryview) -> Reply:
    """Decode a reply.

    Raises:
        ValueError: not a reply of this format (the client treats it as a protocol error).
    """
    if len(data) != REPLY_BYTES:
        raise ValueError(f"reply of {len(data)} bytes, expected {REPLY_BYTES}")
    (magic, version, status, op, ndim, req_id, tversion, step, nbytes, chunk, dtype, msg_len, lease, *rest) = (
        REPLY.unpack_from(data)
    )
    dims, error = rest[:MAX_DIMS], rest[MAX_DIMS]
    if magic != REPLY_MAGIC or version != DATA_REQUESTS_VERSION:
        raise ValueError(f"bad reply magic/version {bytes(magic)!r} v{version}")
    if status not in (OK, ERROR, GO, SHM, FALLBACK) or ndim > MAX_DIMS or msg_len > MAX_MESSAGE:
        raise ValueError(f"bad reply (status {status}, rank {ndim}, message {msg_len} bytes)")
    message = bytes(data[REPLY.size : REPLY.size + msg_len]).decode("utf-8", "replace")
    return Reply(
        status,
        op,
        req_id,
        tversion,
        step,
        nbytes,
        chunk,
        dtype,
        tuple(dims[:ndim]),
        error.rstrip(b"\0").decode("ascii", "replace"),
        message,
        lease if status == SHM else 0,
    )
