"""The load columns a potential-loads query reads (``kv_slot_tracker.core.loads.LoadColumns``): kept between
queries, refreshed only for the ranks that changed, with decaying prefill tokens read at query
time. Every answer here is also what a fresh computation from the sequences gives."""

from __future__ import annotations

from kv_slot_tracker.core.commands import Add
from kv_slot_tracker.core.loads import Columns
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker
from kv_slot_tracker.core.types import U64_MAX, PrefillTokenDeltas, WorkerDpRange, WorkerWithDpRank
from tests.fakes import FakeClock
from tests.support.tracker import load_columns, new_tracker

W0, W1, W2 = WorkerWithDpRank(0, 0), WorkerWithDpRank(0, 1), WorkerWithDpRank(1, 0)


def tracker() -> tuple[ActiveSequencesMultiWorker, FakeClock]:
    clock = FakeClock()
    return new_tracker(None, 4, {0: (0, 2), 1: (0, 1)}, clock=clock.now), clock


def add(t: ActiveSequencesMultiWorker, rid: str, w: WorkerWithDpRank, hashes, tokens=0, ms=None):
    cmd = Add(
        model_name="m",
        request_id=rid,
        worker_id=w.worker_id,
        dp_rank=w.dp_rank,
        new_isl_tokens=tokens,
        expected_prefill_ms=ms,
    )
    t.add_on_rank(cmd, hashes, t.clock())


def test_a_query_refreshes_only_the_ranks_changed_since_the_last_one() -> None:
    t, clock = tracker()
    t.potential_loads(None, 0, clock.now())
    assert load_columns(t).changed == set()
    add(t, "a", W1, [1, 2, 3], tokens=30)
    assert load_columns(t).changed == {W1}  # one insertion per lifecycle call, nothing else
    assert t.potential_loads([1, 2, 9], 7, clock.now()) == [
        (0, 0, 7, 3, 0),
        (0, 1, 30 + 7, 3 + 3 - 2, 1),
        (1, 0, 7, 3, 0),
    ]
    assert load_columns(t).changed == set()
    t.mark_prefill_completed("a", clock.now())
    t.free("missing", clock.now())  # an unknown id changes nothing
    assert load_columns(t).changed == {W1}
    assert t.potential_loads([1, 2, 9], 7, clock.now())[1] == (0, 1, 7, 4, 1)
    t.free("a", clock.now())
    assert t.potential_loads([1, 2, 9], 7, clock.now())[1] == (0, 1, 7, 3, 0)
    t.assert_consistent()


def test_decaying_prefill_tokens_are_read_at_query_time() -> None:
    t, clock = tracker()
    add(t, "a", W0, [1], tokens=100, ms=10_000)  # modeled: decays over 10 s
    add(t, "b", W2, [2], tokens=40)  # unmodeled: counts in full until completed
    assert [r[2] for r in t.potential_loads(None, 0, clock.now())] == [100, 0, 40]
    clock.advance(5)  # no lifecycle call in between
    assert [r[2] for r in t.potential_loads(None, 0, clock.now())] == [50, 0, 40]
    clock.advance(20)
    assert [r[2] for r in t.potential_loads(None, 0, clock.now())] == [0, 0, 40]
    t.assert_consistent()


def test_a_topology_change_gives_new_columns() -> None:
    t, clock = tracker()
    add(t, "a", W2, [5, 6], tokens=8)
    before = t.potential_loads([5], 1, clock.now())
    t.register_worker(WorkerDpRange(2, 0, 1))
    after = t.potential_loads([5], 1, clock.now())
    assert after == [*before, (2, 0, 1, 1, 0)]
    t.unregister_worker(1)
    assert t.potential_loads([5], 1, clock.now()) == [before[0], before[1], (2, 0, 1, 1, 0)]
    t.assert_consistent()


def test_per_rank_deltas_and_saturation() -> None:
    t, clock = tracker()
    add(t, "a", W0, [1], tokens=U64_MAX - 5)
    deltas = PrefillTokenDeltas(10, {W1: 3, WorkerWithDpRank(9, 9): 4})
    assert [r[2] for r in t.potential_loads(None, deltas, clock.now())] == [U64_MAX, 3, 10]
    assert t.potential_columns([1, 2], 6, clock.now()) == Columns(
        ranks=[W0, W1, W2], prefill=[U64_MAX, 6, 6], decode=[2, 2, 2], requests=[1, 0, 0]
    )
