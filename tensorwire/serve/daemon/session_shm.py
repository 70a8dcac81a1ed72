"""A session's shared memory: the hello region and page, the read pin handed to its client, its write-ahead
grant and its scratch region (the :class:`SessionShm` part of :class:`tensorwire.serve.daemon.session.Session`).

A session offered shared memory holds a *hello* region until its client proves it
maps it (``SHM_HELLO``) or sends anything else; once proven (``shm``), the session
may hold one read pin handed to the client (released by ``RELEASE``, the next
request, or close), one write-ahead grant (shm version >= 3), and a scratch region
for row updates (charged against ``--max-bytes``, unlinked by close). The
uncommitted shared-memory write, if any, is the session's ``pending`` write.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.errors import ClosedError, ResourceExhaustedError
from tensorwire.serve.daemon.entry import AheadGrant, region_of
from tensorwire.serve.daemon.shm import new_hello, page_counts
from tensorwire.serve.protocol.common import MAX_ROWS_BYTES
from tensorwire.serve.protocol.shm import AHEAD_VERSION, PageLock, page_ahead, round_page

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.daemon.metrics import Metrics

__all__ = ["SessionShm"]


class SessionShm:
    """The shared memory of a session (see the module docstring); a part of
    :class:`~tensorwire.serve.daemon.session.Session`."""

    # what the session provides
    closed: bool
    close_reason: str
    _lock: threading.Lock
    _metrics: "Metrics | None"

    def _init_shm(self) -> None:
        self.shm = False
        self.shm_hello: Any = None  # the hello region, until proven or withdrawn
        self.shm_nonce = b""
        self.shm_version = 0  # negotiated at OpenSession (2: read leases)
        self.shm_page: Any = None  # the hello region once proven (shm version >= 2): the client's lease-read counts
        self._page_seen = (0, 0, 0, 0)
        self.ahead: Any = None  # the write-ahead grant its client holds (tensorwire.serve.daemon.entry.AheadGrant)
        self._page_lock: Any = None  # (PageLock, ticket cell) of the page, made with the first grant
        self._tickets = 0
        self._pin: "tuple[Callable[[], None], str] | None" = None
        self._shm_scratch: Any = None  # Region
        self._scratch_charge: "tuple[Any, int] | None" = None  # (store, bytes charged)

    def offer_shm(self, registry: Any) -> str:
        """Create the hello region (the client proves it maps it); returns its name."""
        region, nonce = new_hello(registry)
        with self._lock:
            closed = self.closed
            if not closed:
                self.shm_hello, self.shm_nonce = region, nonce
        if closed:
            region.close()
        return region.name

    def withdraw_hello(self, *, keep: bool = False) -> None:
        """Take the hello region off the offer (proof given, refused, or the client went on without it): unlinked,
        or with ``keep`` (a good proof on shm version >= 2) kept as the session's page (see :meth:`fold_page`)."""
        with self._lock:
            region, self.shm_hello = self.shm_hello, None
            self.shm_nonce = b""
            if keep and region is not None and not self.closed:
                self.shm_page, region = region, None
        if region is not None:
            region.close()

    def fold_page(self) -> None:
        """Add the reads this session's client served from leases since the last fold to the metrics.

        The client counts them in its page (get ops, get bytes, get_rows ops, get_rows bytes); only
        growth is counted, so a client writing nonsense can at worst inflate its own counters.
        """
        with self._lock:
            page, m, seen = self.shm_page, self._metrics, self._page_seen
            if page is None or m is None or page.closed:
                return
            now = page_counts(page)
            self._page_seen = tuple(max(a, b) for a, b in zip(now, seen))  # type: ignore[assignment]
        d = [max(0, a - b) for a, b in zip(now, seen)]
        for op, ops, nbytes in (("Get", d[0], d[1]), ("GetRows", d[2], d[3])):
            if ops:
                m.operations.labels(op, "ok").inc(ops)
                m.transfers.labels("shm", "out").inc(ops)
            if nbytes:
                m.bytes.labels("shm", "out").inc(nbytes)

    def grant_ahead(self, entry: Any) -> Any:
        """After this session committed a put of ``entry``: reserve its staging slot for the next one
        (shm version >= 3). Returns the grant (its slot's region and ticket go in the COMMIT's reply) or None."""
        with self._lock:
            page = self.shm_page
            if self.closed or page is None or page.closed or self.shm_version < AHEAD_VERSION or self.ahead is not None:
                return None
            if self._page_lock is None:
                self._page_lock = (PageLock(page.path), page_ahead(page._mm))
            lock, word = self._page_lock
            self._tickets += 1
            ticket = self._tickets

        def make(idx: int) -> AheadGrant:
            word[0] = ticket  # the client reads it only after the reply, or under the page lock
            return AheadGrant(entry, idx, ticket, region_of(entry.slot(idx)), word, lock)

        g = entry.grant_ahead(make)
        if g is None:
            return None
        with self._lock:
            if not self.closed:
                self.ahead = g
                return g
        g.revoke(force=True)
        return None

    def give_back_ahead(self, g: Any) -> None:
        """Undo :meth:`take_ahead` (the grant stays the session's; ended at close if not before)."""
        with self._lock:
            if not self.closed and self.ahead is None:
                self.ahead = g
                return
        g.revoke(force=True)

    def take_ahead(self) -> Any:
        """The session's grant, no longer the session's (claim or revoke it)."""
        with self._lock:
            g, self.ahead = self.ahead, None
        return g

    def hold_pin(self, release: Callable[[], None], name: str) -> None:
        """Keep a read pin until the client's RELEASE (or its next request, or close)."""
        with self._lock:
            old, closed = self._pin, self.closed
            if not closed:
                self._pin = (release, name)
        if old is not None:  # pragma: no cover - callers release first
            old[0]()
        if closed:
            release()

    @property
    def holds_pin(self) -> bool:
        """Whether a read pin is held for the client (set and cleared by the thread running its requests)."""
        return self._pin is not None

    def release_pin(self, name: str | None = None) -> bool:
        """Release the held pin (of ``name``, when given). Returns whether one was held (and matched)."""
        with self._lock:
            pin = self._pin
            if pin is None or (name is not None and pin[1] != name):
                return False
            self._pin = None
        pin[0]()
        return True

    def shm_scratch(self, nbytes: int, store: Any) -> Any:
        """The session's scratch region, of at least ``nbytes`` (grown, never shrunk; charged to the store).

        Raises:
            ResourceExhaustedError: over ``--max-bytes`` or the per-request limit.
            ShmError: no region could be made.
        """
        r = self._shm_scratch
        if r is not None and not r.closed and r.size >= nbytes:
            return r
        if nbytes > MAX_ROWS_BYTES:
            raise ResourceExhaustedError(f"{nbytes} bytes of rows exceeds the per-request limit of {MAX_ROWS_BYTES}")
        size = round_page(min(max(1 << 20, 1 << max(0, (nbytes - 1).bit_length())), MAX_ROWS_BYTES))
        self._drop_scratch()
        store.charge(size, "a session's shared-memory scratch")
        try:
            region = store.shm.create(size)
        except BaseException:
            store.uncharge(size)
            raise
        with self._lock:
            closed = self.closed
            if not closed:
                self._shm_scratch, self._scratch_charge = region, (store, size)
        if closed:
            region.close()
            store.uncharge(size)
            raise ClosedError(f"session closed: {self.close_reason}")
        return region

    def _drop_scratch(self) -> None:
        with self._lock:
            region, self._shm_scratch = self._shm_scratch, None
            charge, self._scratch_charge = self._scratch_charge, None
        if region is not None:
            region.close()
        if charge is not None:
            charge[0].uncharge(charge[1])

    def _close_shm(self) -> None:
        """Closing the session: release the pin, end the grant, unlink the scratch and hello regions, fold and
        close the page."""
        self.release_pin()
        g = self.take_ahead()
        if g is not None:
            g.revoke(force=True)  # the client is gone or going (as a pending write's abort)
        self._drop_scratch()
        self.withdraw_hello()
        self.fold_page()
        with self._lock:
            page, self.shm_page = self.shm_page, None
            lock, self._page_lock = self._page_lock, None
        if lock is not None:
            lock[0].close()
        if page is not None:
            page.close()
