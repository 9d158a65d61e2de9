"""The seeds' prompt-membership deltas of one rank (``PromptMembershipDelta``), for the ports of
their ``ActiveSequences`` tests. The service has no use for them, so the core does not build
them: these helpers derive them from the rank's requests around each call.

A hash is present on a rank while a prompt or output block of an active request holds it. An
add *stores* its prompt from the first position whose hash was not present (with the hash before
it as parent); a free *removes* the prompt from the first position whose hash stopped being
present (the last occurrence in the prompt of a hash that went) to its end. An expiry frees its
requests one after the other, in the order they were added.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kv_slot_tracker.core.sequences import ActiveSequences
from kv_slot_tracker.core.types import SequenceHash

Held = dict[str, tuple[list[int], tuple[int, ...]]]  # request id -> (prompt, output blocks)


@dataclass(slots=True)
class PromptMembershipStore:
    parent: SequenceHash | None
    hashes: list[SequenceHash]


@dataclass(slots=True)
class PromptMembershipRemove:
    hashes: list[SequenceHash]


@dataclass(slots=True)
class PromptMembershipDelta:
    """Which prompt hashes became present (stores) or absent (removes) on one worker."""

    stores: list[PromptMembershipStore] = field(default_factory=list)
    removes: list[PromptMembershipRemove] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.stores and not self.removes


@dataclass(slots=True)
class SeedOutcome:
    """The seeds' ``SequenceMutationOutcome``: the core's, with the membership delta."""

    membership_delta: PromptMembershipDelta = field(default_factory=PromptMembershipDelta)
    expired_request_ids: set[str] = field(default_factory=set)
    expired_prompts: dict[str, list[SequenceHash]] = field(default_factory=dict)


def _held(slot: ActiveSequences) -> Held:
    return {rid: (list(st.prompt_blocks), st.output_blocks) for rid, st in slot.requests.items()}


def _present(held: Held, extra: Iterable[int] = ()) -> set[int]:
    out = set(extra)
    for prompt, outputs in held.values():
        out.update(prompt)
        out.update(outputs)
    return out


def _remove(prompt: list[int], present: set[int]) -> list[PromptMembershipRemove]:
    last = {h: i for i, h in enumerate(prompt)}
    start = min((i for h, i in last.items() if h not in present), default=-1)
    return [PromptMembershipRemove(prompt[start:])] if start >= 0 else []


def _expire(held: Held, expired: Iterable[str], delta: PromptMembershipDelta) -> None:
    """Take the expired requests out of ``held`` one by one, recording their removes."""
    for rid in expired:
        prompt, outputs = held.pop(rid)
        # the freed request's own outputs are released after its prompt's removes are read
        delta.removes.extend(_remove(prompt, _present(held, outputs)))


def add(
    slot: ActiveSequences, request_id: str, token_sequence: list[int] | None, *rest: Any
) -> SeedOutcome:
    """``add_request_with_prefill_tracking`` (same arguments) with the seeds' outcome."""
    duplicate = request_id in slot.requests
    held = _held(slot)
    out = slot.add_request_with_prefill_tracking(request_id, token_sequence, *rest)
    seed = SeedOutcome(
        expired_request_ids=out.expired_request_ids, expired_prompts=out.expired_prompts
    )
    if duplicate:
        return seed
    _expire(held, out.expired_prompts, seed.membership_delta)
    present = _present(held)
    prompt = list(token_sequence) if token_sequence else []
    first_new = next((i for i, h in enumerate(prompt) if h not in present), -1)
    if first_new >= 0:
        parent = prompt[first_new - 1] if first_new > 0 else None
        seed.membership_delta.stores.append(PromptMembershipStore(parent, prompt[first_new:]))
    return seed


def free(slot: ActiveSequences, request_id: str, decay_now: int) -> PromptMembershipDelta:
    """``release`` with the seeds' delta."""
    delta = PromptMembershipDelta()
    held = _held(slot)
    slot.release(request_id, decay_now)
    if request_id in held:
        _expire(held, [request_id], delta)
    return delta


def force_expiry(slot: ActiveSequences) -> SeedOutcome:
    """``force_expiry`` with the seeds' outcome."""
    held = _held(slot)
    out = slot.force_expiry()
    seed = SeedOutcome(
        expired_request_ids=out.expired_request_ids, expired_prompts=out.expired_prompts
    )
    _expire(held, out.expired_prompts, seed.membership_delta)
    return seed


# -- reads of one rank that the service does not make ------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerLoadSnapshot:
    active_blocks: int
    active_requests: int


def num_requests(slot: ActiveSequences) -> int:
    return len(slot.requests)


def worker_load_snapshot(slot: ActiveSequences) -> WorkerLoadSnapshot:
    return WorkerLoadSnapshot(slot.blocks.active_blocks(), len(slot.requests))


def active_block_hashes(slot: ActiveSequences) -> set[int]:
    """The hashes an active request's prompt or output block holds."""
    return slot.blocks.active_hashes()


def active_prompt_hashes(slot: ActiveSequences) -> set[int]:
    return {h for st in slot.requests.values() for h in st.prompt_blocks}
