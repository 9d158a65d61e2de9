"""Recovery and propagation between real service processes (``python -m kv_slot_tracker``) through Redis.

Three instances A, B, C of one namespace (tests/e2e/servers.py starts them). Figures:

1. Recovery: 10,000 active requests (16 workers x 4 ranks, block size 16, 32-block prompts
   sharing 16-block prefixes, prefill tokens) are added through ``/batch``; once all three agree,
   C is killed with SIGKILL and started again on its port. Measured from the ``Popen`` of the
   new process: the first ``/ready`` 200 (polled every millisecond; the process only answers
   HTTP once its startup, including replication bootstrap, is done) and the first ``/loads``
   equal to A's. Done with the periodic snapshot present, and again without any snapshot (C
   then replays the whole stream). The start of an instance on an empty namespace is the baseline
   (interpreter, imports, uvicorn).
2. Propagation: 1,000 requests, one at a time: ``/add`` on A, then B's
   ``GET /loads?model_name=lat`` (one rank, a ~250-byte answer) in a tight loop until the rank
   shows it, then ``/free`` on A and the same until B shows it gone. A latency is from just
   before A's call is sent to the arrival of B's first answer showing the change, so it
   includes A's own HTTP round trip (reported separately) and overstates by up to one poll
   round trip (reported as the resolution); the "poll midpoint" figure takes the middle of
   that poll instead (when B answered, give or take half a round trip). Idle, then with ``/batch`` background traffic
   (adds and frees of another model, ~5,000 operations/s open loop, spread over A, B and C)
   from a separate process.

Run: .venv/bin/python bench/recovery_bench.py [--redis-url URL] [--batch-ms MS]
(default URL: SLOT_TRACKER_TEST_REDIS_URL, else redis://127.0.0.1:6379/0). Everything goes to a
fresh namespace that is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import httpx  # noqa: E402
import redis  # noqa: E402
from kv_slot_tracker_client import BatchBuilder  # noqa: E402

from kv_slot_tracker.replication.redis.stream import NamespaceKeys  # noqa: E402
from kv_slot_tracker.settings import load_settings  # noqa: E402
from tests.e2e.servers import Fleet, ServerProcess, wait_until  # noqa: E402

MODEL, LAT_MODEL, BG_MODEL = "bench", "lat", "bg"
WORKERS, RANKS, BLOCK_SIZE = 16, 4, 16
BATCH_OPS = 500


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summary(values_s: list[float]) -> str:
    ms = [v * 1000 for v in values_s]
    return (
        f"p50 {pct(ms, 0.5):7.2f} ms   p99 {pct(ms, 0.99):7.2f} ms   max {max(ms):7.2f} ms"
        f"   (n={len(ms)})"
    )


def loads(server: ServerProcess) -> list[dict]:
    return [r.model_dump() for r in server.client.loads()]


# -- recovery ----------------------------------------------------------------------------------


def fill(a: ServerProcess, requests: int, seed: int = 1) -> float:
    """Add ``requests`` active requests on A through /batch; returns seconds taken."""
    rng = random.Random(seed)
    prefixes = [[rng.getrandbits(63) for _ in range(16)] for _ in range(64)]
    started = time.perf_counter()
    batch = BatchBuilder()
    for i in range(requests):
        w = i % WORKERS
        hashes = prefixes[i % len(prefixes)] + [rng.getrandbits(63) for _ in range(16)]
        batch.add(MODEL, f"req-{i}", w, i % RANKS, hashes, new_isl_tokens=rng.randint(64, 2048))
        if len(batch) == BATCH_OPS or i == requests - 1:
            results = a.client.batch(batch)
            assert all(r.status == 201 for r in results), results[:3]
            batch.clear()
    return time.perf_counter() - started


def restart_timing(fleet: Fleet, c: ServerProcess, want: list[dict]) -> tuple[float, float]:
    """SIGKILL C, start it again; seconds from Popen to /ready 200 and to /loads == want."""
    c.kill()
    fleet.restart(c, wait=False)
    ready = c.wait_ready(timeout=120)
    wait_until(lambda: loads(c) == want, 60, "C's /loads to equal A's", 0.001)
    identical = time.monotonic() - c.started_at
    return ready, identical


# -- propagation -------------------------------------------------------------------------------


def propagation(a_url: str, b_url: str, samples: int, tag: str) -> dict[str, list[float]]:
    """Add/free on A, watched on B; seconds per sample (see the module docstring)."""
    out: dict[str, list[float]] = {
        "add": [], "free": [], "add_mid": [], "free_mid": [], "a_call": [], "poll": []
    }  # fmt: skip
    a = httpx.Client(base_url=a_url, timeout=10)
    b = httpx.Client(base_url=b_url, timeout=10)
    params = {"model_name": LAT_MODEL, "routing_group": "default"}

    def wait_for(count: int) -> tuple[float, float]:
        deadline = time.perf_counter() + 10
        while True:
            sent = time.perf_counter()
            rows = b.get("/loads", params=params).json()
            now = time.perf_counter()
            out["poll"].append(now - sent)
            if rows[0]["active_requests"] == count:
                return sent, now
            if now > deadline:
                raise RuntimeError(f"B did not show {count} requests within 10 s")

    for i in range(samples):
        rid = f"{tag}-{i}"
        body = {"model_name": LAT_MODEL, "request_id": rid}
        t0 = time.perf_counter()
        r = a.post("/add", json={**body, "worker_id": 1, "dp_rank": 0,
                                 "sequence_hashes": [i, i + 1], "new_isl_tokens": 16})  # fmt: skip
        out["a_call"].append(time.perf_counter() - t0)
        assert r.status_code == 201, r.text
        sent, seen = wait_for(1)
        out["add"].append(seen - t0)
        out["add_mid"].append((sent + seen) / 2 - t0)
        t0 = time.perf_counter()
        r = a.post("/free", json=body)
        assert r.status_code == 200, r.text
        sent, seen = wait_for(0)
        out["free"].append(seen - t0)
        out["free_mid"].append((sent + seen) / 2 - t0)
    a.close()
    b.close()
    return out


def background(urls: list[str], rate: float, active: int) -> None:
    """Open-loop /batch traffic at ``rate`` operations/s until SIGTERM; prints JSON stats."""
    clients = [httpx.Client(base_url=u, timeout=30) for u in urls]
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    rng = random.Random(2)
    per_batch = 100
    interval = per_batch / rate
    live: list[str] = []
    n = ops = late = 0
    started = next_at = time.perf_counter()
    while not stop:
        ops_list = []
        while len(ops_list) < per_batch:
            if len(live) >= active:
                ops_list.append({"op": "free", "model_name": BG_MODEL, "request_id": live.pop(0)})
            rid = f"bg-{n}"
            n += 1
            live.append(rid)
            ops_list.append({"op": "add", "model_name": BG_MODEL, "request_id": rid,
                             "worker_id": n % 4, "dp_rank": 0, "new_isl_tokens": 128,
                             "sequence_hashes": [n % 32, rng.getrandbits(62)]})  # fmt: skip
        r = clients[n % len(clients)].post("/batch", json={"operations": ops_list})
        r.raise_for_status()
        ops += len(ops_list)
        next_at += interval
        pause = next_at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        else:
            late += 1
    elapsed = time.perf_counter() - started
    print(json.dumps({"ops": ops, "seconds": elapsed, "late_batches": late}), flush=True)


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=os.environ.get("SLOT_TRACKER_TEST_REDIS_URL")
                        or "redis://127.0.0.1:6379/0")  # fmt: skip
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--samples", type=int, default=1_000)
    parser.add_argument("--bg-rate", type=float, default=5_000.0)
    parser.add_argument(
        "--batch-ms", type=int, help="replication_batch_ms (default: the configured one)"
    )
    parser.add_argument("--snapshot-interval", type=int, default=5)
    parser.add_argument("--background", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.background is not None:
        background(args.background, args.bg_rate, active=2_000)
        return

    namespace = f"bench-recovery-{uuid.uuid4().hex[:8]}"
    logs = Path(tempfile.mkdtemp(prefix="recovery-bench-"))
    batch_ms = args.batch_ms if args.batch_ms is not None else load_settings().replication_batch_ms
    env = {"LOG_LEVEL": "warning", "REPLICATION_BATCH_MS": str(batch_ms)}
    fleet = Fleet(
        args.redis_url,
        namespace,
        logs,
        snapshot_interval_seconds=args.snapshot_interval,
        env=env,
        die_with_parent=False,  # the figures are about the service alone
    )
    print(f"namespace {namespace}, replication_batch_ms={batch_ms}, "
          f"snapshot every {args.snapshot_interval} s, logs in {logs}, {os.cpu_count()} CPUs")  # fmt: skip
    bg: subprocess.Popen[str] | None = None
    try:
        a, b, c = fleet.spawn(3)
        baseline = Fleet(args.redis_url, namespace + "-empty", logs, die_with_parent=False)
        try:
            print(f"baseline: start to /ready on an empty namespace "
                  f"{baseline.spawn(1)[0].wait_ready():.3f} s")  # fmt: skip
        finally:
            baseline.close()

        for w in range(WORKERS):
            a.client.register(w, MODEL, BLOCK_SIZE, 0, RANKS)
        a.client.register(1, LAT_MODEL, BLOCK_SIZE, 0, 1)
        for w in range(4):
            a.client.register(w, BG_MODEL, BLOCK_SIZE, 0, 1)
        took = fill(a, args.requests)
        want = wait_until(
            lambda: (rows := loads(a)) == loads(b) == loads(c) and rows,
            120,
            "identical /loads",
            0.05,
        )
        total = sum(r["active_requests"] for r in want if r["model_name"] == MODEL)
        assert total == args.requests, total
        print(f"\n{args.requests} requests added through /batch on A in {took:.2f} s; "
              "A, B, C agree")  # fmt: skip
        wait_until(lambda: a.status().get("snapshot_stream_id"), 60, "a snapshot", 0.1)

        print("\nrecovery of C after SIGKILL (seconds from process start):")
        for label in ("with snapshot", "stream only"):
            if label == "stream only":
                # no instance may write a snapshot from here on: restart A and B without
                # periodic snapshots (they recover first), then delete the stored one
                for s in (a, b, c):
                    s.env["SLOT_TRACKER_SNAPSHOT_INTERVAL_SECONDS"] = "3600"
                for s in (a, b):
                    s.kill()
                    fleet.restart(s)
                    wait_until(lambda s=s: loads(s) == want, 60, f"{s.name} to recover", 0.01)
                client = redis.Redis.from_url(args.redis_url)
                client.delete(NamespaceKeys.of(namespace).snapshot)
                client.close()
            for i in range(args.restarts):
                ready, identical = restart_timing(fleet, c, want)
                st = c.status()
                source = st["snapshot_stream_id"] or "none"
                print(f"  {label:13s} #{i + 1}: /ready {ready:.3f} s, identical /loads "
                      f"{identical:.3f} s   (snapshot {source}, records applied {st['applied']})")  # fmt: skip

        print(f"\npropagation A -> B, {args.samples} adds and frees, idle:")
        idle = propagation(a.url, b.url, args.samples, "idle")
        report(idle)

        bg = subprocess.Popen(
            [sys.executable, __file__, "--bg-rate", str(args.bg_rate), "--background",
             a.url, b.url, c.url],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        time.sleep(2)  # reach the steady state
        print(f"\npropagation A -> B under ~{args.bg_rate:.0f} ops/s of /batch background:")
        loaded = propagation(a.url, b.url, args.samples, "loaded")
        bg.send_signal(signal.SIGTERM)
        out, _ = bg.communicate(timeout=30)
        stats = json.loads(out.strip().splitlines()[-1])
        report(loaded)
        print(f"  background achieved {stats['ops'] / stats['seconds']:.0f} ops/s over "
              f"{stats['seconds']:.1f} s ({stats['late_batches']} batches behind schedule)")  # fmt: skip
        bg = None
        for s in (a, b, c):
            st = s.status()
            print(f"  {s.name}: dropped {st['dropped']}, gaps {st['gaps']}, "
                  f"outbox depth {st['outbox_depth']}")  # fmt: skip
    finally:
        if bg is not None and bg.poll() is None:
            bg.kill()
            bg.wait()
        fleet.close()
        client = redis.Redis.from_url(args.redis_url)
        for ns in (namespace, namespace + "-empty"):
            keys = list(client.scan_iter(match="{" + ns + "}:*"))
            if keys:
                client.delete(*keys)
        client.close()


def report(samples: dict[str, list[float]]) -> None:
    print(f"  add  visible on B: {summary(samples['add'])}")
    print(f"       (poll midpoint) {summary(samples['add_mid'])}")
    print(f"  free visible on B: {summary(samples['free'])}")
    print(f"       (poll midpoint) {summary(samples['free_mid'])}")
    print(f"  A's /add round trip (included above): p50 "
          f"{statistics.median(samples['a_call']) * 1000:.2f} ms")  # fmt: skip
    print(f"  resolution (B's /loads round trip): p50 "
          f"{statistics.median(samples['poll']) * 1000:.3f} ms, "
          f"p99 {pct(samples['poll'], 0.99) * 1000:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
