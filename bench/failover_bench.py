"""Through a Redis failover: how long writes are refused, and what acknowledged work is lost.

A primary, one replica (``--replicas N``: N) and three Sentinels on loopback (``tests/ha/topology.py``); three
``python -m kv_slot_tracker`` processes that know only the Sentinels, with
``replication_ack = "redis"`` and ``replication_ack_replicas = 1``; six clients sending
load-balanced lifecycle calls and keeping a ground truth of what they were acknowledged
(``tests/e2e/consistency.py``), retrying a 503 as a client does. After a few seconds of
traffic, one of:

  kill      the primary is killed (SIGKILL); the Sentinels promote the replica; the old primary
            is started again (empty) as a replica of the new one;
  switch    a graceful switch-over (``SENTINEL FAILOVER``): the primary hands over and becomes
            the replica.

Reported per run: ``no_answer_acknowledged_s``, the longest stretch from the fault to the end
of the traffic in which no call got a definite answer (the seconds of refused writes: calls
answered 503 "not accepted" or "not acknowledged" meanwhile were retried until acknowledged);
``refused_span_s``, from the first answer 503 after the fault to the last, and the 503s
counted; the acknowledged active requests each instance lacks or has in excess at the end
against the ground truth (expected 0), how long after the traffic stopped the instances all
reported it, and the instances' stream resets and re-sent records.

Run:  .venv/bin/python bench/failover_bench.py [--runs 3] [--kinds kill switch]
                [--redis-arg repl-diskless-sync-delay 0] ...
Needs: redis-server on PATH (or SLOT_TRACKER_TEST_REDIS_SERVER).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


from tests.e2e.consistency import Tally, Traffic, Watcher, register_topology  # noqa: E402
from tests.e2e.servers import Fleet  # noqa: E402
from tests.ha.topology import MASTER, SentinelGroup, wait_for  # noqa: E402


class TimedTally(Tally):
    """``Tally`` that notes when each definite answer and each answer 503 came."""

    def __init__(self) -> None:
        super().__init__()
        self.answered_at: list[float] = []
        self.refused_at: list[float] = []
        self.answers = TimedCounter(self.refused_at)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "last_answer" and value:
            self.answered_at.append(value)
        super().__setattr__(name, value)


class TimedCounter(Counter[str]):
    def __init__(self, refused_at: list[float]) -> None:
        super().__init__()
        self.refused_at = refused_at

    def __setitem__(self, key: str, value: int) -> None:
        if key.endswith(" 503"):
            self.refused_at.append(time.monotonic())
        super().__setitem__(key, value)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest stretch within [start, end] without a time of ``times``."""
    inside = [start, *sorted(t for t in times if start < t < end), end]
    return max(b - a for a, b in zip(inside, inside[1:], strict=False))


def lost(want: list[dict[str, int]], got: list[dict[str, int]] | None) -> int:
    if got is None:
        return -1
    return sum(abs(w["active_requests"] - g["active_requests"])
               for w, g in zip(want, got, strict=True))  # fmt: skip


def one_run(
    binary: str, kind: str, seed: int, redis_args: list[str], replicas: int = 1
) -> dict[str, Any]:
    group = SentinelGroup(binary, replicas=replicas)
    for server in group.servers:  # the data nodes (not the Sentinels)
        server.args += redis_args
    logs = Path(tempfile.mkdtemp(prefix="failover-bench-"))
    fleet = Fleet(group.urls, f"fo-{uuid.uuid4().hex[:10]}", logs, snapshot_interval_seconds=5,
                  env={"REPLICATION_ACK": "redis", "REPLICATION_ACK_REPLICAS": "1",
                       "REPLICATION_ACK_TIMEOUT_MS": "1000"})  # fmt: skip
    watcher = None
    try:
        group.start()
        fleet.spawn(3)
        urls = [s.url for s in fleet.servers]
        register_topology(urls[0])
        watcher = Watcher(urls)
        wait_for(lambda: len({str(v) for v in watcher.all_loads()}) == 1, 10, "the topology")
        traffic = Traffic(urls, clients=6, seed=seed, pace_s=0.01)
        tally = traffic.tally = TimedTally()
        traffic.start()
        try:
            time.sleep(3.0)
            old = group.primary()
            started = time.monotonic()
            if kind == "kill":
                old.kill()
                wait_for(lambda: group.primary_port() != old.port, 30, "the promotion")
                old.start("--replicaof", "127.0.0.1", str(group.primary_port()))
                old.wait_up()
            else:
                with group.sentinels[0].client() as c:
                    c.execute_command("SENTINEL FAILOVER", MASTER)
                wait_for(lambda: group.primary_port() != old.port, 30, "the switch-over")
            promoted_s = time.monotonic() - started
            group.wait_healthy(45)
            time.sleep(4.0)
            ended = time.monotonic()
        finally:
            traffic.stop()
        want = traffic.truth.loads()
        converged = watcher.wait_for(want, timeout=20)
        seen = watcher.all_loads()
        statuses = [s.status() for s in fleet.servers]
        refused = [t for t in tally.refused_at if t >= started]
        return {
            "kind": kind,
            "promoted_s": round(promoted_s, 2),
            "no_answer_acknowledged_s": round(longest_gap(tally.answered_at, started, ended), 2),
            "refused_span_s": round(refused[-1] - refused[0], 2) if refused else 0.0,
            "answers_503": len(refused),
            "acknowledged": dict(traffic.tally.calls),
            "lost_per_instance": [lost(want, rows) for rows in seen],
            "converged_s": None if converged is None else round(converged - ended, 2),
            "unexpected": traffic.tally.unexpected[:3],
            "spurious_404": len(traffic.tally.spurious_404),
            "resets": [st.get("resets") for st in statuses],
            "resent": [st.get("resent") for st in statuses],
        }
    finally:
        if watcher is not None:
            watcher.close()
        fleet.close()
        group.close()
        if not os.environ.get("FAILOVER_BENCH_KEEP_LOGS"):
            shutil.rmtree(logs, ignore_errors=True)
        else:
            print("logs in", logs, file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=["kill", "switch"],
                        choices=["kill", "switch"])  # fmt: skip
    parser.add_argument("--redis-arg", nargs=2, action="append", default=[],
                        metavar=("NAME", "VALUE"),
                        help="a setting for the two data nodes, e.g. repl-diskless-sync-delay 0 "
                        "(as the shipped deployment files set it)")  # fmt: skip
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="Redis replicas beside the primary (the instances wait for one)",
    )
    args = parser.parse_args()
    redis_args = [a for name, value in args.redis_arg for a in (f"--{name}", value)]
    binary = os.environ.get("SLOT_TRACKER_TEST_REDIS_SERVER") or shutil.which("redis-server")
    if not binary:
        sys.exit("no redis-server binary: set SLOT_TRACKER_TEST_REDIS_SERVER or PATH")
    for kind in args.kinds:
        for run in range(args.runs):
            result = one_run(binary, kind, 100 + run, redis_args, args.replicas)
            print(json.dumps({**result, "redis_args": redis_args, "replicas": args.replicas}),
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
