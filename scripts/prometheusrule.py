"""Write deploy/kubernetes/monitoring/prometheusrule.yaml from deploy/prometheus/alerts.yaml.

    python scripts/prometheusrule.py          # rewrite the PrometheusRule
    python scripts/prometheusrule.py --check  # exit 1 when it is not what alerts.yaml gives

The PrometheusRule's ``spec.groups`` is the rules file's ``groups``, verbatim (comments
included), so the Prometheus Operator loads exactly the rules promtool checks and tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULE = ROOT / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"

HEAD = """\
# The alert rules of deploy/prometheus/alerts.yaml as a PrometheusRule, for the Prometheus
# Operator (kube-prometheus-stack and the like). Written by scripts/prometheusrule.py:
# spec.groups is that file's `groups`, verbatim (tests/deploy/test_alerts.py checks it; edit
# alerts.yaml, then run the script). Many installations only load rules carrying a given label
# (the Prometheus resource's ruleSelector, e.g. `release: <the Helm release>`): add it under
# metadata.labels, here or with a kustomize patch.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kv-slot-tracker
  labels:
    app.kubernetes.io/name: kv-slot-tracker
spec:
"""


def render(alerts: str) -> str:
    groups = alerts[alerts.index("\ngroups:") + 1 :]
    return HEAD + "".join("  " + line if line.strip() else line for line in groups.splitlines(True))


def main(argv: list[str]) -> int:
    wanted = render(ALERTS.read_text())
    if argv[1:] == ["--check"]:
        if RULE.read_text() != wanted:
            print(f"{RULE} is out of date: run python scripts/prometheusrule.py", file=sys.stderr)
            return 1
        return 0
    RULE.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
