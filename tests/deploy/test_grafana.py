"""The Grafana dashboard (``deploy/grafana/kv-slot-tracker.json``) charts only series the
service really exports, with labels they really carry.

Two applications built by ``create_app`` replicate through the test Redis; a little traffic
(register, add, prefill complete, output block, free, a refused call, a selection worker and a
pending selection, on both) makes every series appear, and both ``/metrics`` pages are read.
Every PromQL expression of the dashboard (panel targets and template-variable queries) is
parsed with a real PromQL parser, and then:

* every selector names a sample the service exports (so ``..._bucket``/``_sum``/``_count``/
  ``_total`` must be spelt as exported: a histogram's bare name is refused);
* every label matched, grouped by (``by``) or joined on (``on``) is a label of the series it
  applies to, or one Prometheus adds (``instance``, ``job``);
* every family the service exports is charted somewhere;
* the load and HTTP panels also work against an embedded (no Redis) instance.

The checker itself is shown to catch a missing series, a bare histogram name, a wrong label
and a syntax error.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import promql_parser
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.support import DASHBOARD, app_client

# Labels Prometheus attaches to every scraped series.
TARGET_LABELS = frozenset({"instance", "job"})
# Grafana's interval macros, replaced by a duration so the expression parses as PromQL.
MACROS = re.compile(r"\$\{?__(rate_interval|interval|range)\}?")
# Families the service exports that no panel charts, on purpose (none so far).
UNCHARTED: frozenset[str] = frozenset()
DATASOURCE_UID = "${datasource}"


# --- The service's series ---------------------------------------------------------------------


@dataclass
class Exported:
    """Sample names of one or more ``/metrics`` pages with their label names and families."""

    labels: dict[str, set[str]] = field(default_factory=dict)
    family: dict[str, str] = field(default_factory=dict)

    def add_page(self, text: str) -> None:
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                self.labels.setdefault(sample.name, set()).update(sample.labels)
                self.family[sample.name] = fam.name


async def drive_traffic(client: httpx.AsyncClient, worker_id: int) -> None:
    ok = [
        ("/register", {"model_name": "llama", "worker_id": worker_id, "block_size": 16,
                       "dp_start": 0, "dp_size": 2}),
        ("/add", {"model_name": "llama", "request_id": f"a{worker_id}", "worker_id": worker_id,
                  "dp_rank": 0, "sequence_hashes": [1, 2, 3], "new_isl_tokens": 48}),
        ("/add", {"model_name": "llama", "request_id": f"b{worker_id}", "worker_id": worker_id,
                  "dp_rank": 1, "sequence_hashes": [1, 2, 4], "new_isl_tokens": 40}),
        ("/prefill_complete", {"model_name": "llama", "request_id": f"b{worker_id}"}),
        ("/output_block", {"model_name": "llama", "request_id": f"b{worker_id}"}),
        ("/free", {"model_name": "llama", "request_id": f"a{worker_id}"}),
    ]  # fmt: skip
    # a selection worker and a pending selection: every selection series (two selection
    # records for the peer)
    selection = [
        ("/selection/workers", {"model_name": "llama-sel", "worker_id": worker_id,
                                "endpoint": f"http://w{worker_id}", "block_size": 4}),
        ("/selection/select", {"model_name": "llama-sel", "selection_id": "s",
                               "token_ids": [1, 2, 3, 4, 5]}),
    ]  # fmt: skip
    for path, body in ok + selection:
        resp = await client.post(path, json=body)
        assert resp.is_success, (path, resp.status_code, resp.text)
    assert (await client.get("/loads", params={"model_name": "llama"})).status_code == 200
    assert (await client.post("/free", json={"request_id": "x"})).status_code == 422


async def scrape_replicated(redis_url: str, namespace: str) -> Exported:
    exported = Exported()
    settings = {"redis_url": redis_url, "namespace": namespace}
    async with app_client(**settings) as a, app_client(**settings) as b:
        assert (await a.get("/ready")).status_code == 200
        assert (await b.get("/ready")).status_code == 200
        await drive_traffic(a, worker_id=1)
        await drive_traffic(b, worker_id=2)

        async def caught_up() -> bool:
            sa = (await a.get("/replication")).json()
            sb = (await b.get("/replication")).json()
            return sa["published"] == sb["applied"] == 7 and sb["published"] == sa["applied"] == 7

        for _ in range(1000):
            if await caught_up():
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the two instances did not apply each other's records")
        for client in (a, b):
            page = (await client.get("/metrics")).text
            assert "kv_slot_tracker_replication_lag_seconds_count 7.0" in page
            exported.add_page(page)
    return exported


async def scrape_embedded() -> Exported:
    exported = Exported()
    async with app_client() as client:
        await drive_traffic(client, worker_id=1)
        exported.add_page((await client.get("/metrics")).text)
    return exported


@pytest.fixture(scope="module")
def replicated(redis_url: str) -> Exported:
    namespace = f"test-grafana-{uuid.uuid4().hex}"
    try:
        return asyncio.run(scrape_replicated(redis_url, namespace))
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match="{" + namespace + "}:*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture(scope="module")
def embedded() -> Exported:
    return asyncio.run(scrape_embedded())


# --- PromQL -----------------------------------------------------------------------------------


@dataclass
class Query:
    where: str  # panel title / variable name, for messages
    expr: str
    label: str | None = None  # label_values(..., label): the label the variable lists


def selector_name(node: promql_parser.VectorSelector) -> str | None:
    if node.name:
        return node.name
    for m in node.matchers.matchers:
        if m.name == "__name__" and m.op == promql_parser.MatchOp.Equal:
            return m.value
    return None


def selectors(expr: promql_parser.Expr) -> list[promql_parser.VectorSelector]:
    found: list[promql_parser.VectorSelector] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            found.append(node)
        return True

    promql_parser.walk(expr, visit)
    return found


def grouping_problems(
    where: str,
    expr: promql_parser.Expr,
    labels_of: Callable[[list[promql_parser.VectorSelector]], set[str]],
) -> list[str]:
    """Labels of ``by (...)`` and ``on (...)`` that the series they apply to lack."""
    out: list[str] = []

    def visit(node: Any) -> bool:
        grouping: list[str] = []
        scope: list[promql_parser.VectorSelector] = []
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            if node.modifier.type == promql_parser.AggModifierType.By:
                grouping, scope = list(node.modifier.labels), selectors(node.expr)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            matching = node.modifier.matching
            if matching is not None and matching.type == promql_parser.LabelModifierType.Include:
                grouping = list(matching.labels) + list(node.modifier.group_labels or [])
                scope = selectors(node.lhs) + selectors(node.rhs)
        known = labels_of(scope)
        out.extend(
            f"{where}: `{label}` is not a label of {sorted(map(selector_name, scope))}"
            for label in grouping
            if label not in known
        )
        return True

    promql_parser.walk(expr, visit)
    return out


def problems(queries: Iterable[Query], exported: Exported) -> list[str]:
    """What in ``queries`` names a series or label that ``exported`` lacks (empty: none)."""
    out: list[str] = []
    for q in queries:
        text = MACROS.sub("5m", q.expr)
        try:
            expr = promql_parser.parse(text)
        except ValueError as exc:
            out.append(f"{q.where}: `{q.expr}` is not PromQL: {exc}")
            continue

        def labels_of(nodes: list[promql_parser.VectorSelector]) -> set[str]:
            names = (selector_name(n) for n in nodes)
            return set().union(TARGET_LABELS, *(exported.labels.get(n, set()) for n in names))

        for node in selectors(expr):
            name = selector_name(node)
            if name is None:
                out.append(f"{q.where}: a selector without a metric name in `{q.expr}`")
            elif name not in exported.labels:
                out.append(f"{q.where}: `{name}` is not a series /metrics exports")
            else:
                known = labels_of([node]) | {"__name__"}
                for m in node.matchers.matchers:
                    if m.name not in known:
                        out.append(f"{q.where}: `{name}` has no label `{m.name}`")
        if q.label is not None and q.label not in labels_of(selectors(expr)):
            out.append(f"{q.where}: the variable lists label `{q.label}`, which its series lack")

        out.extend(grouping_problems(q.where, expr, labels_of))
    return out


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


def test_every_query_names_exported_series_and_labels(
    dashboard: dict[str, Any], replicated: Exported
) -> None:
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 30
    assert problems(queries, replicated) == []


def test_every_exported_family_is_charted(dashboard: dict[str, Any], replicated: Exported) -> None:
    used = {
        replicated.family[selector_name(node)]
        for q in dashboard_queries(dashboard)
        for node in selectors(promql_parser.parse(MACROS.sub("5m", q.expr)))
    }
    # `_created` samples (creation timestamps of counters and histograms) need no panel
    families = {f for f in replicated.family.values() if not f.endswith("_created")}
    assert len(families) >= 20
    assert families - used - UNCHARTED == set(), "exported but on no panel"


def test_load_and_http_panels_work_without_redis(
    dashboard: dict[str, Any], embedded: Exported
) -> None:
    replicated_only = ("kv_slot_tracker_replication_", "kv_slot_tracker_consistency_")
    queries = [
        q for q in dashboard_queries(dashboard) if not any(p in q.expr for p in replicated_only)
    ]
    assert len(queries) >= 15
    assert problems(queries, embedded) == []


# --- The checker catches mistakes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "complaint"),
    [
        ("kv_slot_tracker_active_blocks", "`kv_slot_tracker_active_blocks` is not a series"),
        (
            "histogram_quantile(0.99, sum by (le) (rate(http_request_duration_seconds[5m])))",
            "`http_request_duration_seconds` is not a series",
        ),
        ("rate(http_requests[$__rate_interval])", "`http_requests` is not a series"),
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
        "sum by (le, handler) (rate(http_request_duration_seconds_bucket[5m]))",
        "rate(http_request_duration_seconds_sum[5m]) / rate(http_request_duration_seconds_count[5m])",
        'sum by (instance) (rate(kv_slot_tracker_replication_applied_total{job="kv"}[$__range]))',
        'kv_slot_tracker_active_decode_blocks{model_name="llama", dp_rank="1"}',
    ]
    assert problems([Query("probe", e) for e in fine], replicated) == []
