"""The cost of durable acknowledgements: the lifecycle workload of ``bench/http_bench.py``
against one instance in three configurations, in turn (A B C A B C ...):

  embedded   no Redis (the single-instance baseline)
  local      replicated through Redis, ``replication_ack = "local"`` (answered once applied)
  redis      replicated, ``replication_ack = "redis"`` (answered once the record is in the
             stream; group-committed)

Per run: wrk (1 thread, 32 connections, pinned to CPU 0; the server on CPU 1) for the closed-loop
maximum and its p99, then ``bench/openloop.py`` at a fixed rate (default 1,000 calls/s, below
every configuration's maximum) for the latency a client sees at moderate load.
``consistency_wait_ms`` is 0 so that the workload's first frees (of ids it never added) do not
wait: only the acknowledgement differs between ``local`` and ``redis``.

Run:  .venv/bin/python bench/ack_bench.py [--redis-url URL] [--duration 8] [--rounds 3]
Needs: wrk, taskset, a Redis (default SLOT_TRACKER_TEST_REDIS_URL, else redis://127.0.0.1:6379/0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import redis  # noqa: E402

from bench.http_bench import children, pin, setup_topology, wrk  # noqa: E402
from bench.reference import REPO, Server, _start_checked, ours_python  # noqa: E402

MODES = ("embedded", "local", "redis")


def start(mode: str, redis_url: str, namespace: str) -> Server:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOT_TRACKER_")}
    env.update(
        SLOT_TRACKER_REDIS_URL="" if mode == "embedded" else redis_url,
        SLOT_TRACKER_NAMESPACE=namespace,
        SLOT_TRACKER_REPLICATION_ACK="redis" if mode == "redis" else "local",
        SLOT_TRACKER_CONSISTENCY_WAIT_MS="0",
        SLOT_TRACKER_SNAPSHOT_INTERVAL_SECONDS="3600",
    )

    def make(port: int) -> Server:
        argv = [
            ours_python(),
            "-m",
            "kv_slot_tracker",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        return Server(f"ours-{mode}", argv, port, cwd=REPO, env=env)

    server = _start_checked(make)
    pin(server.pid, 1)
    for c in children(server.pid):
        pin(c, 1)
    return server


def wait_ready(url: str) -> None:
    import time
    import urllib.request

    for _ in range(500):
        try:
            with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{url} not ready")


def one_run(mode: str, redis_url: str, duration: int, rate: float, round_no: int) -> dict:
    namespace = f"bench-ack-{uuid.uuid4().hex[:10]}"
    server = start(mode, redis_url, namespace)
    try:
        wait_ready(server.url)
        setup_topology(server.url)
        wrk(server.url, "lifecycle.lua", 2, {"WRK_TAG": f"warm{round_no}"})
        closed = wrk(server.url, "lifecycle.lua", duration, {"WRK_TAG": f"r{round_no}"})
        cmd = [sys.executable, str(HERE / "openloop.py"), server.url, "--rate", str(rate),
               "--seconds", str(duration), "--tag", f"ol{round_no}"]  # fmt: skip
        cmd = ["taskset", "-c", "0", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        opened = json.loads(out.strip().splitlines()[-1])
        return {
            "rps": closed["rps"],
            "p99_ms_closed": closed["p99_ms"],
            "non2xx": closed["non2xx"],
            "open_p50_ms": opened["p50_ms"],
            "open_p99_ms": opened["p99_ms"],
            "open_errors": opened["errors"],
        }
    finally:
        server.stop()
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_url = os.environ.get("SLOT_TRACKER_TEST_REDIS_URL") or "redis://127.0.0.1:6379/0"
    ap.add_argument("--redis-url", default=default_url)
    ap.add_argument("--duration", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=1000)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for round_no in range(args.rounds):
        for mode in MODES:
            res = one_run(mode, args.redis_url, args.duration, args.rate, round_no)
            runs[mode].append(res)
            print(json.dumps({"mode": mode, "round": round_no, **res}), flush=True)
    summary = {
        mode: {
            field: statistics.median(r[field] for r in rs)
            for field in ("rps", "p99_ms_closed", "open_p50_ms", "open_p99_ms")
        }
        | {"non2xx": sum(r["non2xx"] for r in rs), "errors": sum(r["open_errors"] for r in rs)}
        for mode, rs in runs.items()
    }
    print(json.dumps({"summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
