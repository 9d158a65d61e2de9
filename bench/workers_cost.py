"""CPU time per lifecycle call: one process, and ``--workers 2`` through each transport.

On a shared, loaded machine requests per second move with the neighbours; the CPU time the
server spends per call answered moves much less, so that is the figure: every process of the
server (the supervisor with the hub thread, the server processes, the private redis-server),
read from ``/proc`` before and after a wrk run of ``lifecycle.lua`` (``/add`` + ``/free``),
divided by the calls answered. Nothing is pinned (wrk and every server process share the cores).
``consistency_wait_ms = 0``: the script's first frees are of ids never added, which would each
wait the consistency bound otherwise.

Run:  .venv/bin/python bench/workers_cost.py [--duration 5] [--rounds 2] [--connections 1,32]
Needs: wrk (apt-get install wrk), redis-server on PATH (the "redis" transport).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench import http_bench as hb  # noqa: E402
from bench.reference import start_ours  # noqa: E402

CONFIGS = {  # name: (workers, workers_transport, replication_ack)
    "one-process": (1, "local", "local"),
    "2-local": (2, "local", "local"),
    "2-local-durable": (2, "local", "redis"),
    "2-redis": (2, "redis", "local"),
}


def cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds so far of the supervisor (with its hub thread), its server processes and
    its private redis-server (a single process: all of it is "servers")."""

    def seconds(p: int) -> float:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    kids = hb.children(pid)
    if not kids:
        return {"servers": seconds(pid), "supervisor": 0.0, "redis": 0.0}
    roles = {"servers": 0.0, "supervisor": seconds(pid), "redis": 0.0}
    for child in kids:
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except FileNotFoundError:
            continue
        roles["redis" if name.startswith("redis") else "servers"] += seconds(child)
    return roles


def run(name: str, connections: int, duration: int, round_no: int) -> dict[str, float]:
    workers, transport, ack = CONFIGS[name]
    env = {**os.environ, "SLOT_TRACKER_WORKERS_TRANSPORT": transport,
           "SLOT_TRACKER_REPLICATION_ACK": ack, "SLOT_TRACKER_CONSISTENCY_WAIT_MS": "0"}  # fmt: skip
    with start_ours(extra_args=["--workers", str(workers)], env=env) as s:
        if workers > 1:
            hb.wait_all_ready(s.url, workers)
        hb.setup_topology(s.url)
        hb.settle(s.url)
        hb.wrk(s.url, "lifecycle.lua", 2, {"WRK_TAG": f"warm{round_no}"}, connections)
        before = cpu_by_role(s.pid)
        res = hb.wrk(s.url, "lifecycle.lua", duration, {"WRK_TAG": f"r{round_no}"}, connections)
        after = cpu_by_role(s.pid)
    calls = res["rps"] * duration
    out = {role: (after[role] - before[role]) / calls * 1e6 for role in after}
    out["total"] = sum(out.values())
    out["rps"] = res["rps"]
    out["non2xx"] = res["non2xx"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--connections", default="1,32")
    ap.add_argument("--only", default=",".join(CONFIGS))
    args = ap.parse_args()
    hb.OURS_WORKERS = 2  # nothing pinned, whatever the configuration
    names = [n for n in CONFIGS if n in args.only.split(",")]
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    for connections in (int(c) for c in args.connections.split(",")):
        for r in range(args.rounds):
            for name in names:  # interleaved: the same minutes for every configuration
                res = run(name, connections, args.duration, r)
                results.setdefault((name, connections), []).append(res)
                print(f"{name:12s} c={connections:<3d} round {r}: {res['rps']:8.0f} req/s, "
                      f"non-2xx {res['non2xx']}, CPU per call: servers {res['servers']:.0f} us, "
                      f"supervisor {res['supervisor']:.0f} us, redis {res['redis']:.0f} us, "
                      f"total {res['total']:.0f} us", flush=True)  # fmt: skip
    for (name, connections), runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        totals = ", ".join(f"{x['total']:.0f}" for x in runs)
        print(f"SUMMARY {name} c={connections}: {med['rps']:.0f} req/s, CPU per call (median) "
              f"servers {med['servers']:.0f} us + supervisor {med['supervisor']:.0f} us + "
              f"redis {med['redis']:.0f} us = {med['total']:.0f} us "
              f"(totals of the rounds: {totals})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
