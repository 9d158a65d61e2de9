"""``deploy/kubernetes-sentinel/``: the base's Deployment on a Redis primary with two replicas
and three Sentinels, checked offline.

* ``redis-sentinel.yaml`` is valid Kubernetes (oldest supported and latest schemas), locked
  down like the base's workloads;
* the kustomization takes the base, adds that file, deletes exactly the base's single Redis
  (its Service and StatefulSet) and patches the Deployment;
* the patched Deployment (the strategic merge applied here, by the env list's ``name`` key)
  has settings the service accepts that name exactly the StatefulSet's pods through its
  headless Service on the Sentinel port, the master name the Sentinels monitor, and an
  acknowledgement level one replica can still meet after a failover;
* every Redis node and Sentinel requires the password of the same Secret the instances read,
  and their start scripts are valid ``sh`` once Kubernetes has turned ``$$`` into ``$``.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kv_slot_tracker.replication.redis.endpoint import RedisEndpoint
from tests.deploy.support import KUBE_DIR, load_yaml_docs, settings_from_env
from tests.deploy.test_kubernetes import OLDEST_KUBERNETES, one

DIR = KUBE_DIR.parent / "kubernetes-sentinel"
KUSTOMIZATION = yaml.safe_load((DIR / "kustomization.yaml").read_text())
OBJECTS = load_yaml_docs(DIR / "redis-sentinel.yaml")


def ha(kind: str) -> dict[str, Any]:
    (found,) = [o for o in OBJECTS if o["kind"] == kind]
    return found


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_redis_sentinel_manifest_is_valid_kubernetes(version: str) -> None:
    assert [o["kind"] for o in OBJECTS] == ["Service", "PodDisruptionBudget", "StatefulSet"]
    for doc in OBJECTS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_replaces_the_single_redis() -> None:
    assert KUSTOMIZATION["resources"] == ["../kubernetes", "redis-sentinel.yaml"]
    deleted, patched = set(), []
    for patch in KUSTOMIZATION["patches"]:
        if "path" in patch:
            patched.append(yaml.safe_load((DIR / patch["path"]).read_text()))
            continue
        doc = yaml.safe_load(patch["patch"])
        assert doc.pop("$patch") == "delete"
        deleted.add((doc["kind"], doc["metadata"]["name"]))
    base_redis = {(o, one(o, "kv-slot-tracker-redis")["metadata"]["name"])
                  for o in ("Service", "StatefulSet")}  # fmt: skip
    assert deleted == base_redis
    assert [(p["kind"], p["metadata"]["name"]) for p in patched] == [("Deployment",
                                                                      "kv-slot-tracker")]  # fmt: skip


def patched_env() -> list[dict[str, Any]]:
    """The Deployment container's env after the patch (strategic merge by ``name``)."""
    deployment = copy.deepcopy(one("Deployment"))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (patch,) = [p for p in KUSTOMIZATION["patches"] if "path" in p]
    doc = yaml.safe_load((DIR / patch["path"]).read_text())
    (patch_container,) = doc["spec"]["template"]["spec"]["containers"]
    assert patch_container["name"] == container["name"]
    env = {e["name"]: e for e in container["env"]}
    for entry in patch_container["env"]:
        if entry.get("$patch") == "delete":
            assert env.pop(entry["name"], None) is not None, entry
        else:
            env[entry["name"]] = entry
    return list(env.values())


def test_instances_ask_the_sentinels_of_the_statefulset() -> None:
    env = patched_env()
    plain = {e["name"]: e["value"] for e in env if "value" in e}
    plain.update({e["name"]: "from-the-secret" for e in env if "valueFrom" in e})
    settings = settings_from_env(plain)
    endpoint = RedisEndpoint.of(settings)
    assert endpoint.kind == "sentinel" and endpoint.password == "from-the-secret"
    service, statefulset = ha("Service"), ha("StatefulSet")
    pods = [f"{statefulset['metadata']['name']}-{i}.{service['metadata']['name']}"
            for i in range(statefulset["spec"]["replicas"])]  # fmt: skip
    sentinel_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "sentinel")
    assert list(endpoint.sentinels) == [(pod, sentinel_port) for pod in pods]
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    sentinel_script = container("sentinel")["command"][2]
    monitor = re.search(r"sentinel monitor (\S+) \$primary 6379 2", sentinel_script)
    assert monitor and monitor.group(1) == endpoint.master
    assert settings.replication_ack == "redis"
    # one replica fewer than there are: after a failover one still confirms
    assert 1 <= settings.replication_ack_replicas < statefulset["spec"]["replicas"] - 1
    # the password comes from the Secret the base reads the API key from
    (entry,) = [e for e in env if e["name"] == "SLOT_TRACKER_REDIS_PASSWORD"]
    assert entry["valueFrom"]["secretKeyRef"] == {"name": "kv-slot-tracker",
                                                  "key": "redis-password"}  # fmt: skip


def container(name: str) -> dict[str, Any]:
    (found,) = [c for c in ha("StatefulSet")["spec"]["template"]["spec"]["containers"]
                if c["name"] == name]  # fmt: skip
    return found


@pytest.mark.parametrize("name", ["redis", "sentinel"])
def test_every_redis_process_requires_the_password(name: str) -> None:
    c = container(name)
    (auth,) = c["env"]
    assert auth["name"] == "REDISCLI_AUTH"
    assert auth["valueFrom"]["secretKeyRef"] == {"name": "kv-slot-tracker", "key": "redis-password"}
    text = c["command"][2]
    # written from REDISCLI_AUTH into the files Redis and the Sentinel load, never on a command
    # line (test_deploy_invariants.py runs these scripts)
    assert """pw=$$(printf '%s' "$REDISCLI_AUTH" | sed""" in text
    lines = (["""printf 'requirepass "%s"\\nmasterauth "%s"\\n' "$pw" "$pw" """.strip(),
              "exec redis-server /etc/redis/redis.conf"] if name == "redis"
             else ['requirepass \\"$pw\\"', 'sentinel sentinel-pass \\"$pw\\"',
                   'sentinel auth-pass mymaster \\"$pw\\"'])  # fmt: skip
    for line in lines:
        assert line in text, (name, line)
    sh = shutil.which("sh")
    assert sh is not None
    script = text.replace("$$", "$")  # what Kubernetes hands the shell
    done = subprocess.run([sh, "-n", "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_locked_down_like_the_base() -> None:
    pod = ha("StatefulSet")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    for c in pod["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]


def test_kubectl_kustomize_renders_the_sentinel_variant() -> None:
    """``kubectl apply -k deploy/kubernetes-sentinel`` works: the overlay is not inside the base
    directory, which kustomize refuses as a cycle."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(DIR)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(result.stdout) if d}
    assert ("StatefulSet", "kv-slot-tracker-redis") not in rendered
    assert ("Deployment", "kv-slot-tracker") in rendered
    assert {(o["kind"], o["metadata"]["name"]) for o in OBJECTS} <= rendered
