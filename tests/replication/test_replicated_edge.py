"""The call routes of a replicated instance (``kv_slot_tracker.http.replicated``), as the
dispatchers run them: a lifecycle call whose ids are all known answers its ``Result`` at once,
synchronously, as an embedded instance does; only one about an id not known here yet answers
``Later``, which the dispatcher awaits.

Whole apps in this process on a real Redis (``tests/replication/apps.py``); the routes'
operations are taken from the lean dispatcher's table and called as it calls them."""

from __future__ import annotations

import orjson
import pytest

from kv_slot_tracker.http.answers import Later
from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, register, running_apps

pytestmark = pytest.mark.redis

OK = (200, b'{"status":"ok"}')


def settings(redis_url: str, namespace: str, **overrides) -> Settings:
    return Settings(redis_url=redis_url, namespace=namespace, snapshot_interval_seconds=3600,
                    **overrides)  # fmt: skip


def operation(app: App, path: str):
    return app.app.lean.exact["POST"][path].op


def ref(rid: str) -> bytes:
    return orjson.dumps({"model_name": "m", "request_id": rid})


async def test_known_ids_answer_at_once_and_unknown_ones_later(
    redis_url: str, namespace: str
) -> None:
    # a's records reach the stream 300 ms after its calls; b waits up to 5 s for unknown ids
    async with running_apps(
        settings(redis_url, namespace, replication_batch_ms=300),
        settings(redis_url, namespace, consistency_wait_ms=5000),
    ) as (a, b):
        await register(a, [b])
        free, batch = operation(b, "/free"), operation(b, "/batch")
        prefill = operation(b, "/prefill_complete")

        assert await b.add("known") == 201
        assert prefill(ref("known")) == OK  # a Result, not Later: answered synchronously
        assert free(ref("known")) == OK
        both = orjson.dumps({"operations": [
            {"op": "add", "model_name": "m", "request_id": "n", "worker_id": 1, "dp_rank": 0,
             "sequence_hashes": [5]},
            {"op": "free", "model_name": "m", "request_id": "n"},  # added just before: known
        ]})  # fmt: skip
        assert batch(both) == (200, b'{"results":[{"status":201},{"status":200}]}')
        assert b.metric("consistency_barrier_waits_total") == 0

        assert await a.add("x") == 201  # on the peer: not known here yet
        answer = free(ref("x"))
        assert isinstance(answer, Later)
        assert await answer == OK
        assert b.metric("consistency_barrier_waits_total") == 1
        assert (await b.loads())[0]["active_requests"] == 0  # x arrived and was freed


async def test_an_id_certainly_unknown_after_the_wait_is_answered_404_later(
    redis_url: str, namespace: str
) -> None:
    """With durable acknowledgements the barrier proves an id unknown: the waiting call's
    error is answered with its status when it is awaited, as a synchronous call's is."""
    async with running_apps(
        settings(redis_url, namespace, replication_ack="redis", consistency_wait_ms=2000)
    ) as (a,):
        await register(a, [])
        answer = operation(a, "/prefill_complete")(ref("nobody"))
        assert isinstance(answer, Later)
        assert await answer == (404, b'{"error":"Request nobody not found"}')
