"""The trackers of one process, keyed by ``(model_name, routing_group)``, with their counters.

A tracker is created by the first topology change of its key and dropped when its last worker
goes. Its counters (added, freed, expired: the tracker counts into them) go with it: a client that registers and unregisters
ever new names must not grow the process or the metrics (a counter that comes back starts from
0 again, which Prometheus reads as a counter reset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kv_slot_tracker.core.limits import DEFAULT_MAX_TRACKERS, UNLIMITED, Budgets, Usage
from kv_slot_tracker.core.publisher import ReplicaWorkerPolicy, SequencePublisher
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker
from kv_slot_tracker.core.types import LifecycleCounts
from kv_slot_tracker.service.commands import Key
from kv_slot_tracker.service.errors import NoTracker, OverBudget, OverMemoryBudget, TooManyTrackers
from kv_slot_tracker.service.leases import Leases
from kv_slot_tracker.service.memory import MemoryWatch

WORKER_TYPE = "standalone"
# how often adds consult the memory reading while under the memory budget (the clock's ns); the
# reading is itself at most ``MemoryWatch.interval`` old, so a budget passed is enforced within
# the two together
MEMORY_CHECK_NS = 250_000_000
NEVER = 1 << 63  # a clock time no clock reaches


class TrackerRegistry:
    def __init__(
        self,
        *,
        clock: Callable[[], int],
        expiry_ns: int,
        check_interval_ns: int,
        instance_id: int,
        replicated: bool,
        publisher_for: Callable[[Key, int], SequencePublisher],
    ) -> None:
        self.clock = clock
        self.expiry_ns = expiry_ns
        self.check_interval_ns = check_interval_ns
        self.instance_id = instance_id
        self.replicated = replicated
        self.publisher_for = publisher_for
        self.trackers: dict[Key, ActiveSequencesMultiWorker] = {}
        # per key, kept while its tracker lives, also across a snapshot's replacement of it
        self.counters: dict[Key, LifecycleCounts] = {}
        self.max_trackers = DEFAULT_MAX_TRACKERS
        self.leases = Leases(0)  # worker leases (``worker_ttl_seconds``; off: 0)
        self.workers_expired = 0  # workers removed because their lease ran out
        # the global budgets (``admit_*``): what every tracker holds, counted as it changes
        self.usage = Usage()
        self.budgets: Budgets = UNLIMITED
        # resident memory in bytes, sampled (``service.memory.MemoryWatch``); None: not watched
        self._resident: Callable[[], int] | None = None
        # the clock's time (ns) from which the next add consults the memory reading (``add``
        # compares, ``admit_request`` consults); NEVER while no reading is watched
        self.memory_due = NEVER
        self.refusals: dict[str, int] = {}  # calls refused, per budget
        # workers in the selection catalog (the selection service's, when there is one)
        self.catalog_size: Callable[[], int] = lambda: 0

    # -- budgets: O(1) checks before a call grows the state -------------------------------------

    @property
    def resident(self) -> Callable[[], int] | None:
        """Resident memory in bytes, sampled; None: the memory budget is not watched."""
        return self._resident

    @resident.setter
    def resident(self, read: Callable[[], int] | None) -> None:
        self._resident = read
        self.memory_due = NEVER if read is None else 0

    def _refuse(self, error: OverBudget) -> OverBudget:
        self.refusals[error.budget] = self.refusals.get(error.budget, 0) + 1
        return error

    def admit_memory(self) -> None:
        """``OverMemoryBudget`` when the process is past its memory budget."""
        if self._resident is not None:
            resident = self._resident()
            limit = self.budgets.memory_bytes
            if resident > limit and isinstance(self._resident, MemoryWatch):
                resident = self._resident.after_trim()  # free pages the allocator kept
            if resident > limit:
                raise self._refuse(OverMemoryBudget(resident, limit))

    def admit_ranks(self, adding: int) -> None:
        held, limit = self.usage.ranks, self.budgets.ranks
        if adding > 0 and held + adding > limit:
            raise self._refuse(OverBudget("worker ranks", held, adding, limit, "max_ranks"))
        self.admit_memory()

    def over_request_budgets(self, hashes: int, now: int) -> bool:
        """Whether an add of ``hashes`` hashes at ``now`` must go through ``admit_request``: a
        count budget reached, or the memory reading due. ``SlotTrackerService.add`` writes this
        out: calling ``admit_request`` on every add cost 2 % of a batch operation's
        instructions (``bench/edge_cost.py``)."""
        usage, budgets = self.usage, self.budgets
        return (
            usage.requests >= budgets.active_requests
            or usage.hashes + hashes > budgets.block_hashes
            or now >= self.memory_due
        )

    def admit_request(self, hashes: int, now: int) -> None:
        """Refuse an add of ``hashes`` hashes past a budget. The memory reading is consulted at
        most every ``MEMORY_CHECK_NS`` of the clock while under its budget (the reading is
        itself at most ``MemoryWatch.interval`` old), on every add while past it."""
        usage, budgets = self.usage, self.budgets
        if usage.requests >= budgets.active_requests:
            raise self._refuse(OverBudget("active requests", usage.requests, 1,
                                          budgets.active_requests, "max_active_requests"))  # fmt: skip
        if hashes and usage.hashes + hashes > budgets.block_hashes:
            raise self._refuse(OverBudget("block hashes", usage.hashes, hashes,
                                          budgets.block_hashes, "max_block_hashes"))  # fmt: skip
        if now < self.memory_due:
            return
        resident = self._resident  # watched: ``memory_due`` is NEVER while it is None
        if resident is not None and resident() > budgets.memory_bytes:
            self.memory_due = now  # past it: every add consults it until it is back under
            self.admit_memory()  # trims, reads again, refuses
        self.memory_due = now + MEMORY_CHECK_NS

    def admit_selection_worker(self, held: int) -> None:
        limit = self.budgets.selection_workers
        if held >= limit:
            raise self._refuse(
                OverBudget("selection workers", held, 1, limit, "max_selection_workers")
            )
        self.admit_memory()

    def recount(self) -> None:
        """Count what the trackers hold from scratch (after their wholesale replacement)."""
        usage = self.usage
        usage.ranks = usage.requests = usage.hashes = 0
        for t in self.trackers.values():
            t.count_into(usage)

    def check_room(self, key: Key) -> None:
        """``TooManyTrackers`` when ``key`` has no tracker and there is no room for one."""
        if key not in self.trackers and len(self.trackers) >= self.max_trackers:
            raise TooManyTrackers(key, self.max_trackers)

    def create(
        self, key: Key, block_size: int, *, capped: bool = True
    ) -> ActiveSequencesMultiWorker:
        """A new tracker for ``key``; ``capped``: refuse it beyond ``max_trackers`` (a
        snapshot being restored is not: it holds what its writer accepted)."""
        if capped:
            self.check_room(key)
        tracker = ActiveSequencesMultiWorker(
            self.publisher_for(key, block_size),
            block_size,
            {},
            self.replicated,
            self.instance_id,
            worker_type=WORKER_TYPE,
            clock=self.clock,
            expiry_ns=self.expiry_ns,
            check_interval_ns=self.check_interval_ns,
            replica_worker_policy=ReplicaWorkerPolicy.REQUIRE_REGISTERED,
            counts=self.counters.setdefault(key, LifecycleCounts()),
            usage=self.usage,
        )
        self.trackers[key] = tracker
        return tracker

    def get(self, key: Key) -> ActiveSequencesMultiWorker:
        t = self.trackers.get(key)
        if t is None:
            raise NoTracker(key)
        return t

    def find(self, key: Key) -> ActiveSequencesMultiWorker | None:
        return self.trackers.get(key)

    def drop_if_empty(self, key: Key) -> None:
        t = self.trackers.get(key)
        if t is not None and not t.has_registered_workers():
            usage = self.usage
            usage.ranks -= t.num_ranks()
            usage.requests -= t.num_requests()
            usage.hashes -= t.held_hashes()
            del self.trackers[key]
            self.counters.pop(key, None)

    def matching(self, model_name: str | None, routing_group: str | None) -> list[Key]:
        """Keys of live trackers, sorted, filtered by model and/or routing group."""
        if model_name is not None and routing_group is not None:
            key = (model_name, routing_group)
            return [key] if key in self.trackers else []
        keys: Iterable[Key] = (
            k
            for k in self.trackers
            if (model_name is None or k[0] == model_name)
            and (routing_group is None or k[1] == routing_group)
        )
        return sorted(keys)

    def replace_all(self, trackers: dict[Key, ActiveSequencesMultiWorker]) -> None:
        """Replace the trackers; the counters of keys still present are kept (``prune``).
        Every worker gets a full lease from now: a snapshot carries no lease deadlines, and a
        worker that is really gone expires one ttl later."""
        self.trackers = trackers
        self.recount()
        now = self.clock()
        for key, t in trackers.items():
            for r in t.worker_ranges():
                self.leases.renew(key, r.worker_id, now)

    def prune_counters(self) -> None:
        """Forget the counters of keys without a tracker (after ``replace_all``)."""
        trackers = self.trackers
        self.counters = {k: c for k, c in self.counters.items() if k in trackers}
