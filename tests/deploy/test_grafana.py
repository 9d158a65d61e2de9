"""The Grafana dashboard (``deploy/grafana/kv-slot-tracker.json``) charts only series the
service really exports, with labels they really carry.

The series are those of real applications (``series.py``: two replicated instances with
traffic and a KV-event listener, one discovering workers through a fake Kubernetes API). Every
PromQL expression of the dashboard (panel targets and template-variable queries) is parsed with
a real PromQL parser, and then:

* every selector names a sample the service exports (so ``..._bucket``/``_sum``/``_count``/
  ``_total`` must be spelt as exported: a histogram's bare name is refused);
* every label matched, grouped by (``by``) or joined on (``on``) is a label of the series it
  applies to, or one Prometheus adds (``instance``, ``job``);
* every family the service exports is charted somewhere;
* the load, HTTP and process panels also work against an embedded (no Redis) instance.

The checker itself is shown to catch a missing series, a bare histogram name, a wrong label
and a syntax error.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from tests.deploy.series import (
    Exported,
    Query,
    families_used,
    problems,
)
from tests.deploy.support import DASHBOARD

# Series of the KV-event listener that a query may name before this checkout exports them (they
# come with the ingest's field-named metrics: kv_cache_events_applied, kv_cache_event_warnings,
# listeners), with their labels. Once exported they are checked like every other series (their
# exported labels win); had they been named otherwise, the families really exported would be
# left uncharted, which test_every_exported_family_is_charted refuses.
ANTICIPATED: dict[str, set[str]] = {
    "kv_slot_tracker_kv_cache_events_applied_total": {"event_type", "status"},
    "kv_slot_tracker_kv_cache_event_warnings_total": {"warning_kind"},
    "kv_slot_tracker_kv_events_listeners": {"status"},
    "kv_slot_tracker_kv_events_reconnects_total": set(),
}
# Families the service exports that no panel charts, on purpose (none so far).
UNCHARTED: frozenset[str] = frozenset()
DATASOURCE_UID = "${datasource}"


# --- The dashboard ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def chart_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def dashboard_queries(dashboard: dict[str, Any]) -> list[Query]:
    queries = [
        Query(f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in chart_panels(dashboard)
        for t in p["targets"]
    ]
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert m, f"variable {var['name']}: only label_values(SELECTOR, LABEL) is checked"
        queries.append(Query(f"variable {var['name']}", m.group(1), label=m.group(2)))
    return queries


def test_dashboard_is_importable(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "kv-slot-tracker"
    assert dashboard["id"] is None, "an id is assigned by the Grafana that imports it"
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    (ds_var,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds_var["name"] == "datasource" and ds_var["query"] == "prometheus"
    for p in dashboard["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
    for p in chart_panels(dashboard):
        assert p["datasource"]["uid"] == DATASOURCE_UID, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == DATASOURCE_UID, p["title"]


def test_no_data_source_is_hard_coded() -> None:
    """A uid of one Grafana would break the import into another."""
    uids = set(re.findall(r'"uid":\s*"([^"]*)"', DASHBOARD.read_text()))
    assert uids == {"kv-slot-tracker", DATASOURCE_UID, "-- Grafana --"}


def with_anticipated(exported: Exported) -> Exported:
    """``exported`` and the anticipated series it lacks."""
    out = copy.deepcopy(exported)
    for name, labels in ANTICIPATED.items():
        out.labels.setdefault(name, set(labels))
    return out


def test_every_query_names_exported_series_and_labels(
    dashboard: dict[str, Any], replicated: Exported
) -> None:
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 30
    assert problems(queries, with_anticipated(replicated)) == []


def test_anticipated_series_are_charted_and_nothing_else_is_excused(
    dashboard: dict[str, Any], replicated: Exported
) -> None:
    text = json.dumps(dashboard)
    assert all(name in text for name in ANTICIPATED)
    # without them, exactly the queries naming them are refused
    found = problems(dashboard_queries(dashboard), replicated)
    missing = {name for name in ANTICIPATED if name not in replicated.labels}
    assert bool(found) == bool(missing), found
    assert all(any(n in f for n in missing) for f in found), found


def test_every_exported_family_is_charted(dashboard: dict[str, Any], replicated: Exported) -> None:
    used = families_used(dashboard_queries(dashboard), replicated)
    # `_created` samples (creation timestamps of counters and histograms) need no panel
    families = {f for f in replicated.family.values() if not f.endswith("_created")}
    assert len(families) >= 20
    assert families - used - UNCHARTED == set(), "exported but on no panel"


# What an embedded instance with default settings does not export: replication, KV events (off in
# the tests' environment), discovery, and a memory limit where the machine has none.
NOT_EMBEDDED = (
    "kv_slot_tracker_replication_",
    "kv_slot_tracker_consistency_",
    "kv_slot_tracker_kv_",
    "kv_slot_tracker_discovery_",
    "kv_slot_tracker_memory_limit_",
)


def test_load_http_and_process_panels_work_without_redis(
    dashboard: dict[str, Any], embedded: Exported
) -> None:
    queries = [
        q for q in dashboard_queries(dashboard) if not any(p in q.expr for p in NOT_EMBEDDED)
    ]
    assert len(queries) >= 20
    assert any("process_cpu_seconds_total" in q.expr for q in queries)
    assert problems(queries, embedded) == []


# --- The checker catches mistakes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "complaint"),
    [
        ("kv_slot_tracker_active_blocks", "`kv_slot_tracker_active_blocks` is not a series"),
        (
            "histogram_quantile(0.99, sum by (le) (rate(kv_slot_tracker_http_request_duration_seconds"
            "[5m])))",
            "`kv_slot_tracker_http_request_duration_seconds` is not a series",
        ),
        (
            "rate(kv_slot_tracker_http_requests[$__rate_interval])",
            "`kv_slot_tracker_http_requests` is not a series",
        ),
        # the names without the service's prefix are gone
        ("rate(http_requests_total[5m])", "`http_requests_total` is not a series"),
        ("sum by (model) (kv_slot_tracker_active_requests)", "`model` is not a label"),
        ('kv_slot_tracker_trackers{model_name="m"}', "has no label `model_name`"),
        (
            "kv_slot_tracker_trackers * on (handler) kv_slot_tracker_replication_connected",
            "`handler` is not a label",
        ),
        ('{job="x"}', "without a metric name"),
        ("sum(rate(http_requests_total[5m])", "is not PromQL"),
        ('rate(http_requests_total{status=~"$status"}[$step])', "is not PromQL"),
    ],
)
def test_the_checker_reports(expr: str, complaint: str, replicated: Exported) -> None:
    found = problems([Query("probe", expr)], replicated)
    assert found and complaint in found[0], found


def test_the_checker_reports_a_variable_listing_a_missing_label(replicated: Exported) -> None:
    found = problems([Query("v", "kv_slot_tracker_trackers", label="model_name")], replicated)
    assert len(found) == 1 and "lists label `model_name`" in found[0], found


def test_the_checker_accepts_suffixed_series_and_target_labels(replicated: Exported) -> None:
    fine = [
        "sum by (le, handler) (rate(kv_slot_tracker_http_request_duration_seconds_bucket[5m]))",
        "rate(kv_slot_tracker_http_request_duration_seconds_sum[5m])"
        " / rate(kv_slot_tracker_http_request_duration_seconds_count[5m])",
        "max by (worker_id, dp_rank) (kv_slot_tracker_kv_events_silent_seconds)",
        "kv_slot_tracker_discovery_workers + on (instance) kv_slot_tracker_memory_limit_bytes",
        'sum by (instance) (rate(kv_slot_tracker_replication_applied_total{job="kv"}[$__range]))',
        'kv_slot_tracker_active_decode_blocks{model_name="llama", dp_rank="1"}',
    ]
    assert problems([Query("probe", e) for e in fine], replicated) == []
