"""What the reference decides about an event from the events before it on the same socket: KV
cache groups and cache salts (Dynamo 1.6.1 ``ZmqEventNormalizer``, one per listener).

Why per listener: an engine names its KV cache groups (``group_idx`` with
``kv_cache_spec_kind``) once, in a store, and later events of the group may carry the index
alone; and a salted request's first store carries the salt while the blocks stored under it
later do not. So the reference remembers, per listener:

* per ``(dp rank, group_idx)`` the kind a store named (a kindless store or removal of a group
  then follows that kind: main attention kept, any other skipped; a group never named is kept
  only when it is group 0). An event naming a kind is kept when the kind is full, MLA or
  sink-full attention, else skipped.
* per ``(dp rank, engine hash)`` the cache namespace of each salted block held: a store without
  a salt under a salted parent takes the parent's salt; a hash stored once with one salt and
  once with another (or without) becomes ambiguous, and a store without a salt under an
  ambiguous parent is skipped. A removal forgets the hashes (not the ambiguous ones); a clear
  forgets the rank's.

Disk and external events (``STORAGE``, ``EXTERNAL``, ...) pass untouched: they neither teach nor
obey either rule. Skipped events change nothing here. Pure; the selection service keeps one per
subscribed socket.
"""

from __future__ import annotations

from dataclasses import replace

from kv_slot_tracker.core.selection.kv_blocks import DISK, EXTERNAL

from .records import AllCleared, BlocksStored, KvEvent

MAIN_ATTENTION = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
_AMBIGUOUS = ""  # a namespace is never empty (an empty salt is no salt)


class EventNormalizer:
    """One listener's memory of KV cache groups and cache salts."""

    __slots__ = ("_groups", "_salts")

    def __init__(self) -> None:
        self._groups: dict[tuple[int, int], str] = {}
        self._salts: dict[tuple[int, int], str] = {}

    def __len__(self) -> int:
        """Entries remembered (groups and salted blocks)."""
        return len(self._groups) + len(self._salts)

    def normalize(self, ev: KvEvent, rank: int) -> KvEvent | None:
        """``ev`` as the index should apply it on ``rank`` (a store may gain its parent's
        salt), or ``None`` when the reference skips it."""
        if isinstance(ev, AllCleared):
            if self._salts:
                self._salts = {k: v for k, v in self._salts.items() if k[0] != rank}
            return ev
        if ev.tier in (DISK, EXTERNAL):
            return ev
        if isinstance(ev, BlocksStored):
            if ev.group_idx is None and ev.kind is None and ev.cache_salt is None:
                if not self._salts:
                    return ev  # the common case: nothing to learn, check or inherit
                return self._salted(ev, rank)
            if ev.group_idx is not None and ev.kind is not None:
                self._groups[rank, ev.group_idx] = ev.kind
            return self._salted(ev, rank) if self._main(ev.group_idx, ev.kind, rank) else None
        if not self._main(ev.group_idx, ev.kind, rank):
            return None
        salts = self._salts
        if salts:
            for h in ev.block_hashes:
                if salts.get((rank, h)) not in (None, _AMBIGUOUS):
                    del salts[rank, h]
        return ev

    def _main(self, group_idx: int | None, kind: str | None, rank: int) -> bool:
        if kind is not None:
            return kind in MAIN_ATTENTION
        if group_idx is None:
            return True
        learned = self._groups.get((rank, group_idx))
        if learned is not None:
            return learned in MAIN_ATTENTION
        return group_idx == 0

    def _salted(self, ev: BlocksStored, rank: int) -> BlocksStored | None:
        salts = self._salts
        salt = ev.cache_salt
        if salt is None and ev.parent_hash is not None and salts:
            inherited = salts.get((rank, ev.parent_hash))
            if inherited == _AMBIGUOUS:
                return None
            if inherited is not None:
                salt = inherited
                ev = replace(ev, cache_salt=salt)
        if salt is not None:
            for h in ev.block_hashes:
                held = salts.get((rank, h))
                if held is None:
                    salts[rank, h] = salt
                elif held != salt:
                    salts[rank, h] = _AMBIGUOUS
        elif salts:
            for h in ev.block_hashes:
                if (rank, h) in salts:
                    salts[rank, h] = _AMBIGUOUS
        return ev
