"""Seeded lifecycle traffic against real instances, and an independent model of what it should
leave behind.

``Expected`` does not use the service's code: it keeps the active requests and derives every
rank's load from them (requests, unique prompt blocks, prefill tokens) and the prefix overlap of
a query. With HTTP-added prefills (no duration) none of this depends on time.

``Traffic`` sends adds (chained hashes sharing prefixes, ``new_isl_tokens`` > 0),
``prefill_complete``s and ``free``s round-robin over instances, and applies each to the model.
A lifecycle call for a request added on *another* instance may only be sent once that instance
has the request, or it would be a no-op there and the outcome would depend on timing: the first
such call is a ``prefill_complete`` repeated while it answers 404 (harmless), which both waits
for replication and establishes that the instance has it.
"""

from __future__ import annotations

import copy
import hashlib
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kv_slot_tracker_client import BatchBuilder, Conflict, NotFound

from tests.e2e.servers import ServerProcess

Key = tuple[str, str]
LOAD_FIELDS = (
    "model_name",
    "routing_group",
    "worker_id",
    "dp_rank",
    "active_prefill_tokens",
    "active_decode_blocks",
    "active_requests",
)


@dataclass(frozen=True, order=True)
class Rank:
    model: str
    group: str
    worker_id: int
    dp_rank: int

    @property
    def key(self) -> Key:
        return (self.model, self.group)


@dataclass
class Req:
    rid: str
    rank: Rank
    blocks: list[int]
    hashes: tuple[int, ...]
    tokens: int
    owner: int  # index of the instance it was added on
    prefill_done: bool = False
    known_by: set[int] = field(default_factory=set)  # instances known to hold it


def chain(blocks: list[int]) -> tuple[int, ...]:
    """Chained u64 sequence hashes: each one covers its block and the whole prefix."""
    out, parent = [], b"root"
    for block in blocks:
        digest = hashlib.blake2b(parent + block.to_bytes(8, "little"), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little"))
        parent = digest
    return tuple(out)


class Prompts:
    """Prompts (as block contents) from a few shared "system prompts" plus short tails from a
    tiny alphabet, so requests share prefixes of every length, including whole prompts."""

    def __init__(self, rng: random.Random, families: int = 5) -> None:
        self.rng = rng
        self.families = [
            [rng.randrange(1 << 20) for _ in range(rng.randint(2, 6))] for _ in range(families)
        ]

    def blocks(self, rng: random.Random | None = None) -> list[int]:
        rng = rng or self.rng
        if rng.random() < 0.1:
            return [rng.randrange(1 << 30) for _ in range(rng.randint(0, 4))]
        family = rng.choice(self.families)
        head = family[: rng.randint(1, len(family))]
        return head + [rng.randrange(3) for _ in range(rng.randint(0, 5))]


class Expected:
    """The state every instance should converge to, derived from the traffic alone."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = sorted(ranks)
        self.active: dict[tuple[Key, str], Req] = {}

    def copy(self) -> Expected:
        other = Expected(self.ranks)
        other.active = {k: copy.copy(r) for k, r in self.active.items()}
        return other

    def add(self, req: Req) -> None:
        self.active[(req.rank.key, req.rid)] = req

    def prefill_complete(self, key: Key, rid: str) -> None:
        req = self.active.get((key, rid))
        if req is not None:
            req.prefill_done = True

    def free(self, key: Key, rid: str) -> None:
        self.active.pop((key, rid), None)

    def _on(self, rank: Rank) -> list[Req]:
        return [r for r in self.active.values() if r.rank == rank]

    def loads(self) -> list[dict[str, Any]]:
        rows = []
        for rank in self.ranks:
            reqs = self._on(rank)
            rows.append(
                {
                    "model_name": rank.model,
                    "routing_group": rank.group,
                    "worker_id": rank.worker_id,
                    "dp_rank": rank.dp_rank,
                    "active_prefill_tokens": sum(r.tokens for r in reqs if not r.prefill_done),
                    "active_decode_blocks": len({h for r in reqs for h in r.hashes}),
                    "active_requests": len(reqs),
                }
            )
        return rows

    def potential(self, key: Key, query: tuple[int, ...], new_isl: int) -> list[tuple[int, ...]]:
        """Sorted ``(worker_id, dp_rank, prefill tokens, decode blocks, active requests)``."""
        rows = []
        for rank, load in zip(self.ranks, self.loads(), strict=True):
            if rank.key != key:
                continue
            overlap = 0
            for r in self._on(rank):
                k = 0
                while k < min(len(query), len(r.hashes)) and query[k] == r.hashes[k]:
                    k += 1
                overlap = max(overlap, k)
            rows.append(
                (
                    rank.worker_id,
                    rank.dp_rank,
                    load["active_prefill_tokens"] + new_isl,
                    load["active_decode_blocks"] + len(query) - overlap,
                    load["active_requests"],
                )
            )
        return rows


def load_rows(server: ServerProcess) -> list[dict[str, Any]]:
    """``/loads`` of ``server``, every field."""
    return [row.model_dump() for row in server.client.loads()]


def load_view(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fields of ``/loads`` rows that ``Expected`` predicts."""
    return [{f: row[f] for f in LOAD_FIELDS} for row in rows]


def potential_rows(
    server: ServerProcess, key: Key, query: tuple[int, ...], new_isl: int
) -> list[tuple[int, ...]]:
    rows = server.client.potential_loads(
        key[0], query, new_isl_tokens=new_isl, routing_group=key[1]
    )
    return sorted(
        (
            r.worker_id,
            r.dp_rank,
            r.potential_prefill_tokens,
            r.potential_decode_blocks,
            r.active_requests,
        )
        for r in rows
    )


class Traffic:
    """Seeded lifecycle calls round-robin over ``servers``, mirrored into ``expected``.

    ``cross``: lifecycle calls may go to another instance than the request's owner (after it
    has the request, see the module docstring). Without it every call for a request goes to
    the instance that added it, as a router pinned to its own requests does; that needs no
    replication at all, so it also works while Redis is down. ``local`` (index -> Expected)
    additionally tracks, per instance, the state it should show from its own calls alone.
    """

    def __init__(
        self,
        servers: list[ServerProcess],
        ranks: list[Rank],
        seed: int,
        *,
        expected: Expected | None = None,
        prefix: str = "r",
    ) -> None:
        self.servers = servers
        self.ranks = ranks
        self.rng = random.Random(seed)
        self.prompts = Prompts(self.rng)
        self.expected = expected if expected is not None else Expected(ranks)
        self.local: dict[int, Expected] | None = None
        self.prefix = prefix
        self.n = 0
        self.turn = 0
        self.added: Counter[Rank] = Counter()
        self.freed: Counter[Rank] = Counter()
        self.calls: Counter[str] = Counter()

    def live(self) -> list[Req]:
        return list(self.expected.active.values())

    def run(self, ops: int, targets: list[int] | None = None, *, cross: bool = True) -> None:
        """Send ``ops`` calls, round-robin over the instances ``targets`` (default: all)."""
        targets = list(range(len(self.servers))) if targets is None else targets
        for _ in range(ops):
            target = targets[self.turn % len(targets)]
            self.turn += 1
            self.step(target, cross)

    def _mirror(self, target: int, fn: str, *args: Any) -> None:
        getattr(self.expected, fn)(*args)
        if self.local is not None:
            getattr(self.local[target], fn)(*(copy.copy(a) for a in args))

    def step(self, target: int, cross: bool) -> None:
        rng = self.rng
        live = self.live()
        if not cross:
            live = [r for r in live if r.owner == target]
        roll = rng.random()
        if not live or roll < 0.5:
            self.add(target)
        elif roll < 0.65:
            self.prefill_complete(target, rng.choice(live))
        elif roll < 0.69:
            self.duplicate_add(target, rng.choice(live), cross)
        elif roll < 0.71:
            self.calls["free_unknown"] += 1
            rank = self.ranks[0]
            self.servers[target].client.free(
                rank.model, f"{self.prefix}-never-added", routing_group=rank.group
            )
        else:
            self.free(target, rng.choice(live))

    def add(self, target: int) -> Req:
        rank = self.rng.choice(self.ranks)
        blocks = self.prompts.blocks()
        req = Req(
            f"{self.prefix}{self.n}",
            rank,
            blocks,
            chain(blocks),
            self.rng.randint(1, 4096),
            owner=target,
            known_by={target},
        )
        self.n += 1
        self.servers[target].client.add(
            rank.model,
            req.rid,
            rank.worker_id,
            rank.dp_rank,
            req.hashes,
            new_isl_tokens=req.tokens,
            routing_group=rank.group,
        )
        self.calls["add"] += 1
        self.added[rank] += 1
        self._mirror(target, "add", req)
        return req

    def batch_add(self, target: int, count: int) -> None:
        """``count`` adds in one ``/batch`` call (one round trip, many records at once)."""
        batch = BatchBuilder()
        reqs = []
        for _ in range(count):
            rank = self.rng.choice(self.ranks)
            blocks = self.prompts.blocks()
            req = Req(f"{self.prefix}{self.n}", rank, blocks, chain(blocks),
                      self.rng.randint(1, 4096), owner=target, known_by={target})  # fmt: skip
            self.n += 1
            reqs.append(req)
            batch.add(rank.model, req.rid, rank.worker_id, rank.dp_rank, req.hashes,
                      new_isl_tokens=req.tokens, routing_group=rank.group)  # fmt: skip
        results = self.servers[target].client.batch(batch)
        assert [r.status for r in results] == [201] * count, results
        for req in reqs:
            self.calls["add"] += 1
            self.added[req.rank] += 1
            self._mirror(target, "add", req)

    def _reach(self, target: int, req: Req) -> bool:
        """Make sure ``target`` holds ``req``; True when that already completed its prefill."""
        if target in req.known_by:
            return False
        server = self.servers[target]
        deadline = time.monotonic() + 10
        while True:
            try:
                server.client.prefill_complete(
                    req.rank.model, req.rid, routing_group=req.rank.group
                )
                break
            except NotFound:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{req.rid} added on {self.servers[req.owner].name} did not reach "
                        f"{server.name} within 10 s"
                    ) from None
                time.sleep(0.001)
        self.calls["prefill_complete"] += 1
        self.calls["crossed"] += 1
        req.known_by.add(target)
        self._mirror(target, "prefill_complete", req.rank.key, req.rid)
        return True

    def prefill_complete(self, target: int, req: Req) -> None:
        if self._reach(target, req):
            return
        self.servers[target].client.prefill_complete(
            req.rank.model, req.rid, routing_group=req.rank.group
        )
        self.calls["prefill_complete"] += 1
        self._mirror(target, "prefill_complete", req.rank.key, req.rid)

    def duplicate_add(self, target: int, req: Req, cross: bool) -> None:
        """An add of a live request id on an instance holding it: 409, nothing changes."""
        if cross:
            self._reach(target, req)
        rank = self.rng.choice([r for r in self.ranks if r.key == req.rank.key])
        try:
            self.servers[target].client.add(
                rank.model,
                req.rid,
                rank.worker_id,
                rank.dp_rank,
                chain([1, 2]),
                new_isl_tokens=5,
                routing_group=rank.group,
            )
        except Conflict:
            self.calls["duplicate_add"] += 1
            return
        raise AssertionError(f"a second add of {req.rid} on {self.servers[target].name} succeeded")

    def free(self, target: int, req: Req) -> None:
        self._reach(target, req)
        self.servers[target].client.free(req.rank.model, req.rid, routing_group=req.rank.group)
        self.calls["free"] += 1
        self.freed[req.rank] += 1
        self._mirror(target, "free", req.rank.key, req.rid)

    def queries(self, count: int = 6) -> list[tuple[Key, tuple[int, ...], int]]:
        """``/potential_loads`` queries: live prompts, their prefixes and extensions, fresh
        prompts and the empty prompt, over every key. (Drawn from a random generator of their
        own: checking does not change the traffic that follows.)"""
        rng = random.Random(self.n)
        keys = sorted({r.key for r in self.ranks})
        out: list[tuple[Key, tuple[int, ...], int]] = [(k, (), 0) for k in keys]
        live = self.live()
        for i in range(count):
            if live and i % 3 != 2:
                base = rng.choice(live)
                blocks = base.blocks[: rng.randint(0, len(base.blocks))]
                if i % 2:  # a continuation that no request has (or one that some do)
                    blocks = blocks + [rng.randrange(4)]
                out.append((base.rank.key, chain(blocks), rng.randint(1, 500)))
            else:
                out.append((rng.choice(keys), chain(self.prompts.blocks(rng)), rng.randint(1, 500)))
        return out
