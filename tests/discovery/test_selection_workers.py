"""Kubernetes discovery of selection workers: each ready endpoint goes into the selection API's
catalog with its HTTP endpoint and its KV-event (and replay) publishers, from its pod's
annotations or named container ports, else from the slice, so that a fleet publishing KV events
needs no hand-written registration. Pure reading first, then end to end against the fake API
server (``fake_kube.py``) over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kv_slot_tracker.discovery.endpoints import (
    Mapping,
    Pod,
    pods_wanted,
    read_pod,
    read_slice,
)
from tests.discovery.fake_kube import FakeKubeApi, endpoint
from tests.discovery.test_kubernetes import SERVICE, eventually, serving

IP = "192.0.2.10"  # TEST-NET-1: nothing answers there
SELECTION = Mapping(namespace="ns1", api="selection", model_name="llama", block_size=16)
VLLM_PORTS = [
    {"name": "http", "port": 8000, "protocol": "TCP"},
    {"name": "kv-events", "port": 5557, "protocol": "TCP"},
    {"name": "kv-replay", "port": 5560, "protocol": "TCP"},
]


def slice_obj(
    endpoints: list[dict[str, Any]],
    labels: dict[str, str] | None = None,
    ports: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "s1",
            "namespace": "ns1",
            "labels": labels or {},
            "annotations": annotations or {},
        },
        "endpoints": endpoints,
        "ports": VLLM_PORTS if ports is None else ports,
    }


def pod(annotations: dict[str, str] | None = None, uid: str = "u", **ports: int) -> Pod:
    return Pod(uid, tuple((annotations or {}).items()), tuple(ports.items()))


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as api:
        yield api


# -- reading ----------------------------------------------------------------------------------


def test_a_slice_alone_gives_the_addresses_rank_r_at_port_plus_r() -> None:
    read = read_slice(
        slice_obj([endpoint("vllm-0", ip=IP)], {"kv-slot-tracker/dp-size": "2"}), SELECTION
    )
    (w,) = read.workers.values()
    assert (w.api, w.worker_id, w.dp_start, w.dp_size) == ("selection", 0, 0, 2)
    assert w.endpoint == f"http://{IP}:8000"
    assert w.kv_events == ((0, f"tcp://{IP}:5557"), (1, f"tcp://{IP}:5558"))
    assert w.replay == (f"tcp://{IP}:5560", f"tcp://{IP}:5561")  # the engines offset it too


def test_one_rank_worker_gets_its_replay_socket_at_its_rank() -> None:
    labels = {"kv-slot-tracker/dp-start": "3", "kv-slot-tracker/dp-size": "1"}
    (w,) = read_slice(slice_obj([endpoint("vllm-1", ip=IP)], labels), SELECTION).workers.values()
    assert w.kv_events == ((3, f"tcp://{IP}:5560"),)
    assert w.replay == (f"tcp://{IP}:5563",)


def test_the_pod_says_first_then_the_slice() -> None:
    ep = [endpoint("vllm-0", ip=IP)]
    ann = {"kv-slot-tracker/kv-events-port": "7000"}
    # pod annotation > pod container port > slice annotation or label > slice port
    cases = [
        ({"vllm-0": pod(ann, **{"kv-events": 6000})}, {"kv-slot-tracker/kv-events-port": "6500"}, 7000),
        ({"vllm-0": pod(None, **{"kv-events": 6000})}, {"kv-slot-tracker/kv-events-port": "6500"}, 6000),
        ({"vllm-0": pod(None)}, {"kv-slot-tracker/kv-events-port": "6500"}, 6500),
        ({}, {}, 5557),
    ]  # fmt: skip
    for pods, labels, port in cases:
        (w,) = read_slice(slice_obj(ep, labels), SELECTION, pods).workers.values()
        assert w.kv_events == ((0, f"tcp://{IP}:{port}"),), (pods, labels)
    # an HTTP port from the pod, and an annotation on the slice instead of a label
    pods = {"vllm-0": pod(None, http=9000)}
    annotations = {"kv-slot-tracker/replay-port": "5600"}
    (w,) = read_slice(slice_obj(ep, annotations=annotations), SELECTION, pods).workers.values()
    assert (w.endpoint, w.replay) == (f"http://{IP}:9000", (f"tcp://{IP}:5600",))


def test_without_named_ports_the_first_other_port_is_http_and_no_publisher() -> None:
    ports = [{"name": "metrics", "port": 9100}]
    (w,) = read_slice(slice_obj([endpoint("sglang-2", ip=IP)], ports=ports), SELECTION).workers.values()  # fmt: skip
    assert (w.endpoint, w.kv_events, w.replay) == (f"http://{IP}:9100", (), ())
    (w,) = read_slice(slice_obj([endpoint("sglang-2", ip=IP)], ports=[]), SELECTION).workers.values()  # fmt: skip
    assert w.endpoint is None  # the catalog will say: endpoint is required


def test_an_ipv6_address_is_bracketed() -> None:
    (w,) = read_slice(slice_obj([endpoint("vllm-0", ip="fd00::1")]), SELECTION).workers.values()
    assert w.endpoint == "http://[fd00::1]:8000"
    assert w.kv_events == ((0, "tcp://[fd00::1]:5557"),)


def test_bad_ports_and_addresses_are_counted_not_fatal() -> None:
    good = endpoint("vllm-0", ip=IP)
    no_address = {**endpoint("vllm-1"), "addresses": []}
    odd_address = endpoint("vllm-2", ip="10.0.0.1/8")
    read = read_slice(slice_obj([good, no_address, odd_address]), SELECTION)
    assert [w.worker_id for w in read.workers.values()] == [0]
    assert read.invalid == 2
    # a port that is no number, out of range, or too high for the ranks: the endpoint skipped
    for labels in (
        {"kv-slot-tracker/kv-events-port": "x"},
        {"kv-slot-tracker/kv-events-port": "70000"},
        {"kv-slot-tracker/kv-events-port": "65535", "kv-slot-tracker/dp-size": "2"},
    ):
        read = read_slice(slice_obj([good], labels), SELECTION)
        assert (len(read.workers), read.invalid) == (0, 1), labels
    bad_pod = {"vllm-0": pod({"kv-slot-tracker/kv-events-port": "0"})}
    assert read_slice(slice_obj([good]), SELECTION, bad_pod).invalid == 1
    # a slice whose api is neither, or whose ports are no list: every endpoint skipped
    assert read_slice(slice_obj([good], {"kv-slot-tracker/api": "both"}), SELECTION).invalid == 1
    assert read_slice({**slice_obj([good]), "ports": "8000"}, SELECTION).invalid == 1


def test_a_slot_tracker_slice_is_read_as_before() -> None:
    slot = Mapping(namespace="ns1", model_name="llama", block_size=16)
    (w,) = read_slice(slice_obj([endpoint("vllm-0", ip=IP)]), slot).workers.values()
    assert (w.api, w.endpoint, w.kv_events, w.replay) == ("slot", None, (), ())
    # ... and a slice may ask for the selection API itself
    labels = {"kv-slot-tracker/api": "selection"}
    (w,) = read_slice(slice_obj([endpoint("vllm-0", ip=IP)], labels), slot).workers.values()
    assert (w.api, w.endpoint) == ("selection", f"http://{IP}:8000")


def test_pods_wanted_are_the_ready_pods_of_selection_slices() -> None:
    eps = [endpoint("vllm-0"), endpoint("vllm-1", ready=False), {"hostname": "h-2"}]
    assert pods_wanted(slice_obj(eps), SELECTION) == {"vllm-0": "uid-vllm-0"}
    assert pods_wanted(slice_obj(eps), Mapping(namespace="ns1")) == {}
    assert pods_wanted({"metadata": "x"}, SELECTION) == {}


def test_read_pod_keeps_its_annotations_and_named_ports() -> None:
    obj = {
        "metadata": {
            "uid": "u-1",
            "annotations": {"kv-slot-tracker/kv-events-port": "5557", "other/x": "y"},
        },
        "spec": {
            "containers": [
                {"ports": [{"name": "kv-events", "containerPort": 5557}, {"containerPort": 1}]},
                {"ports": [{"name": "http", "containerPort": 8000}, "junk"]},
                "junk",
            ]
        },
    }
    got = read_pod(obj)
    assert got == Pod("u-1", (("kv-slot-tracker/kv-events-port", "5557"),), (("kv-events", 5557), ("http", 8000)))  # fmt: skip
    for bad in (None, {}, {"metadata": {"uid": 5}}, []):
        with pytest.raises(ValueError):
            read_pod(bad)


# -- end to end ---------------------------------------------------------------------------------

VLLM = {**SERVICE, "kv-slot-tracker/model-name": "llama", "kv-slot-tracker/block-size": "16",
        "kv-slot-tracker/dp-size": "2"}  # fmt: skip


async def catalog(app: Any) -> dict[int, dict[str, Any]]:
    resp = await app.state.client.get("/selection/workers")
    assert resp.status_code == 200
    return {w["worker_id"]: w for w in resp.json()}


def held(app: Any) -> dict[int, Any]:
    return {r.spec.worker_id: r for r in app.state.selection.workers(None, None)}


async def test_selection_workers_come_from_their_pods(kube: FakeKubeApi, tmp_path: Path) -> None:
    # vLLM: container ports named http and kv-events (rank r publishes on 5557 + r)
    kube.put_pod("vllm-0", ports={"http": 8000, "kv-events": 5557, "kv-replay": 5570})
    # SGLang: annotations (its --kv-events-config endpoint port, and the server's port)
    kube.put_pod(
        "sglang-1",
        annotations={"kv-slot-tracker/kv-events-port": "5600", "kv-slot-tracker/http-port": "30000",
                     "kv-slot-tracker/replay-port": "5610"},
    )  # fmt: skip
    kube.put("vllm", [endpoint("vllm-0", ip=IP)], VLLM, ports=[])
    sglang = {**VLLM, "kv-slot-tracker/dp-size": "1"}
    kube.put("sglang", [endpoint("sglang-1", ip="192.0.2.11")], sglang, ports=[])
    async with serving(
        kube, tmp_path, discovery_kubernetes_api="selection", router_use_kv_events=True
    ) as app:
        await eventually(lambda: len(held(app)) == 2, "both workers in the catalog")
        workers = await catalog(app)
        assert workers[0]["lifecycle"] == "schedulable"
        assert workers[0]["endpoint"] == f"http://{IP}:8000"
        assert workers[0]["kv_events_endpoints"] == {"0": f"tcp://{IP}:5557", "1": f"tcp://{IP}:5558"}  # fmt: skip
        assert (workers[0]["data_parallel_start_rank"], workers[0]["data_parallel_size"]) == (0, 2)
        # two ranks: a replay socket each (the reference's one field cannot say which rank)
        assert workers[0]["replay_endpoints"] == [f"tcp://{IP}:5570", f"tcp://{IP}:5571"]
        assert workers[0]["replay_endpoint"] is None
        assert workers[1]["lifecycle"] == "schedulable"
        assert workers[1]["endpoint"] == "http://192.0.2.11:30000"
        assert workers[1]["kv_events_endpoints"] == {"0": "tcp://192.0.2.11:5600"}
        assert workers[1]["replay_endpoint"] == "tcp://192.0.2.11:5610"
        assert "replay_endpoints" not in workers[1]  # one rank: the reference's shape
        # the selection API can choose among them at once
        pick = await app.state.client.post(
            "/selection/select", json={"model_name": "llama", "token_ids": list(range(40))}
        )
        assert pick.status_code == 200 and pick.json()["worker_id"] in (0, 1)

        # a slice change that leaves the pod as it was reads no pod again
        reads = len(kube.pod_reads)
        kube.put("vllm", [endpoint("vllm-0", ip=IP), endpoint("vllm-2", ready=False)], VLLM, ports=[])  # fmt: skip
        await eventually(lambda: app.state.discovery.counters.events >= 1, "the change")
        assert len(kube.pod_reads) == reads
        # the pod restarts (a new uid) with another port: read again, the record follows
        kube.put_pod("vllm-0", ports={"http": 8000, "kv-events": 6000}, uid="uid-vllm-0-b")
        restarted = {**endpoint("vllm-0", ip=IP), "targetRef": {"kind": "Pod", "name": "vllm-0", "uid": "uid-vllm-0-b"}}  # fmt: skip
        kube.put("vllm", [restarted], VLLM, ports=[])
        await eventually(
            lambda: (
                held(app)[0].spec.kv_events_endpoints
                == {"0": f"tcp://{IP}:6000", "1": f"tcp://{IP}:6001"}
            ),  # fmt: skip
            "the restarted pod's port",
        )
        # not ready: out of the catalog
        kube.put("sglang", [endpoint("sglang-1", ready=False, ip="192.0.2.11")], sglang, ports=[])
        await eventually(lambda: sorted(held(app)) == [0], "sglang-1 not ready")
        assert sorted(await catalog(app)) == [0]


async def test_pods_that_cannot_be_read_leave_the_slice_to_say(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.pods_forbidden = True  # no RBAC on pods
    kube.put("vllm", [endpoint("vllm-0", ip=IP)], VLLM, ports=VLLM_PORTS)
    async with serving(
        kube, tmp_path, discovery_kubernetes_api="selection", router_use_kv_events=False
    ) as app:
        await eventually(lambda: len(held(app)) == 1, "the worker from the slice")
        record = (await catalog(app))[0]
        assert record["kv_events_endpoints"] == {"0": f"tcp://{IP}:5557", "1": f"tcp://{IP}:5558"}
        assert app.state.discovery.counters.pod_errors >= 1


async def test_an_incomplete_worker_is_kept_and_counted(kube: FakeKubeApi, tmp_path: Path) -> None:
    """KV events on and no publisher port anywhere: in the catalog, not schedulable."""
    kube.put_pod("vllm-0", ports={"http": 8000})
    kube.put("vllm", [endpoint("vllm-0", ip=IP)], VLLM, ports=[])
    async with serving(
        kube, tmp_path, discovery_kubernetes_api="selection", router_use_kv_events=True
    ) as app:
        await eventually(lambda: len(held(app)) == 1, "the worker")
        record = (await catalog(app))[0]
        assert record["lifecycle"] == "incomplete"
        assert app.state.discovery.applier.counters.incomplete == 1


async def test_the_slot_api_still_registers_slot_workers(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.put("vllm", [endpoint("vllm-0", ip=IP)], VLLM)
    async with serving(kube, tmp_path, router_use_kv_events=False) as app:
        await eventually(lambda: len(app.state.service.workers(None, None)) == 1, "the worker")
        assert held(app) == {} and kube.pod_reads == []
