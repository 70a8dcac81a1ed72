"""The daemons of a sharded client: one one-daemon client each, reached lazily, run on in parallel.

:class:`Daemons` connects to daemon ``k`` on first use (and again after it was
lost), turns a transport failure on it into
:class:`~tensorwire.errors.ShardLostError` naming its address, and runs the
parts of an operation that spans daemons in parallel: the first in the calling
thread, the others on a pool of ``n - 1`` threads made once with the client
(no thread is made per call).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tensorwire.errors import ClosedError, ConfigError, ShardLostError, TransportError

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.client.client import Client

__all__ = ["Daemons"]

#: A part of an operation: what to run on the client of one daemon.
Task = tuple[int, Callable[["Client"], Any]]


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Daemons:
    """The one-daemon clients of a sharded client (see the module docstring).

    Args:
        addresses: the ordered daemon list.
        single: the one-daemon client class; ``kw``: its arguments.
        parallel: run parts in threads (True), in the calling thread (False), or (None) in threads
            unless they are reads of daemons all reached through shared memory (:meth:`fan`).
    """

    def __init__(
        self, addresses: list[str], single: "type[Client]", kw: dict[str, Any], *, parallel: bool | None
    ) -> None:
        self.addresses = addresses
        self.n = n = len(addresses)
        self._single = single
        self._kw = kw
        self._parallel = parallel
        self.clients: "list[Client | None]" = [None] * n
        self._connecting = [threading.Lock() for _ in range(n)]
        self._pool = ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="tensorwire-shard") if n > 1 else None
        self.closed = False

    def lost(self, k: int, exc: BaseException) -> ShardLostError:
        a = self.addresses[k]
        return ShardLostError(f"daemon {a} (number {k} of {self.n}) is unreachable: {exc}", address=a)

    def client(self, k: int) -> "Client":
        """The client of daemon ``k``, connected now if it is not.

        Raises:
            ShardLostError: it cannot be reached. ConfigError: it records no shard layouts.
        """
        c = self.clients[k]
        if c is not None:
            return c
        with self._connecting[k]:
            c = self.clients[k]
            if c is None:
                if self.closed:
                    raise ClosedError("client is closed")
                try:
                    c = self._single(self.addresses[k], **self._kw)
                except TransportError as exc:
                    raise self.lost(k, exc) from exc
                if not c.layout_checks:
                    c.close()
                    raise ConfigError(
                        f"daemon {self.addresses[k]} does not record shard layouts (an older "
                        f"tensorwire serve): a client over several daemons needs every one to"
                    )
                self.clients[k] = c
            return c

    def on(self, k: int, fn: Callable[["Client"], Any]) -> Any:
        """``fn(client of daemon k)``; a transport failure becomes ShardLostError naming the daemon."""
        try:
            return fn(self.client(k))
        except ShardLostError:
            raise
        except TransportError as exc:
            raise self.lost(k, exc) from exc

    def fan(self, tasks: list[Task], *, settle: bool = False, read: bool = False) -> list[Any]:
        """Run ``fn`` on each daemon of ``tasks`` (in parallel when more than one); their results, in order.

        Every task runs to its end; then the first error is raised (``settle``: returned in its place).
        ``read``: the tasks are reads, which run in this thread when every daemon they need is reached
        through shared memory (each part is then a copy by this process; a hand-off to another thread
        costs more than it saves on a few cores).
        """
        if len(tasks) == 1 and not settle:
            k, fn = tasks[0]
            return [self.on(k, fn)]
        if read and not settle and not self._threads([k for k, _ in tasks]):
            return [self.on(k, fn) for k, fn in tasks]  # an error stops the rest (reads: nothing to finish)

        def run(k: int, fn: Callable[["Client"], Any]) -> Any:
            try:
                return self.on(k, fn)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                return _Failed(exc)

        # the first part in this thread, the others on the pool's (n - 1 threads: one per other daemon)
        futs = [self._pool.submit(run, k, fn) for k, fn in tasks[1:]] if self._pool is not None else []
        out = [run(*tasks[0])] if tasks else []
        out += [f.result() for f in futs]
        if settle:
            return [r.exc if isinstance(r, _Failed) else r for r in out]
        for r in out:
            if isinstance(r, _Failed):
                raise r.exc
        return out

    def _threads(self, ks: Sequence[int]) -> bool:
        """Whether parts on daemons ``ks`` run in threads (see ``parallel``)."""
        if self._parallel is not None:
            return self._parallel
        for k in ks:
            c = self.clients[k]
            if c is None or not c.shm:
                return True
        return False

    def close(self) -> None:
        """Close every daemon's client. Idempotent."""
        self.closed = True
        for k in range(self.n):
            with self._connecting[k]:
                c, self.clients[k] = self.clients[k], None
            if c is not None:
                c.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # its threads end before close returns
