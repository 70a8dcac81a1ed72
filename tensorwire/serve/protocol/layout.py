"""Shard layouts: what a daemon records with each shard of a table sharded by rows.

Shared by the daemon and the client (stdlib only). A table of ``rows`` rows
sharded over an ordered list of ``shards`` daemons puts rows
``[row_start, row_stop)`` on daemon ``index`` (:func:`row_ranges`: contiguous,
balanced); the list itself is named by its *fingerprint* (:func:`fingerprint`:
16 bytes of SHA-256 over the normalised addresses, in order).

A daemon stores the :class:`ShardLayout` of each shard it holds (and writes it
into its snapshots). Every request of the tensor's data says which layout its
client expects -- ``None`` for a whole tensor -- and the daemon refuses a
request whose expectation differs from what it holds
(:func:`check_layout`, :class:`~tensorwire.errors.LayoutMismatchError`): a
client over another daemon list, the same daemons in another order, or a
client that still believes a table it has not seen replaced is unchanged, never
reads or writes the wrong rows.

Wire form (data-plane requests with ``FLAG_LAYOUT``, see
:mod:`tensorwire.serve.wire`): :data:`LAYOUT_STRUCT`, 48 bytes little-endian::

    fingerprint 16s, shards u32, index u32, rows u64, row_start u64, row_stop u64
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

from tensorwire.errors import LayoutMismatchError, SpecError

__all__ = ["ShardLayout", "LAYOUT_STRUCT", "LAYOUT_BYTES", "row_ranges", "fingerprint", "check_layout", "RESHARD_HINT"]

LAYOUT_STRUCT = struct.Struct("<16sIIQQQ")
LAYOUT_BYTES = LAYOUT_STRUCT.size
FINGERPRINT_BYTES = 16

#: What every layout error says about changing a table's daemon list (there is no reshard command).
RESHARD_HINT = (
    "tensorwire has no reshard command: to move a table to another daemon list, get it through a "
    "client over the list it was put with (c.get(name)), delete it there (c.delete(name)), and put it "
    "with shard='rows' through a client over the new list (see docs/serve-sharding.md)"
)


def row_ranges(rows: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous, balanced ``[start, stop)`` ranges covering ``rows`` rows (sizes differ by <= 1)."""
    if shards < 1:
        raise SpecError(f"a table needs at least one shard, got {shards}")
    if rows < 0:
        raise SpecError(f"rows must be >= 0, got {rows}")
    return [(k * rows // shards, (k + 1) * rows // shards) for k in range(shards)]


def fingerprint(addresses: Sequence[str]) -> bytes:
    """16 bytes naming an ordered daemon list (another order or other members: another fingerprint)."""
    h = hashlib.sha256()
    for a in addresses:
        h.update(a.encode("utf-8"))
        h.update(b"\n")
    return h.digest()[:FINGERPRINT_BYTES]


@dataclass(frozen=True)
class ShardLayout:
    """Shard ``index`` of ``shards`` of a ``rows``-row table: rows ``[row_start, row_stop)``."""

    shards: int
    index: int
    rows: int
    row_start: int
    row_stop: int
    fingerprint: bytes

    def __post_init__(self) -> None:
        if len(self.fingerprint) != FINGERPRINT_BYTES:
            raise SpecError(f"a layout fingerprint has {FINGERPRINT_BYTES} bytes, got {len(self.fingerprint)}")
        if not 0 <= self.index < self.shards:
            raise SpecError(f"shard index {self.index} out of range for {self.shards} shards")
        if (self.row_start, self.row_stop) != row_ranges(self.rows, self.shards)[self.index]:
            raise SpecError(
                f"rows [{self.row_start}, {self.row_stop}) are not shard {self.index} of {self.shards} "
                f"of a {self.rows}-row table"
            )

    @classmethod
    def of(cls, addresses_fingerprint: bytes, shards: int, index: int, rows: int) -> "ShardLayout":
        start, stop = row_ranges(rows, shards)[index]
        return cls(shards, index, rows, start, stop, addresses_fingerprint)

    @property
    def shard_rows(self) -> int:
        return self.row_stop - self.row_start

    def describe(self) -> str:
        return (
            f"shard {self.index} of {self.shards} (rows {self.row_start}..{self.row_stop} of {self.rows}) "
            f"of the daemon list {self.fingerprint.hex()[:12]}"
        )

    # -- forms ---------------------------------------------------------------------------------
    def pack(self) -> bytes:
        return LAYOUT_STRUCT.pack(self.fingerprint, self.shards, self.index, self.rows, self.row_start, self.row_stop)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "ShardLayout":
        """Raises: SpecError: not a consistent layout."""
        fp, shards, index, rows, start, stop = LAYOUT_STRUCT.unpack(bytes(data))
        return cls(shards, index, rows, start, stop, fp)

    def to_proto(self) -> Any:
        from tensorwire.v1 import store_pb2

        return store_pb2.ShardLayout(
            shards=self.shards,
            index=self.index,
            rows=self.rows,
            row_start=self.row_start,
            row_stop=self.row_stop,
            fingerprint=self.fingerprint,
        )

    @classmethod
    def from_proto(cls, msg: Any) -> "ShardLayout":
        return cls(
            int(msg.shards),
            int(msg.index),
            int(msg.rows),
            int(msg.row_start),
            int(msg.row_stop),
            bytes(msg.fingerprint),
        )

    @classmethod
    def from_field(cls, request: Any) -> "ShardLayout | None":
        """The ``layout`` field of a request or TensorInfo, None when absent."""
        return cls.from_proto(request.layout) if request.HasField("layout") else None

    def to_json(self) -> str:
        return json.dumps(
            {
                "shards": self.shards,
                "index": self.index,
                "rows": self.rows,
                "row_start": self.row_start,
                "row_stop": self.row_stop,
                "fingerprint": self.fingerprint.hex(),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | dict) -> "ShardLayout":
        d = json.loads(text) if isinstance(text, str) else text
        return cls(
            int(d["shards"]),
            int(d["index"]),
            int(d["rows"]),
            int(d["row_start"]),
            int(d["row_stop"]),
            bytes.fromhex(d["fingerprint"]),
        )


def check_layout(
    name: str, stored: ShardLayout | None, expected: ShardLayout | None, *, where: str = "this daemon"
) -> None:
    """Raise :class:`LayoutMismatchError` unless ``stored`` (what ``where`` holds) is what a request ``expected``.

    ``None`` stands for a whole tensor.
    """
    if stored == expected:
        return
    if expected is None:
        assert stored is not None
        raise LayoutMismatchError(
            f"{name!r} on {where} is {stored.describe()}; a request for a whole tensor was refused (nothing read or "
            f"written). Use a client over that daemon list, in the same order: tw.Client([...]). {RESHARD_HINT}"
        )
    if stored is None:
        raise LayoutMismatchError(
            f"{name!r} on {where} is a whole tensor, not {expected.describe()} as this client expects (nothing read "
            f"or written): it was put without shard='rows', or the table was replaced"
        )
    if stored.fingerprint != expected.fingerprint or stored.shards != expected.shards or stored.index != expected.index:
        why = "its daemon list differs from the one the table was put with (other daemons, or another order)"
    else:
        why = "the table was replaced meanwhile (another row count)"
    raise LayoutMismatchError(
        f"{name!r} on {where} is {stored.describe()}; this client expects {expected.describe()}: {why}. Nothing was "
        f"read or written. {RESHARD_HINT}"
    )
