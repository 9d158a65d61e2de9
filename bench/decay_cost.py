"""Wall time of ``add_output_block`` with a decay fraction on one rank whose request has a long
prompt (default 280,000 blocks, the first half shared with another request of the rank).

Reports the request's first decaying output block (which gives the fraction to every block it
holds alone) and the median of the ones after it. ``--repo`` points at a checkout of another
commit to compare. A benchmark, not a test: the figures depend on the machine and its load.

    .venv/bin/python bench/decay_cost.py [--repo PATH] [--blocks N] [--calls N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", type=Path, default=HERE.parent)
    ap.add_argument("--blocks", type=int, default=280_000, help="prompt blocks")
    ap.add_argument("--calls", type=int, default=20, help="decaying output blocks after the first")
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo))
    from kv_slot_tracker.core.sequences import ActiveSequences

    rng = random.Random(1)
    prompt = [rng.getrandbits(64) for _ in range(args.blocks)]
    slot = ActiveSequences(16, lambda: 0, expiry_ns=None, rng=random.Random(2))
    slot.add_request_with_prefill_tracking(
        "shared", prompt[: args.blocks // 2], None, False, None, 0
    )
    slot.add_request_with_prefill_tracking("long", prompt, None, False, None, 0)
    start = time.perf_counter()
    slot.add_output_block("long", 0.5)
    first = time.perf_counter() - start
    times = []
    for i in range(args.calls):
        start = time.perf_counter()
        slot.add_output_block("long", 0.5 - i / (4 * args.calls))
        times.append(time.perf_counter() - start)
    print(
        f"repo {args.repo}: prompt {args.blocks:,} blocks, active blocks {slot.active_blocks():,}"
    )
    print(f"first decaying output block: {first * 1e3:.3f} ms")
    print(f"next {args.calls}: median {statistics.median(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
