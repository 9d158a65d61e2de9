"""``replay_endpoints``: one replay socket per dp rank, an extension of the reference's worker
body (whose one ``replay_endpoint`` serves a worker of one rank only).

Registration and PATCH through the ASGI app, exact answers: what is accepted and echoed, what is
refused (400 or, for the wrong JSON type, serde's 422) with nothing changed, and that a worker
that does not give the field is answered exactly as the reference answers it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.api.selection.helpers import SEL, post


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    """KV events on, as the reference runs by default (a worker then needs its endpoints)."""
    return {"router_use_kv_events": True}


KV = {"0": "tcp://10.0.0.1:5557", "1": "tcp://10.0.0.1:5558"}
REPLAY = ["tcp://10.0.0.1:5600", "ipc:///run/engine/replay-1"]


def body(**fields: Any) -> dict[str, Any]:
    """A dp-2 worker with its publishers (KV events on) and one replay socket per rank."""
    out = {"worker_id": 5, "endpoint": "http://w5", "block_size": 16, "data_parallel_size": 2,
           "kv_events_endpoints": KV, "replay_endpoints": REPLAY}  # fmt: skip
    out.update(fields)
    return {k: v for k, v in out.items() if v is not ...}


def record(**fields: Any) -> dict[str, Any]:
    """The answer for ``body()``, in the reference's field order plus ``replay_endpoints``."""
    out: dict[str, Any] = {
        "worker_id": 5,
        "model_name": "default",
        "routing_group": "default",
        "lifecycle": "schedulable",
        "endpoint": "http://w5",
        "kv_events_endpoint": None,
        "kv_events_endpoints": KV,
        "replay_endpoint": None,
        "replay_endpoints": REPLAY,
        "block_size": 16,
        "data_parallel_start_rank": None,
        "data_parallel_size": 2,
        "max_num_batched_tokens": None,
        "total_kv_blocks": None,
        "stable_routing_id": None,
        "is_eagle": None,
        "taints": [],
        "topology_domains": {},
        "kv_transfer_domain": None,
        "kv_transfer_enforcement": None,
        "kv_transfer_preferred_weight": None,
    }
    out.update(fields)
    return {k: v for k, v in out.items() if v is not ...}


async def workers(client: Any) -> list[dict[str, Any]]:
    r = await client.get(SEL + "/workers")
    assert r.status_code == 200
    return r.json()


async def test_a_dp2_worker_names_a_replay_socket_per_rank(client: Any) -> None:
    r = await post(client, "/workers", body())
    assert (r.status_code, r.json()) == (201, record())
    assert list(r.json()) == list(record())  # right after replay_endpoint
    assert await workers(client) == [record()]
    ranks = (await client.get(SEL + "/loads")).json()[0]["loads"]
    assert [x["dp_rank"] for x in ranks] == [0, 1]


async def test_without_the_field_the_answer_is_the_references(client: Any) -> None:
    r = await post(client, "/workers", body(replay_endpoints=None, data_parallel_size=1,
                                            kv_events_endpoints={"0": KV["0"]},
                                            replay_endpoint="tcp://10.0.0.1:5600"))  # fmt: skip
    want = record(replay_endpoints=..., data_parallel_size=1, kv_events_endpoints={"0": KV["0"]},
                  replay_endpoint="tcp://10.0.0.1:5600")  # fmt: skip
    assert "replay_endpoints" not in r.json()
    assert (r.status_code, r.json()) == (201, want)
    assert await workers(client) == [want]


async def test_ranks_from_a_start_rank_and_one_rank(client: Any) -> None:
    r = await post(client, "/workers", body(data_parallel_start_rank=4,
                                            kv_events_endpoints={"4": KV["0"], "5": KV["1"]}))  # fmt: skip
    assert r.json()["lifecycle"] == "schedulable", r.json()
    r = await post(client, "/workers", body(worker_id=6, data_parallel_size=...,
                                            kv_events_endpoints=...,
                                            kv_events_endpoint=KV["0"],
                                            replay_endpoints=[REPLAY[0]]))  # fmt: skip
    assert r.status_code == 201
    assert (r.json()["lifecycle"], r.json()["replay_endpoints"]) == ("schedulable", [REPLAY[0]])


async def test_one_replay_endpoint_for_two_ranks_stays_incomplete(client: Any) -> None:
    """The reference's rule stands; the list is the way to name one socket per rank."""
    r = await post(client, "/workers", body(replay_endpoints=..., replay_endpoint=REPLAY[0]))
    assert r.status_code == 201
    assert r.json() == record(
        replay_endpoints=...,
        replay_endpoint=REPLAY[0],
        lifecycle="incomplete",
        not_schedulable_reasons=["replay_endpoint is supported only for data_parallel_size 1"],
    )


ONE_PER_RANK = "replay_endpoints must have one entry per dp rank: data_parallel_size is {}, " \
    "replay_endpoints has {}"  # fmt: skip
ADDRESS = "replay_endpoints[{}] must be tcp://HOST:PORT or ipc://PATH"

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("one short", body(replay_endpoints=REPLAY[:1]), ONE_PER_RANK.format(2, 1)),
    ("one too many", body(replay_endpoints=[*REPLAY, REPLAY[0]]), ONE_PER_RANK.format(2, 3)),
    ("empty", body(replay_endpoints=[]), ONE_PER_RANK.format(2, 0)),
    ("dp size omitted is 1", body(data_parallel_size=...), ONE_PER_RANK.format(1, 2)),
    ("dp size 0", body(data_parallel_size=0), ONE_PER_RANK.format(0, 2)),
    (
        "both forms",
        body(replay_endpoint=REPLAY[0]),
        "give either replay_endpoint or replay_endpoints, not both",
    ),
    ("http", body(replay_endpoints=[REPLAY[0], "http://10.0.0.1:5601"]), ADDRESS.format(1)),
    ("no port", body(replay_endpoints=["tcp://10.0.0.1", REPLAY[1]]), ADDRESS.format(0)),
    ("port too big", body(replay_endpoints=["tcp://h:65536", REPLAY[1]]), ADDRESS.format(0)),
    ("no path", body(replay_endpoints=[REPLAY[0], "ipc://"]), ADDRESS.format(1)),
    ("blank", body(replay_endpoints=["", REPLAY[1]]), ADDRESS.format(0)),
    ("spaces", body(replay_endpoints=["tcp://a b:1", REPLAY[1]]), ADDRESS.format(0)),
    ("inproc", body(replay_endpoints=["inproc://r", REPLAY[1]]), ADDRESS.format(0)),
]


@pytest.mark.parametrize(("case", "sent", "error"), REFUSED, ids=[c for c, _, _ in REFUSED])
async def test_refused_registrations_change_nothing(
    client: Any, case: str, sent: dict[str, Any], error: str
) -> None:
    r = await post(client, "/workers", sent)
    assert (r.status_code, r.json()) == (400, {"error": error})
    assert await workers(client) == []
    # over a registered worker: it stays as it was
    assert (await post(client, "/workers", body())).status_code == 201
    r = await post(client, "/workers", sent)
    assert (r.status_code, r.json()) == (400, {"error": error})
    assert await workers(client) == [record()]


SHAPES: list[tuple[Any, str]] = [
    (
        "tcp://10.0.0.1:5600",
        'replay_endpoints: invalid type: string "tcp://10.0.0.1:5600", expected a sequence at '
        "line 1 column 193",
    ),
    (
        [1, 2],
        "replay_endpoints[0]: invalid type: integer `1`, expected a string at line 1 column 174",
    ),  # fmt: skip
    (
        {"0": "tcp://a:1"},
        "replay_endpoints: invalid type: map, expected a sequence at line 1 column 189",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("value", "error"), SHAPES)
async def test_wrong_json_types_are_refused_as_serde_words_them(
    client: Any, value: Any, error: str
) -> None:
    """Worded as the other array fields are (``taints``): serde's text, the value's end."""
    r = await post(client, "/workers", body(replay_endpoints=value))
    assert (r.status_code, r.json()) == (
        422,
        {"error": "Failed to deserialize the JSON body into the target type: " + error},
    )
    assert await workers(client) == []


async def test_an_address_over_the_length_bound_is_refused(client: Any) -> None:
    r = await post(client, "/workers", body(replay_endpoints=["tcp://h:1", "ipc://" + "p" * 4091]))
    assert r.status_code == 422, r.text
    assert r.json() == {
        "error": "Failed to deserialize the JSON body into the target type: "
        "replay_endpoints[1]: String should have at most 4096 characters"
    }
    assert await workers(client) == []
    r = await post(client, "/workers", body(replay_endpoints=["tcp://h:1", "ipc://" + "p" * 4090]))
    assert r.status_code == 201, r.text


async def test_patch_checks_the_worker_it_would_leave(client: Any) -> None:
    assert (await post(client, "/workers", body())).status_code == 201
    url = f"{SEL}/workers/5"
    # more ranks without as many sockets: refused, nothing changed
    r = await client.patch(url, json={"data_parallel_size": 3})
    assert (r.status_code, r.json()) == (400, {"error": ONE_PER_RANK.format(3, 2)})
    assert await workers(client) == [record()]
    # ranks and sockets together
    kv3 = {**KV, "2": "tcp://10.0.0.1:5559"}
    three = [*REPLAY, "tcp://10.0.0.1:5602"]
    r = await client.patch(
        url, json={"data_parallel_size": 3, "kv_events_endpoints": kv3, "replay_endpoints": three}
    )
    want = record(data_parallel_size=3, kv_events_endpoints=kv3, replay_endpoints=three)
    assert (r.status_code, r.json()) == (200, want)
    # null keeps the list; the single form cannot be added beside it
    r = await client.patch(url, json={"replay_endpoints": None, "total_kv_blocks": 9})
    assert (r.status_code, r.json()) == (200, {**want, "total_kv_blocks": 9})
    r = await client.patch(url, json={"replay_endpoint": REPLAY[0]})
    assert (r.status_code, r.json()) == (
        400,
        {"error": "give either replay_endpoint or replay_endpoints, not both"},
    )
    r = await client.patch(url, json={"replay_endpoints": ["tcp://a:1", "tcp://b:2", "udp://c:3"]})
    assert (r.status_code, r.json()) == (400, {"error": ADDRESS.format(2)})
    assert await workers(client) == [{**want, "total_kv_blocks": 9}]


async def test_the_array_form_keeps_the_references_22_elements(client: Any) -> None:
    """Positionally the body is the reference's struct: no element for the list (a 23rd is
    refused as the reference refuses it), so an array body never sets it."""
    fields: list[Any] = [5, "default", "default", "http://w5", "tcp://10.0.0.1:5557", {},
                         "tcp://10.0.0.1:5600", 16, None, None, None, None, None, None, [], {},
                         None, None, None, None, {}, None]  # fmt: skip
    assert len(fields) == 22
    r = await post(client, "/workers", fields)
    assert r.status_code == 201, r.text
    assert "replay_endpoints" not in r.json()
    assert r.json()["replay_endpoint"] == "tcp://10.0.0.1:5600"
    r = await post(client, "/workers", [*fields, REPLAY])
    column = len(json.dumps(fields, separators=(",", ":"))) + 1  # where the 23rd begins
    assert (r.status_code, r.json()) == (
        400,
        {"error": f"Failed to parse the request body as JSON: trailing characters at line 1 "
                  f"column {column}"},
    )  # fmt: skip
    assert "replay_endpoints" not in (await workers(client))[0]
