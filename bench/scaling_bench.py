"""How the cost of a call grows with the number of active requests.

In process (``--inprocess``), through the service layer (no HTTP):

  fill        adding N requests of 32 blocks (16 shared), tracked prefill, never freed;
              the rate per 10,000 as they accumulate
  add+free    one more request added and freed, at 1,000 and at 100,000 active
  memory      resident size above idle with N active requests

Run:  .venv/bin/python bench/scaling_bench.py --inprocess [--fill 100000] [--gc default|tuned]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from app.service import AddCall, SlotTrackerService  # noqa: E402

WORKERS, RANKS_PER_WORKER = 16, 4
RANKS = WORKERS * RANKS_PER_WORKER
KEY = ("bench", "default")
PREFIX = [1000003 * i for i in range(1, 17)]  # the 16 shared blocks, as bench/wrk/fill.lua


def rss_self_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def new_service() -> SlotTrackerService:
    svc = SlotTrackerService()
    for w in range(WORKERS):
        svc.register(KEY, w, 16, 0, RANKS_PER_WORKER)
    return svc


def add_call(tag: str, n: int) -> AddCall:
    """Request ``n`` as fill.lua builds it: rank n % 64, 16 shared + 16 unique blocks."""
    rank = n % RANKS
    return AddCall(
        KEY[0],
        KEY[1],
        f"{tag}{n}",
        rank // RANKS_PER_WORKER,
        rank % RANKS_PER_WORKER,
        [1000003 * i for i in range(1, 17)] + [n * 64 + i for i in range(1, 17)],
        new_isl_tokens=512,
    )


def fill(
    svc: SlotTrackerService, start: int, stop: int, step: int = 10_000
) -> list[tuple[int, float]]:
    """Add requests ``start..stop-1``; ``(adds, seconds)`` per chunk of ``step`` adds."""
    out = []
    for lo in range(start, stop, step):
        calls = [add_call("f", n) for n in range(lo, min(lo + step, stop))]
        t0 = time.perf_counter()
        for c in calls:
            svc.add(c)
        out.append((len(calls), time.perf_counter() - t0))
    return out


def add_free_us(svc: SlotTrackerService, rounds: int = 7, number: int = 1000) -> float:
    """Median microseconds for one add plus its free, next to the active requests."""
    calls = [add_call("x", 10_000_000 + i) for i in range(rounds * number)]
    free = svc.free
    per = []
    for r in range(rounds):
        batch = calls[r * number : (r + 1) * number]
        t0 = time.perf_counter()
        for c in batch:
            svc.add(c)
            free(KEY, c.request_id)
        per.append((time.perf_counter() - t0) / number)
    return statistics.median(per) * 1e6


class GcTimer:
    """Time spent in the cyclic collector, per generation, and the longest single pass."""

    def __init__(self) -> None:
        self.total = [0.0, 0.0, 0.0]
        self.passes = [0, 0, 0]
        self.longest = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        spent = time.perf_counter() - self._start
        gen = info["generation"]
        self.total[gen] += spent
        self.passes[gen] += 1
        self.longest = max(self.longest, spent)


def inprocess(fill_count: int, gc_mode: str) -> dict:
    if gc_mode == "tuned":
        from app.gc_tuning import tune_gc

        tune_gc()
    timer = GcTimer()
    gc.callbacks.append(timer)
    base = rss_self_mb()
    svc = new_service()
    res: dict = {"gc_mode": gc_mode}
    chunks = fill(svc, 0, 1000)
    res["add_free_us_1000"] = add_free_us(svc)
    chunks += fill(svc, 1000, fill_count)
    res["add_free_us_full"] = add_free_us(svc)
    res["fill_s"] = sum(sec for _, sec in chunks)
    gc.callbacks.remove(timer)
    res["gc"] = timer
    res["fill_chunks_s"] = chunks
    gc.collect()
    res["rss_above_idle_mb"] = rss_self_mb() - base
    res["active"] = sum(len(s.requests) for s in svc.tracker(KEY).slots.values())
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inprocess", action="store_true")
    ap.add_argument("--fill", type=int, default=100_000)
    ap.add_argument("--gc", choices=["default", "tuned"], default="default")
    args = ap.parse_args()
    if args.inprocess:
        r = inprocess(args.fill, args.gc)
        chunks = ", ".join(f"{sec * 1e6 / n:.1f}" for n, sec in r["fill_chunks_s"])
        t = r["gc"]
        print(f"gc {r['gc_mode']}: active {r['active']}")
        print(f"  fill {args.fill}: {r['fill_s']:.2f} s; us per add, by chunk: {chunks}")
        print(f"  add+free at 1,000 active: {r['add_free_us_1000']:.1f} us")
        print(f"  add+free at {args.fill:,} active: {r['add_free_us_full']:.1f} us")
        print(f"  RSS above idle: {r['rss_above_idle_mb']:.0f} MB")
        print(
            f"  collector: {sum(t.total):.2f} s in {t.passes} passes (gen 0/1/2), "
            f"gen 2 {t.total[2]:.2f} s, longest pass {t.longest * 1e3:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
