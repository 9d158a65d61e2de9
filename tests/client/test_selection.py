"""The client's selection API (``client.selection``) against a live instance.

The scenario is SELECTION.md §4 S9 (block size 4): worker 2 books blocks [1..5] with 20 prefill
tokens, so the prompt [1, 2, 3, 9] (isl 16) costs 12 there and 8 on the empty worker 1, which
wins; once worker 2's prefill is done it costs 7 there and worker 2 wins. The same scenario runs
through the blocking and the async client (both over the network, each with its own model and
reservation ids); the coroutine ``scenario`` awaits the async client's results and takes the
blocking client's as they are.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from kv_slot_tracker_client import (
    AsyncSelectionClient,
    AsyncSlotTrackerClient,
    BadRequest,
    Conflict,
    NotFound,
    Overlap,
    PartitionLoads,
    RankLoad,
    ReservationResponse,
    SelectAndReserveResponse,
    SelectionClient,
    SelectionReady,
    SelectResponse,
    ServerError,
    SlotTrackerClient,
    Unavailable,
)

from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings
from tests.servers import live_server

P5 = [1, 2, 3, 4, 5]  # block and sequence hashes of worker 2's booking (isl 20)
QUERY = [1, 2, 3, 9]  # shares 3 leading blocks with P5 (isl 16)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory.mktemp("selection")) as url:
        yield url


@pytest.fixture
def client(server: str) -> Iterator[SlotTrackerClient]:
    with SlotTrackerClient(server) as c:
        yield c


@pytest.fixture
async def aclient(server: str) -> AsyncIterator[AsyncSlotTrackerClient]:
    async with AsyncSlotTrackerClient(server) as c:
        yield c


@pytest.fixture
def model() -> str:
    return f"m-{uuid.uuid4().hex[:12]}"


async def ev(result: Any) -> Any:
    """The result of a call of either client: awaited for the async one."""
    return await result if inspect.isawaitable(result) else result


def ranks(loads: list[RankLoad]) -> list[tuple[int, int, int, int, int]]:
    rows = [
        (r.worker_id, r.dp_rank, r.potential_prefill_tokens, r.potential_decode_blocks)
        + (r.active_requests,)
        for r in loads
    ]
    return sorted(rows)


async def scenario(sel: SelectionClient | AsyncSelectionClient, model: str) -> None:
    sid = f"r-{uuid.uuid4().hex[:8]}/1"  # a '/' in an id travels percent-encoded
    # register: worker 1 complete, worker 2 incomplete until its block size is patched in
    w1 = await ev(sel.upsert_worker(1, model, endpoint="http://w1:8000", block_size=4))
    assert (w1.worker_id, w1.model_name, w1.routing_group) == (1, model, "default")
    assert (w1.lifecycle, w1.endpoint, w1.block_size, w1.not_schedulable_reasons) == (
        "schedulable",
        "http://w1:8000",
        4,
        None,
    )
    assert w1.data_parallel_size is None and w1.model_extra["taints"] == []
    w2 = await ev(sel.upsert_worker(2, model, endpoint="http://w2:8000", total_kv_blocks=100))
    assert w2.lifecycle == "incomplete"
    assert w2.not_schedulable_reasons == ["block_size must be greater than 0"]
    w2 = await ev(sel.patch_worker(2, block_size=4))
    assert (w2.lifecycle, w2.block_size, w2.model_extra["total_kv_blocks"]) == (
        "schedulable",
        4,
        100,
    )
    assert [w.worker_id for w in await ev(sel.workers(model))] == [1, 2]
    assert await ev(sel.ready()) is True

    # select on empty ranks, pinned to worker 2: books nothing
    picked = await ev(
        sel.select(model, block_hashes=P5, sequence_hashes=P5, isl_tokens=20, pinned_worker=(2, 0))
    )
    assert picked == SelectResponse(
        model_name=model,
        routing_group="default",
        worker_id=2,
        dp_rank=0,
        endpoint="http://w2:8000",
        block_size=4,
        overlap=Overlap(longest_matched=0, gpu=0, dp={"0": 0}, cpu=0, disk=0),
        effective_prefill_tokens=20,
        potential_decode_blocks=5,
    )

    # select_and_reserve on worker 2: P=20, D=5, A=1, cache [1..5]
    booked = await ev(
        sel.select_and_reserve(
            model,
            block_hashes=P5,
            sequence_hashes=P5,
            isl_tokens=20,
            selection_id=sid,
            allowed_worker_ids=[2],
        )
    )
    assert booked == SelectAndReserveResponse(
        **picked.model_dump(exclude={"selection_id"}),
        selection_id=sid,
        sequence_hashes=P5,
        isl_tokens=20,
        track_prefill_tokens=True,
    )
    # S9: worker 2 costs (20+16)/4 - 3 + (5+1) = 12, worker 1 costs 4 + 4 = 8
    query = {"block_hashes": QUERY, "sequence_hashes": QUERY, "isl_tokens": 16}
    choice = await ev(sel.select(model, **query))
    assert (choice.worker_id, choice.effective_prefill_tokens, choice.overlap.gpu) == (1, 16, 0)
    assert choice.potential_decode_blocks == 4
    potential = await ev(sel.potential_loads(model, **query))
    assert ranks(potential) == [(1, 0, 16, 4, 0), (2, 0, 24, 6, 1)]
    scores = await ev(sel.overlap_scores(model, **query))
    assert (scores.block_size, scores.num_blocks) == (4, 4)
    devices = sorted((w.worker_id, w.device_blocks, w.host_pinned_blocks) for w in scores.workers)
    assert devices == [(1, 0, 0), (2, 3, 3)]
    assert not scores.shared_cache.enabled

    # prefill done: worker 2 costs 16/4 - 3 + 6 = 7 < 8 and wins
    assert await ev(sel.prefill_complete(sid)) is None
    choice = await ev(sel.select(model, **query))
    assert (choice.worker_id, choice.effective_prefill_tokens) == (2, 4)
    assert choice.overlap == Overlap(longest_matched=12, gpu=12, dp={"0": 12}, cpu=12, disk=12)
    assert choice.potential_decode_blocks == 6

    # output blocks: 5 + 1 = 6; with decay 0.5, 7 blocks weigh 3.5, rounded to 4
    await ev(sel.output_block(sid))
    (part,) = await ev(sel.loads(model))
    assert ranks(part.loads) == [(1, 0, 0, 0, 0), (2, 0, 0, 6, 1)]
    await ev(sel.output_block(sid, decay_fraction=0.5))
    (part,) = await ev(sel.loads(model, "default"))
    assert ranks(part.loads) == [(1, 0, 0, 0, 0), (2, 0, 0, 4, 1)]

    # delete the reservation: the load is gone, a second delete is NotFound
    assert await ev(sel.free(sid)) is None
    loads = await ev(sel.loads(model))
    assert loads == [
        PartitionLoads(
            model_name=model,
            routing_group="default",
            loads=loads[0].loads,
            pending_count=0,
            pending_isl_tokens=0,
        )
    ]
    assert ranks(loads[0].loads) == [(1, 0, 0, 0, 0), (2, 0, 0, 0, 0)]
    with pytest.raises(NotFound) as err:
        await ev(sel.free(sid))
    assert err.value.message == f"reservation {sid} not found"
    assert err.value.path == f"/selection/reservations/{sid}"  # decoded

    # the approximate cache keeps the booked chain on worker 2
    dump = (await ev(sel.dump()))[f"{model}:default"]
    assert dump.block_size == 4
    assert [e["worker_id"] for e in dump.events] == [2]
    stored = dump.events[0]["event"]["data"]["stored"]["blocks"]
    assert [b["tokens_hash"] for b in stored] == P5


def test_scenario_sync(client: SlotTrackerClient, model: str) -> None:
    asyncio.run(scenario(client.selection, model))


async def test_scenario_async(aclient: AsyncSlotTrackerClient, model: str) -> None:
    await scenario(aclient.selection, model)


def test_pending_and_explicit_reservations(client: SlotTrackerClient, model: str) -> None:
    sel = client.selection
    sel.upsert_worker(7, model, endpoint="http://w7", block_size=4, data_parallel_size=2)
    pending, explicit = f"p-{uuid.uuid4().hex[:8]}", f"e-{uuid.uuid4().hex[:8]}"
    # select with an id keeps the pick; reserve_pending books exactly it, once
    picked = sel.select(model, token_ids=range(8), selection_id=pending, pinned_worker=(7, 1))
    assert (picked.selection_id, picked.worker_id, picked.dp_rank) == (pending, 7, 1)
    (part,) = sel.loads(model)
    assert ranks(part.loads) == [(7, 0, 0, 0, 0), (7, 1, 0, 0, 0)]  # nothing booked yet
    booked = sel.reserve_pending(pending, model)
    assert booked == ReservationResponse(
        selection_id=pending,
        model_name=model,
        routing_group="default",
        worker_id=7,
        dp_rank=1,
        endpoint="http://w7",
    )
    (part,) = sel.loads(model)
    assert ranks(part.loads) == [(7, 0, 0, 0, 0), (7, 1, 8, 2, 1)]
    with pytest.raises(NotFound) as missing:  # single use
        sel.reserve_pending(pending, model)
    assert missing.value.message == (
        f"no pending selection {pending} for model={model} routing_group=default "
        "(expired, already used, or never selected)"
    )
    # a select may reuse a booked id, but booking it again conflicts
    sel.select(model, token_ids=range(8), selection_id=pending)
    with pytest.raises(Conflict) as conflict:
        sel.reserve_pending(pending, model)
    assert conflict.value.message == f"selection {pending} is already reserved or being reserved"
    sel.free(pending)
    # explicit form: prefill tokens only with effective_prefill_tokens; u64 hashes are converted
    big = 2**64 - 1
    booked = sel.reserve(
        explicit, 7, model_name=model, sequence_hashes=[big, 5], isl_tokens=8,
        effective_prefill_tokens=6,
    )  # fmt: skip
    assert (booked.worker_id, booked.dp_rank) == (7, 0)
    (part,) = sel.loads(model)
    assert ranks(part.loads) == [(7, 0, 6, 2, 1), (7, 1, 0, 0, 0)]
    with pytest.raises(BadRequest) as bad:
        sel.reserve(f"x-{explicit}", 7, model_name=model, sequence_hashes=[1], isl_tokens=4,
                    effective_prefill_tokens=5)  # fmt: skip
    assert bad.value.message == "effective_prefill_tokens (5) must not exceed isl_tokens (4)"
    with pytest.raises(NotFound) as rank:
        sel.reserve(f"y-{explicit}", 7, 2, model_name=model, sequence_hashes=[1], isl_tokens=4)
    assert rank.value.message == "Worker WorkerWithDpRank { worker_id: 7, dp_rank: 2 } not found"
    # deleting the worker frees its reservations
    gone = sel.delete_worker(7)
    assert (gone.worker_id, gone.lifecycle) == (7, "unschedulable")
    (part,) = sel.loads(model)
    assert part.loads == []
    with pytest.raises(NotFound) as unknown:
        sel.delete_worker(7)
    assert unknown.value.message == "worker 7 not found"


def test_errors(client: SlotTrackerClient, model: str) -> None:
    sel = client.selection
    # another partition has a schedulable worker: the 503 texts name the partition
    sel.upsert_worker(4, f"{model}-other", endpoint="http://w4", block_size=4)
    with pytest.raises(Unavailable) as unavailable:
        sel.select(model, token_ids=[1, 2, 3, 4])
    assert isinstance(unavailable.value, ServerError)
    assert unavailable.value.status == 503
    assert unavailable.value.message == (
        f"no schedulable workers for model={model} routing_group=default"
    )
    with pytest.raises(Unavailable) as potential:
        sel.potential_loads(model, token_ids=[1, 2, 3, 4])
    assert potential.value.message == unavailable.value.message
    sel.upsert_worker(3, model, endpoint="http://w3", block_size=4)
    with pytest.raises(BadRequest) as missing:
        sel.select(model, sequence_hashes=[1], isl_tokens=4)
    assert missing.value.message == "block_hashes is required without token_ids"
    sid = sel.select_and_reserve(model, token_ids=[1, 2, 3, 4]).selection_id
    assert uuid.UUID(sid).version == 4  # generated by the service
    with pytest.raises(BadRequest) as decay:
        sel.output_block(sid, decay_fraction=1.5)
    assert decay.value.message == "decay_fraction must be between 0.0 and 1.0"
    with pytest.raises(Conflict):
        sel.select_and_reserve(model, token_ids=[1, 2, 3, 4], selection_id=sid)
    with pytest.raises(NotFound) as patch:
        sel.patch_worker(2**64 - 1, endpoint="http://x")
    assert patch.value.message == f"worker {2**64 - 1} not found"
    for lifecycle in (sel.prefill_complete, sel.output_block):
        with pytest.raises(NotFound):
            lifecycle(f"never-{model}")


async def test_readiness_and_bodies_sent() -> None:
    """On a fresh in-process instance: not ready without workers (503 reads as an answer), then
    ready; and the exact bodies the methods send (unset fields are not sent)."""
    app = create_app(load_settings())
    sent: list[tuple[str, str, Any]] = []

    async def record(request: httpx.Request) -> None:
        body = json.loads(request.content) if request.content else None
        sent.append((request.method, request.url.raw_path.decode(), body))

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncSlotTrackerClient("http://t", transport=transport) as c:
            c._http.event_hooks["request"] = [record]
            sel = c.selection
            assert await sel.health() is True
            assert await sel.ready() is False
            assert await sel.readiness() == SelectionReady(
                ready=False, schedulable_workers=0, workers=[]
            )
            with pytest.raises(Unavailable) as unavailable:  # no worker anywhere
                await sel.overlap_scores("m", token_ids=range(4))
            assert unavailable.value.message == "no schedulable workers are available"
            await sel.upsert_worker(5, "m", endpoint="http://w5", block_size=4, taints=["a"])
            ready = await sel.readiness()
            assert (ready.ready, ready.schedulable_workers) == (True, 1)
            assert [w.worker_id for w in ready.workers] == [5]
            await sel.select("m", token_ids=range(4), advisory=True, pinned_worker=(5, 0))
            with pytest.raises(NotFound):
                await sel.output_block("a b")
    assert sent[4:] == [
        (
            "POST",
            "/selection/workers",
            {
                "worker_id": 5,
                "model_name": "m",
                "routing_group": "default",
                "endpoint": "http://w5",
                "block_size": 4,
                "taints": ["a"],
            },
        ),
        ("GET", "/selection/ready", None),
        (
            "POST",
            "/selection/select",
            {
                "model_name": "m",
                "routing_group": "default",
                "token_ids": [0, 1, 2, 3],
                "pinned_worker": {"worker_id": 5, "dp_rank": 0},
                "advisory": True,
            },
        ),
        ("POST", "/selection/reservations/a%20b/output_block", {}),
    ]


def test_sync_and_async_selection_have_the_same_methods() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {n: inspect.signature(f) for n, f in vars(cls).items() if not n.startswith("_")}

    sync, async_ = public(SelectionClient), public(AsyncSelectionClient)
    assert len(sync) == 22 and sorted(sync) == sorted(async_)
    for name, signature in sync.items():
        assert str(async_[name]) == str(signature), name
        assert inspect.iscoroutinefunction(getattr(AsyncSelectionClient, name)), name
        assert getattr(SelectionClient, name).__qualname__ == f"SelectionClient.{name}"
    assert sync["select"].return_annotation is SelectResponse
    assert sync["free"].return_annotation is None


async def test_cached_tokens_reach_the_receipt() -> None:
    """``cached_tokens`` on the lifecycle calls of both APIs: sent only when given, and joined
    with the selection's receipt (predicted 0 cached tokens on an empty rank)."""
    app = create_app(load_settings())
    sent: list[tuple[str, str, Any]] = []

    async def record(request: httpx.Request) -> None:
        body = json.loads(request.content) if request.content else None
        sent.append((request.method, request.url.raw_path.decode(), body))

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncSlotTrackerClient("http://t", transport=transport) as c:
            sel = c.selection
            await sel.upsert_worker(5, "m", endpoint="http://w5", block_size=4)
            await sel.select_and_reserve("m", token_ids=range(16), selection_id="r1")
            await sel.select_and_reserve("m", token_ids=range(16), selection_id="r2")
            c._http.event_hooks["request"] = [record]
            await sel.prefill_complete("r1", cached_tokens=12)
            await sel.free("r1")
            await c.prefill_complete("m", "r2")
            await c.free("m", "r2", cached_tokens=8)
            r1, r2 = await sel.receipt("r1"), await sel.receipt("r2")
    assert sent[:4] == [
        ("POST", "/selection/reservations/r1/prefill_complete", {"cached_tokens": 12}),
        ("DELETE", "/selection/reservations/r1", None),
        ("POST", "/prefill_complete", {"model_name": "m", "routing_group": "default",
                                       "request_id": "r2"}),
        ("POST", "/free", {"model_name": "m", "routing_group": "default", "request_id": "r2",
                           "cached_tokens": 8}),
    ]  # fmt: skip
    assert (r1["outcome"]["state"], r1["outcome"]["cached_tokens"]) == ("freed", 12)
    assert (r2["outcome"]["state"], r2["outcome"]["cached_tokens"]) == ("freed", 8)
    assert r2["outcome"]["observed_hit_rate"] == 0.5
