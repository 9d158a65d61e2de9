"""/metrics stays bounded whatever clients name things or however many ranks they register:
label values are cut (distinct names stay distinct series) and the per-rank series stop at
``metrics_max_rank_series``, the ranks beyond it added up per tracker."""

from __future__ import annotations

import re

from tests.api.conftest import post_json


def series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


async def test_long_names_are_cut_to_the_label_limit_and_stay_distinct(make_client) -> None:
    async with make_client(metrics_max_label_chars=40) as (_, client):
        names = ["n" * 1000 + "a", "n" * 1000 + "b"]
        for wid, name in enumerate(names):
            reg = {"model_name": name, "worker_id": wid, "block_size": 4, "dp_start": 0,
                   "dp_size": 2}  # fmt: skip
            assert (await post_json(client, "/register", reg)).status_code == 201
        text = (await client.get("/metrics")).text
        rows = series(text, "kv_slot_tracker_worker_registered")
        models = {re.search(r'model_name="([^"]*)"', row).group(1) for row in rows}  # type: ignore[union-attr]
        assert len(models) == 2
        assert all(len(m) == 40 and m.startswith("n" * 27 + "~") for m in models), models
        assert max(len(line) for line in text.splitlines()) < 400


async def test_per_rank_series_stop_at_the_bound_and_the_rest_is_added_up(make_client) -> None:
    async with make_client(metrics_max_rank_series=5) as (_, client):
        for wid, model in ((1, "a"), (2, "b")):
            reg = {"model_name": model, "worker_id": wid, "block_size": 4, "dp_start": 0,
                   "dp_size": 4}  # fmt: skip
            assert (await post_json(client, "/register", reg)).status_code == 201
        add = {"model_name": "b", "request_id": "r", "worker_id": 2, "dp_rank": 3,
               "sequence_hashes": [1, 2]}  # fmt: skip
        assert (await post_json(client, "/add", add)).status_code == 201
        text = (await client.get("/metrics")).text
        rows = series(text, "kv_slot_tracker_worker_registered")
        assert len(rows) == 6  # 4 ranks of a, 1 of b, and b's other 3 added up
        assert ('kv_slot_tracker_worker_registered{dp_rank="other",model_name="b",'
                'routing_group="default",worker_id="other"} 3.0') in rows  # fmt: skip
        assert ('kv_slot_tracker_active_requests{dp_rank="other",model_name="b",'
                'routing_group="default",worker_id="other"} 1.0') in text.splitlines()  # fmt: skip


async def test_catalog_workers_of_names_without_a_partition_share_one_series(client) -> None:
    for wid in range(50):  # incomplete workers (no endpoint, no block size), each a new name
        r = await post_json(
            client, "/selection/workers", {"worker_id": wid, "model_name": f"x{wid}"}
        )
        assert r.status_code == 201, r.text
    text = (await client.get("/metrics")).text
    rows = series(text, "kv_slot_tracker_selection_workers")
    assert ('kv_slot_tracker_selection_workers{lifecycle="incomplete",model_name="other",'
            'routing_group="other"} 50.0') in rows  # fmt: skip
    assert len(rows) == 3  # other: schedulable, incomplete, unschedulable
