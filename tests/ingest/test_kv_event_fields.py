"""Every KV-event field as the reference (Dynamo 1.6.1 ``select_service``, KV events on) reads
it, end to end: msgpack payloads shaped as the engines' msgspec structs encode them (vLLM 0.33
``vllm/distributed/kv_events.py`` and SGLang 0.5.23 ``sglang/srt/disaggregation/kv_events.py``:
the batch a positional array, each event a map with ``type`` and no field left at its default;
the older positional event form where noted) go through the real decode and the selection
service, and the answers are read from ``/selection/overlap_scores`` and ``/selection/dump``
through the ASGI app. Every expected number was first read from the reference fed the same
events (``bench/kv_conformance.py`` checks the same rules at random).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import pytest

from kv_slot_tracker.ingest.records import decode_batch
from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings
from tests.fakes import FakeClock

SEL = "/selection"
BS = 4
TOKENS = list(range(1, 17))  # four blocks
# the reference's /dump tokens_hash of TOKENS' blocks, plain and with cache salt "s1"
PLAIN = [14643705804678351452, 16777012769546811212, 483935686894639516, 135165725823939817]
SALTED = [3402648387515217860, 5797218295650403483, 16864446200706943492]
U32_MAX = 2**32 - 1


def vllm_stored(hashes: list[int], tokens: list, parent: int | None = None, *,
                medium: str | None = "GPU", lora_name: str | None = None,
                **optional: Any) -> dict[str, Any]:  # fmt: skip
    """vLLM's ``BlockStored`` as msgspec encodes it: the fields without defaults always, in
    order, then the optional ones given (``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``,
    ``kv_cache_spec_sliding_window``, ``locality``, ``ownership``, ``session_id``)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": medium,
            "lora_name": lora_name, **optional}  # fmt: skip


def vllm_removed(hashes: list[int], medium: str | None = "GPU", **optional: Any) -> dict:
    """vLLM's ``BlockRemoved`` (optional: ``group_idx``, ``locality``, ``ownership``)."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **optional}


def sglang_stored(hashes: list[int], tokens: list, parent: int | None = None, *,
                  medium: str | None = None, cache_salt: str | None = None) -> dict[str, Any]:  # fmt: skip
    """SGLang's ``BlockStored``: ``medium`` and ``cache_salt`` default to None (omitted)."""
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes,
                          "parent_block_hash": parent, "token_ids": tokens, "block_size": BS,
                          "lora_id": None}  # fmt: skip
    if medium is not None:
        ev["medium"] = medium
    if cache_salt is not None:
        ev["cache_salt"] = cache_salt
    return ev


CLEARED = {"type": "AllBlocksCleared"}


class Engine:
    """The app, and the engines' sockets as the ingest hands their batches to the service."""

    def __init__(self, app: Any, client: httpx.AsyncClient) -> None:
        self.app, self.client = app, client
        self.seq = itertools.count()

    def publish(self, worker: int, events: list, rank: int | None = 0, socket: int = 0) -> None:
        payload = msgpack.packb([1.5, events, rank])
        batch = decode_batch(next(self.seq), payload)
        self.app.state.selection.kv_events.apply_kv_batch(worker, socket, batch)

    async def overlap(self, tokens: list[int] = TOKENS, **extra: Any) -> list[tuple[int, ...]]:
        r = await self.client.post(SEL + "/overlap_scores", json={"token_ids": tokens, **extra})
        assert r.status_code == 200, r.text
        return [
            (w["worker_id"], w["dp_rank"], w["device_blocks"], w["host_pinned_blocks"],
             w["disk_blocks"])
            for w in r.json()["workers"]
        ]  # fmt: skip

    async def dump(self) -> list[dict[str, Any]]:
        r = await self.client.get(SEL + "/dump")
        assert r.status_code == 200
        return r.json().get("default:default", {"events": []})["events"]

    async def chains(self) -> list[tuple[int, int, str, int | None, list[int], list[int]]]:
        """``/dump`` as (worker, rank, tier, parent, block hashes, tokens hashes), sorted."""
        out = []
        for e in await self.dump():
            st = e["event"]["data"]["stored"]
            out.append((e["worker_id"], e["event"]["dp_rank"], e["storage_tier"],
                        st["parent_hash"], [b["block_hash"] for b in st["blocks"]],
                        [b["tokens_hash"] for b in st["blocks"]]))  # fmt: skip
        return sorted(out, key=repr)


@contextlib.asynccontextmanager
async def engine(workers: tuple[tuple[int, int], ...] = ((1, 1),)) -> AsyncIterator[Engine]:
    """The service with KV events on and ``(worker_id, dp_size)`` workers registered."""
    app = create_app(load_settings(redis_url="", router_use_kv_events=True), clock=FakeClock().now)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for wid, size in workers:
                r = await client.post(SEL + "/workers", json={
                    "worker_id": wid, "endpoint": f"http://w{wid}", "block_size": BS,
                    "data_parallel_size": size,
                    "kv_events_endpoints": {str(r): "tcp://127.0.0.1:9" for r in range(size)},
                })  # fmt: skip
                assert r.json()["lifecycle"] == "schedulable", r.text
            yield Engine(app, client)


# -- the batch ---------------------------------------------------------------------------------


async def test_a_negative_data_parallel_rank_is_its_u32() -> None:
    # the reference casts the batch's i32 rank to u32: -1 is rank 4294967295 (indexed, listed
    # by /overlap_scores though the worker did not declare it)
    async with engine() as e:
        e.publish(1, [vllm_stored([11, 12, 13, 14], TOKENS)], rank=-1)
        assert await e.overlap() == [(1, 0, 0, 0, 0), (1, U32_MAX, 4, 4, 4)]
        assert {c[1] for c in await e.chains()} == {U32_MAX}


# -- medium ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("medium", "row", "tier"),
    [
        (None, (4, 4, 4), "device"),
        ("GPU", (4, 4, 4), "device"),
        ("", (4, 4, 4), "device"),  # an empty medium is no medium
        ("CPU", (0, 4, 4), "host_pinned"),
        ("CPU_PINNED", (0, 4, 4), "host_pinned"),  # SGLang's host medium
        ("STORAGE", (0, 0, 4), "disk"),  # vLLM's offloading medium
        ("DISK", (0, 0, 4), "disk"),
        ("EXTERNAL", (0, 0, 4), "external"),  # SGLang's shared pool: its own tier, in disk_blocks
        ("NVME_XYZ", (0, 0, 0), None),  # a medium the reference does not know: skipped
        ("gpu", (0, 0, 0), None),  # names are case-sensitive
    ],
)
async def test_each_medium_is_a_tier_or_skipped(
    medium: str | None, row: tuple[int, int, int], tier: str | None
) -> None:
    async with engine() as e:
        e.publish(1, [vllm_stored([11, 12, 13, 14], TOKENS, medium=medium)])
        assert await e.overlap() == [(1, 0, *row)]
        assert {c[2] for c in await e.chains()} == ({tier} if tier else set())
        e.publish(1, [vllm_removed([11, 12, 13, 14], medium)])  # the same medium removes them
        assert await e.overlap() == [(1, 0, 0, 0, 0)]
        if tier is None:  # and a removal in that medium is skipped too
            e.publish(1, [vllm_stored([11, 12, 13, 14], TOKENS)])
            e.publish(1, [vllm_stored([21], [9] * 4, medium="CPU")])
            e.publish(1, [vllm_removed([11, 21], medium)])
            assert await e.overlap() == [(1, 0, 4, 4, 4)]
            assert len(await e.chains()) == 2


async def test_an_sglang_event_without_medium_is_the_device() -> None:
    async with engine() as e:
        e.publish(1, [sglang_stored([11, 12], TOKENS[:8])])
        assert await e.overlap() == [(1, 0, 2, 2, 2)]


async def test_external_blocks_continue_after_disk_blocks() -> None:
    # reference: DISK [11], EXTERNAL [12] under 11, DISK [13] under 12 -> disk_blocks 2 (the
    # disk walk stops at 12, the external one continues there; the tiers are walked in turn)
    async with engine() as e:
        e.publish(1, [sglang_stored([11], TOKENS[:4], medium="DISK")])
        e.publish(1, [sglang_stored([12], TOKENS[4:8], 11, medium="EXTERNAL")])
        e.publish(1, [sglang_stored([13], TOKENS[8:12], 12, medium="DISK")])
        assert await e.overlap() == [(1, 0, 0, 0, 2)]


# -- locality and ownership --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "kept"),
    [
        ({}, True),
        ({"locality": "LOCAL"}, True),
        ({"locality": "REMOTE"}, False),
        ({"locality": "local"}, False),  # anything but "LOCAL" is not the worker's own
        ({"locality": "ELSEWHERE"}, False),
        ({"ownership": "tier2"}, False),  # any ownership is not the framework's
        ({"ownership": "kvcr"}, False),
        ({"ownership": "primary"}, False),
        ({"ownership": ""}, False),
    ],
)
async def test_locality_and_ownership(fields: dict[str, str], kept: bool) -> None:
    async with engine() as e:
        e.publish(1, [vllm_stored([11, 12, 13, 14], TOKENS, **fields)])
        assert await e.overlap() == [(1, 0, 4 if kept else 0, 4 if kept else 0, 4 if kept else 0)]
        # the same fields on a removal and a clear of blocks stored plainly
        e.publish(1, [vllm_stored([11, 12, 13, 14], TOKENS)])
        e.publish(1, [vllm_removed([13], **fields)])
        assert (await e.overlap())[0][2] == (2 if kept else 4)
        if "ownership" in fields:
            e.publish(1, [{**CLEARED, "ownership": fields["ownership"]}])
            e.publish(1, [["AllBlocksCleared", fields["ownership"]]])
            assert (await e.overlap())[0][2] == 4  # not the framework's clear: nothing cleared


# -- cache salts -------------------------------------------------------------------------------


async def test_an_sglang_cache_salt_changes_the_tokens_hashes() -> None:
    async with engine() as e:
        e.publish(1, [sglang_stored([11, 12], TOKENS[:8], cache_salt="s1")])
        e.publish(1, [sglang_stored([13], TOKENS[8:12], 12)])  # takes its parent's salt
        assert await e.chains() == [(1, 0, "device", None, [11, 12, 13], SALTED)]
        assert await e.overlap(TOKENS[:12]) == [(1, 0, 0, 0, 0)]  # an unsalted prompt
        assert await e.overlap(TOKENS[:12], cache_salt="s1") == [(1, 0, 3, 3, 3)]
        assert await e.overlap(TOKENS[:12], cache_salt="s2") == [(1, 0, 0, 0, 0)]


async def test_an_empty_cache_salt_is_none() -> None:
    async with engine() as e:
        e.publish(1, [sglang_stored([11, 12, 13], TOKENS[:12], cache_salt="")])
        e.publish(1, [sglang_stored([14], TOKENS[12:], 13)])  # no salt to take, none to doubt
        assert await e.chains() == [(1, 0, "device", None, [11, 12, 13, 14], PLAIN)]


async def test_a_vllm_salt_comes_tagged_in_the_first_blocks_extra_keys() -> None:
    tag = "dynamo-cache-salt:s1"
    async with engine() as e:
        e.publish(1, [vllm_stored([11, 12, 13], TOKENS[:12], extra_keys=[[tag], None, None])])
        assert (await e.chains())[0][5] == SALTED
        e.publish(1, [CLEARED])
        untagged = [["tenant-a-with-a-long-name"]]
        e.publish(1, [vllm_stored([11], TOKENS[:4], extra_keys=untagged)])
        assert (await e.chains())[0][5] == PLAIN[:1]
        e.publish(1, [CLEARED])
        # an item equal to the LoRA name comes first; a salt named like it is still read
        lora = [["ad1", "dynamo-cache-salt:ad1"]]
        e.publish(1, [vllm_stored([11], TOKENS[:4], lora_name="ad1", extra_keys=lora)])
        assert await e.overlap(TOKENS[:4], lora_name="ad1", cache_salt="ad1") == [(1, 0, 1, 1, 1)]
        assert await e.overlap(TOKENS[:4], lora_name="ad1") == [(1, 0, 0, 0, 0)]


async def test_a_hash_stored_with_two_salts_is_ambiguous() -> None:
    # reference: 11 salted, then 11 unsalted (two runs for one hash); a store under 11 without a
    # salt cannot tell whose child it is: skipped
    async with engine() as e:
        e.publish(1, [sglang_stored([11], TOKENS[:4], cache_salt="s1")])
        e.publish(1, [sglang_stored([11], TOKENS[:4])])
        e.publish(1, [sglang_stored([12], TOKENS[4:8], 11)])
        assert await e.chains() == [
            (1, 0, "device", None, [11], PLAIN[:1]), (1, 0, "device", None, [11], SALTED[:1]),
        ]  # fmt: skip
        assert await e.overlap(TOKENS[:8]) == [(1, 0, 1, 1, 1)]


async def test_a_hash_stored_under_two_salts_is_ambiguous() -> None:
    async with engine() as e:
        e.publish(1, [sglang_stored([11], TOKENS[:4], cache_salt="s1")])
        e.publish(1, [sglang_stored([11], TOKENS[:4], cache_salt="s2")])
        e.publish(1, [sglang_stored([12], TOKENS[4:8], 11)])  # whose salt? skipped
        assert [c[4] for c in await e.chains()] == [[11], [11]]


@pytest.mark.parametrize("forget", [vllm_removed([11]), CLEARED])
async def test_a_removal_or_clear_forgets_the_salt(forget: dict) -> None:
    async with engine() as e:
        e.publish(1, [sglang_stored([11], TOKENS[:4], cache_salt="s1"), forget])
        e.publish(1, [sglang_stored([11], TOKENS[:4])])  # 11 is unsalted now, not ambiguous
        e.publish(1, [sglang_stored([12], TOKENS[4:8], 11)])
        assert await e.chains() == [(1, 0, "device", None, [11, 12], PLAIN[:2])]


async def test_disk_blocks_neither_record_nor_inherit_salts() -> None:
    async with engine() as e:
        e.publish(1, [sglang_stored([11], TOKENS[:4], medium="DISK", cache_salt="s1")])
        e.publish(1, [sglang_stored([12], TOKENS[4:8], 11, medium="DISK")])
        assert await e.chains() == [
            (1, 0, "disk", 11, [12], PLAIN[1:2]), (1, 0, "disk", None, [11], SALTED[:1]),
        ]  # fmt: skip


# -- KV cache groups ---------------------------------------------------------------------------


async def test_kv_cache_groups_are_learned_from_stores() -> None:
    full = {"group_idx": 1, "kv_cache_spec_kind": "full_attention"}
    window = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window"}
    async with engine() as e:
        # group 1 named full attention: a later removal naming only group 1 applies
        e.publish(1, [vllm_stored([11, 12, 13, 14], TOKENS, **full)])
        e.publish(1, [vllm_removed([14], group_idx=1)])
        assert await e.overlap() == [(1, 0, 3, 3, 3)]
        # group 0 named sliding window (that store itself skipped): group-0 removals skipped
        e.publish(1, [vllm_stored([21], TOKENS[:4], **window)])
        e.publish(1, [vllm_removed([13], group_idx=0)])
        assert await e.overlap() == [(1, 0, 3, 3, 3)]
    async with engine() as e:
        e.publish(1, [vllm_stored([11, 12], TOKENS[:8], group_idx=1)])  # never named: skipped
        e.publish(1, [vllm_stored([11], TOKENS[:4], kv_cache_spec_kind="mamba")])
        assert await e.overlap() == [(1, 0, 0, 0, 0)]
        e.publish(1, [vllm_stored([11], TOKENS[:4], group_idx=0)])  # group 0 needs no name
        assert await e.overlap() == [(1, 0, 1, 1, 1)]


async def test_disk_and_external_events_ignore_kv_cache_groups() -> None:
    window = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
    async with engine() as e:
        e.publish(1, [vllm_stored([11, 12, 13], TOKENS[:12], medium="STORAGE", **window)])
        e.publish(1, [vllm_stored([11, 12, 13], TOKENS[:12], medium="CPU", **window)])
        assert await e.overlap() == [(1, 0, 0, 0, 3)]
        # and teach nothing: a device store of group 1 is still unnamed
        e.publish(1, [vllm_stored([11], TOKENS[:4], group_idx=1)])
        assert (await e.overlap())[0][2] == 0


# -- tokens ------------------------------------------------------------------------------------


async def test_eagle_bigrams_hash_each_block_with_the_next_token() -> None:
    tokens = list(range(1, 14))
    bigrams = [[tokens[i], tokens[i + 1]] for i in range(12)]
    async with engine() as e:
        e.publish(1, [vllm_stored([11, 12, 13], bigrams)])
        assert (await e.chains())[0][5] == [
            1914873892905420881, 1929047464662796003, 8175084615354468756,
        ]  # fmt: skip
        assert await e.overlap(tokens) == [(1, 0, 0, 0, 0)]


# -- the lower tiers ---------------------------------------------------------------------------


async def test_a_second_rank_storing_the_same_tokens_under_other_hashes_is_not_indexed() -> None:
    async with engine(((1, 1), (2, 1))) as e:
        e.publish(1, [vllm_stored([11, 12, 13], TOKENS[:12], medium="CPU")])
        e.publish(2, [vllm_stored([21, 22, 23], TOKENS[:12], medium="CPU")])
        assert await e.overlap(TOKENS[:12]) == [(1, 0, 0, 3, 3), (2, 0, 0, 0, 0)]
        assert {c[0] for c in await e.chains()} == {1}
        # under the same hashes the edges are shared, as far as they agree
        e.publish(2, [vllm_stored([11, 12, 23], TOKENS[:12], medium="CPU")])
        assert await e.overlap(TOKENS[:12]) == [(1, 0, 0, 3, 3), (2, 0, 0, 2, 2)]


async def test_host_blocks_continue_from_the_device_blocks_engine_hash() -> None:
    # host blocks stored under a parent held nowhere are reached once the device holds it
    async with engine() as e:
        e.publish(1, [vllm_stored([12, 13], TOKENS[4:12], 11, medium="CPU")])
        assert await e.overlap(TOKENS[:12]) == [(1, 0, 0, 0, 0)]
        e.publish(1, [vllm_stored([11], TOKENS[:4])])
        assert await e.overlap(TOKENS[:12]) == [(1, 0, 1, 3, 3)]


async def test_a_device_store_under_another_ranks_hashes_stops_at_the_first_run() -> None:
    # rank 2 stores rank 1's tokens under its own hashes: it joins rank 1's first run (matched
    # by tokens) but not the run below it (its last hash is not that run's tail: a stale parent)
    async with engine(((1, 1), (2, 1))) as e:
        e.publish(1, [vllm_stored([11, 12, 13, 14], TOKENS)])
        e.publish(1, [vllm_stored([31], [7, 7, 7, 7], 11)])  # splits the run after block 0
        e.publish(2, [vllm_stored([21, 22, 23], TOKENS[:12])])
        assert await e.overlap() == [(1, 0, 4, 4, 4), (2, 0, 1, 1, 1)]
        e.publish(2, [vllm_removed([21]), CLEARED])  # its hash is in no run; the clear finds it
        assert await e.overlap() == [(1, 0, 4, 4, 4), (2, 0, 0, 0, 0)]
        assert {c[0] for c in await e.chains()} == {1}


# -- /dump -------------------------------------------------------------------------------------


async def test_dump_lists_one_stored_event_per_rank_and_chain() -> None:
    async with engine(((1, 1), (2, 1))) as e:
        e.publish(1, [vllm_stored([1, 2, 3, 4, 5, 6, 7, 8], TOKENS + TOKENS)])
        e.publish(2, [vllm_stored([1, 2, 3, 4, 5], TOKENS + TOKENS[:4])])
        e.publish(1, [vllm_stored([20, 21], [7] * 8, 3)])
        e.publish(2, [vllm_stored([9], [5] * 4, 5, medium="CPU")])
        events = await e.dump()
        # device: the run [1, 2, 3] for both ranks, below it [4..8] (rank 2 holds [4, 5]) and
        # the branch [20, 21]: five events for 15 blocks; then one host block
        assert [(ev["storage_tier"], ev["event"]["event_id"]) for ev in events] == [
            ("device", 0), ("device", 1), ("device", 2), ("device", 3), ("device", 4),
            ("host_pinned", 0),
        ]  # fmt: skip
        assert sum(len(ev["event"]["data"]["stored"]["blocks"]) for ev in events) == 16
        assert [(c[0], c[2], c[3], c[4]) for c in await e.chains()] == [
            (1, "device", 3, [20, 21]), (1, "device", 3, [4, 5, 6, 7, 8]),
            (1, "device", None, [1, 2, 3]), (2, "device", 3, [4, 5]),
            (2, "device", None, [1, 2, 3]), (2, "host_pinned", 5, [9]),
        ]  # fmt: skip


# -- the older positional form -----------------------------------------------------------------


async def test_positional_events_read_trailing_fields_by_layout() -> None:
    async with engine() as e:
        # group, kind, window, locality, ownership: a fixed layout (four or more that fit it)
        e.publish(1, [["BlockStored", [11], None, TOKENS[:4], BS, None, "GPU", None, None,
                       None, None, None, "REMOTE"]])  # fmt: skip
        assert (await e.overlap())[0][2] == 0
        e.publish(1, [["BlockStored", [11], None, TOKENS[:4], BS, None, "GPU", None, None,
                       0, "full_attention", 7, 8]])  # fmt: skip
        assert (await e.overlap())[0][2] == 1  # 8 is no locality: read loosely, kept
        # vLLM's BlockRemoved order (group, locality, ownership) is not that layout: its text
        # is read as a KV cache kind, which no main-attention kind is: skipped
        e.publish(1, [["BlockRemoved", [11], "GPU", 0, "LOCAL", None]])
        assert (await e.overlap())[0][2] == 1
        e.publish(1, [["BlockRemoved", [11], "GPU", 0]])
        assert (await e.overlap())[0][2] == 0
