"""``deploy/kubernetes/discovery/``: discovery of selection workers, checked offline.

* every manifest is valid Kubernetes (oldest supported and latest schemas);
* ``rbac-pods.yaml`` grants exactly ``get`` on pods, to the ServiceAccount of ``rbac.yaml``;
* ``selection-patch.yaml`` gives settings the service accepts: selection discovery of the
  Services labelled ``kv-slot-tracker/api=selection``, and the selection port;
* the vLLM and SGLang examples, read as the API server would present them (the Service's
  EndpointSlice: its labels, its ports resolved to the containers', one endpoint per pod; each
  pod as its template makes it), give the workers the docs promise: endpoint, a KV-event
  publisher per rank at the base port + rank, and the replay socket of a one-rank worker.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml

from kv_slot_tracker.discovery.endpoints import Mapping, read_pod, read_slice
from kv_slot_tracker.discovery.kubernetes import label_selector
from tests.deploy.support import KUBE_DIR, load_yaml_docs, settings_from_env
from tests.deploy.test_kubernetes import OLDEST_KUBERNETES

DIR = KUBE_DIR / "discovery"
FILES = ("rbac-pods.yaml", "vllm-workers.yaml", "sglang-workers.yaml")
PATCH = yaml.safe_load((DIR / "selection-patch.yaml").read_text())


def docs(name: str) -> list[dict[str, Any]]:
    return load_yaml_docs(DIR / name)


def of_kind(name: str, kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs(name) if d["kind"] == kind]
    return found


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
@pytest.mark.parametrize("name", FILES)
def test_manifests_are_valid_kubernetes(name: str, version: str) -> None:
    for doc in docs(name):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_pods_role_gets_pods_and_nothing_else() -> None:
    role = of_kind("rbac-pods.yaml", "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    binding = of_kind("rbac-pods.yaml", "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = of_kind("rbac.yaml", "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]


def patch_settings() -> Any:
    (container,) = PATCH["spec"]["template"]["spec"]["containers"]
    return settings_from_env({e["name"]: e["value"] for e in container["env"]})


def test_the_patch_turns_selection_discovery_and_the_selection_port_on() -> None:
    assert (PATCH["kind"], PATCH["metadata"]["name"]) == ("Deployment", "kv-slot-tracker")
    settings = patch_settings()
    assert settings.discovery_kubernetes_api == "selection"
    assert settings.discovery_kubernetes_worker_id == "hash"  # two StatefulSets: ordinals clash
    assert settings.selection_port == 8092
    (container,) = PATCH["spec"]["template"]["spec"]["containers"]
    assert {"name": "selection", "containerPort": 8092} in container["ports"]


def endpoint_slice(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Service's EndpointSlice (two ready pods at 10.1.0.1 and .2) and the pod object its
    StatefulSet makes, as the API server would give them."""
    service, sts = of_kind(name, "Service"), of_kind(name, "StatefulSet")
    template = sts["spec"]["template"]
    (container,) = template["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    ports = [
        {"name": p["name"], "port": named.get(p["targetPort"], p["targetPort"]), "protocol": "TCP"}
        for p in service["spec"]["ports"]
    ]
    pod_name = sts["metadata"]["name"]
    endpoints = [
        {
            "addresses": [f"10.1.0.{i + 1}"],
            "conditions": {"ready": True},
            "targetRef": {"kind": "Pod", "name": f"{pod_name}-{i}", "uid": f"u{i}"},
        }
        for i in range(sts["spec"]["replicas"])
    ]
    meta = {"name": f"{name}-abcde", "namespace": "ns1", "labels": {
        **service["metadata"]["labels"], "kubernetes.io/service-name": service["metadata"]["name"]}}  # fmt: skip
    pod = {"metadata": {"uid": "u0", **template["metadata"]}, "spec": template["spec"]}
    return {"metadata": meta, "endpoints": endpoints, "ports": ports}, pod


def selected(labels: dict[str, str], selector: str) -> bool:
    return all(labels.get(k) == v for k, _, v in (t.partition("=") for t in selector.split(",")))


@pytest.mark.parametrize(
    ("name", "endpoint", "kv_events", "replay", "model"),
    [
        ("vllm-workers.yaml", "http://10.1.0.1:8000",
         ((0, "tcp://10.1.0.1:5557"), (1, "tcp://10.1.0.1:5558")),
         ("tcp://10.1.0.1:5560", "tcp://10.1.0.1:5561"), "llama-3.1-8b-instruct"),
        ("sglang-workers.yaml", "http://10.1.0.1:30000",
         ((0, "tcp://10.1.0.1:5557"),), ("tcp://10.1.0.1:5558",), "qwen2.5-7b-instruct"),
    ],
)  # fmt: skip
def test_the_examples_give_the_promised_workers(
    name: str, endpoint: str, kv_events: tuple, replay: tuple[str, ...], model: str
) -> None:
    settings = patch_settings()
    obj, pod = endpoint_slice(name)
    selector = label_selector(settings.discovery_kubernetes_service)
    assert selected(obj["metadata"]["labels"], selector)
    mapping = Mapping(
        namespace="ns1",
        worker_id_from=settings.discovery_kubernetes_worker_id,
        api=settings.discovery_kubernetes_api,
    )
    pods = {obj["endpoints"][0]["targetRef"]["name"]: read_pod(pod)}
    read = read_slice(obj, mapping, pods)
    assert (read.invalid, len(read.workers)) == (0, 2)
    first = next(w for w in read.workers.values() if w.pod.endswith("-0"))
    assert (first.api, first.model_name, first.block_size) == ("selection", model, 16)
    assert (first.endpoint, first.kv_events, first.replay) == (endpoint, kv_events, replay)
    # the container really publishes where the worker is registered: the engine's flag
    (container,) = pod["spec"]["containers"]
    flag = next(a for a in container["args"] if a.startswith("--kv-events-config="))
    assert '"endpoint":"tcp://*:5557"' in flag
    base = replay[0].rpartition(":")[2]  # the engine offsets it by the rank, as the publisher's
    assert f'"replay_endpoint":"tcp://*:{base}"' in flag
