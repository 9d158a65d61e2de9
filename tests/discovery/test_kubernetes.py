"""Kubernetes discovery end to end: the service, pointed through a kubeconfig file at a fake API
server over real HTTP (``fake_kube.py``), lists and watches its EndpointSlices; workers appear,
follow their readiness, disappear, and the watch carries on after the server drops it."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kv_slot_tracker import __main__ as entry
from kv_slot_tracker.config_sources import ConfigError
from kv_slot_tracker.discovery import kubernetes as kube_discovery
from kv_slot_tracker.discovery.kubernetes import (
    DiscoveryUnavailable,
    label_selector,
    require_client,
)
from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import Settings, load_settings
from tests.discovery.fake_kube import FakeKubeApi, endpoint

SERVICE = {"kubernetes.io/service-name": "vllm"}
LLAMA = {
    **SERVICE,
    "kv-slot-tracker/model-name": "llama",
    "kv-slot-tracker/block-size": "16",
    "kv-slot-tracker/dp-size": "2",
}


async def eventually(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def kube() -> FakeKubeApi:
    with FakeKubeApi() as api:
        yield api


@contextlib.asynccontextmanager
async def serving(kube: FakeKubeApi, tmp_path: Path, **overrides: Any) -> AsyncIterator[Any]:
    settings = load_settings(
        discovery_kubernetes_service="vllm",
        discovery_kubernetes_kubeconfig=str(kube.kubeconfig(tmp_path / "kubeconfig")),
        **overrides,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            app.state.client = client
            yield app


async def workers(app: Any) -> list[tuple[str, int, int, int, int]]:
    resp = await app.state.client.get("/workers")
    assert resp.status_code == 200
    return sorted(
        (w["model_name"], w["worker_id"], w["block_size"], w["dp_start"], w["dp_size"])
        for w in resp.json()
    )


def seen(app: Any) -> list[tuple[str, int, int, int, int]]:
    return sorted(
        (w["model_name"], w["worker_id"], w["block_size"], w["dp_start"], w["dp_size"])
        for w in app.state.service.workers(None, None)
    )


async def test_workers_appear_follow_readiness_and_disappear(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    # three slices: two pages of the list (the fake pages by 2); one of another Service
    kube.put("vllm-ipv4", [endpoint("vllm-0"), endpoint("vllm-1", ready=False)], LLAMA)
    kube.put("vllm-ipv6", [endpoint("vllm-0", ip="fd00::1")], LLAMA)  # the same pod
    kube.put("vllm-extra", [endpoint("vllm-2")], LLAMA)
    kube.put("other", [endpoint("other-5")], {"kubernetes.io/service-name": "other"})
    async with serving(kube, tmp_path) as app:
        await eventually(lambda: len(seen(app)) == 2, "the listed workers")
        assert await workers(app) == [("llama", 0, 16, 0, 2), ("llama", 2, 16, 0, 2)]
        assert kube.lists == 2  # two pages
        discovery = app.state.discovery
        assert discovery.namespace == "ns1"  # the kubeconfig context's
        await eventually(lambda: kube.open_watches() == 1, "the watch")
        assert kube.watches == ["1004"]  # from the list's resourceVersion

        # a request on worker 0, rank 1, for the removal to take with it
        add = {"model_name": "llama", "request_id": "r1", "worker_id": 0, "dp_rank": 1,
               "sequence_hashes": [1, 2], "new_isl_tokens": 32}  # fmt: skip
        assert (await app.state.client.post("/add", json=add)).status_code == 201

        # vllm-1 becomes ready
        kube.put("vllm-ipv4", [endpoint("vllm-0"), endpoint("vllm-1")], LLAMA)
        await eventually(lambda: len(seen(app)) == 3, "vllm-1 ready")
        # vllm-0 stops being ready in one slice: the other still lists it ready
        kube.put("vllm-ipv4", [endpoint("vllm-0", ready=False), endpoint("vllm-1")], LLAMA)
        kube.put("vllm-extra", [endpoint("vllm-2"), endpoint("vllm-4")], LLAMA)
        await eventually(lambda: len(seen(app)) == 4, "vllm-4")
        assert [w[1] for w in await workers(app)] == [0, 1, 2, 4]
        # ... and in the other one: worker 0 goes, with its request
        kube.put("vllm-ipv6", [endpoint("vllm-0", ready=False, ip="fd00::1")], LLAMA)
        await eventually(lambda: [w[1] for w in seen(app)] == [1, 2, 4], "vllm-0 not ready")
        loads = (await app.state.client.get("/loads", params={"model_name": "llama"})).json()
        assert sorted({(r["worker_id"], r["active_requests"]) for r in loads}) == [
            (1, 0), (2, 0), (4, 0)
        ]  # fmt: skip
        # a slice deleted: its workers go
        kube.delete("vllm-extra")
        await eventually(lambda: [w[1] for w in seen(app)] == [1], "the slice deleted")

        metrics = (await app.state.client.get("/metrics")).text
        assert "kv_slot_tracker_discovery_workers 1.0" in metrics
        assert "kv_slot_tracker_discovery_removals_total 3.0" in metrics
        assert "kv_slot_tracker_discovery_lists_total 1.0" in metrics
        assert "kv_slot_tracker_discovery_synced 1.0" in metrics


async def test_the_watch_resumes_after_a_drop_and_lists_again_after_410(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.put("vllm-a", [endpoint("vllm-0")], LLAMA)
    async with serving(kube, tmp_path) as app:
        await eventually(lambda: kube.open_watches() == 1, "the watch")
        assert [w[1] for w in seen(app)] == [0]

        kube.drop_watches()  # cut mid-stream: a new watch from the last version seen
        await eventually(lambda: len(kube.watches) == 2 and kube.open_watches() == 1, "rewatch")
        assert kube.watches == ["1001", "1001"]
        await eventually(lambda: app.state.discovery.synced, "synced again without an event")
        kube.put("vllm-a", [endpoint("vllm-0"), endpoint("vllm-1")], LLAMA)  # version 1002
        await eventually(lambda: [w[1] for w in seen(app)] == [0, 1], "vllm-1 after the drop")
        assert kube.lists == 1  # resumed, not listed again
        counters = app.state.discovery.counters
        assert counters.errors == 1 and counters.events == 1

        # the history compacted while the watch is away: 410, then a full list
        kube.drop_watches()
        kube.put("vllm-a", [endpoint("vllm-1")], LLAMA)  # version 1003 ...
        kube.compact()  # ... never sent as an event
        await eventually(lambda: [w[1] for w in seen(app)] == [1], "the state after 410")
        assert kube.lists == 2
        await eventually(lambda: kube.open_watches() == 1, "the watch after the list")
        assert kube.watches[-2:] == ["1002", "1003"]  # refused (410), then from the new list
        assert app.state.discovery.synced


async def test_a_watch_the_server_ends_is_opened_again_without_error(
    kube: FakeKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube_discovery, "WATCH_TIMEOUT_S", 1)
    kube.put("vllm-a", [endpoint("vllm-0")], LLAMA)
    async with serving(kube, tmp_path) as app:
        await eventually(lambda: len(kube.watches) >= 3, "two watches ended by the server")
        assert set(kube.watches) == {"1001"} and kube.lists == 1
        assert app.state.discovery.counters.errors == 0
        kube.put("vllm-a", [endpoint("vllm-3")], LLAMA)
        await eventually(lambda: [w[1] for w in seen(app)] == [3], "a change after that")


async def test_bad_input_is_counted_and_skipped_and_the_cap_holds(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    bad = {**LLAMA, "kv-slot-tracker/block-size": "sixteen"}
    kube.put("a-bad", [endpoint("vllm-7")], bad)
    kube.put("b-deployment", [endpoint("vllm-6f7d-abcde")], LLAMA)  # no ordinal
    kube.put("c-many", [endpoint(f"vllm-{i}") for i in range(3)], LLAMA)
    kube.put("d-more", [endpoint("vllm-3")], LLAMA)
    async with serving(kube, tmp_path, discovery_kubernetes_max_workers=3) as app:
        await eventually(lambda: kube.open_watches() == 1, "the watch")
        assert [w[1] for w in seen(app)] == [0, 1, 2]
        d = app.state.discovery
        assert d.counters.invalid_endpoints == 2 and d.discovered.over_cap == 1
        # room is made: discovery lists again and admits the worker it skipped
        kube.put("c-many", [endpoint("vllm-0"), endpoint("vllm-1")], LLAMA)
        await eventually(lambda: [w[1] for w in seen(app)] == [0, 1, 3], "the list after room")
        assert d.counters.lists == 2
        metrics = (await app.state.client.get("/metrics")).text
        assert "kv_slot_tracker_discovery_invalid_endpoints_total 4.0" in metrics  # twice each
        assert "kv_slot_tracker_discovery_over_cap_total 1.0" in metrics
        assert "kv_slot_tracker_discovery_workers 3.0" in metrics


async def test_a_block_size_the_tracker_refuses_is_counted(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.put("vllm-a", [], {**LLAMA, "kv-slot-tracker/block-size": "32"})
    async with serving(kube, tmp_path) as app:
        # a client registered the model first, with block size 16
        body = {
            "model_name": "llama",
            "worker_id": 9,
            "block_size": 16,
            "dp_start": 0,
            "dp_size": 1,
        }
        assert (await app.state.client.post("/register", json=body)).status_code == 201
        kube.put(
            "vllm-a",
            [endpoint("vllm-0"), endpoint("vllm-1")],
            {**LLAMA, "kv-slot-tracker/block-size": "32"},
        )
        await eventually(lambda: app.state.discovery.applier.counters.rejected == 2, "refusals")
        assert [w[1] for w in seen(app)] == [9]


async def test_settings_say_what_the_labels_do_not(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.put("vllm-a", [endpoint("vllm-0"), endpoint("vllm-1")], SERVICE)
    overrides = {
        "discovery_kubernetes_model_name": "qwen",
        "discovery_kubernetes_block_size": 64,
        "discovery_kubernetes_dp_size": 4,
        "discovery_kubernetes_routing_group": "prefill",
        "discovery_kubernetes_worker_id": "hash",
    }
    async with serving(kube, tmp_path, **overrides) as app:
        await eventually(lambda: len(seen(app)) == 2, "the workers")
        rows = app.state.service.workers(None, None)
        assert {(r["routing_group"], r["block_size"], r["dp_size"]) for r in rows} == {
            ("prefill", 64, 4)
        }
        from kv_slot_tracker.discovery.endpoints import pod_hash

        assert sorted(r["worker_id"] for r in rows) == sorted(
            [pod_hash("ns1", "vllm-0"), pod_hash("ns1", "vllm-1")]
        )


async def test_an_api_server_refusing_the_key_is_retried_not_fatal(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.put("vllm-a", [endpoint("vllm-0")], LLAMA)
    kube.refusing = True  # the kubeconfig's token is not (yet) accepted
    async with serving(kube, tmp_path) as app:
        await eventually(lambda: app.state.discovery.counters.errors >= 1, "a refused list")
        assert seen(app) == [] and not app.state.discovery.synced
        assert (await app.state.client.get("/health")).status_code == 200
        kube.refusing = False
        await eventually(lambda: [w[1] for w in seen(app)] == [0], "the list once accepted")


async def test_an_answer_that_is_no_list_is_counted_and_listed_again(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.put("vllm-a", [endpoint("vllm-0")], LLAMA)
    kube.garbled_lists = 2
    async with serving(kube, tmp_path) as app:
        await eventually(lambda: [w[1] for w in seen(app)] == [0], "the third list")
        d = app.state.discovery
        assert (d.counters.lists, d.counters.errors, kube.lists) == (3, 2, 3)
        assert d.last_error is None and d.synced


async def test_a_watch_line_that_is_no_event_is_counted_and_skipped(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.put("vllm-a", [endpoint("vllm-0")], LLAMA)
    async with serving(kube, tmp_path) as app:
        await eventually(lambda: kube.open_watches() == 1, "the watch")
        kube.inject(b"not json")
        kube.inject(b'{"type": "ADDED", "object": {"metadata": {}}}')  # a slice without a name
        kube.inject(b'{"type": "DELETED", "object": 7}')
        kube.inject(b'{"object": {}}')  # no type
        kube.put("vllm-a", [endpoint("vllm-0"), endpoint("vllm-2")], LLAMA)
        await eventually(lambda: [w[1] for w in seen(app)] == [0, 2], "the change after them")
        d = app.state.discovery
        assert (d.counters.invalid_slices, d.counters.errors, d.counters.watches) == (4, 0, 1)


def test_a_service_name_or_a_label_selector() -> None:
    assert label_selector("vllm") == "kubernetes.io/service-name=vllm"
    assert label_selector("app=vllm,tier!=cpu") == "app=vllm,tier!=cpu"


def test_without_the_client_the_service_says_so_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes_asyncio", None)  # import fails
    with pytest.raises(DiscoveryUnavailable, match=r"kv-slot-tracker\[kubernetes\]"):
        require_client()
    with pytest.raises(ConfigError, match=r"kv-slot-tracker\[kubernetes\]"):  # the one validation
        load_settings(discovery_kubernetes_service="vllm")
    with pytest.raises(DiscoveryUnavailable):
        create_app(Settings(discovery_kubernetes_service="vllm"))
    assert entry.main(["--discovery-kubernetes-service", "vllm"]) == 2
    err = capsys.readouterr().err
    assert (
        "\n--discovery-kubernetes-service: discovery_kubernetes_service is set but the Kubernetes "
        "client" in err
    )
    create_app(load_settings())  # off by default: nothing is imported


@pytest.mark.redis
async def test_what_one_instance_discovers_every_instance_holds(
    kube: FakeKubeApi, tmp_path: Path, redis_url: str, redis_namespace: str
) -> None:
    import redis

    shared = {"redis_url": redis_url, "namespace": redis_namespace}
    kube.put("vllm-a", [endpoint("vllm-0"), endpoint("vllm-1")], LLAMA)
    plain = create_app(load_settings(**shared))  # no discovery of its own
    try:
        async with (
            plain.router.lifespan_context(plain),
            serving(kube, tmp_path, **shared) as discovering,
        ):
            await eventually(lambda: [w[1] for w in seen(plain)] == [0, 1], "the replicas")
            kube.put("vllm-a", [endpoint("vllm-1", ready=False)], LLAMA)
            await eventually(lambda: seen(plain) == [], "the removals replicated")
            assert seen(discovering) == []
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + redis_namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()


async def test_a_kubeconfig_without_a_cluster_is_retried_not_fatal(tmp_path: Path) -> None:
    broken = tmp_path / "kubeconfig"
    broken.write_text('{"apiVersion": "v1", "kind": "Config", "current-context": "none"}')
    app = create_app(
        load_settings(
            discovery_kubernetes_service="vllm", discovery_kubernetes_kubeconfig=str(broken)
        )
    )
    async with app.router.lifespan_context(app):
        await eventually(lambda: app.state.discovery.counters.errors >= 1, "the failed start")
        assert "context" in app.state.discovery.last_error
        assert app.state.discovery.counters.lists == 0


def test_a_kubeconfig_that_is_not_there_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        load_settings(discovery_kubernetes_kubeconfig=str(tmp_path / "missing"))


def test_a_served_instance_discovers_workers(kube: FakeKubeApi, tmp_path: Path) -> None:
    """``python -m kv_slot_tracker`` (uvloop, uvicorn) configured by environment variables."""
    from tests.servers import live_server

    kube.put("vllm-a", [endpoint("vllm-0"), endpoint("vllm-1")], LLAMA)
    env = {
        "SLOT_TRACKER_DISCOVERY_KUBERNETES_SERVICE": "vllm",
        "SLOT_TRACKER_DISCOVERY_KUBERNETES_KUBECONFIG": str(kube.kubeconfig(tmp_path / "kc")),
    }
    with live_server(tmp_path, **env) as url:

        def worker_ids() -> list[int]:
            return sorted(w["worker_id"] for w in httpx.get(f"{url}/workers").json())

        deadline = time.monotonic() + 20
        while worker_ids() != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker_ids() == [0, 1]
        kube.put("vllm-a", [endpoint("vllm-1")], LLAMA)
        deadline = time.monotonic() + 20
        while worker_ids() != [1] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker_ids() == [1]
        metrics = httpx.get(f"{url}/metrics").text
        assert "kv_slot_tracker_discovery_removals_total 1.0" in metrics


async def test_discovered_workers_keep_their_leases_and_others_expire(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    from tests.fakes import FakeClock

    clock = FakeClock()
    kube.put("vllm-a", [endpoint("vllm-0")], LLAMA)
    settings = load_settings(
        discovery_kubernetes_service="vllm",
        discovery_kubernetes_kubeconfig=str(kube.kubeconfig(tmp_path / "kubeconfig")),
        worker_ttl_seconds=3,
    )
    app = create_app(settings, clock=clock.now)
    service = app.state.service
    key = ("llama", "default")
    async with app.router.lifespan_context(app):
        await eventually(lambda: [w[1] for w in seen(app)] == [0], "the discovered worker")
        register = {"model_name": "llama", "worker_id": 9, "block_size": 16, "dp_start": 0,
                    "dp_size": 2}  # fmt: skip
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.post("/register", json=register)).status_code == 201
        start = clock.now()
        assert service.registry.leases.deadline(key, 9) == start + 3 * 10**9
        clock.advance(2)
        # discovery renews its worker every ttl/3 (1 s of real time): from the clock's now
        await eventually(
            lambda: service.registry.leases.deadline(key, 0) == clock.now() + 3 * 10**9,
            "the renewal",
        )
        clock.advance(2)  # worker 9: 4 s without a renewal; worker 0: 2 s since its renewal
        await eventually(lambda: [w[1] for w in seen(app)] == [0], "worker 9's lease to run out")
        assert service.registry.workers_expired == 1
