"""``selection_cache_max_bytes``: the pending selections' byte budget over HTTP, with the
numbers observed on the reference (``--selection-cache-max-bytes 1000``: of 200 selects of
1-block prompts with 4-character ids, the newest 35 can still be replayed)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.selection.helpers import A, add_worker, post, prompt


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"selection_cache_max_bytes": 1000}


async def test_the_byte_budget_keeps_the_newest_selections_as_the_reference_does(
    client, app
) -> None:
    await add_worker(client, A, model_name="m")
    for i in range(200):
        body = prompt([i * 100_000 + 1], selection_id=f"s{i:03d}", model_name="m")
        r = await post(client, "/select", body)
        assert r.status_code == 200, r.text
    replayed = []
    for i in range(200):
        r = await post(client, "/reservations", {"selection_id": f"s{i:03d}", "model_name": "m"})
        assert r.status_code in (201, 404), r.text
        if r.status_code == 201:
            replayed.append(i)
    assert replayed == list(range(165, 200))
    registry = app.state.registry
    evicted = registry.get_sample_value("kv_slot_tracker_selection_pending_evicted_total")
    assert evicted == 165
