"""Listings are bounded: at most ``list_max_items`` items (or ``limit``) per answer, in the
reference's body shape, with the next page's ``cursor`` in the ``x-next-cursor`` header; and
the open ``/selection/ready`` computes for a caller without the key only what it answers."""

from __future__ import annotations

from tests.api.conftest import post_json


async def test_lora_counts_come_in_pages(make_client) -> None:
    async with make_client(list_max_items=2) as (_, client):
        reg = {"model_name": "m", "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
        assert (await post_json(client, "/register", reg)).status_code == 201
        for i, lora in enumerate("edcba"):
            add = {"model_name": "m", "request_id": f"r{i}", "worker_id": 1, "dp_rank": 0,
                   "sequence_hashes": [i], "lora_name": lora}  # fmt: skip
            assert (await post_json(client, "/add", add)).status_code == 201
        pages, cursor = [], None
        while True:
            params = {"model_name": "m"} | ({"cursor": cursor} if cursor else {})
            r = await client.get("/lora_counts", params=params)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body.keys() == {"model_name", "routing_group", "lora_counts"}
            pages.append(list(body["lora_counts"]))
            cursor = r.headers.get("x-next-cursor")
            if cursor is None:
                break
        assert pages == [["a", "b"], ["c", "d"], ["e"]]
        one = await client.get("/lora_counts", params={"model_name": "m", "limit": "1"})
        assert one.json()["lora_counts"] == {"a": 1} and one.headers["x-next-cursor"] == "1"
        many = await client.get("/lora_counts", params={"model_name": "m", "limit": "50"})
        assert list(many.json()["lora_counts"]) == ["a", "b"]  # at most list_max_items
        for bad in ({"limit": "0"}, {"limit": "-1"}, {"limit": "x"}, {"cursor": "-1"}):
            r = await client.get("/lora_counts", params={"model_name": "m", **bad})
            assert r.status_code == 400, (bad, r.text)


async def test_a_short_listing_is_the_whole_answer_without_a_cursor(client) -> None:
    reg = {"model_name": "short", "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
    assert (await post_json(client, "/register", reg)).status_code == 201
    r = await client.get("/workers", params={"model_name": "short"})
    assert [w["worker_id"] for w in r.json()] == [1]
    assert "x-next-cursor" not in r.headers


async def test_selection_workers_come_in_pages(make_client) -> None:
    async with make_client(list_max_items=3) as (_, client):
        for wid in range(7):
            r = await post_json(client, "/selection/workers", {"worker_id": wid})
            assert r.status_code == 201, r.text
        r = await client.get("/selection/workers")
        assert [w["worker_id"] for w in r.json()] == [0, 1, 2]
        assert r.headers["x-next-cursor"] == "3"
        r = await client.get("/selection/workers", params={"cursor": "6"})
        assert [w["worker_id"] for w in r.json()] == [6] and "x-next-cursor" not in r.headers


async def test_selection_ready_without_the_key_does_not_list_the_catalog(make_client) -> None:
    async with make_client(api_key="k") as (app, client):
        key = {"authorization": "Bearer k"}
        r = await post_json(client, "/selection/workers", {"worker_id": 1}, headers=key)
        assert r.status_code == 201
        selection = app.state.selection

        def listing(*_: object) -> list[object]:
            raise AssertionError("the catalog was listed for a caller without the key")

        selection.workers = listing
        r = await client.get("/selection/ready")
        assert r.status_code == 503 and r.json() == {"ready": False, "schedulable_workers": 0}
        del selection.workers  # the class's method again
        full = await client.get("/selection/ready", headers=key)
        assert [w["worker_id"] for w in full.json()["workers"]] == [1]
