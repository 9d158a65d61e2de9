"""Consistency across instances, measured with real processes (``python -m kv_slot_tracker``) on a Redis
server of the bench's own (restartable, SIGSTOP-able), three instances on loopback.

  visibility  an add on A, one at a time on an idle system: when B has applied it. Exact per
              add: B's ``/replication`` ``last_applied_lag_ms`` (A's record time, stamped
              during A's call, to B's apply; one host, one clock); also the time from A's
              answer to the first answer of B's ``/loads`` that shows it (HTTP polling).
  run         load-balanced lifecycle traffic (``tests/e2e/consistency.py``: clients keeping a
              ground truth of what was acknowledged) for ``--seconds``, with faults while it
              runs: SIGTERM + restart of an instance, Redis SIGSTOP for 4 s, Redis killed and
              restarted empty, and with ``--ack redis`` kill -9 + restart of instances. At the
              end every instance must equal the ground truth; reports the answers seen and how
              long after the traffic stopped the instances were identical.
  floor       the same path without the service: one process appends (``XADD``) a timestamp
              every 20 ms, three others wait in ``XREAD BLOCK`` (redis-py asyncio on uvloop, as
              the service) and report append-to-read latency (one host, one monotonic clock):
              what Redis and the scheduler deliver on this machine, next to ``visibility``.
  outage      traffic, then Redis goes away (SIGSTOP 4 s, or killed and restarted empty) and
              the traffic stops during the outage: the time from Redis being back to every
              instance equal to the ground truth.

Run: .venv/bin/python bench/consistency_bench.py {visibility,floor,run,outage} [options]
Needs a redis-server binary (SLOT_TRACKER_TEST_REDIS_SERVER or PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import httpx  # noqa: E402

from tests.e2e.consistency import (  # noqa: E402
    GroundTruth,
    Traffic,
    Watcher,
    inject_faults,
    load_view,
    register_topology,
)  # noqa: E402
from tests.e2e.servers import Fleet, ServerProcess, wait_until  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.replication.helpers import RedisServer  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def stats_ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(values), 3),
        "p99_ms": round(pct(values, 0.99), 3),
        "max_ms": round(max(values), 3),
    }


def loads(server: ServerProcess) -> list[dict[str, int]] | None:
    try:
        r = httpx.get(server.url + "/loads", timeout=5)
    except httpx.TransportError:
        return None
    return load_view(r.json()) if r.status_code == 200 else None


def converge_s(servers: list[ServerProcess], traffic: Traffic, timeout: float = 30) -> float:
    want = traffic.truth.loads()
    started = time.monotonic()
    wait_until(lambda: all(loads(s) == want for s in servers), timeout, "the ground truth",
               0.002, lambda: f"expected {want}\n" + "\n".join(
                   f"{s.name}: {loads(s)} {s.status()}" for s in servers))  # fmt: skip
    return time.monotonic() - started


class Setup:
    def __init__(
        self, ack: str = "local", env: dict[str, str] | None = None, snapshot_s: int = 2
    ) -> None:
        binary = os.environ.get("SLOT_TRACKER_TEST_REDIS_SERVER") or shutil.which("redis-server")
        if not binary:
            raise SystemExit("no redis-server binary (SLOT_TRACKER_TEST_REDIS_SERVER or PATH)")
        self.redis = RedisServer(binary, free_port())
        self.redis.start()
        self.logs = Path(tempfile.mkdtemp(prefix="consistency-bench-"))
        self.fleet = Fleet(self.redis.url, f"bench-{uuid.uuid4().hex[:8]}", self.logs,
                           snapshot_interval_seconds=snapshot_s,
                           env={"REPLICATION_ACK": ack, "LOG_LEVEL": "warning", **(env or {})})  # fmt: skip

    def __enter__(self) -> Setup:
        self.fleet.spawn(3)
        register_topology(self.fleet.servers[0].url)
        first = self.fleet.servers[0]
        wait_until(lambda: all(loads(s) == loads(first) for s in self.fleet.servers), 10,
                   "the topology")  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        self.fleet.close()
        self.redis.cleanup()

    def pause_redis(self, seconds: float) -> None:
        assert self.redis.proc is not None
        os.kill(self.redis.proc.pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(self.redis.proc.pid, signal.SIGCONT)


# -- visibility ----------------------------------------------------------------------------------


def visibility(samples: int) -> dict:
    with Setup(snapshot_s=30) as setup:  # the default interval: no snapshot during the run
        a, b, _ = setup.fleet.servers
        ha = httpx.Client(base_url=a.url, timeout=10)
        hb = httpx.Client(base_url=b.url, timeout=10)
        params = {"model_name": "llama"}
        applied, seen = [], []

        def add(rid: str, i: int) -> float:
            body = {"model_name": "llama", "request_id": rid, "worker_id": 1, "dp_rank": 0,
                    "sequence_hashes": [i + 1], "new_isl_tokens": 8}  # fmt: skip
            r = ha.post("/add", json=body)
            assert r.status_code == 201, r.text
            return time.perf_counter()

        def free(rid: str) -> None:
            assert ha.post("/free", json={"model_name": "llama", "request_id": rid}).is_success

        # 1. B's own account, with nothing polling B meanwhile (a poll loop takes a core)
        for i in range(samples):
            before = b.status()["applied"]
            add(f"vis-{i}", i)
            time.sleep(0.02)
            status = b.status()
            assert status["applied"] == before + 1, status
            applied.append(status["last_applied_lag_ms"])
            free(f"vis-{i}")
            time.sleep(0.02)
        # 2. what a client polling B sees
        for i in range(samples):
            acked = add(f"poll-{i}", i)
            while True:
                sent = time.perf_counter()
                rows = hb.get("/loads", params=params).json()
                got = time.perf_counter()
                if sum(row["active_requests"] for row in rows) == 1:
                    break
            seen.append(((sent + got) / 2 - acked) * 1000)
            free(f"poll-{i}")
            while sum(row["active_requests"] for row in hb.get("/loads", params=params).json()):
                pass
            time.sleep(0.005)  # idle between adds
        return {
            "b_applied_after_a_record": stats_ms(applied),
            "b_answers_after_a_answered": stats_ms(seen),
        }


# -- traffic with faults -------------------------------------------------------------------------


def run(seconds: float, ack: str, clients: int) -> dict:
    with Setup(ack) as setup:
        fleet = setup.fleet
        servers = fleet.servers
        traffic = Traffic([s.url for s in servers], clients=clients, seed=11)
        traffic.start()
        try:
            faults = inject_faults(fleet, setup.redis, ack, seconds / (5 if ack == "redis" else 4))
        finally:
            watcher = Watcher([s.url for s in servers])  # connected before the traffic ends
            watcher.all_loads()
            traffic.stop()
        try:
            at = watcher.wait_for(traffic.truth.loads(), 30)
        finally:
            watcher.close()
        if at is None:
            converge_s(servers, traffic, 1)  # fails with the details
        tally = traffic.tally
        took = at - tally.last_answer  # type: ignore[operator]
        return {
            "ack": ack,
            "seconds": seconds,
            "faults": faults,
            "converged_after_last_answer_ms": round(took * 1000, 1),
            "active_at_end": sum(r["active_requests"] for r in traffic.truth.loads()),
            "spurious_404": len(tally.spurious_404),
            "unexpected": tally.unexpected[:10],
            **{k: v for k, v in tally.summary().items() if k not in ("spurious_404", "unexpected")},
        }


def outage(kind: str, ack: str, rounds: int) -> dict:
    times = []
    truth = GroundTruth()
    with Setup(ack) as setup:
        servers = setup.fleet.servers
        for i in range(rounds):
            traffic = Traffic([s.url for s in servers], clients=4, seed=100 + i, prefix=f"o{i}-",
                              truth=truth)  # fmt: skip
            traffic.start()
            time.sleep(1.0)
            if kind == "pause":
                os.kill(setup.redis.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
            else:
                setup.redis.stop()
            time.sleep(0.5)
            stopper = traffic.stop if ack == "local" else None
            if stopper is not None:
                stopper()  # local acks: calls go on during the outage; stop them now
            time.sleep(3.5 if kind == "pause" else 1.0)
            if kind == "pause":
                os.kill(setup.redis.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
            else:
                setup.redis.start()
            watcher = Watcher([s.url for s in servers])
            watcher.all_loads()
            back = time.monotonic()
            if stopper is None:
                traffic.stop()  # redis acks: calls wait for Redis; they finish once it is back
            try:
                at = watcher.wait_for(truth.loads(), 30)
            finally:
                watcher.close()
            if at is None:
                converge_s(servers, traffic, 1)  # fails with the details
            times.append((at - back) * 1000)  # type: ignore[operator]
            assert traffic.tally.spurious_404 == [] and traffic.tally.unexpected == []
    return {"kind": kind, "ack": ack, "converged_after_redis_back_ms": [round(t) for t in times]}


# -- floor ---------------------------------------------------------------------------------------

_FLOOR_READER = """
import asyncio, sys, time
import redis.asyncio as redis
import uvloop

async def main(url, key, n):
    r = redis.Redis.from_url(url)
    pos, out = "0-0", []
    while len(out) < n:
        reply = await r.xread({key: pos}, count=100, block=5000)
        now = time.monotonic_ns()
        for _, entries in reply or []:
            for entry_id, fields in entries:
                pos = entry_id
                out.append(now - int(fields[b"t"]))
    print(" ".join(map(str, out)), flush=True)

uvloop.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def floor(samples: int) -> dict:
    import subprocess

    import redis

    binary = os.environ.get("SLOT_TRACKER_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        raise SystemExit("no redis-server binary (SLOT_TRACKER_TEST_REDIS_SERVER or PATH)")
    server = RedisServer(binary, free_port())
    server.start()
    key = f"floor-{uuid.uuid4().hex[:8]}"
    try:
        readers = [
            subprocess.Popen([sys.executable, "-c", _FLOOR_READER, server.url, key, str(samples)],
                             stdout=subprocess.PIPE, text=True)
            for _ in range(3)
        ]  # fmt: skip
        time.sleep(1.0)  # the readers are blocked in XREAD
        client = redis.Redis.from_url(server.url)
        for _ in range(samples):
            client.xadd(key, {"t": time.monotonic_ns()})
            time.sleep(0.02)
        values = []
        for proc in readers:
            out, _ = proc.communicate(timeout=30)
            values += [int(v) / 1e6 for v in out.split()]
        client.close()
    finally:
        server.cleanup()
    return {"append_to_read": stats_ms(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    v = sub.add_parser("visibility")
    v.add_argument("--samples", type=int, default=500)
    f = sub.add_parser("floor")
    f.add_argument("--samples", type=int, default=500)
    r = sub.add_parser("run")
    r.add_argument("--seconds", type=float, default=60)
    r.add_argument("--ack", choices=["local", "redis"], default="local")
    r.add_argument("--clients", type=int, default=6)
    o = sub.add_parser("outage")
    o.add_argument("--kind", choices=["pause", "restart"], default="restart")
    o.add_argument("--ack", choices=["local", "redis"], default="local")
    o.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.what == "visibility":
        result = visibility(args.samples)
    elif args.what == "floor":
        result = floor(args.samples)
    elif args.what == "run":
        result = run(args.seconds, args.ack, args.clients)
    else:
        result = outage(args.kind, args.ack, args.rounds)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
