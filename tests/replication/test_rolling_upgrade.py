"""A rolling upgrade on one real Redis stream: instances of this version start on a stream that
an instance of the previous version wrote (stream format 1) and goes on writing, and write
format 2 among its entries; every instance of this version converges to the same state.

The old instance's entries are the captured ones (``tests/data/replica_stream_v1.msgpack``,
written by the previous version: ``tests/support/capture_stream_v1.py``), appended as they are
but for their producer's time, moved to now (kept in their order) so that nothing in them has
expired yet. Whole apps in this process (``tests/replication/apps.py``)."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import pytest
import redis

from kv_slot_tracker.replication.records import RECORD_FIELD, decode_entry
from kv_slot_tracker.replication.redis.stream import NamespaceKeys, id_text
from kv_slot_tracker.settings import Settings
from tests.replication.apps import App, running_apps, until
from tests.support.capture_stream_v1 import DATA

pytestmark = pytest.mark.redis

CAPTURED = msgpack.unpackb(DATA.read_bytes(), raw=False)


def old_entries() -> list[bytes]:
    """The captured format-1 entries, their times moved to now."""
    shift = time.time_ns() - CAPTURED["wall"]
    out = []
    for entry in CAPTURED["entries"]:
        rec = msgpack.unpackb(entry, raw=False)
        rec["ts"] += shift
        out.append(msgpack.packb(rec))  # still one map: format 1
    return out


def view(app: App) -> dict[str, Any]:
    """What an instance holds, without the instants (each app maps them on its own clock)."""
    svc = app.app.state.service
    trackers = {}
    for entry in svc.export_state():
        t = entry["tracker"]
        slots = sorted(
            (tuple(s["worker"]), sorted((r[0], tuple(r[1]), r[3], r[4], r[5]) for r in s["requests"]),
             sorted(p[0] for p in s["prefills"]))
            for s in t["slots"]
        )  # fmt: skip
        trackers[(entry["model_name"], entry["routing_group"])] = (
            t["block_size"], sorted(map(tuple, t["ranges"])), slots,
            sorted(tuple(r) for r in t["index_only"]),
        )  # fmt: skip
    sel = svc.export_selection()
    return {
        "trackers": trackers,
        "early": sorted((r[0], r[1], r[2], r[3]) for r in svc.export_early()),
        "catalog": sel["catalog"],
        "reservations": sorted((r[0], r[1], r[2], tuple(r[3])) for r in sel["reservations"]),
        "pending": sorted(p[0] for p in sel["pending"]),
    }


@pytest.mark.parametrize("a_writes", [2, 1])
async def test_new_instances_and_old_records_on_one_stream_converge(
    redis_url: str, namespace: str, a_writes: int
) -> None:
    """``a_writes``: the stream format instance A writes (1: as configured while instances of
    the previous version still read the stream); B writes format 2."""
    client = redis.Redis.from_url(redis_url)
    key = NamespaceKeys.of(namespace).events
    old = old_entries()

    def append(entries: list[bytes]) -> None:
        for e in entries:
            client.xadd(key, {RECORD_FIELD: e})

    settings = Settings(redis_url=redis_url, namespace=namespace, snapshot_interval_seconds=3600,
                        replication_stream_format=2)  # fmt: skip
    settings_a = settings.model_copy(update={"replication_stream_format": a_writes})
    try:
        append(old[:10])  # the old instance was there first
        async with running_apps(settings_a, settings) as (a, b):
            # a new instance writes (format 2) while the old one goes on (format 1)
            body = {"model_name": "m", "worker_id": 5, "block_size": 4, "dp_start": 0,
                    "dp_size": 2}  # fmt: skip
            assert (await a.post("/register", body)).status_code == 201
            append(old[10:16])
            assert await a.add("new-1", rank=1) == 201
            append(old[16:])
            r = await b.post("/add", {"model_name": "m", "request_id": "new-2", "worker_id": 1,
                                      "dp_rank": 0, "sequence_hashes": [5, -6]})  # fmt: skip
            assert r.status_code == 201, r.text

            def last() -> str:
                return id_text(client.xinfo_stream(key)["last-generated-id"])

            for app in (a, b):
                await until(lambda app=app: app.outbox_empty(), what="the outbox drained")
            end = last()
            for app in (a, b):
                await until(lambda app=app: app.replication.status().stream_position == end,
                            what=f"the reader at the end of the stream ({end})")  # fmt: skip
            formats = [decode_entry(f[RECORD_FIELD]).format for _, f in client.xrange(key)]
            # A's registration and add, B's add
            assert formats.count(2) == (2 if a_writes == 2 else 0) + 1
            assert formats.count(1) == len(old) + (2 if a_writes == 1 else 0)
            for app in (a, b):
                st = app.replication.status()
                assert st.records_rejected == dict.fromkeys(st.records_rejected, 0)
                assert app.replication.counters.malformed == 0
            va, vb = view(a), view(b)
            assert va == vb
            requests = {r[0] for _, _, slots, _ in va["trackers"].values()
                        for _, reqs, _ in slots for r in reqs}  # fmt: skip
            assert {"r1", "r2", "late-2", "s1", "new-1", "new-2"} <= requests
            assert [spec["worker_id"] for spec, _, _ in va["catalog"]] == [11]
            assert va["pending"] == ["p1"] and [r[0] for r in va["reservations"]] == ["s1"]
    finally:
        client.close()
