"""The cost of remembering an early call (a free or prefill completion that arrived before its
add: ``kv_slot_tracker.service.early_calls.EarlyCalls``) when the store is at its capacity, where
every ``put`` also drops the oldest entry.

    python bench/early_cost.py [--capacity 100000] [--puts 20000] [--rounds 5] [--repo DIR]

Prints the median and the best of the rounds, in microseconds of CPU per ``put``; ``--repo``
measures another checkout's code (for a before/after in one run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--puts", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    from kv_slot_tracker.service.early_calls import FREE, EarlyCalls

    per_put = []
    for _ in range(args.rounds):
        store = EarlyCalls(args.capacity, 1 << 62)
        for i in range(args.capacity):
            store.put(("m", "", f"r{i}"), FREE, i, 0)
        start = time.process_time()
        for i in range(args.puts):
            store.put(("m", "", f"s{i}"), FREE, args.capacity + i, 0)
        per_put.append((time.process_time() - start) / args.puts * 1e6)
        assert len(store) == args.capacity
    print(
        f"capacity {args.capacity:,}, {args.puts:,} puts: "
        f"median {statistics.median(per_put):.2f} us, best {min(per_put):.2f} us per put"
    )


if __name__ == "__main__":
    main()
