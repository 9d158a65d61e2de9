"""Loading the KV index from a peer (``--indexer-peers``), next to the reference.

One publisher process (``bench/kv_publisher.py``) feeds a first server of each kind (KV events on,
no Redis) ``--blocks`` blocks over ``--ranks`` workers of one rank, as chains of ``--chain``
blocks. Then per kind: the peer's dump is fetched ``--rounds`` times (the reference's ``GET
/dump``, this service's ``GET /selection/kv_index``: bytes and seconds, median), and a second
server is started with the first as its peer; reported is the time from its start until its
``/overlap_scores`` shows every rank's last chain in full (workers registered as soon as it
answers), and from when it answered (this service's Python start-up takes seconds on a busy
machine), with no batch published meanwhile: all it knows came from the peer.

    .venv/bin/python bench/kv_peers_bench.py --ranks 16 --blocks 100000
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kv_publisher import PublisherProcess, stored  # noqa: E402
from bench.reference import Server, start_ours, start_reference  # noqa: E402

BS = 16
BASES = {"reference": "", "ours": "/selection"}
DUMPS = {"reference": "/dump", "ours": "/selection/kv_index"}


def register(client: httpx.Client, pub: PublisherProcess, ranks: int) -> None:
    for wid in range(ranks):
        r = client.post("/workers", json={"worker_id": wid + 1, "endpoint": f"http://w{wid}",
                                          "block_size": BS,
                                          "kv_events_endpoint": pub.endpoints[wid]})  # fmt: skip
        assert r.json()["lifecycle"] == "schedulable", r.text


def complete(
    client: httpx.Client, prompts: list[list[int]], last: dict[int, int], chain: int
) -> bool:
    for rank, i in last.items():
        r = client.post("/overlap_scores", json={"token_ids": prompts[i]}).json()
        full = {w["worker_id"]: w["device_blocks"] for w in r["workers"]}
        if full.get(rank + 1) != chain:
            return False
    return True


def start(kind: str, env: dict[str, str], peer: str | None = None) -> Server:
    if kind == "reference":
        extra = ["--indexer-peers", peer] if peer else []
        return start_reference(module="dynamo.select_service", env=env, extra_args=extra)
    extra = ["--indexer-peers", peer, "--indexer-peers-timeout-seconds", "60"] if peer else []
    return start_ours(env={**env, "DYN_ROUTER_USE_KV_EVENTS": "true"}, extra_args=extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    env = {k: v for k, v in os.environ.items() if k != "DYN_ROUTER_USE_KV_EVENTS"}
    servers: list[Server] = []
    pub = PublisherProcess(ranks=args.ranks)
    try:
        firsts = {kind: start(kind, env) for kind in BASES}
        servers += firsts.values()
        clients = {
            k: httpx.Client(base_url=s.url + BASES[k], timeout=60) for k, s in firsts.items()
        }
        for c in clients.values():
            register(c, pub, args.ranks)
        for wid in range(args.ranks):
            pub.wait_subscribers(wid, 2)
        time.sleep(0.5)
        batches = args.blocks // args.chain
        prompts, work = [], []
        for i in range(batches):
            tokens = [rng.randrange(1, 100_000) for _ in range(BS * args.chain)]
            prompts.append(tokens)
            hashes = [rng.randrange(1, 1 << 63) for _ in range(args.chain)]
            work.append([i % args.ranks, [stored(hashes, tokens, BS)]])
        last = {i % args.ranks: i for i in range(batches)}
        for i in range(0, batches, 500):
            pub.call(op="bulk", batches=work[i : i + 500])
        deadline = time.monotonic() + 600
        for kind, c in clients.items():
            while not complete(c, prompts, last, args.chain):
                assert time.monotonic() < deadline, f"{kind} did not ingest everything"
                time.sleep(0.1)
        print(f"{batches * args.chain:,} blocks over {args.ranks} ranks, chains of {args.chain}")
        dumps: dict[str, list[tuple[float, int]]] = {kind: [] for kind in firsts}
        for _ in range(args.rounds):  # alternate the kinds, round after round
            for kind, s in firsts.items():
                t0 = time.monotonic()
                body = httpx.get(s.url + DUMPS[kind], timeout=120).content
                dumps[kind].append((time.monotonic() - t0, len(body)))
        for kind in firsts:
            secs = statistics.median(d[0] for d in dumps[kind])
            size = dumps[kind][0][1]
            print(f"{kind}: dump {size / 1e6:,.1f} MB ({size / (batches * args.chain):,.0f} bytes "
                  f"a block) in {secs:.2f} s")  # fmt: skip
        for kind, s in firsts.items():
            t0 = time.monotonic()
            second = start(kind, env, peer=s.url)
            up = time.monotonic() - t0
            servers.append(second)
            c = httpx.Client(base_url=second.url + BASES[kind], timeout=60)
            register(c, pub, args.ranks)
            while not complete(c, prompts, last, args.chain):
                assert time.monotonic() - t0 < 600, f"{kind}: second server did not recover"
                time.sleep(0.05)
            took = time.monotonic() - t0
            print(f"{kind}: a second server held the whole index {took:.2f} s after its start, "
                  f"{took - up:.2f} s after it answered")  # fmt: skip
    finally:
        pub.close()
        for s in servers:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
