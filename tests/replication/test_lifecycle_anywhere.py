"""Lifecycle calls reach any instance: a free or prefill completion for a request added on a
peer a moment ago waits for the add's record (a read barrier, bounded), and one whose add is
still held up (a peer's outbox, a Redis stall) becomes a replicated tombstone or pending mark
that every instance applies when the add arrives, including the one that made it.

Whole apps in this process (``tests/replication/apps.py``) on a real Redis; an app whose
records must be held back talks to Redis through a ``TcpProxy`` that the test cuts."""

from __future__ import annotations

import pytest

from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, register, running_apps, until
from tests.replication.helpers import proxied

pytestmark = pytest.mark.redis


def settings(redis_url: str, namespace: str, **overrides) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, snapshot_interval_seconds=3600,
                    **overrides)  # fmt: skip


async def same_loads(apps: list[App]) -> list[dict]:
    rows = [await a.loads() for a in apps]
    assert all(r == rows[0] for r in rows[1:]), rows
    return rows[0]


async def converged(apps: list[App]) -> bool:
    if not all(a.outbox_empty() for a in apps):
        return False
    rows = [await a.loads() for a in apps]
    return all(r == rows[0] for r in rows[1:])


async def test_calls_for_a_request_added_on_a_peer_wait_for_its_record(
    redis_url: str, namespace: str
) -> None:
    # a's records reach the stream 300 ms after its calls; b waits up to 5 s for unknown ids
    async with running_apps(
        settings(redis_url, namespace, replication_batch_ms=300),
        settings(redis_url, namespace, consistency_wait_ms=5000),
    ) as (a, b):
        await register(a, [b])
        # each call goes at once to the other instance, as a round-robin load balancer does
        assert await a.add("x") == 201
        assert (await b.call("free", "x")).status_code == 200
        assert await a.add("y", rank=1) == 201
        prefill = await b.call("prefill_complete", "y")
        assert (prefill.status_code, prefill.json()) == (200, {"status": "ok"})
        assert await a.add("z") == 201
        batch = await b.post("/batch", {"operations": [
            {"op": "add", "model_name": "m", "request_id": "w", "worker_id": 1, "dp_rank": 1,
             "sequence_hashes": [9]},
            {"op": "free", "model_name": "m", "request_id": "w"},  # added just before: known
            {"op": "free", "model_name": "m", "request_id": "z"},  # added on a
        ]})  # fmt: skip
        assert batch.json() == {"results": [{"status": 201}, {"status": 200}, {"status": 200}]}
        await until(lambda: converged([a, b]), what="a and b to converge")
        rows = await same_loads([a, b])
        # only y is left, its prefill completed (no tokens)
        assert rows == [
            {"dp_rank": 0, "active_requests": 0, "active_decode_blocks": 0,
             "active_prefill_tokens": 0},
            {"dp_rank": 1, "active_requests": 1, "active_decode_blocks": 3,
             "active_prefill_tokens": 0},
        ]  # fmt: skip
        assert b.metric("consistency_barrier_waits_total") == 3
        assert b.metric("consistency_tombstones_created_total") == 0
        assert b.metric("consistency_marks_created_total") == 0
        assert b.metric("consistency_early_calls") == 0
        assert (await b.call("free", "never-added")).status_code == 200
        assert b.metric("consistency_tombstones_created_total") == 1


async def test_an_add_held_up_longer_than_the_wait_is_cancelled_everywhere(
    redis_url: str, namespace: str
) -> None:
    async with (
        proxied(redis_url) as proxy,
        running_apps(
            settings(proxy.url(), namespace),
            settings(redis_url, namespace, consistency_wait_ms=100),
            settings(redis_url, namespace),
        ) as (a, b, c),
    ):
        await register(a, [b, c])
        proxy.cut()  # a's records stay in its outbox
        assert await a.add("x") == 201
        assert await a.add("y", rank=1, tokens=40) == 201
        assert (await b.call("free", "x")).status_code == 200
        assert (await b.call("prefill_complete", "y")).status_code == 200
        assert b.metric("consistency_tombstones_created_total") == 1
        assert b.metric("consistency_marks_created_total") == 1
        await until(lambda: c.metric("consistency_early_calls") == 2, what="c to keep both")
        proxy.restore()  # a's adds arrive after the tombstone and the mark
        await until(lambda: converged([a, b, c]), what="convergence")
        rows = await same_loads([a, b, c])
        assert [(r["active_requests"], r["active_prefill_tokens"]) for r in rows] == [
            (0, 0),  # x: freed on a, cancelled on b and c
            (1, 0),  # y: its prefill completed everywhere
        ]
        assert a.metric("consistency_tombstones_applied_total") == 1  # freed its copy
        assert b.metric("consistency_tombstones_applied_total") == 1  # cancelled the add
        assert c.metric("consistency_tombstones_applied_total") == 1
        for app in (a, b, c):
            assert app.metric("consistency_marks_applied_total") == 1
        # the id used again later is a new request: the tombstone does not cancel it
        assert await c.add("x", rank=1) == 201
        await until(lambda: converged([a, b, c]), what="convergence after the re-add")
        rows = await same_loads([a, b, c])
        assert [r["active_requests"] for r in rows] == [0, 2]


async def test_tombstones_and_marks_survive_snapshots(redis_url: str, namespace: str) -> None:
    async with (
        proxied(redis_url) as proxy,
        running_apps(
            settings(proxy.url(), namespace),
            settings(redis_url, namespace, consistency_wait_ms=50),
        ) as (a, b),
    ):
        await register(a, [b])
        proxy.cut()
        assert await a.add("x") == 201
        assert await a.add("y", rank=1) == 201
        assert (await b.call("free", "x")).status_code == 200
        assert (await b.call("prefill_complete", "y")).status_code == 200
        assert await b.replication.write_snapshot()
        # an instance started now knows both from the snapshot alone
        async with running_apps(settings(redis_url, namespace)) as (d,):
            assert d.replication.status().bootstraps == 1
            assert d.replication.status().applied == 0
            assert d.metric("consistency_early_calls") == 2
            proxy.restore()
            await until(lambda: converged([a, b, d]), what="convergence")
            rows = await same_loads([a, b, d])
            assert [(r["active_requests"], r["active_prefill_tokens"]) for r in rows] == [
                (0, 0),
                (1, 0),
            ]
            assert d.metric("consistency_tombstones_applied_total") == 1
            assert d.metric("consistency_marks_applied_total") == 1


async def test_the_same_id_added_on_two_instances_keeps_the_first_in_stream_order(
    redis_url: str, namespace: str
) -> None:
    """a and b both accept an add of x (ranks 0 and 1) before either hears of the other's: b's
    record reaches the stream first, so b's copy wins everywhere; a drops its own copy when b's
    add arrives before its own record came back, c ignores the second add."""
    async with (
        proxied(redis_url) as proxy,
        running_apps(
            settings(proxy.url(), namespace),
            settings(redis_url, namespace),
            settings(redis_url, namespace),
        ) as (a, b, c),
    ):
        await register(a, [b, c])
        proxy.cut()  # a's add stays in its outbox until b's is in the stream
        assert await a.add("x", rank=0, tokens=10) == 201
        assert await b.add("x", rank=1, tokens=20) == 201
        await until(lambda: b.outbox_empty(), what="b's add in the stream")
        proxy.restore()
        await until(lambda: converged([a, b, c]), what="convergence")
        rows = await same_loads([a, b, c])
        assert [(r["active_requests"], r["active_prefill_tokens"]) for r in rows] == [
            (0, 0),
            (1, 20),  # b's copy
        ]
        for app in (a, b, c):
            assert app.metric("consistency_duplicate_adds_total") == 1
        assert (await a.call("free", "x")).status_code == 200
        await until(lambda: converged([a, b, c]), what="convergence after the free")
        rows = await same_loads([a, b, c])
        assert [r["active_requests"] for r in rows] == [0, 0]


async def test_plain_lifecycle_bodies_skip_the_models_in_redis_mode_too(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``/prefill_complete`` and ``/free`` with plain bodies decode straight into their
    commands on a replicated instance as on an embedded one; other bodies still get the
    models' messages."""
    import kv_slot_tracker.http.operations as operations

    add = {"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0,
           "sequence_hashes": [1, 2]}  # fmt: skip
    async with running_apps(Settings(redis_url=redis_url, namespace=namespace)) as (a,):
        await register(a, [])
        assert (await a.post("/add", add)).status_code == 201
        models = operations.parse_json

        def refuse(*args, **kwargs):
            raise AssertionError("a plain body went through the models")

        monkeypatch.setattr(operations, "parse_json", refuse)
        ref = {"model_name": "m", "request_id": "r"}
        assert (await a.post("/prefill_complete", ref)).status_code == 200
        assert (await a.post("/free", ref)).status_code == 200
        monkeypatch.setattr(operations, "parse_json", models)
        bad = await a.post("/free", {"model_name": "m"})
        assert bad.status_code == 422
        assert bad.json() == {
            "error": "Failed to deserialize the JSON body into the target type: "
            "missing field `request_id`"
        }


async def test_plain_batches_skip_the_models_in_redis_mode_too(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain ``/batch`` body decodes straight into its commands on a replicated instance as
    on an embedded one, also when one of its ids is not known yet and the batch waits for its
    add; another body still gets the models' messages, operation by operation."""
    from kv_slot_tracker.http.operations import Operations

    def op(name: str, rid: str, **extra) -> dict:
        return {"op": name, "model_name": "m", "request_id": rid, **extra}

    # a's records reach the stream 300 ms after its calls; b waits up to 5 s for unknown ids
    async with running_apps(
        settings(redis_url, namespace, replication_batch_ms=300),
        settings(redis_url, namespace, consistency_wait_ms=5000),
    ) as (a, b):
        await register(a, [b])
        models = Operations.validated_batch

        def refuse(*args, **kwargs):
            raise AssertionError("a plain batch went through the models")

        monkeypatch.setattr(Operations, "validated_batch", refuse)
        known = await a.post("/batch", {"operations": [
            op("add", "x", worker_id=1, dp_rank=0, sequence_hashes=[1, 2], new_isl_tokens=40),
            op("prefill_complete", "x"),
            op("output_block", "x", decay_fraction=0.5),
            op("add", "y", worker_id=1, dp_rank=1, sequence_hashes=[-1], new_isl_tokens=16),
            op("free", "x"),
        ]})  # fmt: skip
        assert known.json() == {"results": [
            {"status": 201}, {"status": 200}, {"status": 200}, {"status": 201}, {"status": 200},
        ]}  # fmt: skip
        assert a.metric("consistency_barrier_waits_total") == 0  # every id known: no wait
        assert await a.add("z") == 201
        waited = await b.post("/batch", {"operations": [op("free", "z"), op("free", "y")]})
        assert waited.json() == {"results": [{"status": 200}, {"status": 200}]}
        assert b.metric("consistency_barrier_waits_total") == 1
        await until(lambda: converged([a, b]), what="convergence after the frees")
        assert [r["active_requests"] for r in await same_loads([a, b])] == [0, 0]

        monkeypatch.setattr(Operations, "validated_batch", models)
        mixed = await b.post("/batch", {"operations": [
            op("add", "v", worker_id=1, dp_rank=0, sequence_hashes=[3], new_isl_tokens=16),
            op("free", "v", extra=1),  # a field the command does not take: not plain
            {"op": "free", "model_name": "m"},
        ]})  # fmt: skip
        assert mixed.json() == {"results": [{"status": 201}, {"status": 200}, {"status": 422,
            "error": "Failed to deserialize the JSON body into the target type: "
            "missing field `request_id`"}]}  # fmt: skip
