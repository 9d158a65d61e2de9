"""The alert rules (``deploy/prometheus/``) and their Kubernetes form
(``deploy/kubernetes/monitoring/``).

* Prometheus's own checker accepts them (``promtool check rules``) and the example
  configuration that loads them (``promtool check config``);
* their unit tests pass (``promtool test rules alerts.test.yaml``), every alert fires in one of
  them, and none of those tests passes whatever the rule says: each alert made never to fire
  fails them;
* every expression names series the service really exports, with labels they really carry
  (the real ``/metrics`` pages of ``series.py``), but for ``up`` and redis_exporter's series;
* every alert has a severity, a summary, a description and a runbook paragraph in
  docs/metrics-and-alerts.md (``runbook_url`` names its anchor);
* the PrometheusRule holds exactly the rules file's groups, the ServiceMonitor scrapes the
  Service's metrics port under the job name the rules match, and ``kubectl kustomize`` renders
  both when kubectl is installed.

promtool comes with Debian's ``prometheus`` package; ``make test`` installs it when missing
(scripts/ensure_promtool.sh). Without it these tests fail and say so.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.series import Exported, Query, problems
from tests.deploy.support import KUBE_DIR, ROOT, load_yaml_docs

PROM_DIR = ROOT / "deploy" / "prometheus"
ALERTS = PROM_DIR / "alerts.yaml"
ALERT_TESTS = PROM_DIR / "alerts.test.yaml"
PROM_CONFIG = PROM_DIR / "prometheus.yaml"
MONITORING = KUBE_DIR / "monitoring"
DOCS = ROOT / "docs" / "metrics-and-alerts.md"
JOB = "kv-slot-tracker"
# Series the rules use that the service does not export: Prometheus's own, and redis_exporter's
# (the Redis memory alert), with the labels they carry besides the target's.
EXTERNAL: dict[str, set[str]] = {
    "up": set(),
    "redis_memory_used_bytes": set(),
    "redis_memory_max_bytes": set(),
}


def promtool() -> str:
    found = os.environ.get("SLOT_TRACKER_PROMTOOL") or shutil.which("promtool")
    if not found and Path("/usr/bin/promtool").is_file():
        found = "/usr/bin/promtool"
    if not found:
        pytest.fail(
            "promtool is not installed: run scripts/ensure_promtool.sh (make test does), or "
            "apt-get install prometheus, or point SLOT_TRACKER_PROMTOOL at a promtool binary",
            pytrace=False,
        )
    return found


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_names() -> list[str]:
    return [rule["alert"] for rule in rules()]


# --- promtool ---------------------------------------------------------------------------------


def test_promtool_accepts_the_rules() -> None:
    done = run_promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout + done.stderr


def test_promtool_accepts_the_example_configuration() -> None:
    done = run_promtool("check", "config", str(PROM_CONFIG))
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load(PROM_CONFIG.read_text())
    assert config["rule_files"] == [ALERTS.name]
    assert [job["job_name"] for job in config["scrape_configs"]] == [JOB]


def test_the_rules_pass_their_unit_tests() -> None:
    done = run_promtool("test", "rules", str(ALERT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_fires_in_a_unit_test() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    assert tests["rule_files"] == [ALERTS.name]
    firing = {
        case["alertname"]
        for test in tests["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert sorted(set(alert_names()) - firing) == []


@pytest.mark.parametrize("alert", alert_names())
def test_the_unit_tests_fail_when_an_alert_never_fires(alert: str, tmp_path: Path) -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == alert:
                rule["expr"] = "vector(1) == 0"
    (tmp_path / ALERTS.name).write_text(yaml.safe_dump(doc))
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    done = run_promtool("test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0, f"the unit tests pass with {alert} never firing"
    assert f"alertname: {alert}," in done.stdout + done.stderr


# --- What the rules say -------------------------------------------------------------------------


def test_every_expression_names_exported_series_and_labels(replicated: Exported) -> None:
    exported = copy.deepcopy(replicated)
    for name, labels in EXTERNAL.items():
        assert name not in exported.labels, f"{name} is the service's own now: drop it here"
        exported.labels[name] = set(labels)
    queries = [Query(f"alert {rule['alert']}", rule["expr"]) for rule in rules()]
    assert problems(queries, exported) == []


def test_the_checker_catches_an_old_name(replicated: Exported) -> None:
    found = problems([Query("probe", "rate(http_requests_total[5m]) > 0")], replicated)
    assert found and "`http_requests_total` is not a series" in found[0]


def test_up_is_matched_by_the_scrape_job() -> None:
    ups = [rule for rule in rules() if re.search(r"\bup\{", rule["expr"])]
    assert [rule["expr"] for rule in ups] == [f'up{{job="{JOB}"}} == 0']


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_every_alert_is_labelled_described_and_has_a_runbook(rule: dict[str, Any]) -> None:
    assert re.fullmatch(r"KvSlotTracker[A-Za-z]+", rule["alert"])
    assert rule["labels"]["severity"] in ("critical", "warning")
    annotations = rule["annotations"]
    assert set(annotations) == {"summary", "description", "runbook_url"}
    url = annotations["runbook_url"]
    assert url == f"docs/metrics-and-alerts.md#{rule['alert'].lower()}", url
    assert DOCS.is_file(), f"{DOCS.relative_to(ROOT)} is missing"
    headings = re.findall(r"^#{2,4} (.+)$", DOCS.read_text(), flags=re.M)
    anchors = {github_anchor(h) for h in headings}
    assert url.split("#", 1)[1] in anchors, f"no heading for {rule['alert']} in {DOCS.name}"


def test_alert_names_are_unique() -> None:
    assert len(alert_names()) == len(set(alert_names()))


# --- Kubernetes ---------------------------------------------------------------------------------


def test_the_prometheusrule_holds_the_rules_file() -> None:
    (rule,) = load_yaml_docs(MONITORING / "prometheusrule.yaml")
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "prometheusrule.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_the_servicemonitor_scrapes_the_metrics_port_under_the_rules_job() -> None:
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["servicemonitor.yaml", "prometheusrule.yaml"]
    (monitor,) = load_yaml_docs(MONITORING / "servicemonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    services = [d for d in load_yaml_docs(KUBE_DIR / "service.yaml") if d["kind"] == "Service"]
    redis = [d for d in load_yaml_docs(KUBE_DIR / "redis.yaml") if d["kind"] == "Service"]
    selector = monitor["spec"]["selector"]["matchLabels"]

    def selected(service: dict[str, Any]) -> bool:
        labels = service["metadata"].get("labels", {})
        return all(labels.get(k) == v for k, v in selector.items())

    (service,) = [s for s in services + redis if selected(s)]  # the instances', not Redis's
    # the Operator names the job after the Service: the name `up{job=...}` matches
    assert service["metadata"]["name"] == JOB
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert endpoint["path"] == "/metrics"


def test_kubectl_kustomize_renders_the_monitoring() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run(
        [kubectl, "kustomize", str(MONITORING)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(done.stdout) if d)
    assert kinds == ["PrometheusRule", "ServiceMonitor"]
