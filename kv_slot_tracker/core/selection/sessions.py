"""Session affinity: a ``session_id`` stays on the worker that served it.

Observed on the reference (1.6.1, ``--session-affinity-ttl-secs T``): a ``select_and_reserve``
with a ``session_id`` binds the session to the chosen worker; later selections with that session
(``/select`` and ``/select_and_reserve``) choose among that worker's ranks whatever the costs, for
``T`` seconds after the session's last request. A query-only ``/select`` does not bind. When the
bound worker is not a candidate any more (deleted, moved to another partition), the selection is
made as without a session and the next booking binds anew. When ``allowed_worker_ids`` excludes
the bound worker, a booking is refused: ``session S is bound to worker B, not W``.

Kept in memory (with Redis, every instance binds the session a booking record names), bounded:
at most ``max_entries`` sessions (the least recently used goes first); expired entries are
dropped as they are met and from the old end on every bind, so a call costs O(1) amortised. Time
is integer nanoseconds passed in.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionAffinity:
    def __init__(self, ttl_ns: int, max_entries: int = 100_000) -> None:
        if ttl_ns <= 0 or max_entries <= 0:
            raise ValueError("ttl_ns and max_entries must be > 0")
        self.ttl_ns = ttl_ns
        self.max_entries = max_entries
        self._bound: OrderedDict[str, tuple[int, int]] = OrderedDict()  # session -> (worker, last)
        self.evicted = 0

    def bound(self, session: str, now_ns: int) -> int | None:
        """The worker ``session`` is bound to, or None (never bound, or expired)."""
        entry = self._bound.get(session)
        if entry is None:
            return None
        if now_ns - entry[1] >= self.ttl_ns:
            del self._bound[session]
            return None
        return entry[0]

    def touch(self, session: str, now_ns: int) -> None:
        """A request of the session: its lifetime starts again."""
        entry = self._bound.get(session)
        if entry is not None:
            self._bound[session] = (entry[0], now_ns)
            self._bound.move_to_end(session)

    def bind(self, session: str, worker_id: int, now_ns: int) -> None:
        bound = self._bound
        bound[session] = (worker_id, now_ns)
        bound.move_to_end(session)
        while bound:
            oldest, (_, last) = next(iter(bound.items()))
            if now_ns - last < self.ttl_ns and len(bound) <= self.max_entries:
                break
            if now_ns - last < self.ttl_ns:
                self.evicted += 1
            del bound[oldest]

    def __len__(self) -> int:
        return len(self._bound)
