"""Simulated inference engines publishing KV events while the load test runs.

One process stands in for the engines of every selection worker rank: per rank, a ZMQ PUB
socket speaking vLLM's and SGLang's framing (``bench/kv_publisher.py``'s ``Rank``: multipart
``topic | sequence as 8 bytes big-endian | msgpack [ts, [events], dp_rank]``). Each rank caches
what it "prefilled": at ``--rate`` batches a second it takes a prompt from the load test's own
distribution (the same shared system prompts, popular ones more often, and a random user part),
stores the blocks it does not hold yet (``BlockStored``, chained to the cached prefix) and, past
``--capacity`` blocks, evicts the least recently used blocks that no cached block extends
(``BlockRemoved``). So the service's index holds the system prompts on the ranks that used them
lately, overlap scores of the load test's prompts are real, and the KV-event ingest is loaded
for the whole run.

A rank starts publishing once ``--subscribers`` subscribers (the service's instances) have
joined, so nothing is lost before they listen. Started by ``loadtest/locustfile.py``;

    python loadtest/kv_engines.py --ranks 16 --block-size 16 [--rate 10] [--host 127.0.0.1]

The first stdout line is ``{"endpoints": [...]}``. It runs until stdin closes (or SIGTERM), then
prints ``{"batches": n, "stored_blocks": n, "removed_blocks": n, "waiting_ranks": n}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import select
import signal
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.kv_publisher import Rank, removed, stored  # noqa: E402

VOCAB = 128_000
PROMPT_SEED = 1234  # the load test's system prompts: the same in every process and run


def system_prompts(count: int, blocks: int, block_size: int) -> tuple[tuple[int, ...], ...]:
    """The shared system prompts (token ids) of the load test's workload."""
    rng = random.Random(PROMPT_SEED)
    return tuple(
        tuple(rng.randrange(VOCAB) for _ in range(blocks * block_size)) for _ in range(count)
    )


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """An engine's hash of a block: of its parent's hash and its tokens (63 bits)."""
    h = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8)
    h.update(array("I", tokens).tobytes())
    return int.from_bytes(h.digest(), "big") >> 1


@dataclass
class Node:
    parent: int
    children: int = 0


@dataclass
class RankCache:
    """The blocks one engine rank holds: a tree of block hashes, evicted leaf first, LRU."""

    capacity: int
    nodes: dict[int, Node] = field(default_factory=dict)
    leaves: OrderedDict[int, None] = field(default_factory=OrderedDict)  # oldest first

    def prefill(self, tokens: Sequence[int], block_size: int) -> tuple[list, list[int]]:
        """The events of prefilling ``tokens``: a ``BlockStored`` of the blocks not held yet
        (and a ``BlockRemoved`` of what that evicted); returns (events, evicted)."""
        parent, hashes, new_tokens, first_parent = 0, [], [], None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            block = tokens[start : start + block_size]
            h = block_hash(parent, block)
            if h in self.nodes:
                if h in self.leaves:
                    self.leaves.move_to_end(h)
            else:
                if first_parent is None:
                    first_parent = parent
                self.nodes[h] = Node(parent)
                if parent:
                    self.nodes[parent].children += 1
                    self.leaves.pop(parent, None)
                hashes.append(h)
                new_tokens.extend(block)
            parent = h
        if hashes:
            self.leaves[hashes[-1]] = None
        events: list = []
        if hashes:
            events.append(stored(hashes, new_tokens, block_size, first_parent or None))
        evicted = self.evict(keep=set(hashes))
        if evicted:
            events.append(removed(evicted))
        return events, evicted

    def evict(self, keep: set[int]) -> list[int]:
        evicted = []
        while len(self.nodes) > self.capacity and self.leaves:
            h = next(iter(self.leaves))
            if h in keep:  # the prompt just stored stays whole
                self.leaves.move_to_end(h)
                if next(iter(self.leaves)) == h:
                    break
                continue
            del self.leaves[h]
            node = self.nodes.pop(h)
            evicted.append(h)
            if node.parent:
                parent = self.nodes[node.parent]
                parent.children -= 1
                if parent.children == 0:
                    self.leaves[node.parent] = None
                    self.leaves.move_to_end(node.parent, last=False)  # as old as its child
        return evicted


def make_prompt(rng: random.Random, prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """A shared system prompt (popular ones more often) and a random user part, as the load
    test's routers send them."""
    tokens: list[int] = []
    if prompts and rng.random() >= 0.1:
        weights = [1 / (i + 1) for i in range(len(prompts))]
        tokens.extend(rng.choices(prompts, weights)[0])
    tokens.extend(rng.randrange(VOCAB) for _ in range(rng.randint(1, 8) * block_size))
    return tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, required=True, help="engine ranks to simulate")
    ap.add_argument("--dp-size", type=int, default=1, help="ranks per worker (the dp_rank sent)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefixes", type=int, default=8, help="shared system prompts")
    ap.add_argument("--prefix-blocks", type=int, default=64, help="blocks per system prompt")
    ap.add_argument("--rate", type=float, default=10.0, help="batches a second per rank")
    ap.add_argument("--capacity", type=int, default=4096, help="blocks cached per rank")
    ap.add_argument("--subscribers", type=int, default=1, help="subscribers to wait for")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if min(args.ranks, args.dp_size, args.block_size, args.capacity) < 1 or args.rate <= 0:
        ap.error("--ranks, --dp-size, --block-size, --capacity and --rate must be positive")

    ctx = zmq.Context()
    ranks = [Rank(ctx, b"", buffer_steps=1, host=args.host) for _ in range(args.ranks)]
    caches = [RankCache(args.capacity) for _ in ranks]
    prompts = system_prompts(args.prefixes, args.prefix_blocks, args.block_size)
    rng = random.Random(args.seed)
    print(json.dumps({"endpoints": [r.endpoint for r in ranks]}), flush=True)

    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    figures = {"batches": 0, "stored_blocks": 0, "removed_blocks": 0}
    interval = 1.0 / args.rate
    due = time.monotonic()
    while not stopping:
        timeout = max(0.0, due - time.monotonic())
        readable, _, _ = select.select([sys.stdin], [], [], timeout)
        if readable and not sys.stdin.readline():
            break  # stdin closed: the load test is over
        if time.monotonic() < due:
            continue
        due += interval
        for i, (rank, cache) in enumerate(zip(ranks, caches, strict=True)):
            rank.read_subscriptions()
            if rank.subscribers < args.subscribers:
                continue
            events, evicted = cache.prefill(make_prompt(rng, prompts, args.block_size),
                                            args.block_size)  # fmt: skip
            if events:
                rank.publish(events, i % args.dp_size, drop=False)
                figures["batches"] += 1
                figures["stored_blocks"] += sum(len(e[1]) for e in events if e[0] == "BlockStored")
                figures["removed_blocks"] += len(evicted)
    figures["waiting_ranks"] = sum(r.subscribers < args.subscribers for r in ranks)
    print(json.dumps(figures), flush=True)
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
