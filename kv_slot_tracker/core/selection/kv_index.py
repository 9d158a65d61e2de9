"""The index of real cache contents: which blocks each rank holds, fed by the engines' KV events.

Why it exists: with KV events on (the reference's default) the router does not guess what a rank
caches from what it routed there (``approx_cache``); each engine publishes the blocks it stores,
removes and clears, and overlap scores read this index. One index per partition ``(model_name,
routing_group)``.

How a block is identified. An engine names its blocks with its own hashes (``block_hash``,
vLLM's ``ExternalBlockHash``; any 64-bit value, signed or not, taken as u64) and links a stored
run to its parent by that hash. Prompts arrive here as the router's *local* hashes (xxh3 of the
block's tokens, ``compute_block_hash_for_seq`` with the partition's block size and LoRA name), so
a stored block is re-hashed from the ``token_ids`` the event carries (``local_hashes``) and then
keyed by its *chain key*: the chained local hashes from block 0 (``compute_seq_hash_for_block``),
which is the prompt's own sequence hash at that depth. The engine's hash only serves to find a
parent and to remove a block; the parent's chain key and the new block's local hash give the new
chain key. A rank therefore keeps, per tier, ``engine hash -> (chain key, local hash, parent
engine hash)``, and the index keeps, per tier, ``chain key -> ranks holding it``.

What the reference does, and so this index (verified on ai-dynamo-runtime 1.6.1):

* ``BlockStored`` in the device tier with a parent the rank does not hold there is skipped whole;
  a host or disk block's parent may be in any tier, and when the rank holds it nowhere the blocks
  are kept (``/dump`` lists them) under a key no prompt reaches; a store repeating a hash (the
  parent included) is dropped; an event whose ``block_size`` differs from
  the partition's, or whose ``token_ids`` cover fewer blocks than it names, stores the full blocks
  it covers and stops (``local_hashes``).
* ``BlockRemoved`` drops the named blocks of that tier from the rank; in the device tier each
  with every block the rank stored under it (stores ``[1,2,3]``, removes ``2``: ``/dump`` lists
  ``1`` only, a later store under ``3`` is refused, overlap 1), in the host and disk tiers just
  the named blocks. Unknown hashes are skipped.
* ``AllBlocksCleared`` empties the publishing rank, every tier (other dp ranks of the worker keep
  theirs).
* Tiers: ``device`` (GPU), ``host_pinned`` (CPU) and ``disk``; a rank's overlap is its device
  prefix ``d``, then the ``host_pinned`` extension (consecutive blocks from depth ``d`` held in
  host memory), then the ``disk`` extension after that. ``/overlap_scores`` reports
  ``host_pinned_blocks = d + host_ext`` and ``disk_blocks = host_pinned_blocks + disk_ext``.

Cost: a store or removal is proportional to its blocks; clearing a rank to the blocks it holds; a
lookup walks the prompt's chain keys once per non-empty tier and compares rank sets only where a
rank stops matching (never a scan over the partition's ranks or blocks). Pure: no time, I/O or
asyncio.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import xxhash

from ..hashing import XXH3_SEED, compute_block_hash_for_seq
from ..types import U64_MAX, WorkerWithDpRank

DEVICE, HOST_PINNED, DISK = 0, 1, 2
TIERS = (DEVICE, HOST_PINNED, DISK)
TIER_NAMES = ("device", "host_pinned", "disk")

# The engines' medium names (vLLM's ``medium``; the reference's ``StorageTier::from_kv_medium``).
# A missing or unknown medium is the device tier; an external/shared medium is no tier of a rank.
_MEDIA = {
    "GPU": DEVICE,
    "DEVICE": DEVICE,
    "CPU": HOST_PINNED,
    "CPU_PINNED": HOST_PINNED,
    "CPU_TIER1": HOST_PINNED,
    "CPU_TIER2": DISK,
    "DISK": DISK,
    "NVME": DISK,
}
_EXTERNAL = frozenset({"EXTERNAL", "NETWORK", "REMOTE", "SHARED"})

_h = xxhash.xxh3_64_intdigest
_pack = struct.Struct("<QQ").pack


def tier_of_medium(medium: str | None) -> int | None:
    """The tier of an event's ``medium``; ``None`` for a medium outside the workers (ignored)."""
    if medium is None:
        return DEVICE
    if medium in _EXTERNAL:
        return None
    return _MEDIA.get(medium, DEVICE)


def chain_key(parent_key: int | None, local_hash: int) -> int:
    """The chain key of a block: its local hash at depth 0, else xxh3 of (parent key, local)."""
    if parent_key is None:
        return local_hash
    return _h(_pack(parent_key, local_hash), seed=XXH3_SEED)


def orphan_key(parent_hash: int) -> int:
    """The chain key standing for a host/disk block's parent that the rank does not hold."""
    return _h(_pack(parent_hash, _ORPHAN), seed=XXH3_SEED)


_ORPHAN = 0x6F7270_68616E  # any constant: it only separates these keys from the chain keys


def local_hashes(
    token_ids: Sequence[int],
    event_block_size: int,
    num_blocks: int,
    block_size: int,
    lora_name: str | None = None,
) -> list[int]:
    """The router's local hash of each stored block, as the reference derives them: only when the
    event's block size is the partition's, and only for the blocks ``token_ids`` fully covers
    (at most ``num_blocks``)."""
    if event_block_size != block_size or block_size <= 0:
        return []
    n = min(num_blocks, len(token_ids) // block_size)
    return compute_block_hash_for_seq(list(token_ids[: n * block_size]), block_size, lora_name)


@dataclass(frozen=True, slots=True)
class TierOverlap:
    """A rank's cached prefix of a prompt: device blocks, then the host and disk extensions."""

    device: int
    host_extension: int = 0
    disk_extension: int = 0


@dataclass(frozen=True, slots=True)
class IndexedBlock:
    """One block of one rank and tier, as ``/dump`` lists it."""

    worker: WorkerWithDpRank
    tier: int
    block_hash: int
    """The engine's hash (u64)."""
    parent_hash: int | None
    """The engine's hash of the parent block, ``None`` at depth 0."""
    tokens_hash: int
    """The router's local hash (u64)."""


Holders = WorkerWithDpRank | dict[WorkerWithDpRank, None]
"""The ranks holding a chain key: the rank itself when one does (the usual case), else a dict."""


def _members(held: Holders) -> AbstractSet[WorkerWithDpRank]:
    """``held`` as a set-like of ranks (a dict's keys view, or a one-rank frozenset)."""
    return held.keys() if type(held) is dict else frozenset((held,))


def _holds(held: Holders, worker: WorkerWithDpRank) -> bool:
    return worker in held if type(held) is dict else held == worker


def _link(kids: dict[int, int | set[int]], parent: int, child: int) -> None:
    have = kids.get(parent)
    if have is None:
        kids[parent] = child
    elif type(have) is set:
        have.add(child)
    elif have != child:
        kids[parent] = {have, child}


def _unlink(kids: dict[int, int | set[int]], parent: int, child: int) -> None:
    have = kids.get(parent)
    if type(have) is set:
        have.discard(child)
    elif have == child:
        del kids[parent]


class KvIndex:
    """Blocks per rank and tier of one partition, keyed by chain key."""

    def __init__(self) -> None:
        # tier -> chain key -> the rank holding it, or a dict (ordered set) when several do: most
        # blocks have one holder, and a dict per block would double the index's memory
        self._holders: tuple[dict[int, Holders], ...] = ({}, {}, {})
        # rank -> per tier: engine hash -> (chain key, local hash, parent engine hash or None)
        self._ranks: dict[WorkerWithDpRank, tuple[dict[int, tuple[int, int, int | None]], ...]] = {}
        # rank -> device parent engine hash -> its child's engine hash, or a set when several
        # (removals cascade in the device tier only)
        self._kids: dict[WorkerWithDpRank, dict[int, int | set[int]]] = {}
        self._ranks_of_worker: dict[int, set[WorkerWithDpRank]] = {}
        self._size = 0
        self.lookup_probes = 0
        """Work done by ``overlaps``: chain keys looked up plus ranks compared (never reset)."""

    # -- writes ------------------------------------------------------------------------------------

    def _rank(self, worker: WorkerWithDpRank) -> tuple[dict[int, tuple[int, int, int | None]], ...]:
        maps = self._ranks.get(worker)
        if maps is None:
            maps = self._ranks[worker] = ({}, {}, {})
            self._kids[worker] = {}
            self._ranks_of_worker.setdefault(worker.worker_id, set()).add(worker)
        return maps

    def store(
        self,
        worker: WorkerWithDpRank,
        tier: int,
        parent_hash: int | None,
        blocks: Sequence[tuple[int, int]],
    ) -> bool:
        """Store ``blocks`` (``(engine hash, local hash)`` each, in order) on ``worker`` in
        ``tier`` under the parent ``parent_hash`` (an engine hash, or ``None`` for block 0).

        Returns False, storing nothing, when the parent is unknown on the rank or a hash repeats.
        """
        parent = None if parent_hash is None else parent_hash & U64_MAX
        hashes = [b & U64_MAX for b, _ in blocks]
        seen = set(hashes)
        if len(seen) != len(hashes) or (parent is not None and parent in seen):
            return False
        maps = self._ranks.get(worker)
        parent_key: int | None = None
        if parent is not None:
            entry = None
            if maps is not None:
                entry = maps[tier].get(parent)
                if entry is None and tier != DEVICE:
                    for other in TIERS:
                        entry = maps[other].get(parent)
                        if entry is not None:
                            break
            if entry is not None:
                parent_key = entry[0]
            elif tier == DEVICE:
                return False
            else:  # kept under a key no prompt can reach, as the reference keeps it
                parent_key = orphan_key(parent)
        if not blocks:
            return True
        maps = self._rank(worker)
        mine = maps[tier]
        kids = self._kids[worker] if tier == DEVICE else None
        holders = self._holders[tier]
        prev = parent
        for h, (_, local) in zip(hashes, blocks, strict=True):
            local &= U64_MAX
            key = chain_key(parent_key, local)
            old = mine.get(h)
            if old is not None:  # stored again: moves to its new place in the chain
                self._unhold(holders, old[0], worker)
                self._size -= 1
                if kids is not None and old[2] is not None:
                    _unlink(kids, old[2], h)
            mine[h] = (key, local, prev)
            if kids is not None and prev is not None:
                _link(kids, prev, h)
            held = holders.get(key)
            if held is None:
                holders[key] = worker
            elif type(held) is dict:
                held[worker] = None
            elif held != worker:
                holders[key] = {held: None, worker: None}
            self._size += 1
            parent_key, prev = key, h
        return True

    @staticmethod
    def _unhold(holders: dict[int, Holders], key: int, worker: WorkerWithDpRank) -> None:
        held = holders.get(key)
        if held is None:
            return
        if type(held) is dict:
            held.pop(worker, None)
            if len(held) == 1:
                holders[key] = next(iter(held))
            elif not held:
                del holders[key]
        elif held == worker:
            del holders[key]

    def remove(self, worker: WorkerWithDpRank, tier: int, block_hashes: Sequence[int]) -> int:
        """Drop the named blocks of ``tier`` from ``worker``, each with the blocks the rank
        stored under it in that tier; returns how many blocks went."""
        maps = self._ranks.get(worker)
        if maps is None:
            return 0
        mine = maps[tier]
        kids = self._kids[worker]
        holders = self._holders[tier]
        removed = 0
        for h in block_hashes:
            h &= U64_MAX
            entry = mine.get(h)
            if entry is None:
                continue
            if tier != DEVICE:
                del mine[h]
                self._unhold(holders, entry[0], worker)
                removed += 1
                continue
            if entry[2] is not None:
                _unlink(kids, entry[2], h)
            stack = [h]
            while stack:
                b = stack.pop()
                gone = mine.pop(b, None)
                if gone is None:
                    continue
                self._unhold(holders, gone[0], worker)
                removed += 1
                below = kids.pop(b, None)
                if type(below) is set:
                    stack.extend(below)
                elif below is not None:
                    stack.append(below)
        self._size -= removed
        return removed

    def clear_rank(self, worker: WorkerWithDpRank) -> int:
        """Forget every block ``worker`` holds, all tiers (``AllBlocksCleared``, a lost gap, a
        rank leaving); returns how many."""
        maps = self._ranks.pop(worker, None)
        if maps is None:
            return 0
        del self._kids[worker]
        ranks = self._ranks_of_worker[worker.worker_id]
        ranks.discard(worker)
        if not ranks:
            del self._ranks_of_worker[worker.worker_id]
        n = 0
        for tier in TIERS:
            holders = self._holders[tier]
            for key, _, _ in maps[tier].values():
                self._unhold(holders, key, worker)
            n += len(maps[tier])
        self._size -= n
        return n

    def remove_worker(self, worker_id: int) -> int:
        """Forget every rank of ``worker_id``; returns blocks dropped."""
        return sum(self.clear_rank(r) for r in list(self._ranks_of_worker.get(worker_id, ())))

    # -- reads -------------------------------------------------------------------------------------

    def overlaps(self, keys: Sequence[int]) -> dict[WorkerWithDpRank, TierOverlap]:
        """Each rank's cached prefix of a prompt given by its chain keys (ranks with nothing
        omitted): consecutive device blocks from block 0, then the host and disk extensions."""
        out: dict[WorkerWithDpRank, TierOverlap] = {}
        if not keys:
            return out
        device = self._device_prefix(keys)
        host_holders, disk_holders = self._holders[HOST_PINNED], self._holders[DISK]
        if not host_holders and not disk_holders:
            return {w: TierOverlap(d) for w, d in device.items()}
        n = len(keys)
        host = [host_holders.get(k & U64_MAX) for k in keys] if host_holders else [None] * n
        disk = [disk_holders.get(k & U64_MAX) for k in keys] if disk_holders else [None] * n
        self.lookup_probes += 2 * n
        lower: set[WorkerWithDpRank] = set()
        for col in (host, disk):
            for held in col:
                if held is not None:
                    lower.update(_members(held))
        for w, d in device.items():
            if w not in lower:
                out[w] = TierOverlap(d)
        for w in lower:
            d = device.get(w, 0)
            i = d
            while i < n and (held := host[i]) is not None and _holds(held, w):
                i += 1
            h = i - d
            while i < n and (held := disk[i]) is not None and _holds(held, w):
                i += 1
            self.lookup_probes += i - d
            if i:
                out[w] = TierOverlap(d, h, i - d - h)
        return out

    def _device_prefix(self, keys: Sequence[int]) -> dict[WorkerWithDpRank, int]:
        """Consecutive device blocks from block 0, per rank: the ranks holding block 0 are
        active; at each deeper block the active ranks it lacks score the depth reached so far
        and drop out. (The reference's tree gives the same: a rank whose middle block was removed
        stops there even though it still holds deeper blocks, and another rank holding those
        deeper blocks is not credited with it.) The active set is compared with a block's holders
        by one C-level subset test per depth; ranks are visited only where some drop out."""
        holders = self._holders[DEVICE]
        result: dict[WorkerWithDpRank, int] = {}
        first = holders.get(keys[0] & U64_MAX)
        if first is None:
            self.lookup_probes += 1
            return result
        active = _members(first)
        probes = 1
        depth = 1
        for depth in range(1, len(keys)):
            held = holders.get(keys[depth] & U64_MAX)
            probes += 1
            if held is None:
                break
            ranks = _members(held)
            if not active <= ranks:
                probes += len(active)
                kept = active & ranks
                for w in active - kept:
                    result[w] = depth
                active = kept
                if not kept:
                    break
        else:
            depth = len(keys)
        for w in active:
            result[w] = depth
        self.lookup_probes += probes + len(active)
        return result

    def blocks(self) -> Iterator[IndexedBlock]:
        """Every indexed block, per rank and tier, in store order."""
        for worker, maps in self._ranks.items():
            for tier in TIERS:
                for h, (_, local, parent) in maps[tier].items():
                    yield IndexedBlock(worker, tier, h, parent, local)

    def ranks(self) -> list[WorkerWithDpRank]:
        return list(self._ranks)

    def rank_size(self, worker: WorkerWithDpRank) -> int:
        maps = self._ranks.get(worker)
        return 0 if maps is None else sum(len(m) for m in maps)

    def __len__(self) -> int:
        """Indexed (rank, tier, block) entries."""
        return self._size

    # -- dump and load (an index handed from one instance to another) ------------------------------

    def rank_entries(self, worker: WorkerWithDpRank) -> list[tuple[int, int, int | None, int]]:
        """Every block of ``worker`` as ``(tier, engine hash, parent engine hash or None, local
        hash)``, per tier in store order: what ``load_rank`` takes back."""
        maps = self._ranks.get(worker)
        if maps is None:
            return []
        return [(t, h, p, local) for t in TIERS for h, (_, local, p) in maps[t].items()]

    def load_rank(
        self, worker: WorkerWithDpRank, entries: Sequence[tuple[int, int, int | None, int]]
    ) -> int:
        """Store ``entries`` (as ``rank_entries`` gives them, in any order: a block waits for
        its parent) on ``worker``; returns how many could not be stored (a device block whose
        parent never came, or a store ``store`` refuses). Host and disk blocks whose parent never
        came are kept under an orphan key, as ``store`` keeps them. Consecutive entries of one
        chain are stored as one run."""
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
            if parent is not None and not self._holds_parent(worker, tier, parent & U64_MAX):
                waiting.setdefault(parent & U64_MAX, []).append(run)
                continue
            if not self.store(worker, tier, parent, blocks):
                refused += self._store_singly(worker, tier, parent, blocks)
            if waiting:
                for h, _ in blocks:
                    runs.extend(reversed(waiting.pop(h & U64_MAX, ())))
        for left in waiting.values():
            for tier, parent, blocks in left:
                if tier == DEVICE:
                    refused += len(blocks)
                elif not self.store(worker, tier, parent, blocks):
                    refused += self._store_singly(worker, tier, parent, blocks)
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

    def _holds_parent(self, worker: WorkerWithDpRank, tier: int, parent: int) -> bool:
        maps = self._ranks.get(worker)
        if maps is None:
            return False
        if tier == DEVICE:
            return parent in maps[DEVICE]
        return any(parent in m for m in maps)
