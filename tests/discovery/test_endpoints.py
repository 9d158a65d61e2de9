"""EndpointSlices read into workers (what an operator's labels and settings make of them), the
discovered set per slice with its cap, and the applier turning it into topology commands."""

from __future__ import annotations

import pytest

from kv_slot_tracker.discovery.apply import Applier
from kv_slot_tracker.discovery.endpoints import (
    DiscoveredSet,
    InvalidSlice,
    Mapping,
    Worker,
    pod_hash,
    read_slice,
)
from kv_slot_tracker.service import SlotTrackerService
from kv_slot_tracker.service import commands as c
from tests.discovery.fake_kube import endpoint
from tests.fakes import FakeClock

SETTINGS = Mapping(namespace="ns1", model_name="llama", block_size=16)


def eslice(name: str, endpoints: list, labels=None, annotations=None, namespace="ns1") -> dict:
    meta = {"name": name, "namespace": namespace, "labels": labels or {}}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta, "addressType": "IPv4", "endpoints": endpoints}


def ids(read) -> list[tuple[str, str, int, int, int, int]]:
    return sorted(
        (w.model_name, w.routing_group, w.worker_id, w.block_size, w.dp_start, w.dp_size)
        for w in read.workers.values()
    )


def test_settings_fill_what_the_slice_does_not_say() -> None:
    read = read_slice(eslice("s", [endpoint("vllm-0"), endpoint("vllm-3")]), SETTINGS)
    assert ids(read) == [("llama", "default", 0, 16, 0, 1), ("llama", "default", 3, 16, 0, 1)]
    assert (read.invalid, read.not_ready) == (0, 0)


def test_annotation_wins_over_label_which_wins_over_the_setting() -> None:
    labels = {
        "kv-slot-tracker/model-name": "from-label",
        "kv-slot-tracker/block-size": "32",
        "kv-slot-tracker/dp-size": "4",
        "kv-slot-tracker/routing-group": "fast",
    }
    annotations = {
        "kv-slot-tracker/model-name": "meta-llama/Llama-3.1-8B",
        "kv-slot-tracker/dp-start": "8",
    }
    read = read_slice(eslice("s", [endpoint("w-2")], labels, annotations), SETTINGS)
    assert ids(read) == [("meta-llama/Llama-3.1-8B", "fast", 2, 32, 8, 4)]


def test_not_ready_endpoints_are_counted_and_an_unset_condition_is_ready() -> None:
    eps = [endpoint("w-0", ready=False), endpoint("w-1", ready=None), endpoint("w-2")]
    read = read_slice(eslice("s", eps), SETTINGS)
    assert [w.worker_id for w in read.workers.values()] == [1, 2]
    assert read.not_ready == 1


def test_hash_ids_are_stable_and_per_namespace() -> None:
    mapping = Mapping(namespace="ns1", worker_id_from="hash", model_name="m", block_size=4)
    read = read_slice(eslice("s", [endpoint("vllm-7d4b9c-x2k9p")]), mapping)
    assert [w.worker_id for w in read.workers.values()] == [5823911315841547464]
    assert pod_hash("ns1", "vllm-7d4b9c-x2k9p") == 5823911315841547464
    assert pod_hash("ns2", "vllm-7d4b9c-x2k9p") == 3873418549231989521
    # the slice's own namespace counts, not the setting
    other = read_slice(eslice("s", [endpoint("vllm-7d4b9c-x2k9p")], namespace="ns2"), mapping)
    assert [w.worker_id for w in other.workers.values()] == [3873418549231989521]


@pytest.mark.parametrize(
    ("labels", "problem"),
    [
        ({"kv-slot-tracker/block-size": "abc"}, "block-size 'abc' is not a whole number"),
        ({"kv-slot-tracker/block-size": "0"}, "block-size 0 is out of range 1..4294967295"),
        ({"kv-slot-tracker/block-size": "-16"}, "block-size '-16' is not a whole number"),
        ({"kv-slot-tracker/dp-size": "0"}, "dp-size 0 is out of range 1..4096"),
        ({"kv-slot-tracker/dp-size": "4097"}, "dp-size 4097 is out of range 1..4096"),
        ({"kv-slot-tracker/model-name": ""}, "model-name must be 1 to 1024 characters"),
    ],
)
def test_bad_labels_skip_every_endpoint_of_the_slice(labels, problem) -> None:
    read = read_slice(eslice("s", [endpoint("w-0"), endpoint("w-1")], labels), SETTINGS)
    assert read.workers == {} and read.invalid == 2 and read.problem == problem


def test_a_model_name_is_required_from_somewhere() -> None:
    read = read_slice(eslice("s", [endpoint("w-0")]), Mapping(namespace="n", block_size=16))
    assert read.workers == {} and read.invalid == 1
    assert read.problem == "model-name must be 1 to 1024 characters"


def test_endpoints_that_name_no_pod_or_ordinal_are_skipped_one_by_one() -> None:
    eps = [
        endpoint("vllm-0"),
        endpoint("vllm-abc"),  # a Deployment's pod: no ordinal
        {"addresses": ["10.0.0.9"], "conditions": {"ready": True}},  # no targetRef, no hostname
        {"addresses": ["10.0.0.8"], "hostname": "vllm-7"},  # a hostname serves as the name
        "not an object",
    ]
    read = read_slice(eslice("s", eps), SETTINGS)
    assert [w.worker_id for w in read.workers.values()] == [0, 7]
    assert read.invalid == 3


def test_an_object_without_a_name_is_not_a_slice() -> None:
    for obj in ({}, {"metadata": {}}, {"metadata": {"name": 5}}, [], None):
        with pytest.raises(InvalidSlice):
            read_slice(obj, SETTINGS)
    assert read_slice({"metadata": {"name": "empty"}}, SETTINGS).workers == {}  # no endpoints


def test_a_slice_with_more_endpoints_than_the_api_allows_is_skipped() -> None:
    eps = [endpoint(f"w-{i}") for i in range(1001)]
    read = read_slice(eslice("s", eps), SETTINGS)
    assert read.workers == {} and read.invalid == 1001


def workers_of(name: str, *pods: str) -> dict:
    return read_slice(eslice(name, [endpoint(p) for p in pods]), SETTINGS).workers


def test_a_pod_in_two_slices_is_wanted_while_either_lists_it() -> None:
    found = DiscoveredSet(max_workers=10)
    assert found.put("v4", workers_of("v4", "w-0", "w-1")) == {
        (("llama", "default"), 0),
        (("llama", "default"), 1),
    }
    found.put("v6", workers_of("v6", "w-1"))  # the same pod in the IPv6 slice
    assert found.delete("v4") == {(("llama", "default"), 0), (("llama", "default"), 1)}
    assert sorted(k[1] for k in found) == [1]
    found.delete("v6")
    assert len(found) == 0


def test_the_cap_skips_and_counts_and_says_when_room_is_made() -> None:
    found = DiscoveredSet(max_workers=2)
    found.put("a", workers_of("a", "w-0", "w-1", "w-2"))
    assert len(found) == 2 and found.over_cap == 1 and not found.room_made
    found.put("a", workers_of("a", "w-0", "w-1", "w-2"))  # the same again: counted again
    assert found.over_cap == 2
    found.put("a", workers_of("a", "w-1"))
    assert found.room_made  # the caller lists again
    found.clear()
    found.put("a", workers_of("a", "w-1", "w-2"))
    assert sorted(k[1] for k in found) == [1, 2] and not found.room_made


def test_the_applier_upserts_removes_only_its_own_and_renews_leases() -> None:
    clock = FakeClock()
    service = SlotTrackerService(clock=clock.now, worker_ttl_seconds=30)
    applier = Applier(service)
    found = DiscoveredSet(max_workers=10)
    key = ("llama", "default")
    # a worker a client registered: discovery never removes it
    service.register(c.Register(model_name="llama", worker_id=9, block_size=16))
    applier.apply(found, found.put("a", workers_of("a", "w-0", "w-1")))
    assert sorted(w["worker_id"] for w in service.workers(None, None)) == [0, 1, 9]
    assert applier.counters.upserts == 2

    # dp size changes on the Service: the ranks are replaced
    labels = {"kv-slot-tracker/dp-size": "2"}
    bigger = read_slice(eslice("a", [endpoint("w-0")], labels), SETTINGS).workers
    applier.apply(found, found.put("a", bigger))
    assert [(w["worker_id"], w["dp_size"]) for w in service.workers(None, None)] == [(0, 2), (9, 1)]
    assert (applier.counters.upserts, applier.counters.removals) == (3, 1)

    clock.advance(20)
    applier.renew()  # worker 0's lease now runs to 50 s; worker 9's (never renewed) to 30 s
    clock.advance(15)
    assert service.expire_leases() == [(key, 9)]
    assert [w["worker_id"] for w in service.workers(None, None)] == [0]

    # removed by someone else: the renewal lets it go, a full list brings it back
    service.unregister(c.Unregister(model_name="llama", worker_id=0))
    applier.renew()
    assert applier.applied == {}
    applier.apply(found, found.clear() | found.put("a", bigger), force=True)
    assert [w["worker_id"] for w in service.workers(None, None)] == [0]


def test_the_applier_counts_what_the_service_refuses() -> None:
    service = SlotTrackerService()
    service.register(c.Register(model_name="llama", worker_id=9, block_size=32))
    applier = Applier(service)
    found = DiscoveredSet(max_workers=10)
    applier.apply(found, found.put("a", workers_of("a", "w-0")))  # block size 16 != 32
    assert applier.counters.rejected == 1 and applier.applied == {}
    assert [w["worker_id"] for w in service.workers(None, None)] == [9]


def test_worker_equality_is_about_ranks() -> None:
    a = Worker("m", "default", 1, 16, 0, 2, "w-1")
    assert a.same_ranks(Worker("m", "default", 1, 16, 0, 2, "other-pod"))
    assert not a.same_ranks(Worker("m", "default", 1, 16, 0, 1, "w-1"))
