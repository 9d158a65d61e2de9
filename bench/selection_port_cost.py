"""What ``selection_port`` costs the main port's hot paths: server CPU per call, with and without.

Two servers in turn (A B A B ...): ``python -m kv_slot_tracker`` as it is, and the same with
``--selection-port P``. Each is given the lifecycle benchmark's topology (16 workers x 4 ranks,
block size 16) and the main port is driven with ``/add`` + ``/free`` pairs (32-block prompts
sharing a 16-block prefix) over a few keep-alive connections; the figure is the server's CPU
time (user + system, from /proc) per call, which compares where requests per second on a
shared machine do not. The server is pinned to CPU 1, the client to CPU 0. Then, for
information, ``/selection/select`` on the main port against ``/select`` on the selection port
(the same route through the prefixing connection).

    .venv/bin/python bench/selection_port_cost.py [--calls 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.http_bench import cpu_seconds, pin, setup_topology  # noqa: E402
from bench.reference import free_port, start_ours  # noqa: E402

CONNECTIONS = 4
PREFIX = [7000001 * i for i in range(1, 17)]


Share = list[tuple[str, bytes]]  # the (path, JSON body) calls of one connection, in order


def drive(port: int, shares: list[Share]) -> None:
    """Send each share over a keep-alive connection of its own, all at once."""
    errors: list[str] = []

    def one(share: Share) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        headers = {"content-type": "application/json"}
        for path, body in share:
            conn.request("POST", path, body, headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status >= 300:
                errors.append(f"{path} {resp.status}")
        conn.close()

    threads = [threading.Thread(target=one, args=(share,)) for share in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def lifecycle_shares(n: int, tag: str) -> list[Share]:
    """``n`` calls: adds and their frees, each pair on one connection."""
    shares: list[Share] = [[] for _ in range(CONNECTIONS)]
    for i in range(n // 2):
        rank = i % 64
        rid = f"{tag}-{i}"
        hashes = PREFIX + [(i * 1_000_003 + k) % (1 << 62) for k in range(16)]
        add = {"model_name": "bench", "request_id": rid, "worker_id": rank // 4,
               "dp_rank": rank % 4, "sequence_hashes": hashes, "new_isl_tokens": 512}  # fmt: skip
        free = {"model_name": "bench", "request_id": rid}
        shares[i % CONNECTIONS] += [("/add", json.dumps(add).encode()), ("/free", json.dumps(free).encode())]  # fmt: skip
    return shares


def select_shares(n: int, path: str) -> list[Share]:
    body = json.dumps({"model_name": "sel", "token_ids": list(range(256))}).encode()
    return [[(path, body)] * (n // CONNECTIONS) for _ in range(CONNECTIONS)]


def measure(port: int, pid: int, shares: list[Share]) -> float:
    """Server CPU microseconds per call."""
    before = cpu_seconds(pid)
    drive(port, shares)
    return (cpu_seconds(pid) - before) * 1e6 / sum(len(s) for s in shares)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    env = {**os.environ, "SLOT_TRACKER_ROUTER_USE_KV_EVENTS": "false"}
    results: dict[str, list[float]] = {"plain": [], "selection_port": [], "sel_main": [], "sel_root": []}  # fmt: skip
    for rnd in range(args.rounds):
        for kind in ("plain", "selection_port"):
            sel_port = free_port()
            extra = ["--selection-port", str(sel_port)] if kind == "selection_port" else []
            server = start_ours(extra_args=extra, env=env)
            try:
                pin(server.pid, 1)
                setup_topology(server.url)
                drive(server.port, lifecycle_shares(2000, f"warm{rnd}"))  # warm up
                cost = measure(server.port, server.pid, lifecycle_shares(args.calls, f"r{rnd}"))
                results[kind].append(cost)
                if kind == "selection_port":
                    worker = {"worker_id": 1, "model_name": "sel", "endpoint": "http://w", "block_size": 16}  # fmt: skip
                    drive(server.port, [[("/selection/workers", json.dumps(worker).encode())]])
                    n = args.calls // 4
                    results["sel_main"].append(measure(server.port, server.pid, select_shares(n, "/selection/select")))  # fmt: skip
                    results["sel_root"].append(measure(sel_port, server.pid, select_shares(n, "/select")))  # fmt: skip
            finally:
                server.stop()
            print(f"round {rnd} {kind}: {results[kind][-1]:.1f} us/call", flush=True)
    med = {k: statistics.median(v) for k, v in results.items() if v}
    print(json.dumps({k: round(v, 1) for k, v in med.items()}))
    print(
        f"main port /add+/free, server CPU per call: {med['plain']:.1f} us without, "
        f"{med['selection_port']:.1f} us with a selection port "
        f"({100 * (med['selection_port'] / med['plain'] - 1):+.1f} %); /selection/select "
        f"{med['sel_main']:.1f} us on the main port, /select {med['sel_root']:.1f} us on the "
        "selection port"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
