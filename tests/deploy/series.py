"""The series the service really exports, and a checker of PromQL against them, shared by the
dashboard's and the alert rules' tests.

Two applications built by ``create_app`` replicate through the test Redis; a little traffic
(register, add, prefill complete, output block, free, a refused call, a selection worker with a
KV-event publisher and a pending selection, on both) makes every series appear, and both
``/metrics`` pages are read. A third application discovers one worker through a fake Kubernetes
API (the discovery series), a fourth finds no Redis where it looks (not ready, degraded with a
reason), and the memory-limit collector reads a limit from a fake cgroup directory (this
machine's may have none).

``problems(queries, exported)`` parses each expression with a real PromQL parser and reports:

* a selector naming no sample the service exports (so ``..._bucket``/``_sum``/``_count``/
  ``_total`` must be spelt as exported: a histogram's bare name is refused);
* a label matched, grouped by (``by``) or joined on (``on``) that the series it applies to
  lack, but for the ones Prometheus adds (``instance``, ``job``).
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kv_slot_tracker.observability.process import MemoryLimitCollector
from tests.deploy.support import app_client
from tests.discovery.fake_kube import FakeKubeApi, endpoint

# Labels Prometheus attaches to every scraped series.
TARGET_LABELS = frozenset({"instance", "job"})
# Grafana's interval macros, replaced by a duration so the expression parses as PromQL.
MACROS = re.compile(r"\$\{?__(rate_interval|interval|range)\}?")


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


async def drive_traffic(
    client: httpx.AsyncClient, worker_id: int, kv_events_endpoint: str | None = None
) -> None:
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
    # a selection worker (with KV events on, it is schedulable only with a KV-event publisher)
    # and a pending selection: every selection series (two selection records for the peer)
    worker: dict[str, Any] = {"model_name": "llama-sel", "worker_id": worker_id,
                              "endpoint": f"http://w{worker_id}", "block_size": 4}  # fmt: skip
    if kv_events_endpoint is not None:
        worker["kv_events_endpoint"] = kv_events_endpoint
    selection = [
        ("/selection/workers", worker),
        ("/selection/select", {"model_name": "llama-sel", "selection_id": "s",
                               "token_ids": [1, 2, 3, 4, 5]}),
    ]  # fmt: skip
    for path, body in ok + selection:
        resp = await client.post(path, json=body)
        assert resp.is_success, (path, resp.status_code, resp.text)
    assert (await client.get("/loads", params={"model_name": "llama"})).status_code == 200
    assert (await client.post("/free", json={"request_id": "x"})).status_code == 422


async def page_once(
    client: httpx.AsyncClient, has: Callable[[str], bool], what: str, timeout: float = 20.0
) -> str:
    """The ``/metrics`` page, once ``has(page)``."""
    deadline = time.monotonic() + timeout
    while True:
        page = (await client.get("/metrics")).text
        if has(page):
            return page
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def scrape_replicated(redis_url: str, namespace: str) -> Exported:
    exported = Exported()
    settings = {"redis_url": redis_url, "namespace": namespace, "router_use_kv_events": True}
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)  # an engine's KV-event socket, on a port of its own
    publisher.bind("tcp://127.0.0.1:*")
    kv_events_endpoint = publisher.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        async with app_client(**settings) as a, app_client(**settings) as b:
            assert (await a.get("/ready")).status_code == 200
            assert (await b.get("/ready")).status_code == 200
            await drive_traffic(a, worker_id=1, kv_events_endpoint=kv_events_endpoint)
            await drive_traffic(b, worker_id=2, kv_events_endpoint=kv_events_endpoint)

            async def caught_up() -> bool:
                sa = (await a.get("/replication")).json()
                sb = (await b.get("/replication")).json()
                return (
                    sa["published"] == sb["applied"] == 7 and sb["published"] == sa["applied"] == 7
                )

            for _ in range(1000):
                if await caught_up():
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the two instances did not apply each other's records")
            # the listeners subscribed to the publisher
            page_a = await page_once(
                a, lambda p: "kv_slot_tracker_kv_events_connected{" in p, "a KV listener"
            )
            for page in (page_a, (await b.get("/metrics")).text):
                assert "kv_slot_tracker_replication_lag_seconds_count 7.0" in page
                exported.add_page(page)
    finally:
        publisher.close(linger=0)
        context.term()
    return exported


def discovery_page() -> str:
    """``/metrics`` of an instance discovering one worker through a fake Kubernetes API (runs
    its own event loop)."""
    labels = {"kubernetes.io/service-name": "vllm", "kv-slot-tracker/model-name": "llama",
              "kv-slot-tracker/block-size": "16"}  # fmt: skip

    async def scrape(kube: FakeKubeApi, kubeconfig: Path) -> str:
        async with app_client(
            discovery_kubernetes_service="vllm", discovery_kubernetes_kubeconfig=str(kubeconfig)
        ) as client:
            return await page_once(
                client, lambda p: "kv_slot_tracker_discovery_workers 1.0" in p, "the discovery"
            )

    with FakeKubeApi() as kube, tempfile.TemporaryDirectory() as tmp:
        kube.put("vllm-a", [endpoint("vllm-0")], labels)
        return asyncio.run(scrape(kube, kube.kubeconfig(Path(tmp) / "kubeconfig")))


def unreachable_page() -> str:
    """``/metrics`` of an instance whose Redis is not there: not ready, degraded, with a reason
    (runs its own event loop)."""

    async def scrape(url: str) -> str:
        async with app_client(redis_url=url, namespace="test-series-unreachable") as client:
            return await page_once(
                client, lambda p: "kv_slot_tracker_replication_degraded_reason{" in p, "a reason"
            )

    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(scrape(f"unix://{Path(tmp) / 'no-redis.sock'}"))


def memory_limit_page() -> str:
    """The memory-limit series as a process under a 1 GiB cgroup limit exports it."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "memory.max").write_text(f"{2**30}\n")
        registry = CollectorRegistry()
        registry.register(MemoryLimitCollector(Path(tmp)))
        return generate_latest(registry).decode()


async def scrape_embedded() -> Exported:
    exported = Exported()
    async with app_client() as client:
        await drive_traffic(client, worker_id=1)
        exported.add_page((await client.get("/metrics")).text)
    return exported


# --- PromQL -----------------------------------------------------------------------------------


@dataclass
class Query:
    where: str  # panel title / variable name / alert, for messages
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


def families_used(queries: Iterable[Query], exported: Exported) -> set[str]:
    """The exported families the queries select."""
    return {
        exported.family[name]
        for q in queries
        for node in selectors(promql_parser.parse(MACROS.sub("5m", q.expr)))
        if (name := selector_name(node)) in exported.family
    }
