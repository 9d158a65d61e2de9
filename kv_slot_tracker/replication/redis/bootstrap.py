"""Where this instance stands with the shared state: the bootstrap state machine.

A starting instance loads the snapshot, reads the stream from the id it covers (from the
beginning without one) and only then reports ready. ``Phase`` is where it is on that way;
``ready()`` and the not-ready reason are derived from it, and ``Bootstrap`` has one method per
transition::

    NOT_STARTED ─connecting─► CONNECTING ─loading─► LOADING ─loaded─► READY (for good)
                  UNREACHABLE ◄─unreachable─ (any phase before READY) ─failed─► FAILED
                  WAITING_FOR_SNAPSHOT ◄─waiting_for_snapshot─ LOADING
    UNREACHABLE, FAILED, WAITING_FOR_SNAPSHOT ─loading─► LOADING (the reader retries)

``start()`` returns at once (the instance listens and answers 503 until READY);
``settled()`` waits until the machine *settles* (READY, UNREACHABLE or FAILED) or for
``START_WAIT_S``; an instance waiting for a snapshot keeps ``settled()`` waiting.

Redis losing data. Until a snapshot is written after a reset (``{ns}:reset`` is set), starting
instances stay not ready, for at most ``SNAPSHOT_WAIT_NS``: the stream then holds only the
re-sent recent records, each instance's in its own order, so replaying it could miss older
records or see a free before its add. A running instance waits the same way at a gap while a
reset is pending (``keep_waiting_for_snapshot``).

Whether the local state is worth a snapshot is decided here too (``snapshot_allowed``), from
the conditions the reader reports: a stream position checked against the server after a
reconnect, own records read back, no wait at a gap, no recent gap that no snapshot covered.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable

from kv_slot_tracker.core.types import NS_PER_S

log = logging.getLogger(__name__)

START_WAIT_S = 10.0  # settled() returns after this even if still catching up (then not ready)
BOOTSTRAP_RETRY_S = 0.5  # while waiting for a snapshot that a running instance is to write
SNAPSHOT_WAIT_NS = 60 * NS_PER_S  # then bootstrap anyway (no instance able to write one is up)


class Phase(enum.Enum):
    """Where a starting instance is; the value is the not-ready reason (before any detail)."""

    NOT_STARTED = "not started"
    CONNECTING = "connecting to Redis"
    LOADING = "loading the snapshot and catching up with the stream"
    WAITING_FOR_SNAPSHOT = "waiting for a snapshot"
    UNREACHABLE = "Redis unreachable"
    FAILED = "bootstrap failed"
    READY = ""


SETTLED = frozenset({Phase.READY, Phase.UNREACHABLE, Phase.FAILED})


class BootstrapPending(Exception):
    """Bootstrapping now would miss records that only running instances hold: retry later."""

    def __init__(self, why: str) -> None:
        super().__init__(f"waiting for a snapshot: {why}")
        self.why = why


class Bootstrap:
    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.phase = Phase.NOT_STARTED
        self._detail: str | None = None  # what the reason adds to the phase
        self._settled = asyncio.Event()
        self._waiting_since: int | None = None  # clock ns; waiting for a snapshot since then
        self._check_position = False  # the stream position needs checking against the server
        self._no_snapshot_until = 0  # clock ns; after going on past records no snapshot covered
        self._local_floor = 1  # own records from this seq on are already in local state
        self._replay_target = 0  # own records up to this seq must be read back before snapshots

    # -- the phase ------------------------------------------------------------------------

    def ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def not_ready_reason(self) -> str:
        if self._detail is None:
            return self.phase.value
        return f"{self.phase.value}: {self._detail}"

    def _enter(self, phase: Phase, detail: str | None = None) -> None:
        self.phase = phase
        self._detail = detail
        if phase in SETTLED:
            self._settled.set()

    def connecting(self) -> None:
        self._enter(Phase.CONNECTING)

    def loading(self) -> None:
        self._enter(Phase.LOADING)

    def waiting_for_snapshot(self, why: str) -> None:
        self._enter(Phase.WAITING_FOR_SNAPSHOT, why)

    def unreachable(self, error: BaseException | None) -> None:
        """Redis did not answer; nothing changes once ready (local state keeps serving)."""
        if not self.ready():
            self._enter(Phase.UNREACHABLE, str(error))

    def failed(self, error: BaseException) -> None:
        """Bootstrap raised something unexpected (it is retried); nothing changes once ready."""
        if not self.ready():
            self._enter(Phase.FAILED, repr(error))

    def loaded(self) -> None:
        self._waiting_since = None
        self._enter(Phase.READY)

    async def settled(self, timeout_s: float) -> None:
        """Until the phase settled once (see the module docstring), at most ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), timeout_s)

    # -- waiting for a snapshot -------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        return self._waiting_since is not None

    def keep_waiting_for_snapshot(self, why: str) -> bool:
        """Whether to keep waiting for a snapshot (one that a running instance is to write)
        rather than go on without one: True until we have waited ``SNAPSHOT_WAIT_NS``."""
        now = self.clock()
        if self._waiting_since is None:
            self._waiting_since = now
            log.warning("replication: %s; waiting for a snapshot", why)
        if now - self._waiting_since < SNAPSHOT_WAIT_NS:
            return True
        log.error(
            "replication waited %d s for a snapshot in vain (%s); going on without it",
            SNAPSHOT_WAIT_NS // NS_PER_S,
            why,
        )
        return False

    def stop_waiting(self) -> None:
        self._waiting_since = None

    # -- what the local state holds ---------------------------------------------------------

    @property
    def position_check_due(self) -> bool:
        return self._check_position

    def position_in_doubt(self) -> None:
        """The connection failed: Redis may have restarted or failed over meanwhile."""
        self._check_position = True

    def position_checked(self) -> None:
        self._check_position = False

    def restored(self, next_seq: int) -> None:
        """The local state was replaced by a snapshot (or emptied) while the outbox was about to
        number its next record ``next_seq``: own records from there on are in the local state,
        earlier ones must be read back (and applied) before this state is worth a snapshot."""
        self._local_floor = next_seq
        self._replay_target = next_seq - 1

    @property
    def local_floor(self) -> int:
        """Own records from this sequence number on are already in the local state."""
        return self._local_floor

    def went_on_without_records(self, for_ns: int) -> None:
        """The ledger now claims records the state lacks: no snapshot from us for ``for_ns``,
        so that an instance holding them (which saw the reset too) writes the next one."""
        self._no_snapshot_until = self.clock() + for_ns

    def snapshot_allowed(self, reader_connected: bool, own_read_back: int) -> bool:
        """Only a caught-up state that includes all our own accepted records is worth saving,
        only with a stream position checked against the server we are talking to, and neither
        while we wait at a gap nor soon after we went on past records that no snapshot covered
        (the ledger would claim records the state lacks)."""
        return (
            self.ready()
            and reader_connected
            and not self._check_position
            and own_read_back >= self._replay_target
            and self._waiting_since is None
            and self.clock() >= self._no_snapshot_until
        )
