"""``/metrics``: tracker state per worker rank, lifecycle counters and HTTP metrics.

The tracker gauges are read from the service at scrape time, so their values are exact (and the
prefill gauge decays with the clock); every app has its own registry, so several apps in one
process never share or clash over series.
"""

from __future__ import annotations

from typing import Any

import httpx
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings
from tests.api.conftest import PostJson, post_json
from tests.fakes import FakeClock

RANK_GAUGES = (
    "kv_slot_tracker_active_decode_blocks",
    "kv_slot_tracker_active_prefill_tokens",
    "kv_slot_tracker_active_requests",
    "kv_slot_tracker_worker_registered",
)
COUNTERS = (
    "kv_slot_tracker_requests_added",
    "kv_slot_tracker_requests_freed",
    "kv_slot_tracker_requests_expired",
)
U64_MAX = 2**64 - 1
# The HTTP metrics, named with the service's prefix like every series of its own
REQUESTS = "kv_slot_tracker_http_requests_total"
LATENCY = "kv_slot_tracker_http_request_duration_seconds"


class Scrape:
    """One parsed ``/metrics`` answer: ``value(sample_name, **labels)``."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def value(self, name: str, **labels: Any) -> float | None:
        key = (name, frozenset((k, str(v)) for k, v in labels.items()))
        return self.samples.get(key)

    def series(self, name: str) -> list[dict[str, str]]:
        return [dict(labels) for (n, labels) in self.samples if n == name]

    def rank(self, model: str, worker_id: int, dp_rank: int, group: str = "default"):
        """The four gauges of one rank: (blocks, tokens, requests, registered)."""
        labels = {
            "model_name": model,
            "routing_group": group,
            "worker_id": worker_id,
            "dp_rank": dp_rank,
        }
        return tuple(self.value(name, **labels) for name in RANK_GAUGES)

    def counters(self, model: str, group: str = "default"):
        """(added, freed, expired) of one tracker key."""
        labels = {"model_name": model, "routing_group": group}
        return tuple(self.value(f"{name}_total", **labels) for name in COUNTERS)


async def scrape(client: httpx.AsyncClient) -> Scrape:
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return Scrape(r.text)


def reg(worker_id: int, model: str = "m", dp_start: int = 0, dp_size: int = 1, **extra: Any):
    return {
        "worker_id": worker_id,
        "model_name": model,
        "block_size": 4,
        "dp_start": dp_start,
        "dp_size": dp_size,
        **extra,
    }


def add(rid: str, worker_id: int = 1, dp_rank: int = 0, model: str = "m", **extra: Any):
    return {
        "model_name": model,
        "request_id": rid,
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "sequence_hashes": extra.pop("sequence_hashes", []),
        **extra,
    }


async def ok(post: PostJson, path: str, body: Any, status: int = 200) -> None:
    r = await post(path, body)
    assert r.status_code == status, (path, r.status_code, r.text)


async def test_rank_gauges_have_exact_values(
    post: PostJson, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    await ok(post, "/register", reg(1, dp_size=2), 201)
    await ok(post, "/register", reg(U64_MAX, dp_start=7, routing_group="g"), 201)
    await ok(post, "/add", add("r1", sequence_hashes=[1, 2, 3], new_isl_tokens=12), 201)
    await ok(post, "/output_block", {"model_name": "m", "request_id": "r1", "decay_fraction": 0.5})
    body = add("r2", dp_rank=1, sequence_hashes=[1, 2], new_isl_tokens=100)
    await ok(post, "/add", {**body, "expected_prefill_ms": 10_000}, 201)

    m = await scrape(client)
    for name in RANK_GAUGES:
        assert m.families[name].type == "gauge"
    assert m.rank("m", 1, 0) == (2, 12, 1, 1)  # 4 exclusive blocks x 0.5
    assert m.rank("m", 1, 1) == (2, 100, 1, 1)
    assert m.rank("m", U64_MAX, 7, group="g") == (0, 0, 0, 1)
    assert m.value("kv_slot_tracker_trackers") == 2
    assert len(m.series("kv_slot_tracker_worker_registered")) == 3

    clock.advance(5)  # the modeled prefill decays at scrape time
    m = await scrape(client)
    assert m.rank("m", 1, 1) == (2, 50, 1, 1)
    await ok(post, "/prefill_complete", {"model_name": "m", "request_id": "r1"})
    await ok(post, "/free", {"model_name": "m", "request_id": "r2"})
    m = await scrape(client)
    assert m.rank("m", 1, 0) == (2, 0, 1, 1)
    assert m.rank("m", 1, 1) == (0, 0, 0, 1)


async def test_lifecycle_counters_count_exactly(
    app, post: PostJson, client: httpx.AsyncClient, clock: FakeClock
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/register", reg(1, model="other"), 201)
    m = await scrape(client)
    assert m.counters("m") == (0, 0, 0)
    for name in COUNTERS:
        assert m.families[name].type == "counter"

    await ok(post, "/add", add("a"), 201)
    await ok(post, "/add", add("b"), 201)
    await ok(post, "/add", add("a"), 409)  # duplicate: not counted
    await ok(post, "/add", add("z", worker_id=5), 404)  # unknown rank: not counted
    await ok(post, "/free", {"model_name": "m", "request_id": "a"})
    await ok(post, "/free", {"model_name": "m", "request_id": "a"})  # no-op: not counted
    await ok(post, "/free", {"model_name": "m", "request_id": "never"})  # not counted
    await ok(
        post,
        "/batch",
        {
            "operations": [
                {"op": "add", **add("c")},
                {"op": "free", "model_name": "m", "request_id": "c"},
                {"op": "add", **add("d", model="other")},
            ]
        },
    )
    m = await scrape(client)
    assert m.counters("m") == (3, 2, 0)
    assert m.counters("other") == (1, 0, 0)

    clock.advance(331)
    assert app.state.service.expire() == 2  # b on m, d on other
    m = await scrape(client)
    assert m.counters("m") == (3, 2, 1)
    assert m.counters("other") == (1, 0, 1)
    assert m.rank("m", 1, 0) == (0, 0, 0, 1)


async def test_series_of_removed_ranks_disappear(post: PostJson, client: httpx.AsyncClient) -> None:
    await ok(post, "/register", reg(1, dp_size=2), 201)
    await ok(post, "/register", reg(2), 201)
    await ok(post, "/add", add("r1", dp_rank=1, sequence_hashes=[1]), 201)
    m = await scrape(client)
    assert m.rank("m", 1, 1) == (1, 0, 1, 1)

    await ok(post, "/upsert", reg(1, dp_size=1))  # rank (1, 1) leaves
    m = await scrape(client)
    assert m.rank("m", 1, 1) == (None, None, None, None)
    assert m.rank("m", 1, 0) == (0, 0, 0, 1)

    await ok(post, "/unregister", {"worker_id": 2, "model_name": "m"})
    m = await scrape(client)
    assert m.rank("m", 2, 0) == (None, None, None, None)
    for name in RANK_GAUGES:
        assert m.series(name) == [
            {"model_name": "m", "routing_group": "default", "worker_id": "1", "dp_rank": "0"}
        ]

    await ok(post, "/unregister", {"worker_id": 1, "model_name": "m"})  # drops the tracker
    m = await scrape(client)
    for name in RANK_GAUGES:
        assert m.series(name) == []
    assert m.value("kv_slot_tracker_trackers") == 0
    assert m.counters("m") == (None, None, None)  # the key's counters went with its tracker
    for name in COUNTERS:
        assert m.series(f"{name}_total") == []

    await ok(post, "/register", reg(1), 201)  # back: counted from 0 (a counter reset)
    m = await scrape(client)
    assert m.counters("m") == (0, 0, 0)


async def test_names_that_come_and_go_leave_no_series_behind(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    sizes = []
    for i in range(60):
        if i in (10, 59):
            sizes.append(len((await client.get("/metrics")).content))
        name = f"model-{i}-" + "x" * 1000
        body = {"worker_id": 1, "model_name": name, "block_size": 4, "dp_start": 0, "dp_size": 1}
        await ok(post, "/register", body, 201)
        await ok(post, "/add", add("r", sequence_hashes=[1]) | {"model_name": name}, 201)
        await ok(post, "/unregister", {"worker_id": 1, "model_name": name})
    text = (await client.get("/metrics")).text
    assert "model-" not in text
    assert sizes[1] - sizes[0] < 300, sizes  # only the counts' digits grew, no series


async def test_http_metrics_from_the_instrumentator(
    post: PostJson, client: httpx.AsyncClient
) -> None:
    await ok(post, "/register", reg(1), 201)
    await ok(post, "/add", add("r1"), 201)
    await ok(post, "/add", add("r1"), 409)
    await ok(post, "/add", add("r2"), 201)
    await client.get("/loads")
    await client.get("/no/such/route")
    await client.get("/metrics")
    m = await scrape(client)

    assert m.value(REQUESTS, handler="/add", method="POST", status="2xx") == 2
    assert m.value(REQUESTS, handler="/add", method="POST", status="4xx") == 1
    assert m.value(REQUESTS, handler="/loads", method="GET", status="2xx") == 1
    assert m.value(REQUESTS, handler="none", method="GET", status="4xx") == 1
    assert m.families[LATENCY].type == "histogram"
    assert m.value(f"{LATENCY}_count", handler="/add", method="POST") == 3
    # the scrape endpoint does not measure itself
    handlers = {s["handler"] for s in m.series(REQUESTS)}
    assert "/metrics" not in handlers


async def test_two_apps_have_their_own_registries(make_client) -> None:
    async with make_client() as (app_a, a), make_client() as (app_b, b):
        assert app_a.state.registry is not app_b.state.registry
        assert (await post_json(a, "/register", reg(1))).status_code == 201
        assert (await post_json(a, "/add", add("r1", sequence_hashes=[1, 2]))).status_code == 201

        ma, mb = await scrape(a), await scrape(b)
        assert ma.rank("m", 1, 0) == (2, 0, 1, 1)
        assert ma.counters("m") == (1, 0, 0)
        assert mb.series("kv_slot_tracker_active_decode_blocks") == []
        assert mb.counters("m") == (None, None, None)
        assert mb.value("kv_slot_tracker_trackers") == 0
        assert ma.value(REQUESTS, handler="/add", method="POST", status="2xx") == 1
        assert mb.value(REQUESTS, handler="/add", method="POST", status="2xx") is None

    # building more apps in the same process raises no "Duplicated timeseries", and nothing
    # lands in the process-global registry
    for _ in range(3):
        create_app(load_settings(api_key="", redis_url=""))
    global_names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not {n for n in global_names if n.startswith(("kv_slot_tracker", "http_request"))}


def test_http_latency_buckets_count_each_observation_at_or_below_their_bound() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kv_slot_tracker.observability.http import HttpMetrics

    registry = CollectorRegistry()
    http = HttpMetrics(registry)
    for seconds in (0.0005, 0.0006, 0.001, 2.5, 3.0):  # two on a bound, one above the last
        http.observe("POST", "/add", 201, seconds)
    http.observe("POST", "/add", 404, 0.0001)
    http.observe("GET", "/loads", 200, 0.02)
    m = Scrape(generate_latest(registry).decode())

    def bucket(le: str) -> float | None:
        return m.value(f"{LATENCY}_bucket", handler="/add", method="POST", le=le)

    assert [bucket(le) for le in ("0.0005", "0.001", "0.0025", "1.0", "2.5", "+Inf")] == [
        2.0,  # 0.0001 and 0.0005
        4.0,
        4.0,
        4.0,
        5.0,
        6.0,
    ]
    assert m.value(f"{LATENCY}_count", handler="/add", method="POST") == 6
    total = m.value(f"{LATENCY}_sum", handler="/add", method="POST")
    assert abs(total - (0.0005 + 0.0006 + 0.001 + 2.5 + 3.0 + 0.0001)) < 1e-9
    assert m.value(REQUESTS, handler="/add", method="POST", status="2xx") == 5
    assert m.value(REQUESTS, handler="/add", method="POST", status="4xx") == 1
    assert m.value(REQUESTS, handler="/loads", method="GET", status="2xx") == 1
    assert m.value(f"{LATENCY}_created", handler="/loads", method="GET") > 0
