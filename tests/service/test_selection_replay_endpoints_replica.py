"""``replay_endpoints`` between instances: a worker's list travels in its catalog record and in
snapshots; a record without the field (as earlier versions write them) is read as before, and a
record whose list is malformed is refused and counted like any bad record."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.service.selection import commands as sc
from kv_slot_tracker.service.selection import wire
from tests.service.test_selection_replica import KEY, WALL, assert_same, cluster, sync, worker

REPLAY = ("tcp://10.0.0.1:5600", "tcp://10.0.0.1:5601")


def test_the_list_travels_with_the_worker() -> None:
    _, (a, b, c) = cluster(3)
    a.selection.upsert_worker(worker(1, data_parallel_size=2, replay_endpoints=REPLAY))
    a.selection.upsert_worker(worker(2))
    sync([a, b, c])
    view = assert_same([a, b, c])
    specs = {spec.worker_id: spec for spec, _, _ in view["workers"]}
    assert specs[1].replay_endpoints == REPLAY
    assert specs[2].replay_endpoints is None
    # a PATCH on another instance travels as well
    three = (*REPLAY, "ipc:///r2")
    b.selection.patch_worker(
        sc.PatchWorker(worker_id=1, changes={"data_parallel_size": 3, "replay_endpoints": three})
    )
    sync([a, b, c])
    view = assert_same([a, b, c])
    assert view["workers"][0][0].replay_endpoints == three


def test_a_snapshot_carries_the_list() -> None:
    _, (a, b) = cluster(2)
    a.selection.upsert_worker(worker(1, data_parallel_size=2, replay_endpoints=REPLAY))
    state = msgpack.unpackb(
        msgpack.packb(
            [a.service.export_state(), a.service.export_early(), a.service.export_selection()]
        ),
        raw=False,
    )
    b.service.restore_state(*state)
    assert b.view() == a.view()
    assert b.selection.workers(None, None)[0].spec.replay_endpoints == REPLAY


def spec(**fields: Any) -> dict[str, Any]:
    return wire.spec_to_wire(
        WorkerSpec(worker_id=77, model_name=KEY[0], endpoint="http://w77", block_size=16, **fields)
    )


def test_the_record_carries_the_field_only_when_given() -> None:
    plain = spec()
    assert "replay_endpoints" not in plain  # as an instance of an earlier version writes it
    assert wire.spec_from_wire(plain) == WorkerSpec(
        worker_id=77, model_name=KEY[0], endpoint="http://w77", block_size=16
    )
    given = spec(data_parallel_size=2, replay_endpoints=REPLAY)
    assert given["replay_endpoints"] == list(REPLAY)
    assert wire.spec_from_wire(msgpack.unpackb(msgpack.packb(given))).replay_endpoints == REPLAY


MALFORMED = "malformed selection record: replay_endpoints = "
BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "not a list",
        {**spec(data_parallel_size=2), "replay_endpoints": "tcp://a:1"},
        "Expected `array | null`, got `str` - at `$.replay_endpoints`",
    ),
    (
        "not strings",
        {**spec(data_parallel_size=2), "replay_endpoints": ["tcp://a:1", 2]},
        "Expected `str`, got `int` - at `$.replay_endpoints[1]`",
    ),
    (
        "too long",
        {**spec(), "replay_endpoints": ["ipc://" + "p" * 4091]},
        "Expected `str` of length <= 4096 - at `$.replay_endpoints[0]`",
    ),
    (
        "too many",
        {**spec(data_parallel_size=4097), "replay_endpoints": ["tcp://a:1"] * 4097},
        "Expected `array` of length <= 4096 - at `$.replay_endpoints`",
    ),
    (
        "one per rank",
        {**spec(data_parallel_size=2), "replay_endpoints": ["tcp://a:1"]},
        MALFORMED + "'replay_endpoints must have one entry per dp rank: data_parallel_size is 2, "
        "replay_endpoints has 1'",
    ),
    (
        "both",
        {**spec(replay_endpoint="tcp://a:1"), "replay_endpoints": ["tcp://a:1"]},
        MALFORMED + "'give either replay_endpoint or replay_endpoints, not both'",
    ),
    (
        "address",
        {**spec(), "replay_endpoints": ["http://a:1"]},
        MALFORMED + "'replay_endpoints[0] must be tcp://HOST:PORT or ipc://PATH'",
    ),
    (
        "unknown field",
        {**spec(), "replay_endpointz": None},
        "Object contains unknown field `replay_endpointz`",
    ),
]


@pytest.mark.parametrize(("case", "record", "error"), BAD, ids=[c for c, _, _ in BAD])
def test_a_malformed_list_is_refused(case: str, record: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError) as caught:
        wire.spec_from_wire(record)
    assert str(caught.value) == error


def test_a_malformed_list_on_the_stream_is_counted_and_skipped() -> None:
    _, (a, b) = cluster(2)
    a.selection.upsert_worker(worker(1))
    bad = {**spec(data_parallel_size=2), "replay_endpoints": ["tcp://a:1"]}
    b.service.apply_remote(
        [{"origin": 1, "ts": WALL, "selection": {"op": "put_worker", "spec": bad}}]
    )
    assert b.service.replica.dropped == 1
    b.deliver()
    assert [r.spec.worker_id for r in b.selection.workers(None, None)] == [1]
