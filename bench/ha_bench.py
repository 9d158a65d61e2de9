"""What durability costs: ``replication_ack = "local"``, ``"redis"`` and ``"redis"`` with
``replication_ack_replicas = 1``, measured in turn in one run, against a Redis primary with one
replica that the bench starts on loopback (the replica is attached in every configuration; only
the acknowledgement differs).

Two whole applications (``create_app``) in this process on one event loop, driven over ASGI:

1. add -> visible on the peer: 500 adds on A, one at a time; for each, the time from sending
   it to A until B holds the request (answer, append, WAIT if any, B's XREAD wake-up, apply),
   and the answer's own latency;
2. acknowledged calls under load: 16 concurrent callers sending add then free to A for
   ``--seconds``; the latency of every answer (p50, p99) and the calls per second.

Run:  .venv/bin/python bench/ha_bench.py [--rounds 2] [--seconds 4]
Needs: redis-server on PATH (or SLOT_TRACKER_TEST_REDIS_SERVER).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kv_slot_tracker.settings import Settings  # noqa: E402
from tests.ha.topology import RedisProcess, wait_for  # noqa: E402
from tests.replication.apps import MODEL, register, running_apps  # noqa: E402

MODES = {"local": ("local", 0), "redis": ("redis", 0), "redis+1 replica": ("redis", 1)}
KEY = (MODEL, "default")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_run(url: str, mode: str, adds: int, seconds: float) -> dict[str, float]:
    ack, replicas = MODES[mode]
    settings = [Settings(redis_url=url, namespace=f"ha-bench-{uuid.uuid4().hex[:8]}",
                         replication_ack=ack, replication_ack_replicas=replicas,
                         snapshot_interval_seconds=3600, consistency_wait_ms=0)] * 2  # fmt: skip
    async with running_apps(*settings) as (a, b):
        await register(a, [b])
        b_tracker = b.app.state.service.tracker(KEY)
        visible, answered = [], []
        for i in range(adds):
            rid = f"v{i}"
            t0 = time.perf_counter()
            assert await a.add(rid) == 201
            t1 = time.perf_counter()
            while not b_tracker.has_request(rid):
                await asyncio.sleep(0)
            visible.append(time.perf_counter() - t0)
            answered.append(t1 - t0)
        latencies: list[float] = []
        stop = time.perf_counter() + seconds

        async def caller(c: int) -> None:
            n = 0
            while time.perf_counter() < stop:
                rid = f"l{c}-{n}"
                n += 1
                for op in ("add", "free"):
                    t0 = time.perf_counter()
                    if op == "add":
                        status = await a.add(rid)
                    else:
                        status = (await a.call("free", rid)).status_code
                    latencies.append(time.perf_counter() - t0)
                    assert status in (200, 201), status

        started = time.perf_counter()
        await asyncio.gather(*(caller(c) for c in range(16)))
        elapsed = time.perf_counter() - started
    ms = 1000
    return {
        "visible_p50_ms": statistics.median(visible) * ms,
        "visible_p99_ms": pct(visible, 0.99) * ms,
        "answer_p50_ms": statistics.median(answered) * ms,
        "load_calls_per_s": len(latencies) / elapsed,
        "load_p50_ms": statistics.median(latencies) * ms,
        "load_p99_ms": pct(latencies, 0.99) * ms,
    }


async def run(args: argparse.Namespace) -> None:
    binary = os.environ.get("SLOT_TRACKER_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        raise SystemExit("no redis-server")
    root = Path(tempfile.mkdtemp(prefix="ha-bench-"))
    primary = RedisProcess(binary, "primary", root)
    replica = RedisProcess(binary, "replica", root)
    try:
        primary.start()
        primary.wait_up()
        replica.start("--replicaof", "127.0.0.1", str(primary.port))
        replica.wait_up()

        def synced() -> bool:
            with replica.client(decode_responses=True) as c:
                return c.info("replication")["master_link_status"] == "up"

        wait_for(synced, 10, "the replica")
        url = f"redis://127.0.0.1:{primary.port}/0"
        results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for round_no in range(args.rounds):
            for mode in MODES:
                res = await one_run(url, mode, args.adds, args.seconds)
                results[mode].append(res)
                print(json.dumps({"mode": mode, "round": round_no, **res}), flush=True)
        print(
            "| Configuration | add -> visible on peer p50 | p99 | answer p50 | under load "
            "calls/s | p50 | p99 |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for mode, rs in results.items():
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"| {mode} | {med['visible_p50_ms']:.2f} ms | {med['visible_p99_ms']:.2f} ms "
                  f"| {med['answer_p50_ms']:.2f} ms | {med['load_calls_per_s']:,.0f} "
                  f"| {med['load_p50_ms']:.1f} ms | {med['load_p99_ms']:.1f} ms |")  # fmt: skip
    finally:
        primary.kill()
        replica.kill()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--adds", type=int, default=500)
    ap.add_argument("--seconds", type=float, default=4.0)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
