"""A body cut short (or a list where a map is read) answers on ``/selection`` exactly what the
reference answers: serde_json's "EOF while parsing ..." with serde_path_to_error's path in front
and the column where the body ended (``kv_slot_tracker.core.serde.syntax``).

``reference_cut_short_bodies.json`` holds the reference's answers as given (its ``source``
says how they were taken): every prefix of one body that walks through keys, strings, numbers,
literals, lists and a nested object, plus lists, nested lists, escapes and a second line."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

ROWS = json.loads((Path(__file__).with_name("reference_cut_short_bodies.json")).read_text())["rows"]


def test_the_table_covers_every_kind_of_place() -> None:
    texts = " ".join(r["error"] for r in ROWS)
    for what in ("a value", "a string", "a list", "an object"):
        assert f"EOF while parsing {what}" in texts
    assert "pinned_worker.?: " in texts and "sequence_hashes[1]: " in texts
    assert "expected struct SelectRequest at line 1 column 0" in texts
    assert len(ROWS) > 140


@pytest.mark.parametrize("row", ROWS, ids=lambda r: repr(r["body"][-16:]))
async def test_a_cut_short_body_answers_the_references_text(
    client: httpx.AsyncClient, row: dict
) -> None:
    r = await client.post("/selection/select", content=row["body"],
                          headers={"content-type": "application/json"})  # fmt: skip
    assert (r.status_code, r.json()["error"]) == (row["status"], row["error"])
