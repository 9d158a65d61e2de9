"""Throughput of the selection API next to Dynamo's selection service, in the same run.

Both servers are started here (the reference is ``python -m dynamo.select_service`` from its own
virtualenv with ``DYN_ROUTER_USE_KV_EVENTS=false``, see ``bench/reference.py``; ours is
``python -m kv_slot_tracker``, its selection API under ``/selection``), given the same catalog (16 workers x
4 ranks, block size 16, one model), and loaded in turn (A B A B ...) with wrk: 1 thread,
32 connections, wrk pinned to CPU 0 and the server to CPU 1, as ``bench/http_bench.py`` does.

Figures:
  reserve   /select_and_reserve + DELETE /reservations/{id} alternating (each reservation is
            deleted 64 calls later), 32-block prompts sharing a 16-block prefix
  select    /select alone, same prompts, with 200 reservations active (explicit bookings)

Run:  .venv/bin/python bench/selection_bench.py [--duration 10] [--rounds 2] [--only reserve]
Needs: wrk, taskset, the reference venv (python bench/reference.py ensure).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.http_bench import children, pin, post, wrk  # noqa: E402
from bench.reference import Server, start_ours, start_reference  # noqa: E402

WORKERS, RANKS_PER_WORKER, BLOCK_SIZE = 16, 4, 16
PREFIX = {"ref": "", "ours": "/selection"}
SCRIPTS = {"reserve": "select_reserve.lua", "select": "select.lua"}


def started(kind: str) -> Server:
    if kind == "ref":
        env = {**os.environ, "DYN_ROUTER_USE_KV_EVENTS": "false"}
        server = start_reference(module="dynamo.select_service", env=env)
    else:
        server = start_ours()
    pin(server.pid, 1)
    for c in children(server.pid):
        pin(c, 1)
    return server


def setup_catalog(url: str) -> None:
    for w in range(WORKERS):
        status, body = post(
            url,
            "/workers",
            {
                "worker_id": w,
                "model_name": "bench",
                "endpoint": f"http://w{w}:8000",
                "block_size": BLOCK_SIZE,
                "data_parallel_size": RANKS_PER_WORKER,
            },
        )
        assert status == 201, body


def setup_active(url: str, n: int = 200) -> None:
    """Explicit bookings spread over the ranks, sharing the benchmark prompts' prefix."""
    rng = random.Random(5)
    for i in range(n):
        rank = rng.randrange(WORKERS * RANKS_PER_WORKER)
        blocks = [1000003 * j for j in range(1, 17)] + [rng.getrandbits(62) for _ in range(16)]
        status, body = post(
            url,
            "/reservations",
            {
                "selection_id": f"act{i}",
                "model_name": "bench",
                "worker_id": rank // RANKS_PER_WORKER,
                "dp_rank": rank % RANKS_PER_WORKER,
                "block_hashes": blocks,
                "sequence_hashes": [b + 7 for b in blocks],
                "isl_tokens": 512,
                "effective_prefill_tokens": 256,
            },
        )
        assert status == 201, body


def bench(kind: str, workload: str, duration: int, round_no: int) -> dict:
    with started(kind) as s:
        base = s.url + PREFIX[kind]
        setup_catalog(base)
        if workload == "select":
            setup_active(base)
        env = {"WRK_PREFIX": PREFIX[kind]}
        wrk(s.url, SCRIPTS[workload], 2, {**env, "WRK_TAG": f"warm{round_no}"})
        return wrk(s.url, SCRIPTS[workload], duration, {**env, "WRK_TAG": f"r{round_no}"})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="reserve,select")
    args = ap.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    for workload in args.only.split(","):
        for r in range(args.rounds):
            for kind in ("ref", "ours"):
                res = bench(kind, workload, args.duration, r)
                results.setdefault(workload, {}).setdefault(kind, []).append(res["rps"])
                print(
                    f"{workload:8s} round {r} {kind:4s} {res['rps']:10.0f} req/s "
                    f"p99 {res['p99_ms']} ms non-2xx {res['non2xx']}",
                    flush=True,
                )
    for workload, by_kind in results.items():
        ref, ours = statistics.median(by_kind["ref"]), statistics.median(by_kind["ours"])
        print(
            f"SUMMARY {workload}: ref {ref:.0f} req/s, ours {ours:.0f} req/s, "
            f"ratio {ours / ref:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
