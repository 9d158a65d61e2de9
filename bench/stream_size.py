"""What the replication keys cost in Redis memory: bytes per stream entry (an add with a
prompt of N blocks, a free) and bytes of snapshot per active request, measured with
``MEMORY USAGE`` on a namespace of its own. The sizing paragraph of docs/redis-ha.md comes from this.

Run:  .venv/bin/python bench/stream_size.py [--redis-url URL] [--requests 20000] [--blocks 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import redis  # noqa: E402

from kv_slot_tracker.replication.redis.stream import NamespaceKeys  # noqa: E402
from tests.calls import free, register  # noqa: E402
from tests.replication.helpers import KEY, Clocks, Cluster, Node  # noqa: E402


async def settle(node: Node) -> None:
    while node.rep.status().outbox_depth:
        await asyncio.sleep(0.01)


async def measure(url: str, requests: int, blocks: int) -> None:
    namespace = f"size-{uuid.uuid4().hex[:8]}"
    cluster = Cluster(url, namespace, Clocks())
    client = redis.Redis.from_url(url)
    keys = NamespaceKeys.of(namespace)
    try:
        node = await cluster.node()
        register(node.service, KEY, 1, 4, 0, 8)
        await settle(node)
        before = client.memory_usage(keys.events, samples=0)
        for i in range(requests):
            hashes = [(i * 7919 + j) * 2654435761 % 2**63 for j in range(blocks)]
            node.add(f"req-{uuid.uuid4()}", dp_rank=i % 8, hashes=hashes, tokens=blocks * 16)
            if i % 500 == 0:
                await settle(node)
        await settle(node)
        after_adds = client.memory_usage(keys.events, samples=0)
        assert await node.rep.write_snapshot()
        snapshot = client.memory_usage(keys.snapshot, samples=0)
        for i, rid in enumerate([r for r, _ in node.service.tracker(KEY).indexed_requests()]):
            free(node.service, KEY, rid)
            if i % 500 == 0:
                await settle(node)
        await settle(node)
        after_frees = client.memory_usage(keys.events, samples=0)
        print(f"add ({blocks} blocks): {(after_adds - before) / requests:.0f} B per stream entry")
        print(f"free: {(after_frees - after_adds) / requests:.0f} B per stream entry")
        print(f"snapshot: {snapshot / requests:.0f} B per active request ({blocks} blocks)")
    finally:
        await cluster.close()
        found = list(client.scan_iter(match="{" + namespace + "}:*"))
        if found:
            client.delete(*found)
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("SLOT_TRACKER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    parser.add_argument("--redis-url", default=default)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(measure(args.redis_url, args.requests, args.blocks))


if __name__ == "__main__":
    main()
