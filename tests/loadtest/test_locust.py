"""A short headless Locust run of ``loadtest/locustfile.py`` against a real instance.

The instance runs as a subprocess (embedded mode, bearer key on, KV events on) and so does
Locust, so gevent's monkey-patching stays out of the test process. The run must exit 0 (no
unexpected failure, no exception in the locustfile, every rank empty at the end) and its CSV
must show traffic on every lifecycle route, every selection route and both expected-failure
classes; the simulated engines (``loadtest/kv_engines.py``) must have stored and evicted blocks,
and selections must have found prompts' blocks cached. A run without the key must fail.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import live_server

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
API_KEY = "loadtest-key"

# Stat names used by the locustfile (not imported: importing locust monkey-patches this process).
DUPLICATE_ADD = "/add [expect 409 duplicate id]"
UNKNOWN_RANK_ADD = "/add [expect 404 unknown rank]"
LIFECYCLE = ["/potential_loads", "/project_loads", "/add", "/prefill_complete", "/output_block",
             "/free"]  # fmt: skip
SELECTION = [
    "/selection/workers",
    "/selection/select_and_reserve",
    "/selection/select",
    "/selection/reservations [pending selection]",
    "/selection/overlap_scores",
    "/selection/potential_loads",
    "/selection/reservations [given rank]",
    "/selection/reservations/{id}/prefill_complete",
    "/selection/reservations/{id}/output_block",
    "/selection/reservations/{id} [free]",
    "/selection/loads",
    "/selection/workers [list]",
    "/selection/health",
    "/selection/ready",
    "/selection/dump",
    "/selection/kv_index",
    "/selection/workers/{id} [patch]",
    "/selection/workers/{id}",
]
KV_EVENTS_ON = {"SLOT_TRACKER_ROUTER_USE_KV_EVENTS": "true"}  # the service's default


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without settings or workload options that would change the run."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("LOADTEST_")
        and k not in ("SLOT_TRACKER_REDIS_URL", "SLOT_TRACKER_API_KEY", "SLOT_TRACKER_PORT")
    }
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(
        tmp_path_factory.mktemp("instance"), SLOT_TRACKER_API_KEY=API_KEY, **KV_EVENTS_ON
    ) as url:
        yield url


def run_locust(
    url: str, out: Path, env: dict[str, str], *extra: str
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", *extra]
    cmd += ["-u", "10", "-r", "10", "-t", "5s", "-H", url, "--csv", str(out / "run")]
    cmd += ["--only-summary", "--lt-check-drained", "--lt-inject-ratio", "0.3"]
    # users finish the task (or warm-up) under way when the time is up, at most 10 s more: every
    # route is then called at least once however slow the machine (see the users' on_start)
    cmd += ["--stop-timeout", "10"]
    cmd += ["--lt-kv-capacity", "150"]  # small: the engines evict within the run
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)


def read_stats(path: Path) -> dict[str, dict[str, str]]:
    with path.open(newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def assert_called(stats: dict[str, dict[str, str]], names: list[str], output: str) -> None:
    """Every route in ``names`` was called, and never failed."""
    for name in names:
        row = stats.get(name)
        assert row is not None, f"no {name} requests: {sorted(stats)}\n{output}"
        assert int(row["Request Count"]) > 0, f"{name}: {row}"
        assert int(row["Failure Count"]) == 0, f"{name}: {row}"


def check_kv_events_and_routes(out: Path, stdout: str) -> None:
    """The engines published (stores and evictions), some selections found a prompt's blocks
    cached, and the per-route report covers the routes with their percentiles."""
    report = json.loads((out / "run_routes.json").read_text())
    published = report["kv_events_published"]
    assert published["batches"] > 0 and published["waiting_ranks"] == 0, published
    assert published["stored_blocks"] > 0 and published["removed_blocks"] > 0, published
    assert 0 < report["overlap"]["hits"] <= report["overlap"]["answers"], report["overlap"]
    routes = {r["name"]: r for r in report["routes"]}
    for name in [*LIFECYCLE, *SELECTION]:
        assert name in routes, f"no {name} in the route report: {sorted(routes)}"
        assert routes[name]["requests"] > 0 and routes[name]["failures"] == 0, name
        assert 0 <= routes[name]["p50"] <= routes[name]["p95"] <= routes[name]["p99"], name
    # the same table printed, one line a route
    assert "p50    p95    p99 (ms)" in stdout, stdout[-4000:]
    assert f"{routes['/selection/select']['requests']:>7}" in stdout


def test_short_run_is_clean_and_covers_the_workload(instance: str, tmp_path: Path) -> None:
    result = run_locust(instance, tmp_path, clean_env(SLOT_TRACKER_API_KEY=API_KEY))
    output = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, output
    assert "LOAD TEST PASSED" in result.stdout, output

    stats = read_stats(tmp_path / "run_stats.csv")
    total = stats["Aggregated"]
    assert int(total["Request Count"]) > 0, output
    assert int(total["Failure Count"]) == 0, output
    required = [*LIFECYCLE, *SELECTION, "/register", "/batch [add]", "/loads", "/lora_counts",
                DUPLICATE_ADD, UNKNOWN_RANK_ADD]  # fmt: skip
    assert_called(stats, required, output)
    check_kv_events_and_routes(tmp_path, result.stdout)


def test_unexpected_failures_fail_the_run(instance: str, tmp_path: Path) -> None:
    result = run_locust(instance, tmp_path, clean_env())  # no bearer key: every call is a 401
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-4000:]
    assert "LOAD TEST FAILED" in result.stdout
    assert "got 401" in result.stdout


@pytest.mark.redis
@pytest.mark.e2e
def test_a_run_across_two_instances_sharing_one_state(
    tmp_path: Path, redis_url: str, redis_namespace: str
) -> None:
    """Every call goes to one of two instances at random; the drain check reads the other.
    With durable acknowledgements: a call answered by one instance is in the stream, so the
    other finds it behind its read barrier, and no call may fail. (With local ones a booking of
    a selection made a moment earlier on the other instance may answer 404 once its records take
    longer than ``consistency_wait_ms`` to arrive, as they do on a saturated machine: that case
    is the consistency tests' (tests/e2e/test_consistency.py, tests/replication/).)"""
    shared = {
        "SLOT_TRACKER_API_KEY": API_KEY,
        "SLOT_TRACKER_REDIS_URL": redis_url,
        "SLOT_TRACKER_NAMESPACE": redis_namespace,
        "SLOT_TRACKER_REPLICATION_ACK": "redis",
        **KV_EVENTS_ON,
    }
    with (
        live_server(tmp_path, **shared, SLOT_TRACKER_INSTANCE_ID="1") as first,
        live_server(tmp_path, **shared, SLOT_TRACKER_INSTANCE_ID="2") as second,
    ):
        env = clean_env(SLOT_TRACKER_API_KEY=API_KEY)
        result = run_locust(second, tmp_path, env, "--lt-hosts", f"{first},{second}")
        output = f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
        assert result.returncode == 0, output
        stats = read_stats(tmp_path / "run_stats.csv")
        assert int(stats["Aggregated"]["Failure Count"]) == 0, output
        assert_called(stats, [*LIFECYCLE, *SELECTION], output)
        check_kv_events_and_routes(tmp_path, result.stdout)
