"""Helpers for the selection API tests: worker registration, bookings, picks, and the cost.

``cost`` is SELECTION.md §4's formula written out independently of the application, so the
scenario tests can check the table's exact numbers from what the API shows (``/loads``,
``/potential_loads``, ``/overlap_scores``) and then check that the winner has the least cost.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx

from tests.api.conftest import post_json

BS = 4
A, B, C = 1, 2, 3
P8 = list(range(1, 9))
SEL = "/selection"


async def post(client: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    return await post_json(client, SEL + path, body)


async def add_worker(client: httpx.AsyncClient, worker_id: int, **fields: Any) -> dict:
    body = {"worker_id": worker_id, "endpoint": f"http://w{worker_id}", "block_size": BS, **fields}
    r = await post(client, "/workers", body)
    assert r.status_code == 201, r.text
    return r.json()


async def book(
    client: httpx.AsyncClient,
    sid: str,
    worker_id: int,
    blocks: list[int] | None,
    *,
    seq: list[int] | None = None,
    isl: int,
    ept: int | None = None,
    **fields: Any,
) -> httpx.Response:
    """An explicit booking; ``blocks`` also feed the approximate cache (None: not given)."""
    body: dict[str, Any] = {"selection_id": sid, "worker_id": worker_id, "isl_tokens": isl}
    body["sequence_hashes"] = seq if seq is not None else blocks
    if blocks is not None:
        body["block_hashes"] = blocks
    if ept is not None:
        body["effective_prefill_tokens"] = ept
    r = await post(client, "/reservations", {**body, **fields})
    assert r.status_code == 201, r.text
    return r


def prompt(blocks: list[int], isl: int | None = None, **fields: Any) -> dict[str, Any]:
    """A select body: the blocks as both block and sequence hashes (as in the scenarios)."""
    return {
        "block_hashes": blocks,
        "sequence_hashes": blocks,
        "isl_tokens": isl if isl is not None else len(blocks) * BS,
        **fields,
    }


async def pick(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    r = await post(client, "/select", body)
    assert r.status_code == 200, r.text
    return r.json()["worker_id"]


async def picks(client: httpx.AsyncClient, body: dict[str, Any], n: int) -> Counter[int]:
    return Counter([await pick(client, body) for _ in range(n)])


async def holds_p8(client: httpx.AsyncClient, worker_id: int = A) -> None:
    """The scenarios' base state: an explicit 8-block booking P8 (no prefill tokens), whose
    prefill then completes."""
    await book(client, "base", worker_id, P8, isl=32)
    r = await client.post(f"{SEL}/reservations/base/prefill_complete")
    assert r.status_code == 200, r.text


async def inputs(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> dict[int, tuple[int, int, int, int]]:
    """Per worker (rank 0): ``(P, D + new, A, k)`` as the API shows them for this prompt."""
    loads = (await client.get(f"{SEL}/loads")).json()
    p = {row["worker_id"]: row["potential_prefill_tokens"] for row in loads[0]["loads"]}
    potential = (await post(client, "/potential_loads", body)).json()
    overlap = (await post(client, "/overlap_scores", body)).json()["workers"]
    k = {row["worker_id"]: row["device_blocks"] for row in overlap}
    return {
        row["worker_id"]: (
            p[row["worker_id"]],
            row["potential_decode_blocks"],
            row["active_requests"],
            k[row["worker_id"]],
        )
        for row in potential
    }


def cost(
    p: int,
    d_new: int,
    a: int,
    k: int,
    *,
    isl: int,
    bs: int = BS,
    credit: float = 1.0,
    decay: float = 0.0,
    scale: float = 1.0,
    w: float = 0.0,
    min_p: int = 0,
) -> float:
    """SELECTION.md §4: ``SCALE*max(0, (P+isl)/bs - CREDIT*decay*k) + (D+new) + W*A``."""
    rb = -(-isl // bs)
    d = 1.0 if decay == 0 else 1 / (1 + decay * ((p - min_p) / bs) / rb)
    return scale * max(0.0, (p + isl) / bs - credit * d * k) + d_new + w * a
