"""Released reservation ids across whole instances on a real Redis: two bookings of one id by two
instances and one free converge to no reservation on every instance, and an instance started
later learns the released ids from the snapshot.

Apps in this process (``tests/replication/apps.py``); one instance reaches Redis through a TCP
proxy that the test cuts, which is how an instance whose records wait in its outbox looks."""

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
                    router_use_kv_events=False, **overrides)  # fmt: skip


async def upsert(app: App) -> None:
    body = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
    assert (await app.post(SEL + "/workers", body)).status_code == 201


def booking(sid: str) -> dict[str, Any]:
    return {"selection_id": sid, "model_name": "m", "worker_id": 1, "block_hashes": [1, 2],
            "sequence_hashes": [1, 2], "isl_tokens": 8, "effective_prefill_tokens": 8}  # fmt: skip


async def view(app: App) -> dict[str, Any]:
    get = app.client.get
    return {"loads": (await get(SEL + "/loads")).json(), "slot_loads": await app.loads()}


async def settled(apps: list[App]) -> bool:
    """Every outbox empty and every reader at the same stream position."""
    if not all(a.outbox_empty() for a in apps):
        return False
    positions = {a.replication.status().stream_position for a in apps}
    return len(positions) == 1


async def nothing_held(app: App) -> bool:
    rows = [row for part in (await view(app))["loads"] for row in part["loads"]]
    return bool(rows) and all(row["active_requests"] == 0 for row in rows)


def rejected(app: App, reason: str) -> int:
    return app.replication.status().records_rejected.get(reason, 0)


async def test_two_bookings_of_one_id_on_two_instances_and_one_free_leave_none(
    redis_url: str, namespace: str
) -> None:
    async with (
        proxied(redis_url) as proxy,
        running_apps(
            settings(redis_url, namespace),
            settings(proxy.url(), namespace),
            settings(redis_url, namespace),
        ) as (a, b, c),
    ):
        await upsert(a)
        await until(lambda: settled([a, b, c]), what="the worker everywhere")
        proxy.cut()  # b's records wait in its outbox; b reads nothing
        r = await b.post(SEL + "/reservations", booking("twice"))
        assert r.status_code == 201, r.text
        r = await a.post(SEL + "/reservations", booking("twice"))  # the client's retry
        assert r.status_code == 201, r.text
        await until(lambda: a.outbox_empty(), what="a's booking in the stream")
        r = await b.client.delete(SEL + "/reservations/twice")  # before b read a's booking
        assert r.status_code == 200, r.text
        proxy.restore()
        await until(lambda: settled([a, b, c]), what="every record applied everywhere")
        for app in (a, b, c):
            assert await nothing_held(app), await view(app)
        assert (await view(a)) == (await view(b)) == (await view(c))
        # b applied a's booking after its own free: dropped there, its add and its record
        assert rejected(b, "released") == 2
        for app in (a, b, c):
            r = await app.post(SEL + "/reservations", booking("twice"))
            assert r.status_code == 409, r.text
            assert "was released" in r.json()["error"]


async def test_an_instance_started_later_learns_released_ids_from_the_snapshot(
    redis_url: str, namespace: str
) -> None:
    async with running_apps(settings(redis_url, namespace)) as (a,):
        await upsert(a)
        assert (await a.post(SEL + "/reservations", booking("done"))).status_code == 201
        assert (await a.client.delete(SEL + "/reservations/done")).status_code == 200
        assert (await a.replication.write_snapshot()) is True
        async with running_apps(settings(redis_url, namespace)) as (late,):
            assert late.replication.status().applied == 0  # all it knows is the snapshot's
            assert late.app.state.selection.reservations.released("done", late.app.state.selection.clock())  # fmt: skip
            r = await late.post(SEL + "/reservations", booking("done"))
            assert (r.status_code, "was released" in r.json()["error"]) == (409, True)
            assert await nothing_held(late)
