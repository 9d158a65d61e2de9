"""How the cost of a call grows with the number of active requests, here and in the reference.

Over HTTP, one kv-slot-tracker and one Dynamo Rust slot tracker (bench/reference.py) run side
by side and are measured at each level as they fill up; each figure is the median of
``--rounds`` wrk runs that alternate reference / ours, so a busy machine hits both alike. The
memory figure comes from a separate pair of fresh servers filled once:

  fill        0, 10,000 and 100,000 active prefill-tracked requests of 32 blocks (16 shared),
              never freed and never prefill-completed (bench/wrk/fill.lua)
  lifecycle   /add + /free alternating (bench/wrk/lifecycle.lua), req/s
  potential   /potential_loads, 64 ranks, 256-block prompt (bench/wrk/potential.lua), req/s;
              every level also holds the 200 requests http_bench.py adds for this query
  memory      resident size above idle with 100,000 active requests

In process (``--inprocess``, ours only, through the service layer, no HTTP):

  fill        adding N such requests; CPU microseconds per add as they accumulate
  add+free    one more request added and freed, at 1,000 and at N active (CPU time)
  memory      resident size above idle with N active requests

With ``--workers N`` ours runs as ``python -m kv_slot_tracker --workers N`` (see bench/http_bench.py).

Run:  .venv/bin/python bench/scaling_bench.py [--duration 5] [--rounds 3] [--levels 0,10000,100000]
                                              [--workers N]
      .venv/bin/python bench/scaling_bench.py --inprocess [--fill 100000] [--gc default|tuned]
Needs (HTTP): wrk, taskset, the reference venv (python bench/reference.py ensure).
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench import http_bench  # noqa: E402
from bench.http_bench import post, rss_mb, setup_active, setup_topology, started, wrk  # noqa: E402
from kv_slot_tracker.service import SlotTrackerService  # noqa: E402
from tests.calls import AddCall, register  # noqa: E402
from tests.calls import free as free_call  # noqa: E402
from tests.support.tracker import active_request_counts  # noqa: E402

WORKERS, RANKS_PER_WORKER = 16, 4
RANKS = WORKERS * RANKS_PER_WORKER
KEY = ("bench", "default")


def rss_self_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def new_service() -> SlotTrackerService:
    svc = SlotTrackerService()
    for w in range(WORKERS):
        register(svc, KEY, w, 16, 0, RANKS_PER_WORKER)
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
        t0 = time.process_time()
        for c in calls:
            svc.add(c)
        out.append((len(calls), time.process_time() - t0))
    return out


def add_free_us(svc: SlotTrackerService, rounds: int = 9, number: int = 1000) -> float:
    """CPU microseconds for one add plus its free, next to the active requests: the fastest of
    ``rounds`` rounds. CPU time of this process, not wall time, so that time spent waiting for
    a core on a shared machine does not count."""
    calls = [add_call("x", 10_000_000 + i) for i in range(rounds * number)]
    per = []
    for r in range(rounds):
        batch = calls[r * number : (r + 1) * number]
        t0 = time.process_time()
        for c in batch:
            svc.add(c)
            free_call(svc, KEY, c.request_id)
        per.append((time.process_time() - t0) / number)
    return min(per) * 1e6


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
        from kv_slot_tracker.gc_tuning import tune_gc

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
    res["active"] = sum(active_request_counts(svc.tracker(KEY)).values())
    return res


def active_requests(url: str) -> int:
    """Active requests over all ranks (``/potential_loads`` reports them on both services)."""
    status, body = post(
        url,
        "/potential_loads",
        {"model_name": "bench", "sequence_hashes": [1], "new_isl_tokens": 0},
    )
    assert status == 200, body
    return sum(row["active_requests"] for row in json.loads(body))


def fill_http(url: str, count: int, already: int = 0) -> float:
    """Add ``count`` more requests with fill.lua (after ``already`` added earlier); returns the
    seconds it took.

    When a wrk run ends before all were sent, another one (at most three more) adds the missing
    number with fresh ids. A wrk run loses a call of the script on start-up, so a request or
    two (at most 0.1 %) may stay missing."""
    t0 = time.perf_counter()
    base = active_requests(url)
    start, missing = already + 1, count
    for _ in range(4):
        env = {"FILL_COUNT": str(missing), "FILL_START": str(start)}
        wrk(url, "fill.lua", max(5, missing // 2000 + 3), env, connections=16)
        http_bench.settle(url)  # several processes: until every one applied the fill
        start += missing
        missing = count - (active_requests(url) - base)
        if missing <= max(2, count // 1000):
            break
    return time.perf_counter() - t0


def measure(servers: dict, res: dict, level: int, duration: int, rounds: int) -> None:
    """Lifecycle and potential loads on every server; each measured wrk run alternates between
    them (reference, ours, reference, ours, ...), so a busy neighbour hits both alike."""
    for k, s in servers.items():
        row = res[k][level] = {"kind": k, "level": level, "active": active_requests(s.url)}
        row["lifecycle"], row["potential"], row["non2xx"] = [], [], 0
        wrk(s.url, "lifecycle.lua", 2, {"WRK_TAG": f"w{level}"})
        wrk(s.url, "potential.lua", 2)
    for workload in ("lifecycle", "potential"):
        for r in range(rounds):
            for k, s in servers.items():
                run = wrk(s.url, f"{workload}.lua", duration, {"WRK_TAG": f"r{level}-{r}"})
                res[k][level][workload].append(run["rps"])
                res[k][level]["non2xx"] += run["non2xx"]
    for k in servers:
        row = res[k][level]
        row["lifecycle_rps"] = statistics.median(row["lifecycle"])
        row["potential_rps"] = statistics.median(row["potential"])
        print(json.dumps(row), flush=True)


def http_scaling(levels: list[int], duration: int, rounds: int) -> list[dict]:
    """One reference and one ours side by side, measured at each level as they fill up (the
    same processes throughout, so a level is compared with the same server empty)."""
    res: dict[str, dict[int, dict]] = {"ref": {}, "ours": {}}
    with started("ref") as ref, started("ours") as ours:
        servers = {"ref": ref, "ours": ours}
        for s in servers.values():
            setup_topology(s.url)
            setup_active(s.url)  # the 200 requests potential.lua overlaps with
            http_bench.settle(s.url)
        filled = 0
        for level in levels:
            if level > filled:
                for s in servers.values():
                    fill_http(s.url, level - filled, filled)
            filled = level
            measure(servers, res, level, duration, rounds)
    return [res[k][level] for k in res for level in levels]


def http_memory(count: int) -> dict:
    """RSS with no request and with ``count`` active ones, on fresh servers (no churn before)."""
    out = {}
    with started("ref") as ref, started("ours") as ours:
        servers = {"ref": ref, "ours": ours}
        for s in servers.values():
            setup_topology(s.url)
        time.sleep(0.5)
        idle = {k: rss_mb(s.pid) for k, s in servers.items()}
        for s in servers.values():
            fill_http(s.url, count)
        time.sleep(1)
        for k, s in servers.items():
            out[k] = {"rss_idle_mb": idle[k], "rss_filled_mb": rss_mb(s.pid)}
            out[k]["active"] = active_requests(s.url)
    print(json.dumps({"memory": out}), flush=True)
    return out


def inprocess_subprocess(fill_count: int) -> dict:
    """The in-process figures from a fresh interpreter (collector tuned as when serving)."""
    cmd = [sys.executable, str(Path(__file__)), "--inprocess", "--gc", "tuned", "--json"]
    cmd += ["--fill", str(fill_count)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(http: list[dict], memory: dict, inproc: dict, levels: list[int]) -> str:
    def cell(kind: str, level: int, key: str) -> float:
        return next(r[key] for r in http if r["kind"] == kind and r["level"] == level)

    top = levels[-1]
    head = ["Figure"]
    for name in ("reference", "ours"):
        head += [f"{name}, {level:,} active" for level in levels]
    head += [f"reference {top:,} / {levels[0]:,}", f"ours {top:,} / {levels[0]:,}"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, label in (
        ("lifecycle_rps", "`/add` + `/free` req/s"),
        ("potential_rps", "`/potential_loads` req/s"),
    ):
        vals = [cell(k, lv, key) for k in ("ref", "ours") for lv in levels]
        ratios = [cell(k, top, key) / cell(k, levels[0], key) for k in ("ref", "ours")]
        rows.append(
            f"| {label} | "
            + " | ".join(f"{v:,.0f}" for v in vals)
            + " | "
            + " | ".join(f"{x:.2f}" for x in ratios)
            + " |"
        )
    lines = ["\n".join(rows), ""]
    if memory:
        count = memory["ours"]["active"]
        above = {k: m["rss_filled_mb"] - m["rss_idle_mb"] for k, m in memory.items()}
        lines += [
            f"| Memory, RSS | idle | with {count:,} active | above idle |",
            "| --- | --- | --- | --- |",
        ]
        for k, name in (("ref", "reference"), ("ours", "ours")):
            m = memory[k]
            lines.append(
                f"| {name} | {m['rss_idle_mb']:.0f} MB | {m['rss_filled_mb']:.0f} MB | "
                f"{above[k]:.0f} MB |"
            )
        lines += [f"| ours / reference | | | {above['ours'] / above['ref']:.2f} |", ""]
    n = inproc["fill"]
    lines += [
        f"| In process (ours, service layer) | 1,000 active | {n:,} active | ratio |",
        "| --- | --- | --- | --- |",
        f"| add + free of one more request | {inproc['add_free_us_1000']:.1f} us | "
        f"{inproc['add_free_us_full']:.1f} us | "
        f"{inproc['add_free_us_full'] / inproc['add_free_us_1000']:.2f} |",
        f"| fill of {n:,}: {inproc['fill_s']:.1f} s; RSS above idle "
        f"{inproc['rss_above_idle_mb']:.0f} MB | | | |",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inprocess", action="store_true", help="only the in-process figures")
    ap.add_argument("--fill", type=int, default=100_000)
    ap.add_argument("--gc", choices=["default", "tuned"], default="default")
    ap.add_argument("--json", action="store_true", help="(--inprocess) one JSON line")
    ap.add_argument("--duration", type=int, default=5, help="seconds per measured wrk run")
    ap.add_argument("--rounds", type=int, default=3, help="measured runs per service and level")
    ap.add_argument("--levels", default="0,10000,100000")
    ap.add_argument(
        "--workers", type=int, default=1, help="ours as python -m kv_slot_tracker --workers N"
    )
    args = ap.parse_args()
    http_bench.OURS_WORKERS = args.workers  # nothing pinned when N > 1 (see http_bench.py)
    if args.inprocess:
        r = inprocess(args.fill, args.gc)
        t = r.pop("gc")
        if args.json:
            print(json.dumps({**r, "fill": args.fill, "gc_seconds": sum(t.total)}))
            return 0
        chunks = ", ".join(f"{sec * 1e6 / n:.1f}" for n, sec in r["fill_chunks_s"])
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
    # stop the servers (context managers) also when killed, e.g. by timeout(1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    levels = [int(x) for x in args.levels.split(",")]
    memory = http_memory(levels[-1]) if levels[-1] else {}
    results = http_scaling(levels, args.duration, args.rounds)
    inproc = inprocess_subprocess(max(levels[-1], 1000))
    print(json.dumps({"inprocess": inproc}), flush=True)
    print()
    print(table(results, memory, inproc, levels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
