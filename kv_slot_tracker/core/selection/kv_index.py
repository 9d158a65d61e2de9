"""The index of real cache contents: which blocks each rank holds, fed by the engines' KV events.

Why it exists: with KV events on (the reference's default) the router does not guess what a rank
caches from what it routed there (``approx_cache``); each engine publishes the blocks it stores,
removes and clears, and overlap scores read this index. One index per partition ``(model_name,
routing_group)``.

How a block is named (its tier, its chain key and edge key) is ``kv_blocks``; the device tier
is the reference's compressed radix tree (``kv_tree``), the host, disk and external tiers its
``LowerTierIndexer`` (``kv_lower``); this index puts them together.

What the reference does, and so this index (verified on ai-dynamo-runtime 1.6.1):

* ``BlockStored`` in the device tier with a parent the rank does not hold there is skipped whole;
  one that matches a run stored under other engine hashes (another rank's) joins that run and
  stops there (its last block is not the run's tail: a stale parent for what follows). A host,
  disk or external block needs no parent anywhere (``/dump`` lists it; a walk reaches it once it
  ends on that parent). A store repeating a hash (the parent included) is dropped; an event
  whose ``block_size`` differs from the partition's, or whose ``token_ids`` cover fewer blocks
  than it names, stores the full blocks it covers and stops (``local_hashes``).
* A host, disk or external edge belongs to the first store of it: a block whose edge leads to
  another engine hash (another rank stored the same tokens under other hashes), or that the
  rank holds under another edge, ends the store there; one held in the same place is kept.
* ``BlockRemoved`` drops the named blocks of that tier from the rank. In the device tier a block
  goes with the rest of its run that the rank holds, where a run is a node of the reference's
  tree: the blocks stored together that no other store has split (stores ``[1,2,3]``, removes
  ``2``: ``/dump`` lists ``1`` only and a later store under ``3`` is refused). Runs below it are
  kept (listed by ``/dump`` under their parent, reachable as store parents, but no prompt reaches
  them through the removed block), unless no rank holds the run whole any more: then they drop
  out of reach. A removal event's consecutive hashes of one run act from the first of them in
  the run, where the run is the one the rank last stored the event's first hash in and a hash
  is of it by its engine hash. The rank's lookup then loses the hashes of the blocks it held in
  that run, and only those: a rank that stored the same engine hashes under other tokens
  (another cache salt, say) has two runs of them; the other run keeps the rank's blocks
  (``/dump`` lists them), but those named by the removal no longer serve as parents, while the
  hashes it held only in the other run still do. In the host and disk tiers just the named
  blocks go. Unknown hashes are skipped.
* ``AllBlocksCleared`` empties the publishing rank, every tier (other dp ranks of the worker keep
  theirs). Its device runs that no rank holds any more stay in the tree (the reference sweeps
  them in the background, 1.6.1 not within 35 s): a store of the same tokens under other engine
  hashes joins such a run (``/dump`` lists the old hashes) and a store continuing it under the
  new hashes is refused (stale parent). Where this service clears a rank of its own accord (a
  publisher restarting from sequence 0, a gap cleared, a rank leaving: ``clear_rank(prune=
  True)``) those runs are dropped, so an engine restarted under new hashes (vLLM seeds them per
  process) indexes the same tokens again (the reference does not clear on a restart, and
  keeps the runs after a worker's removal: a worker back under new hashes gets one block).
* Tiers: ``device`` (GPU), ``host_pinned`` (CPU), ``disk`` and ``external``; a rank's overlap
  is its device prefix ``d``, then, tier by tier in that order, the edges it holds from where it
  stopped (the engine hash of its last block; from block 0 for a rank holding the prompt's first
  block in the tier). ``/overlap_scores`` reports ``host_pinned_blocks = d + host_ext`` and
  ``disk_blocks = host_pinned_blocks + disk_ext + external_ext``.

Cost: a store or removal is proportional to its blocks, plus, where a store splits a run, the
moved part of the run times its holders (as the reference); finding a block in a run searches
at most ``_LONG`` positions (longer runs keep an index); clearing a rank is proportional to the
blocks it holds (a rank whose lookup lost runs, by storing under other ranks' hashes, sweeps the
tree, as the reference always does); a lookup walks the prompt's chain keys once, then per
non-empty lower tier one probe per rank with a place to continue from plus the edges walked. Pure: no
time, I/O or asyncio.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..types import WorkerWithDpRank
from .kv_blocks import DEVICE, IndexedBlock, StoredChain
from .kv_lower import LowerTiers
from .kv_tree import DeviceTree


@dataclass(frozen=True, slots=True)
class TierOverlap:
    """A rank's cached prefix of a prompt: device blocks, then the host and disk extensions."""

    device: int
    host_extension: int = 0
    disk_extension: int = 0


class KvIndex:
    """Blocks per rank and tier of one partition: the device tier's tree (``DeviceTree``) and
    the host, disk and external tiers (``LowerTiers``)."""

    def __init__(self) -> None:
        self._ranks_of_worker: dict[int, set[WorkerWithDpRank]] = {}
        self._device = DeviceTree(self._note_rank)
        self._lower = LowerTiers(self._note_rank)

    # -- writes ------------------------------------------------------------------------------------

    def _note_rank(self, worker: WorkerWithDpRank) -> None:
        self._ranks_of_worker.setdefault(worker.worker_id, set()).add(worker)

    def store(
        self,
        worker: WorkerWithDpRank,
        tier: int,
        parent_hash: int | None,
        blocks: Sequence[tuple[int, int]],
    ) -> bool:
        """Store ``blocks`` (``(engine hash, local hash)`` each, signed, in order) on ``worker``
        in ``tier`` under the parent ``parent_hash`` (an engine hash, or ``None`` for block 0).

        Returns False, storing nothing, when the parent is unknown on the rank or a hash repeats.
        """
        parent = parent_hash
        hashes = [b for b, _ in blocks]
        seen = set(hashes)
        if len(seen) != len(hashes) or (parent is not None and parent in seen):
            return False
        locals_ = [local for _, local in blocks]
        if tier == DEVICE:
            return self._device.store(worker, parent, hashes, locals_)
        if blocks:
            self._lower.store(worker, tier, parent, hashes, locals_)
        return True

    def remove(self, worker: WorkerWithDpRank, tier: int, block_hashes: Sequence[int]) -> int:
        """Drop the named blocks of ``tier`` from ``worker``; returns how many blocks went
        (in the device tier with the rest of their runs: ``DeviceTree.remove``)."""
        if tier != DEVICE:
            return self._lower.remove(worker, tier, block_hashes)
        return self._device.remove(worker, block_hashes)

    def clear_rank(self, worker: WorkerWithDpRank, *, prune: bool = False) -> int:
        """Forget every block ``worker`` holds, all tiers (``AllBlocksCleared``, a lost gap, a
        rank leaving); returns how many.

        ``prune``: the device runs no rank holds any more are dropped from the tree, so that
        the same tokens stored again under other engine hashes (an engine restarted: vLLM seeds
        its hashes per process) make a run of their own. Without it they stay, as in the
        reference until its background sweep: a store of the same tokens joins such a run and
        a store continuing it under the new hashes is refused (stale parent). The reference
        keeps them after ``AllBlocksCleared``; this service prunes where it clears a rank of its
        own accord (a publisher restarting from sequence 0, a gap cleared, a rank leaving)."""
        device = self._device.clear(worker, prune)
        lower = self._lower.clear(worker)
        if device is None and lower is None:
            return 0
        ranks = self._ranks_of_worker[worker.worker_id]
        ranks.discard(worker)
        if not ranks:
            del self._ranks_of_worker[worker.worker_id]
        return (device or 0) + (lower or 0)

    def remove_worker(self, worker_id: int, *, prune: bool = True) -> int:
        """Forget every rank of ``worker_id`` (``prune``: as ``clear_rank``); returns blocks
        dropped."""
        ranks = list(self._ranks_of_worker.get(worker_id, ()))
        return sum(self.clear_rank(r, prune=prune) for r in ranks)

    # -- reads -------------------------------------------------------------------------------------

    def overlaps(
        self, keys: Sequence[int], locals_: Sequence[int] | None = None
    ) -> dict[WorkerWithDpRank, TierOverlap]:
        """Each rank's cached prefix of a prompt given by its chain keys and its local block
        hashes (ranks with nothing omitted): consecutive device blocks from block 0, then the
        host, disk and external extensions (the disk extension counts the external one)."""
        out: dict[WorkerWithDpRank, TierOverlap] = {}
        if not keys:
            return out
        device = self._device.prefix(keys)
        if locals_ is None or not self._lower.has_edges():
            return {w: TierOverlap(d) for w, (d, _) in device.items()}
        hits = self._lower.walk(device, locals_)
        for w, (d, _) in device.items():
            if w not in hits:
                out[w] = TierOverlap(d)
        for w, (host, lower) in hits.items():
            d = device[w][0] if w in device else 0
            if d or host or lower:
                out[w] = TierOverlap(d, host, lower)
        return out

    def blocks(self) -> Iterator[IndexedBlock]:
        """Every indexed block: the device runs reachable from the root (each rank's part of a
        run, under the run's parent block, as the reference's ``/dump``), then each rank's host
        and disk blocks in store order."""
        yield from self._device.blocks()
        yield from self._lower.blocks()

    def device_runs(self) -> Iterator[StoredChain]:
        """The device blocks as the reference's ``/dump`` gives them (``DeviceTree.runs``)."""
        return self._device.runs()

    def lower_blocks(self, tier: int) -> Iterator[StoredChain]:
        """``tier``'s blocks (host, disk or external), one chain each, as the reference's
        ``/dump`` gives them."""
        return self._lower.chains(tier)

    def ranks(self) -> list[WorkerWithDpRank]:
        return list(dict.fromkeys([*self._device.ranks(), *self._lower.ranks()]))

    def __len__(self) -> int:
        """Indexed (rank, tier, block) entries (device: the blocks in the ranks' maps)."""
        return self._lower.size + self._device.size()

    @property
    def lookup_probes(self) -> int:
        """Work done by ``overlaps``: chain keys compared plus ranks dropped, and edges probed
        (never reset)."""
        return self._device.probes + self._lower.probes

    # -- dump and load (an index handed from one instance to another) ------------------------------

    def entries_by_rank(self) -> dict[WorkerWithDpRank, list[tuple[int, int, int | None, int]]]:
        """Every block as ``(tier, engine hash, parent engine hash or None, local hash)``, per
        rank (from ``blocks``, parents first): what ``load_rank`` takes back."""
        out: dict[WorkerWithDpRank, list[tuple[int, int, int | None, int]]] = {}
        for b in self.blocks():
            out.setdefault(b.worker, []).append(
                (b.tier, b.block_hash, b.parent_hash, b.tokens_hash)
            )
        return out

    def load_rank(
        self, worker: WorkerWithDpRank, entries: Sequence[tuple[int, int, int | None, int]]
    ) -> int:
        """Store ``entries`` (as ``entries_by_rank`` gives them, in any order: a block waits for
        its parent) on ``worker``; returns how many could not be stored (a device block whose
        parent never came, or a store ``store`` refuses). Host, disk and external blocks need no
        parent (``_store_lower``). Consecutive entries of one chain are stored as one run."""
        runs: list[tuple[int, int | None, list[tuple[int, int]]]] = []
        last = None
        for tier, h, parent, local in entries:
            if runs and tier == runs[-1][0] and parent is not None and parent == last:
                runs[-1][2].append((h, local))
            else:
                runs.append((tier, parent, [(h, local)]))
            last = h
        waiting: dict[int, list[tuple[int, int | None, list[tuple[int, int]]]]] = {}
        runs.reverse()
        refused = 0
        while runs:
            tier, parent, blocks = run = runs.pop()
            if tier == DEVICE and parent is not None and not self._device.holds(worker, parent):
                waiting.setdefault(parent, []).append(run)
                continue
            if not self.store(worker, tier, parent, blocks):
                refused += self._store_singly(worker, tier, parent, blocks)
            if waiting:
                for h, _ in blocks:
                    runs.extend(reversed(waiting.pop(h, ())))
        for left in waiting.values():
            for _, _, blocks in left:
                refused += len(blocks)
        return refused

    def _store_singly(
        self, worker: WorkerWithDpRank, tier: int, parent: int | None, blocks: list[tuple[int, int]]
    ) -> int:
        """A run ``store`` refused, block by block (each under the previous); how many failed."""
        refused = 0
        for h, local in blocks:
            if not self.store(worker, tier, parent, ((h, local),)):
                refused += 1
            parent = h
        return refused
