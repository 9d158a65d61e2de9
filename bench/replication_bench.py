"""Replication through Redis: how fast a change shows up on a peer, and how fast an instance
recovers the whole state.

1. Propagation latency: 1,000 adds on instance A, one at a time on an otherwise idle system;
   for each, the time from the call returning on A to the request being in B's tracker.
   Both instances live in this one process on one event loop (A's publisher and B's reader
   share a core), against a real Redis; the figure covers outbox batching (replication_batch_ms,
   measured with the default and with 0), the append script, the blocking XREAD wake-up,
   decoding and applying.
2. Recovery with 10,000 active requests (16 workers x 4 ranks, 32-block prompts sharing
   16-block prefixes, prefill hints): A writes a snapshot, then 1,000 more records follow;
   a late instance B starts and the time until ``ready()`` is measured (load + restore of the
   snapshot, then catch-up), then again with no snapshot at all (replaying the whole stream).
   Each time B's /loads rows must equal A's.

Run: .venv/bin/python bench/replication_bench.py [--redis-url URL]
(default: SLOT_TRACKER_TEST_REDIS_URL, else redis://127.0.0.1:6379/0). Keys go to a fresh
namespace that is deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import statistics
import time
import uuid

import redis
from prometheus_client import CollectorRegistry

from kv_slot_tracker.replication.redis import RedisReplication
from kv_slot_tracker.replication.redis.snapshots import gc_paused
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c
from kv_slot_tracker.settings import Settings

KEY = ("bench-model", "default")
BLOCK_SIZE = 16
WORKERS = 16
RANKS = 4


class Instance:
    def __init__(self, settings: Settings) -> None:
        self.rep = RedisReplication(settings, CollectorRegistry())
        self.service = SlotTrackerService(instance_id=self.rep.instance_id, replicator=self.rep)

    def loads(self) -> list[dict]:
        return self.service.loads(None, None)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def drained(inst: Instance) -> None:
    while inst.rep.status().outbox_depth:
        await asyncio.sleep(0.005)


async def propagation(settings: Settings, n: int = 1_000) -> dict[str, float]:
    a, b = Instance(settings), Instance(settings)
    await a.rep.start(a.service)
    await b.rep.start(b.service)
    await a.rep.settled()
    await b.rep.settled()
    try:
        a.service.register(
            c.Register(model_name=KEY[0], worker_id=1, block_size=BLOCK_SIZE, dp_size=RANKS)
        )
        while not b.service.trackers:
            await asyncio.sleep(0.001)
        seen: dict[str, int] = {}
        arrived = asyncio.Event()
        apply_remote = b.service.apply_remote

        def spy(records):
            done = apply_remote(records)
            now = time.perf_counter_ns()
            for r in records:
                ev = r.get("event")
                if ev is not None:
                    seen[ev["request_id"]] = now
            arrived.set()
            return done

        b.service.apply_remote = spy
        rng = random.Random(3)
        latencies = []
        for i in range(n):
            rid = f"lat-{i}"
            arrived.clear()
            start = time.perf_counter_ns()
            a.service.add(
                c.Add(model_name=KEY[0], request_id=rid, worker_id=1, dp_rank=i % RANKS,
                        sequence_hashes=[rng.getrandbits(63) for _ in range(32)],
                        new_isl_tokens=512)
            )  # fmt: skip
            while rid not in seen:
                await arrived.wait()
                arrived.clear()
            latencies.append((seen[rid] - start) / 1e6)
            a.service.free(c.Free(model_name=KEY[0], request_id=rid))
            await asyncio.sleep(0.002)  # idle between adds
        return {
            "p50_ms": statistics.median(latencies),
            "p99_ms": pct(latencies, 0.99),
            "max_ms": max(latencies),
            "mean_ms": statistics.fmean(latencies),
        }
    finally:
        await a.rep.stop()
        await b.rep.stop()


def compare_loads(a: Instance, b: Instance) -> tuple[bool, int]:
    """Both instances' /loads rows read at one frozen instant: identical?, and the largest
    prefill-token difference (instants travel as wall time, so a few microseconds of clock
    reading jitter can move a decaying count by one token)."""
    now = time.monotonic_ns()
    clocks = a.service.clock, b.service.clock
    a.service.clock = b.service.clock = lambda: now
    try:
        la, lb = a.loads(), b.loads()
    finally:
        a.service.clock, b.service.clock = clocks
    strip = [{k: v for k, v in r.items() if k != "active_prefill_tokens"} for r in la]
    same_but_tokens = strip == [
        {k: v for k, v in r.items() if k != "active_prefill_tokens"} for r in lb
    ]
    diff = max(
        (
            abs(x["active_prefill_tokens"] - y["active_prefill_tokens"])
            for x, y in zip(la, lb, strict=True)
        ),
        default=0,
    )
    return la == lb, diff if same_but_tokens else -1


def fill(inst: Instance, n: int, rng: random.Random) -> None:
    for w in range(WORKERS):
        inst.service.register(
            c.Register(model_name=KEY[0], worker_id=w, block_size=BLOCK_SIZE, dp_size=RANKS)
        )
    prefixes = [[rng.getrandbits(63) for _ in range(16)] for _ in range(64)]
    for i in range(n):
        hashes = rng.choice(prefixes) + [rng.getrandbits(63) for _ in range(16)]
        inst.service.add(
            c.Add(model_name=KEY[0], request_id=f"req-{i}", worker_id=rng.randrange(WORKERS),
                  dp_rank=rng.randrange(RANKS),
                    sequence_hashes=hashes, new_isl_tokens=rng.randrange(1, 2048),
                    expected_prefill_ms=rng.choice([None, 250.0, 1200.0]))
        )  # fmt: skip


async def recovery(settings: Settings, active: int = 10_000, tail: int = 1_000) -> dict:
    rng = random.Random(7)
    a = Instance(settings)
    await a.rep.start(a.service)
    await a.rep.settled()
    out: dict = {}
    try:
        fill(a, active, rng)
        await drained(a)
        while (st := a.rep.status()).stream_position == "0-0" or st.outbox_depth:
            await asyncio.sleep(0.01)
        # the snapshot: export + encode + write, and its size
        with gc_paused():  # as write_snapshot does
            t0 = time.perf_counter()
            snap = a.rep.take_snapshot()
            out["snapshot_export_ms"] = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            blob = snap.encode()
            out["snapshot_encode_ms"] = (time.perf_counter() - t0) * 1e3
        out["snapshot_bytes"] = len(blob)
        t0 = time.perf_counter()
        assert await a.rep.write_snapshot()
        out["snapshot_write_total_ms"] = (time.perf_counter() - t0) * 1e3
        # traffic after the snapshot: frees and new adds
        for i in range(tail // 2):
            a.service.free(c.Free(model_name=KEY[0], request_id=f"req-{i}"))
            hashes = [rng.getrandbits(63) for _ in range(32)]
            a.service.add(
                c.Add(model_name=KEY[0], request_id=f"tail-{i}", worker_id=rng.randrange(WORKERS),
                      dp_rank=0, sequence_hashes=hashes,
                        new_isl_tokens=100, expected_prefill_ms=500.0)
            )  # fmt: skip
        await drained(a)

        for label, wipe_snapshot in (("with_snapshot", False), ("without_snapshot", True)):
            if wipe_snapshot:
                client = redis.Redis.from_url(settings.redis_url)
                client.delete("{" + settings.namespace + "}:snapshot")
                out["stream_entries"] = client.xlen("{" + settings.namespace + "}:events")
                client.close()
            b = Instance(settings)
            t0 = time.perf_counter()
            await b.rep.start(b.service)
            await b.rep.settled()
            ready_ms = (time.perf_counter() - t0) * 1e3
            assert b.rep.ready()
            same, token_diff = compare_loads(a, b)
            active_b = sum(r["active_requests"] for r in b.loads())
            out[label] = {
                "ready_ms": ready_ms,
                "same_loads": same,
                "max_token_diff": token_diff,
                "active_requests": active_b,
                "records_applied": b.rep.status().applied,
            }
            await b.rep.stop()
    finally:
        await a.rep.stop()
    return out


def cleanup(url: str, namespace: str) -> None:
    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(match="{" + namespace + "}:*"))
    if keys:
        client.delete(*keys)
    client.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SLOT_TRACKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    parser.add_argument("--adds", type=int, default=1_000)
    parser.add_argument("--active", type=int, default=10_000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    namespace = f"bench-{uuid.uuid4().hex[:12]}"
    settings = Settings(
        redis_url=args.redis_url, namespace=namespace, snapshot_interval_seconds=3600
    )
    try:
        for batch_ms in (settings.replication_batch_ms, 0):
            lat = await propagation(
                settings.model_copy(update={"replication_batch_ms": batch_ms}), args.adds
            )
            print(
                f"propagation A->B, {args.adds} adds one at a time, replication_batch_ms="
                f"{batch_ms} (one process, one event loop): p50 {lat['p50_ms']:.2f} ms, "
                f"p99 {lat['p99_ms']:.2f} ms, max {lat['max_ms']:.2f} ms, "
                f"mean {lat['mean_ms']:.2f} ms"
            )
            cleanup(args.redis_url, namespace)
        rec = await recovery(settings, args.active)
        print(
            f"snapshot of {args.active} active requests: export {rec['snapshot_export_ms']:.0f} ms, "
            f"encode {rec['snapshot_encode_ms']:.0f} ms, {rec['snapshot_bytes'] / 1e6:.1f} MB, "
            f"write total {rec['snapshot_write_total_ms']:.0f} ms"
        )
        for label in ("with_snapshot", "without_snapshot"):
            r = rec[label]
            print(
                f"late instance {label.replace('_', ' ')}: ready in {r['ready_ms']:.0f} ms, "
                f"{r['records_applied']} records applied, {r['active_requests']} active requests, "
                f"/loads identical to the peer: {r['same_loads']} "
                f"(largest prefill-token difference {r['max_token_diff']})"
            )
        print(f"(stream held {rec['stream_entries']} entries for the replay without snapshot)")
    finally:
        cleanup(args.redis_url, namespace)


if __name__ == "__main__":
    asyncio.run(main())
