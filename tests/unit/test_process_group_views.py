"""``/replication`` and ``/metrics`` of several processes as one (``kv_slot_tracker.http.process_group``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kv_slot_tracker.http.process_group import merge_metrics, merge_status


def exposition(published: int, active: int) -> bytes:
    registry = CollectorRegistry()
    Counter("records_published", "records", registry=registry).inc(published)
    Gauge("active", "requests", ["model"], registry=registry).labels("m").set(active)
    return generate_latest(registry)


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text.decode())
        for s in f.samples
        if not s.name.endswith("_created")
    }


def test_metrics_of_every_process_labelled_with_its_index() -> None:
    merged = merge_metrics({1: exposition(7, 3), 0: exposition(5, 3)})
    assert samples(merged) == {
        ("records_published_total", (("process", "0"),)): 5.0,
        ("records_published_total", (("process", "1"),)): 7.0,
        ("active", (("model", "m"), ("process", "0"))): 3.0,
        ("active", (("model", "m"), ("process", "1"))): 3.0,
    }
    assert merged.count(b"# TYPE records_published_total counter") == 1


def status(process: int, **fields: object) -> dict:
    base = {"mode": "redis", "instance_id": 10 + process, "ready": True, "connected": True,
            "degraded": False, "degraded_reasons": [], "published": 2, "applied": 3,
            "dropped": 0, "process": process, "pid": 100 + process}  # fmt: skip
    return {**base, **fields}


def test_status_sums_counters_and_lists_the_processes() -> None:
    views = [status(0, records_rejected={"malformed": 1}),
             status(1, published=5, applied=1, records_rejected={"malformed": 2, "stale": 1})]  # fmt: skip
    merged = merge_status(views[0], views, [])
    assert merged["published"] == 7 and merged["applied"] == 4 and merged["dropped"] == 0
    assert merged["records_rejected"] == {"malformed": 3, "stale": 1}
    assert merged["ready"] and not merged["degraded"] and merged["not_ready_reason"] is None
    assert merged["instance_id"] == 10 and "process" not in merged and "pid" not in merged
    assert merged["processes"] == views and merged["processes_missing"] == []


def test_status_not_ready_or_degraded_when_any_process_is() -> None:
    views = [status(0), status(1, ready=False, not_ready_reason="loading", connected=False,
                                degraded=True, degraded_reasons=["Redis unreachable"])]  # fmt: skip
    merged = merge_status(views[0], views, [])
    assert not merged["ready"] and merged["not_ready_reason"] == "loading"
    assert merged["degraded"] and merged["degraded_reasons"] == ["Redis unreachable"]
    assert merged["connected"] is False


def test_a_process_not_answering_makes_the_instance_degraded() -> None:
    merged = merge_status(status(0), [status(0)], [1])
    assert not merged["ready"] and merged["not_ready_reason"] == "process 1 not answering"
    assert merged["degraded_reasons"] == ["process 1 not answering"]
    assert merged["processes_missing"] == [1]
