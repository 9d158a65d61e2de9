"""KV-event ingest and selection throughput, and memory per indexed block, next to the reference.

Both servers (KV events on) subscribe to the same publisher process (``bench/kv_publisher.py``):
``--ranks`` workers of one rank each, block size 16. The publisher sends ``--blocks`` blocks as
batches of one ``BlockStored`` of ``--chain`` blocks each (distinct prompts, round robin over
the ranks), ``--chunk`` batches at a time; a server has ingested a chunk when the chunk's last
prompt of every rank shows its full overlap, and the next chunk goes out when both have. Reported
per server: blocks and batches ingested per second (the sum over chunks of publish -> that
server complete), resident memory added per indexed block (with at most a chunk queued, so the
figure is the index's, not a receive backlog's), and sequential
``/select`` calls per second (token prompts of stored chains; ``--rounds`` rounds alternating
between the servers, the median reported).

    .venv/bin/python bench/kv_ingest_bench.py --ranks 64 --blocks 100000
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kv_publisher import PublisherProcess, stored  # noqa: E402
from bench.reference import start_ours, start_reference  # noqa: E402

BS = 16


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--selects", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    env = {k: v for k, v in os.environ.items() if k != "DYN_ROUTER_USE_KV_EVENTS"}
    servers = {
        "reference": start_reference(module="dynamo.select_service", env=env),
        "ours": start_ours(env={**env, "DYN_ROUTER_USE_KV_EVENTS": "true"}),
    }
    bases = {"reference": "", "ours": "/selection"}
    pub = PublisherProcess(ranks=args.ranks)
    try:
        clients = {
            n: httpx.Client(base_url=s.url + bases[n], timeout=30) for n, s in servers.items()
        }
        for wid in range(args.ranks):
            for c in clients.values():
                r = c.post("/workers", json={"worker_id": wid + 1, "endpoint": f"http://w{wid}",
                                             "block_size": BS,
                                             "kv_events_endpoint": pub.endpoints[wid]})  # fmt: skip
                assert r.json()["lifecycle"] == "schedulable", r.text
        for wid in range(args.ranks):
            pub.wait_subscribers(wid, 2)
        time.sleep(0.5)
        before = {n: rss_kib(s.pid) for n, s in servers.items() if s.pid}
        batches = args.blocks // args.chain
        prompts: list[list[int]] = []
        work = []
        for i in range(batches):
            tokens = [rng.randrange(1, 100_000) for _ in range(BS * args.chain)]
            prompts.append(tokens)
            hashes = [rng.randrange(1, 1 << 63) for _ in range(args.chain)]
            work.append([i % args.ranks, [stored(hashes, tokens, BS)]])
        # --chunk batches at a time; the next chunk goes out once both servers hold the last
        # prompt of every rank in this one, so neither queues more than a chunk (a burst of the
        # whole run also measures the receive backlog the allocator keeps). A server's time is
        # the sum over chunks of publish -> its last rank complete, each server polled by its
        # own thread.
        done: dict[str, float] = {n: 0.0 for n in servers}
        failed: set[str] = set()

        def wait_chunk(n: str, last: dict[int, int], started: float) -> float | None:
            """Poll server ``n`` until it holds the last prompt of every rank in the chunk;
            the seconds since ``started``, or None after 600 s."""
            c = clients[n]
            pending = dict(last)
            while time.monotonic() - started < 600:
                for rank, i in list(pending.items()):
                    r = c.post("/overlap_scores", json={"token_ids": prompts[i]}).json()
                    full = {w["worker_id"]: w["device_blocks"] for w in r["workers"]}
                    if full.get(rank + 1) != args.chain:
                        break
                    del pending[rank]
                if not pending:
                    return time.monotonic() - started
                time.sleep(0.01)
            return None

        with ThreadPoolExecutor(len(servers)) as pool:  # one poller per server
            for lo in range(0, batches, args.chunk):
                hi = min(batches, lo + args.chunk)
                last = {i % args.ranks: i for i in range(lo, hi)}  # rank -> its last prompt
                started = time.monotonic()
                pub.call(op="bulk", batches=work[lo:hi])
                waits = {n: pool.submit(wait_chunk, n, last, started) for n in servers}
                for n, f in waits.items():
                    secs = f.result()
                    if secs is None:
                        failed.add(n)
                    else:
                        done[n] += secs
                if failed:
                    break
        time.sleep(0.5)
        after = {n: rss_kib(s.pid) for n, s in servers.items() if s.pid}
        for n in servers:
            secs = done[n]
            if n in failed:
                print(f"{n}: a chunk not complete after 600 s")
                continue
            per_block = (after[n] - before[n]) * 1024 / (batches * args.chain)
            print(f"{n}: {batches * args.chain / secs:,.0f} blocks/s ({batches / secs:,.0f} batches/s), "
                  f"{per_block:,.0f} bytes RSS per indexed block")  # fmt: skip
        # /select: --rounds alternating rounds per server, the same prompts for both; median
        per_round = max(1, args.selects // args.rounds)
        rates: dict[str, list[float]] = {n: [] for n in clients}
        for _ in range(args.rounds):
            picks = [prompts[rng.randrange(batches)] for _ in range(per_round)]
            for n, c in clients.items():
                t0 = time.monotonic()
                for tokens in picks:
                    r = c.post("/select", json={"token_ids": tokens})
                    assert r.status_code == 200, r.text
                rates[n].append(per_round / (time.monotonic() - t0))
        for n, rs in rates.items():
            print(f"{n}: {statistics.median(rs):,.0f} /select per second (median of {args.rounds} "
                  f"rounds of {per_round}; {args.ranks} ranks, sequential)")  # fmt: skip
    finally:
        pub.close()
        for s in servers.values():
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
