"""Selection calls reach any instance: workers, reservations, pending selections and the
approximate cache are shared through Redis, and a call about something a peer made a moment
ago (its records still on their way) waits for them instead of answering 404.

Whole apps in this process (``tests/replication/apps.py``) on a real Redis; ``replication_batch_ms``
holds one app's records back so that the other sees calls before their records."""

from __future__ import annotations

from typing import Any

import pytest

from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, running_apps, until
from tests.replication.helpers import proxied

pytestmark = pytest.mark.redis

SEL = "/selection"


def settings(redis_url: str, namespace: str, **overrides: Any) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, snapshot_interval_seconds=3600,
                    **overrides)  # fmt: skip


async def view(app: App) -> dict[str, Any]:
    get = app.client.get
    return {
        "workers": (await get(SEL + "/workers")).json(),
        "loads": (await get(SEL + "/loads")).json(),
        "dump": (await get(SEL + "/dump")).json(),
        "slot_loads": await app.loads(),
    }


async def converged(apps: list[App]) -> bool:
    if not all(a.outbox_empty() for a in apps):
        return False
    views = [await view(a) for a in apps]
    return all(v == views[0] for v in views[1:])


async def upsert(app: App, wid: int, dp_size: int = 1) -> None:
    body = {"worker_id": wid, "model_name": "m", "endpoint": f"http://w{wid}", "block_size": 4,
            "data_parallel_size": dp_size}  # fmt: skip
    r = await app.post(SEL + "/workers", body)
    assert r.status_code == 201, r.text


def prompt(blocks: list[int], **extra: Any) -> dict[str, Any]:
    return {"model_name": "m", "block_hashes": blocks, "sequence_hashes": blocks,
            "isl_tokens": 4 * len(blocks), **extra}  # fmt: skip


async def test_a_reservation_made_on_one_instance_is_served_by_another(
    redis_url: str, namespace: str
) -> None:
    async with running_apps(
        settings(redis_url, namespace, replication_batch_ms=300),
        settings(redis_url, namespace, consistency_wait_ms=1500),
    ) as (a, b):
        await upsert(a, 1, dp_size=2)
        await upsert(a, 2)
        # each call goes at once to the other instance, before a's records reach the stream
        r = await a.post(SEL + "/select_and_reserve", prompt([1, 2, 3], selection_id="s1"))
        assert r.status_code == 200, r.text
        booked = (r.json()["worker_id"], r.json()["dp_rank"])
        r = await b.post(SEL + "/reservations/s1/prefill_complete", {})
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        assert b.metric("consistency_barrier_waits_total") >= 1

        # a selection on b, its replay on a
        r = await b.post(SEL + "/select", prompt([7, 8], selection_id="p1"))
        assert r.status_code == 200, r.text
        picked = (r.json()["worker_id"], r.json()["dp_rank"])
        r = await a.post(SEL + "/reservations", {"model_name": "m", "selection_id": "p1"})
        assert r.status_code == 201, r.text
        assert (r.json()["worker_id"], r.json()["dp_rank"]) == picked

        await until(lambda: converged([a, b]), what="identical selection state")
        loads = {(row["worker_id"], row["dp_rank"]): row
                 for part in (await view(b))["loads"] for row in part["loads"]}  # fmt: skip
        assert loads[booked]["active_requests"] >= 1
        # the cache written by a's booking answers on b
        scores = (await b.post(SEL + "/overlap_scores", prompt([1, 2]))).json()["workers"]
        assert {(w["worker_id"], w["dp_rank"]) for w in scores if w["device_blocks"] == 2} == {
            booked
        }

        # released on either instance, gone on both; a second release is a 404 on both (after
        # the bounded wait: the id might have been reserved on a peer a moment ago)
        assert (await b.client.delete(SEL + "/reservations/s1")).status_code == 200
        assert (await a.client.delete(SEL + "/reservations/p1")).status_code == 200
        await until(lambda: converged([a, b]), what="the releases everywhere")
        for app in (a, b):
            for sid in ("s1", "p1"):
                r = await app.client.delete(f"{SEL}/reservations/{sid}")
                assert r.status_code == 404, r.text
        assert all(row["active_requests"] == 0 for row in await b.loads())


async def test_a_worker_made_on_a_peer_is_patched_here_and_a_late_instance_restores_all(
    redis_url: str, namespace: str
) -> None:
    async with running_apps(
        settings(redis_url, namespace, replication_batch_ms=300),
        settings(redis_url, namespace, consistency_wait_ms=5000),
    ) as (a, b):
        await upsert(a, 5)
        r = await b.client.patch(SEL + "/workers/5", json={"total_kv_blocks": 64})
        assert r.status_code == 200, r.text
        assert r.json()["total_kv_blocks"] == 64
        r = await a.post(SEL + "/select_and_reserve", prompt([4, 5], selection_id="k"))
        assert r.status_code == 200, r.text
        await until(lambda: converged([a, b]), what="identical selection state")
        assert (await a.replication.write_snapshot()) is True
        # an instance started now restores the selection state from the snapshot
        async with running_apps(settings(redis_url, namespace)) as (c,):
            await until(lambda: converged([a, b, c]), what="the late instance in agreement")
            r = await c.post(SEL + "/reservations/k/prefill_complete", {})
            assert r.status_code == 200, r.text


async def test_durable_acknowledgements_cover_the_selection_routes(
    redis_url: str, namespace: str
) -> None:
    async with proxied(redis_url) as proxy, running_apps(
        settings(proxy.url(), namespace, replication_ack="redis",
                 replication_ack_timeout_ms=300, replication_batch_ms=200),
        settings(redis_url, namespace, replication_ack="redis"),
    ) as (a, b):  # fmt: skip
        await upsert(a, 1)
        # acknowledged: already in the stream, so b finds it after its read barrier alone
        r = await a.post(SEL + "/select_and_reserve", prompt([1, 2], selection_id="d1"))
        assert r.status_code == 200, r.text
        assert (await b.post(SEL + "/reservations/d1/prefill_complete", {})).status_code == 200
        # a read or a plain selection queues nothing: answered without waiting for Redis
        before = a.metric("replication_group_commit_calls_sum")
        assert (await a.post(SEL + "/select", prompt([3]))).status_code == 200
        assert a.metric("replication_group_commit_calls_sum") == before

        proxy.cut()
        # not known yet to be unreachable: applied here, then not acknowledged in time
        r = await a.post(SEL + "/select_and_reserve", prompt([5], selection_id="d2"))
        assert r.status_code == 503 and r.json()["error"].startswith("not acknowledged")
        state = await view(a)
        for method, path, body in (
            ("POST", "/workers", {"worker_id": 2, "model_name": "m", "endpoint": "http://w",
                                  "block_size": 4}),
            ("POST", "/select_and_reserve", prompt([6], selection_id="d3")),
            ("POST", "/reservations/d1/prefill_complete", {}),
            ("DELETE", "/reservations/d1", None),
            ("DELETE", "/workers/1", None),
        ):  # fmt: skip
            r = await a.client.request(method, SEL + path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"].startswith("not accepted"), r.text
        assert await view(a) == state  # nothing changed
        proxy.restore()
        await until(lambda: converged([a, b]), what="a's state on b once Redis answers")
        assert (await b.client.delete(SEL + "/reservations/d2")).status_code == 200


async def test_a_reservation_released_before_its_records_arrive_is_cancelled_everywhere(
    redis_url: str, namespace: str
) -> None:
    async with (
        proxied(redis_url) as proxy,
        running_apps(
            settings(proxy.url(), namespace),
            settings(redis_url, namespace, consistency_wait_ms=300),
        ) as (a, b),
    ):
        await upsert(a, 1)
        await until(lambda: converged([a, b]), what="the worker on b")
        proxy.cut()  # a's records wait in its outbox
        r = await a.post(SEL + "/select_and_reserve", prompt([1, 2], selection_id="gone"))
        assert r.status_code == 200, r.text
        # b cannot know it yet: 404 after the bounded wait, and a tombstone for the id
        r = await b.client.delete(SEL + "/reservations/gone")
        assert r.status_code == 404, r.text
        assert b.metric("consistency_tombstones_created_total") == 1
        proxy.restore()
        # the reservation's request reaches b and is cancelled there; a frees its copy
        await until(lambda: converged([a, b]), what="the same state on both")
        for app in (a, b):
            assert all(row["active_requests"] == 0 for row in await app.loads())
        assert (await a.client.delete(SEL + "/reservations/gone")).status_code == 404


async def test_a_session_booked_on_one_instance_stays_on_its_worker_on_another(
    redis_url: str, namespace: str
) -> None:
    """As the reference with replica sync (observed on 1.6.1: a session bound on one selector
    refuses another worker on its peer), a session's binding travels with its booking."""
    s = settings(redis_url, namespace, session_affinity_ttl_seconds=60, router_use_kv_events=False)
    async with running_apps(s, s) as (a, b):
        for wid in (1, 2):
            await upsert(a, wid)
        await until(lambda: converged([a, b]), what="b knows both workers")
        r = await a.post(SEL + "/select_and_reserve", prompt([1, 2], session_id="s1"))
        bound = r.json()["worker_id"]
        other = 3 - bound
        await until(lambda: converged([a, b]), what="b has the booking")
        r = await b.post(SEL + "/select_and_reserve",
                         prompt([9], session_id="s1", allowed_worker_ids=[other]))  # fmt: skip
        assert (r.status_code, r.json()) == (
            400, {"error": f"session s1 is bound to worker {bound}, not {other}"},
        )  # fmt: skip
        for i in range(4):  # whatever the costs, the session stays on its worker
            r = await b.post(SEL + "/select", prompt([20 + i], session_id="s1"))
            assert r.json()["worker_id"] == bound
        # a session without a booking is bound nowhere
        r = await b.post(SEL + "/select_and_reserve",
                         prompt([30], session_id="s2", allowed_worker_ids=[other]))  # fmt: skip
        assert r.json()["worker_id"] == other
        await until(lambda: converged([a, b]), what="a has b's booking")
        r = await a.post(SEL + "/select_and_reserve",
                         prompt([31], session_id="s2", allowed_worker_ids=[bound]))  # fmt: skip
        assert r.json() == {"error": f"session s2 is bound to worker {other}, not {bound}"}
