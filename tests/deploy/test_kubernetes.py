"""``deploy/kubernetes``, checked without a cluster.

* every manifest is valid (strict: no unknown field) against the Kubernetes schemas
  ``kubernetes-validate`` bundles, for the oldest release claimed and the newest bundled; the
  strict check does refuse a misspelt field;
* the kustomization lists exactly the manifests to apply (not the example Secret); if
  ``kubectl`` is installed, ``kubectl kustomize`` renders them (offline);
* the Deployment: 3 replicas; probes on the paths and port the app serves, open with an API
  key (``/health`` liveness and startup, ``/ready`` readiness); Prometheus annotations on the
  port and path that serve metrics; every variable a real setting with a value the service
  accepts; the API key from the Secret the example and docs/kubernetes.md create; the image of
  this version;
* selectors: the Service and the PodDisruptionBudget select the service's pods and not Redis';
* every container: requests and limits, non-root as the image's user, read-only root, no
  capabilities, no privilege escalation; no Service can inject a ``SLOT_TRACKER_*`` variable.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import kv_slot_tracker
from kv_slot_tracker.config_sources import ENV_PREFIX
from kv_slot_tracker.settings import Settings
from tests.deploy.support import (
    DEPLOY_DOC,
    KUBE_DIR,
    app_client,
    image_user,
    load_yaml_docs,
    settings_from_env,
)

OLDEST_KUBERNETES = "1.27.0"  # the oldest release these manifests claim to support
KUSTOMIZATION = KUBE_DIR / "kustomization.yaml"
SECRET_EXAMPLE = KUBE_DIR / "secret.example.yaml"
APP_PORT = Settings.model_fields["port"].default


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE_DIR.glob("*.yaml") if p != KUSTOMIZATION)


def all_objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in manifest_files():
        for doc in load_yaml_docs(path):
            yield path, doc


def applied_objects() -> list[dict[str, Any]]:
    """What ``kubectl apply -k deploy/kubernetes`` creates."""
    resources = yaml.safe_load(KUSTOMIZATION.read_text())["resources"]
    return [doc for name in resources for doc in load_yaml_docs(KUBE_DIR / name)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        o
        for o in applied_objects()
        if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def deployment() -> dict[str, Any]:
    return one("Deployment")


@pytest.fixture(scope="module")
def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def workloads() -> list[dict[str, Any]]:
    return [o for o in applied_objects() if o["kind"] in ("Deployment", "StatefulSet")]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- Schemas ---------------------------------------------------------------------------------


def versions() -> list[str]:
    return [OLDEST_KUBERNETES, kubernetes_validate.latest_version()]


@pytest.mark.parametrize("version", versions())
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_manifest_is_valid_kubernetes(path: Path, version: str) -> None:
    docs = load_yaml_docs(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(
    "breakage",
    [
        lambda d: d["spec"].update(replica=3),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["livenessProbe"].update(
            httpGet={"path": "/health", "port": [8091]}
        ),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["securityContext"].update(
            runAsNonRoot="yes"
        ),
    ],
    ids=["misspelt-field", "port-not-a-port", "string-for-a-boolean"],
)
def test_the_schema_check_refuses_a_broken_manifest(deployment: dict[str, Any], breakage) -> None:
    broken = copy.deepcopy(deployment)
    breakage(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


# --- Kustomization -----------------------------------------------------------------------------


def test_kustomization_applies_every_manifest_but_the_example_secret() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    expected = {p.name for p in manifest_files()} - {SECRET_EXAMPLE.name}
    assert set(resources) == expected
    assert not any(o["kind"] == "Secret" for o in applied_objects()), "no key is ever applied"


def test_kubectl_kustomize_renders_the_manifests() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(KUBE_DIR)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    rendered = sorted(
        (d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(result.stdout) if d
    )
    assert rendered == sorted((o["kind"], o["metadata"]["name"]) for o in applied_objects())


# --- The Deployment ---------------------------------------------------------------------------


def test_three_replicas_rolled_without_losing_capacity(deployment: dict[str, Any]) -> None:
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod_labels = spec["template"]["metadata"]["labels"]
    assert selects(spec["selector"]["matchLabels"], pod_labels)


def test_image_is_this_version(container: dict[str, Any]) -> None:
    assert container["image"] == f"kv-slot-tracker:{kv_slot_tracker.__version__}"


def container_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def test_container_port_is_the_app_port(container: dict[str, Any]) -> None:
    assert [p["containerPort"] for p in container["ports"]] == [APP_PORT]


@pytest.mark.parametrize(
    ("probe", "path"),
    [("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")],
)
async def test_probe_hits_an_open_route_of_the_app(
    container: dict[str, Any], probe: str, path: str
) -> None:
    get = container[probe]["httpGet"]
    assert get["path"] == path
    assert container_port(container, get["port"]) == APP_PORT
    # The probe sends no key: the route must answer 200 on an instance that has one.
    async with app_client(api_key="a-key") as client:
        assert (await client.get(get["path"])).status_code == 200
        assert (await client.get("/loads")).status_code == 401  # the key is in force


async def test_prometheus_annotations_point_at_the_metrics(
    deployment: dict[str, Any], container: dict[str, Any]
) -> None:
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == container_port(container, "http")
    assert annotations["prometheus.io/path"] == "/metrics"
    async with app_client(api_key="a-key") as client:  # Prometheus sends no key either
        resp = await client.get(annotations["prometheus.io/path"])
        assert resp.status_code == 200
        assert "kv_slot_tracker_trackers 0.0" in resp.text


def plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_environment_holds_real_settings_with_valid_values(container: dict[str, Any]) -> None:
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))
    env = plain_env(container)
    env.update({e["name"]: "from-the-secret" for e in container["env"] if "valueFrom" in e})
    settings = settings_from_env(env)
    assert not settings.embedded
    assert settings.api_key.get_secret_value() == "from-the-secret"


def test_redis_url_names_the_redis_service(container: dict[str, Any]) -> None:
    m = re.fullmatch(
        r"redis://([a-z0-9-]+):(\d+)/\d+", plain_env(container)["SLOT_TRACKER_REDIS_URL"]
    )
    assert m, plain_env(container)["SLOT_TRACKER_REDIS_URL"]
    service = one("Service", m.group(1))
    assert [p["port"] for p in service["spec"]["ports"]] == [int(m.group(2))]
    (redis,) = [w for w in workloads() if w["kind"] == "StatefulSet"]
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], redis_labels)
    assert redis["spec"]["serviceName"] == m.group(1)
    assert redis["spec"]["replicas"] == 1


def secret_ref(container: dict[str, Any]) -> tuple[str, str]:
    (entry,) = [e for e in container["env"] if e["name"] == f"{ENV_PREFIX}API_KEY"]
    ref = entry["valueFrom"]["secretKeyRef"]
    assert ref.get("optional") is not True, "an instance must never start without its key"
    return ref["name"], ref["key"]


def test_api_key_comes_from_the_documented_secret(container: dict[str, Any]) -> None:
    name, key = secret_ref(container)
    (example,) = load_yaml_docs(SECRET_EXAMPLE)
    assert example["kind"] == "Secret" and example["metadata"]["name"] == name
    assert list(example["stringData"]) == [key, "redis-password"]
    for value in example["stringData"].values():
        assert "REPLACE" in value, "the example must not carry a usable secret"
    command = f"kubectl create secret generic {name} --from-literal={key}="
    for doc in (DEPLOY_DOC, KUSTOMIZATION, SECRET_EXAMPLE):
        assert command in doc.read_text(), f"{doc.name} does not show `{command}...`"


def env_secret(container: dict[str, Any], name: str) -> tuple[str, str]:
    (entry,) = [e for e in container["env"] if e["name"] == name]
    ref = entry["valueFrom"]["secretKeyRef"]
    assert ref.get("optional") is not True, name
    return ref["name"], ref["key"]


def test_redis_requires_the_password_the_instances_have(container: dict[str, Any]) -> None:
    ours = env_secret(container, f"{ENV_PREFIX}REDIS_PASSWORD")
    assert ours == (secret_ref(container)[0], "redis-password")
    (redis,) = [w for w in workloads() if w["kind"] == "StatefulSet"]
    (server,) = redis["spec"]["template"]["spec"]["containers"]
    assert env_secret(server, "REDISCLI_AUTH") == ours  # the probes' redis-cli uses it too
    # written from it into the file redis.conf includes (test_deploy_invariants.py runs this)
    assert "args" not in server
    script = server["command"][2]
    assert """printf 'requirepass "%s"\\nmasterauth "%s"\\n' "$pw" "$pw" """.strip() in script
    assert '"$REDISCLI_AUTH"' in script and "> /run/redis/auth.conf" in script
    assert "include /run/redis/auth.conf" in redis_conf()
    command = "--from-literal=redis-password="
    for doc in (DEPLOY_DOC, KUSTOMIZATION, SECRET_EXAMPLE):
        assert command in doc.read_text(), f"{doc.name} does not show `{command}...`"


def test_service_and_budget_select_the_service_pods_only(deployment: dict[str, Any]) -> None:
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    (redis,) = [w for w in workloads() if w["kind"] == "StatefulSet"]
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    service = one("Service", deployment["metadata"]["name"])
    budget = one("PodDisruptionBudget")
    for selector in (service["spec"]["selector"], budget["spec"]["selector"]["matchLabels"]):
        assert selects(selector, pod_labels)
        assert not selects(selector, redis_labels)
    (port,) = service["spec"]["ports"]
    assert port["port"] == APP_PORT and port["targetPort"] == "http"
    assert 0 < budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]


# --- Every container -------------------------------------------------------------------------


QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(m|Ki|Mi|Gi)?")
FACTORS = {None: 1, "m": 0.001, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity(text: str | int) -> float:
    m = QUANTITY.fullmatch(str(text))
    assert m, text
    return float(m.group(1)) * FACTORS[m.group(2)]


@pytest.mark.parametrize("workload", workloads(), ids=lambda w: w["metadata"]["name"])
def test_containers_have_requests_and_limits(workload: dict[str, Any]) -> None:
    for c in workload["spec"]["template"]["spec"]["containers"]:
        resources = c["resources"]
        for resource in ("cpu", "memory"):
            request = quantity(resources["requests"][resource])
            limit = quantity(resources["limits"][resource])
            assert 0 < request <= limit, (c["name"], resource)


@pytest.mark.parametrize("workload", workloads(), ids=lambda w: w["metadata"]["name"])
def test_containers_run_locked_down(workload: dict[str, Any]) -> None:
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert sc.get("privileged", False) is False, c["name"]


def test_service_pods_run_as_the_image_user(deployment: dict[str, Any]) -> None:
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert (pod_security["runAsUser"], pod_security["runAsGroup"]) == image_user()


def test_no_service_can_inject_a_setting() -> None:
    """Kubernetes gives pods ``<SERVICE>_PORT=tcp://...`` variables: a Service named
    ``slot-tracker`` would set ``SLOT_TRACKER_PORT`` and break every instance."""
    for o in applied_objects():
        if o["kind"] == "Service":
            prefix = o["metadata"]["name"].upper().replace("-", "_") + "_"
            assert not prefix.startswith(ENV_PREFIX), o["metadata"]["name"]
    for w in workloads():
        assert w["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_docs_apply_the_same_manifests_without_kustomize() -> None:
    m = re.search(r"kubectl apply -f deploy/kubernetes/\{([a-z,]+)\}\.yaml", DEPLOY_DOC.read_text())
    assert m, "docs/kubernetes.md shows no `kubectl apply -f deploy/kubernetes/{...}.yaml`"
    listed = {f"{name}.yaml" for name in m.group(1).split(",")}
    assert listed == set(yaml.safe_load(KUSTOMIZATION.read_text())["resources"])
    assert "kubectl apply -k deploy/kubernetes" in DEPLOY_DOC.read_text()


def _mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "kb": 1 / 1024, "mb": 1, "gb": 1024}
    for suffix, factor in units.items():
        if quantity.lower().endswith(suffix.lower()):
            return float(quantity[: -len(suffix)]) * factor
    raise AssertionError(f"unknown quantity {quantity}")


def redis_conf() -> str:
    """The Redis configuration of the ConfigMap (the Sentinel variant's data nodes use it too)."""
    return one("ConfigMap", "kv-slot-tracker-redis")["data"]["redis.conf"]


def test_redis_is_bounded_and_never_evicts_the_stream() -> None:
    """maxmemory below the container's limit, noeviction: a full Redis refuses appends (which
    the instances report) instead of dropping stream entries without a word."""
    words = redis_conf().split()
    assert words[words.index("maxmemory-policy") + 1] == "noeviction"
    maxmemory = _mib(words[words.index("maxmemory") + 1])
    seen = 0
    variant = load_yaml_docs(KUBE_DIR.parent / "kubernetes-sentinel" / "redis-sentinel.yaml")
    for obj in [doc for _, doc in all_objects()] + list(variant):
        for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            script = " ".join([*c.get("command", []), *c.get("args", [])])
            if "exec redis-server /etc/redis/redis.conf" not in script:
                continue
            seen += 1
            assert maxmemory <= 0.8 * _mib(c["resources"]["limits"]["memory"])
    assert seen == 2  # the plain Redis and the Sentinel variant's data nodes
