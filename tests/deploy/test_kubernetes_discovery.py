"""``deploy/kubernetes/discovery/``: worker discovery on top of the base, checked offline.

* ``rbac.yaml`` is valid Kubernetes (oldest supported and latest schemas): a ServiceAccount, a
  Role granting exactly get, list and watch on EndpointSlices, and a RoleBinding of that Role to
  that ServiceAccount;
* the Deployment patched (``kubectl patch --patch-file``, as docs/kubernetes.md says) runs as
  that ServiceAccount with its token mounted, with settings the service accepts that turn
  discovery on; ``kubectl patch --local`` (if installed) merges it as this test does;
* the image installs the ``[kubernetes]`` extra discovery needs.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.support import DEPLOY_DOC, DOCKERFILE, KUBE_DIR, load_yaml_docs, settings_from_env
from tests.deploy.test_kubernetes import OLDEST_KUBERNETES, one

DIR = KUBE_DIR / "discovery"
RBAC = load_yaml_docs(DIR / "rbac.yaml")
PATCH = yaml.safe_load((DIR / "deployment-patch.yaml").read_text())


def rbac(kind: str) -> dict[str, Any]:
    (found,) = [o for o in RBAC if o["kind"] == kind]
    return found


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_rbac_manifest_is_valid_kubernetes(version: str) -> None:
    assert [o["kind"] for o in RBAC] == ["ServiceAccount", "Role", "RoleBinding"]
    for doc in RBAC:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_role_reads_endpointslices_and_nothing_else() -> None:
    assert rbac("Role")["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = rbac("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": rbac("Role")["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": rbac("ServiceAccount")["metadata"]["name"]}
    ]


def test_the_patch_is_for_the_base_deployment() -> None:
    assert (PATCH["kind"], PATCH["metadata"]["name"]) == ("Deployment", "kv-slot-tracker")
    assert one("Deployment")["metadata"]["name"] == "kv-slot-tracker"


def patched_deployment() -> dict[str, Any]:
    """The base Deployment with the patch merged (strategic merge: env by ``name``)."""
    deployment = copy.deepcopy(one("Deployment"))
    pod, patch_pod = deployment["spec"]["template"]["spec"], PATCH["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (patch_container,) = patch_pod["containers"]
    assert patch_container["name"] == container["name"]
    env = {e["name"]: e for e in container["env"]}
    env.update({e["name"]: e for e in patch_container["env"]})
    container["env"] = list(env.values())
    pod.update({k: v for k, v in patch_pod.items() if k != "containers"})
    return deployment


def test_the_instances_run_as_the_account_with_discovery_on() -> None:
    deployment = patched_deployment()
    kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == rbac("ServiceAccount")["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is True  # the client reads the mounted token
    (container,) = pod["containers"]
    plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    settings = settings_from_env(plain)
    assert settings.discovery_kubernetes_service == "vllm"
    assert settings.discovery_kubernetes_block_size == 16
    assert settings.discovery_kubernetes_model_name
    assert settings.discovery_kubernetes_kubeconfig == ""  # in-cluster: the service account
    assert settings.redis_url  # still the base's Redis: discovered workers are replicated


def test_kubectl_patches_the_deployment_the_same_way() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "patch", "--local", "-f", str(KUBE_DIR / "deployment.yaml"), "--type",
         "strategic", "--patch-file", str(DIR / "deployment-patch.yaml"), "-o", "yaml"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    pod = yaml.safe_load(result.stdout)["spec"]["template"]["spec"]
    expected = patched_deployment()["spec"]["template"]["spec"]
    for key in ("serviceAccountName", "automountServiceAccountToken"):
        assert pod[key] == expected[key]
    (env,), (expected_env,) = [[c["env"] for c in p["containers"]] for p in (pod, expected)]
    assert sorted(env, key=str) == sorted(expected_env, key=str)


def test_the_docs_give_those_commands() -> None:
    text = DEPLOY_DOC.read_text()
    assert "kubectl apply -f deploy/kubernetes/discovery/rbac.yaml" in text
    assert (
        "kubectl patch deployment kv-slot-tracker --patch-file "
        "deploy/kubernetes/discovery/deployment-patch.yaml"
    ) in text


def test_the_image_has_the_kubernetes_client() -> None:
    assert 'pip install --no-cache-dir "./[kubernetes]"' in DOCKERFILE.read_text()
