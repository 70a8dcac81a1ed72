"""Where the names of a sharded client lie, and how a part of an operation reaches them.

A :class:`~tensorwire.serve.client.sharded_client.ShardedClient` places a
whole tensor on the daemon its name hashes to
(:func:`~tensorwire.serve.client.sharding.owner`) and a table put with
``shard="rows"`` on every daemon, one shard each. :class:`Placement` remembers
which of the two each name is (asking the owner the first time it meets a
name, and checking the layout the owner holds), and runs parts of operations
with each daemon's client expecting the layout of what it should hold there:
a whole tensor, or its shard of the table.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.errors import ClosedError, LayoutMismatchError
from tensorwire.serve.client.daemons import Daemons, Task
from tensorwire.serve.client.sharding import owner
from tensorwire.serve.client.tables import Table, layouts_of
from tensorwire.serve.protocol.layout import ShardLayout, check_layout
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.client.client import Client

__all__ = ["Placement", "bound"]

#: Names whose placement a client remembers (whole or sharded, and the table's rows); past it, it forgets them all.
_MAX_TABLES = 1 << 16


class Placement:
    """What a sharded client knows of where its names lie (see the module docstring).

    Args:
        addresses: the ordered daemon list; ``fingerprint``: its fingerprint (every shard records it).
        daemons: their clients.
    """

    def __init__(self, addresses: list[str], fingerprint: bytes, daemons: Daemons) -> None:
        self.addresses = addresses
        self.fingerprint = fingerprint
        self._daemons = daemons
        self._tables: dict[str, Table | None] = {}  # name -> sharded table, or None: a whole tensor
        self._lock = threading.Lock()

    def layouts(self, rows: int) -> list[ShardLayout]:
        """The layouts of the shards of a table of ``rows`` rows over this daemon list."""
        return layouts_of(self.fingerprint, self._daemons.n, rows)

    def remember(self, name: str, table: Table | None) -> None:
        with self._lock:
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            self._tables[name] = table

    def forget(self, name: str) -> None:
        with self._lock:
            self._tables.pop(name, None)

    def table(self, name: str) -> Table | None:
        """The sharded table ``name`` (None: a whole tensor), asked of its owner the first time.

        Raises:
            ClosedError: the client is closed.
            NotFoundError: the owner holds nothing of that name.
            LayoutMismatchError: it holds a shard of another daemon list's table.
        """
        if self._daemons.closed:
            raise ClosedError("client is closed")
        with self._lock:
            if name in self._tables:
                return self._tables[name]
        k = owner(name, self.addresses)
        st = self._daemons.on(k, lambda c: c.stat(name))
        if st.layout is None:
            self.remember(name, None)
            return None
        rows = st.layout.rows
        check_layout(
            name,
            st.layout,
            ShardLayout.of(self.fingerprint, self._daemons.n, k, rows),
            where=f"daemon {self.addresses[k]}",
        )
        t = Table(TensorSpec(name, (rows, *st.spec.shape[1:]), st.spec.dtype), self.layouts(rows))
        t.versions[k] = st.version
        self.remember(name, t)
        return t

    def whole(self, name: str, fn: Callable[[Client], Any]) -> Any:
        """``fn`` on the owner of whole tensor ``name``, expecting a whole tensor there."""

        def call(c: Client) -> Any:
            c.expect_layout(name, None)
            return fn(c)

        return self._daemons.on(owner(name, self.addresses), call)

    def sharded(self, name: str, t: Table, tasks: list[Task], read: bool = False) -> list[Any]:
        """Run per-shard tasks of table ``t``, each client expecting its shard's layout; a layout refusal makes
        this client forget what it knew of ``name`` (the next call asks again)."""
        try:
            return self._daemons.fan([(k, bound(t, name, k, fn)) for k, fn in tasks], read=read)
        except LayoutMismatchError:
            self.forget(name)
            raise


def bound(t: Table, name: str, k: int, fn: Callable[[Client], Any]) -> Callable[[Client], Any]:
    """``fn`` with daemon k's client expecting shard k of ``t``."""

    def call(c: Client) -> Any:
        c.expect_layout(name, t.layouts[k])
        return fn(c)

    return call
