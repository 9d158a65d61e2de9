"""Micro-benchmarks of the pure core (no HTTP): the costs a router pays per call.

1. add + free of a 32-block prompt sharing a 16-block prefix, with ~500 active requests;
2. a potential-loads query over 64 ranks with a 256-block prompt and 500 active requests;
3. applying one 256-event replica batch (adds, marks and frees) with its flush.

Run: .venv/bin/python bench/core_bench.py  (prints one line per figure)
"""

from __future__ import annotations

import random
import statistics
import time

from kv_slot_tracker.core.commands import Add
from kv_slot_tracker.core.events import (
    FREE,
    MARK_PREFILL_COMPLETED,
    ActiveSequenceEvent,
    AddRequest,
)
from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker, ReplicaEffects
from kv_slot_tracker.core.types import (
    PrefillLoadHint,
    PrefillTokenDeltas,
    WorkerWithDpRank,
)

WORKERS = {w: (0, 4) for w in range(16)}  # 16 workers x 4 ranks = 64 ranks
RANKS = [WorkerWithDpRank(w, r) for w in range(16) for r in range(4)]


def add(rid: str, rank: WorkerWithDpRank, tokens: int) -> Add:
    """The add command the service hands the tracker (prefill tokens tracked)."""
    return Add(
        model_name="bench",
        request_id=rid,
        worker_id=rank.worker_id,
        dp_rank=rank.dp_rank,
        new_isl_tokens=tokens,
    )


def make_tracker() -> ActiveSequencesMultiWorker:
    return ActiveSequencesMultiWorker(
        None, 16, WORKERS, False, 0, worker_type="bench", clock=time.monotonic_ns
    )


def prompt(rng: random.Random, prefix: list[int], length: int) -> list[int]:
    return prefix + [rng.getrandbits(63) for _ in range(length - len(prefix))]


def fill(t: ActiveSequencesMultiWorker, rng: random.Random, n: int, length: int) -> list[list[int]]:
    prefixes = [[rng.getrandbits(63) for _ in range(16)] for _ in range(8)]
    now = time.monotonic_ns()
    for i in range(n):
        p = prompt(rng, rng.choice(prefixes), length)
        t.add_on_rank(add(f"bg-{i}", rng.choice(RANKS), 64), p, now)
    return prefixes


def per_op(fn, repeat: int, number: int) -> float:
    """Median seconds per call over ``repeat`` rounds of ``number`` calls."""
    rounds = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        rounds.append((time.perf_counter() - start) / number)
    return statistics.median(rounds)


def bench_add_free() -> float:
    rng = random.Random(1)
    t = make_tracker()
    prefixes = fill(t, rng, 500, 32)
    prompts = [prompt(rng, rng.choice(prefixes), 32) for _ in range(64)]
    state = {"i": 0}

    def op() -> None:
        i = state["i"] = state["i"] + 1
        now = time.monotonic_ns()
        rid = f"r{i}"
        t.add_on_rank(add(rid, RANKS[i % 64], 512), prompts[i % 64], now)
        t.free(rid, now)

    return per_op(op, 7, 2000)


def bench_potential_loads() -> float:
    rng = random.Random(2)
    t = make_tracker()
    prefixes = fill(t, rng, 500, 256)
    queries = [prompt(rng, rng.choice(prefixes), 256) for _ in range(16)]
    state = {"i": 0}
    deltas = PrefillTokenDeltas.uniform(100)

    def op() -> None:
        state["i"] += 1
        t.potential_loads(queries[state["i"] % 16], deltas, time.monotonic_ns())

    return per_op(op, 7, 500)


def bench_replica_batch() -> float:
    rng = random.Random(3)
    t = make_tracker()
    prefixes = fill(t, rng, 500, 32)
    batches = []
    for b in range(40):
        events = []
        for i in range(86):
            rid = f"rep-{b}-{i}"
            w = rng.choice(RANKS)
            p = prompt(rng, rng.choice(prefixes), 32)
            events.append(
                ActiveSequenceEvent(rid, w, AddRequest(p, True, None, PrefillLoadHint(64)), 9)
            )
            events.append(ActiveSequenceEvent(rid, w, MARK_PREFILL_COMPLETED, 9))
            if i < 84:
                events.append(ActiveSequenceEvent(rid, w, FREE, 9))
        batches.append(events[:256])
    it = iter(batches)

    def op() -> None:
        effects = ReplicaEffects()
        for ev in next(it):
            t.apply_replica_event(ev, effects)
        t.flush_replica_effects(effects)

    return per_op(op, 5, 8)


def main() -> None:
    add_free = bench_add_free()
    pot = bench_potential_loads()
    batch = bench_replica_batch()
    print(
        f"add+free (32-block prompt, 16-block shared prefix, 500 active): {add_free * 1e6:.1f} us"
    )
    print(f"potential loads (64 ranks, 256-block prompt, 500 active):      {pot * 1e6:.1f} us")
    print(f"replica batch apply (256 events + flush, 500 active):         {batch * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
