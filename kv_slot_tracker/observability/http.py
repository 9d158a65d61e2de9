"""HTTP request counts and latencies, shared by the FastAPI routes and the lean paths, and the
access log (one JSON line per request, when ``access_log`` is on)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString
from prometheus_fastapi_instrumentator.metrics import Info

ACCESS_LOGGER = "kv_slot_tracker.access"


def access_logged(
    observe: Callable[[str, str, int, float], None],
) -> Callable[[str, str, int, float], None]:
    """``observe`` that also writes one JSON line per request to the ``kv_slot_tracker.access`` logger:
    time, method, route (its template), status, duration in ms and a request id unique in
    this process. Installed only when ``access_log`` is on: off, the hot paths pay nothing."""
    log = logging.getLogger(ACCESS_LOGGER)
    prefix = f"{os.getpid():x}-"
    ids = itertools.count(1)

    def observe_and_log(method: str, handler: str, status: int, seconds: float) -> None:
        observe(method, handler, status, seconds)
        line = {
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "method": method,
            "route": handler,
            "status": status,
            "duration_ms": round(seconds * 1000, 3),
            "request_id": prefix + str(next(ids)),
        }
        log.info("%s", orjson.dumps(line).decode())

    return observe_and_log


class HttpMetrics:
    """HTTP request counts and latencies, shared by the FastAPI routes (through the
    instrumentator) and the lean paths, so every request lands in the same series.

    Every request is observed, so an observation is two list updates (``bisect`` finds the
    bucket in C) with no locks: the event loop is the only writer. The Prometheus families
    (``kv_slot_tracker_http_requests_total`` by status class,
    ``kv_slot_tracker_http_request_duration_seconds``) are built from
    these cells when scraped, in O(method x route x status seen).
    """

    BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

    def __init__(self, registry: CollectorRegistry) -> None:
        # (method, handler, status) -> [count per bucket..., count above the last, seconds]
        self._cells: dict[tuple[str, str, int], list[Any]] = {}
        self._created: dict[tuple[str, str, int], float] = {}
        registry.register(_HttpCollector(self))

    def observe(self, method: str, handler: str, status: int, seconds: float) -> None:
        key = (method, handler, status)
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = [0] * (len(self.BUCKETS) + 1) + [0.0]
            self._created[key] = time.time()
        cell[bisect_left(self.BUCKETS, seconds)] += 1
        cell[-1] += seconds

    def instrumentation(self, info: Info) -> None:
        """A prometheus-fastapi-instrumentator instrumentation function."""
        status = info.response.status_code if info.response is not None else 500
        self.observe(info.method, info.modified_handler, status, info.modified_duration)


class _HttpCollector(Collector):
    def __init__(self, metrics: HttpMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        cells, created = self.metrics._cells, self.metrics._created
        requests: dict[tuple[str, str, str], list[float]] = {}  # [count, first created]
        latency: dict[tuple[str, str], list[Any]] = {}  # [bucket counts..., seconds, created]
        for key, cell in list(cells.items()):
            method, handler, status = key
            n = sum(cell[:-1])
            row = requests.setdefault((method, handler, f"{status // 100}xx"), [0, created[key]])
            row[0] += n
            row[1] = min(row[1], created[key])
            hist = latency.get((method, handler))
            if hist is None:
                latency[(method, handler)] = [*cell, created[key]]
            else:
                for i, v in enumerate(cell):
                    hist[i] += v
                hist[-1] = min(hist[-1], created[key])
        total = CounterMetricFamily(
            "kv_slot_tracker_http_requests",
            "HTTP requests by method, route and status class",
            labels=["method", "handler", "status"],
        )
        for labels, (n, since) in requests.items():
            total.add_metric(list(labels), n, created=since)
        yield total
        hist_family = HistogramMetricFamily(
            "kv_slot_tracker_http_request_duration_seconds",
            "HTTP request latency by method and route",
            labels=["method", "handler"],
        )
        bounds = [*(floatToGoString(b) for b in HttpMetrics.BUCKETS), "+Inf"]
        for route, hist in latency.items():
            counts, seconds = hist[: len(bounds)], hist[len(bounds)]
            cumulative, running = [], 0
            for bound, count in zip(bounds, counts, strict=True):
                running += count
                cumulative.append((bound, running))
            hist_family.add_metric(list(route), cumulative, seconds)
            method, handler = route
            hist_family.samples.append(
                Sample(
                    "kv_slot_tracker_http_request_duration_seconds_created",
                    {"method": method, "handler": handler},
                    hist[-1],
                )
            )
        yield hist_family
