"""A tiny stand-in for the slot trackers plus a real approximate cache, to build selection inputs.

The worked scenarios of SELECTION.md §4 are stated as bookings ("A holds P8", "a 1-block booking
with ept t"); ``Partition`` replays such bookings and produces the ``RankInput`` rows the service
will hand to ``select``: P, D + new (prompt hashes not active on the rank), A, and k from the
approximate cache. Block hashes double as sequence hashes, as in the scenarios.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kv_slot_tracker.core.selection import (
    ApproximateCache,
    RankInput,
    RouterConfig,
    Selection,
    select,
)
from kv_slot_tracker.core.types import NS_PER_S, WorkerWithDpRank

BS = 4
P8 = list(range(1, 9))


@dataclass
class RankState:
    prefill_tokens: int = 0
    blocks: set[int] = field(default_factory=set)
    requests: int = 0


class Partition:
    def __init__(self, *ranks: WorkerWithDpRank, block_size: int = BS) -> None:
        self.block_size = block_size
        self.state = {r: RankState() for r in ranks}
        self.cache = ApproximateCache(ttl_ns=120 * NS_PER_S)
        self.now = 1_000 * NS_PER_S

    def book(self, rank: WorkerWithDpRank, hashes: list[int], ept: int = 0) -> None:
        """A booking: P += ept, its blocks become active, A += 1, the cache records the chain."""
        s = self.state[rank]
        s.prefill_tokens += ept
        s.blocks.update(hashes)
        s.requests += 1
        self.cache.record(rank, hashes, self.now)

    def candidates(self, query: list[int]) -> list[RankInput]:
        over = self.cache.overlaps(query, self.now)
        return [
            RankInput(
                worker=r,
                active_prefill_tokens=s.prefill_tokens,
                potential_decode_blocks=len(s.blocks) + sum(1 for h in query if h not in s.blocks),
                active_requests=s.requests,
                overlap_blocks=over.get(r, 0),
            )
            for r, s in self.state.items()
        ]

    def select(
        self,
        query: list[int],
        isl: int,
        config: RouterConfig | None = None,
        rng: random.Random | None = None,
        **kw,
    ) -> Selection:
        return select(
            self.candidates(query),
            isl_tokens=isl,
            block_size=self.block_size,
            num_sequence_hashes=len(query),
            config=config or RouterConfig(),
            rng=rng or random.Random(0),
            **kw,
        )
