"""Any call to any instance: three ``python -m kv_slot_tracker`` processes on a Redis server the test owns,
load-balanced lifecycle traffic from several clients keeping a ground truth of what was
acknowledged (``tests/e2e/consistency.py``), faults injected while it runs. At the end every
instance must report exactly the ground truth, per rank; no client may have seen a spurious 404
or an undocumented 5xx.

The longer form with figures is ``bench/consistency_bench.py``.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.e2e.conftest import FleetFactory
from tests.e2e.consistency import Traffic, inject_faults, load_view, register_topology
from tests.e2e.servers import Fleet, ServerProcess, wait_until
from tests.replication.helpers import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

CONVERGE_S = 15.0


def loads(server: ServerProcess) -> list[dict[str, int]] | None:
    try:
        r = httpx.get(server.url + "/loads", timeout=5)
    except httpx.TransportError:
        return None
    return load_view(r.json()) if r.status_code == 200 else None


def consistency_counters(server: ServerProcess) -> str:
    """The instance's early-call and duplicate-add counters (``/metrics``), for a failure."""
    try:
        text = httpx.get(server.url + "/metrics", timeout=5).text
    except httpx.TransportError as e:
        return f"/metrics: {e}"
    prefix = "kv_slot_tracker_consistency_"
    return ", ".join(
        line.removeprefix(prefix) for line in text.splitlines() if line.startswith(prefix)
    )


def converge(servers: list[ServerProcess], traffic: Traffic, timeout: float = CONVERGE_S) -> float:
    """Wait until every instance reports the ground truth; returns how long that took."""
    want = traffic.truth.loads()
    started = time.monotonic()

    def describe() -> str:
        lines = [f"expected {want}"]
        lines += [f"{s.name}: {loads(s)}\n  {s.status()}\n  {consistency_counters(s)}"
                  for s in servers]  # fmt: skip
        lines.append(f"traffic: {traffic.tally.summary()}")
        differ = {(row["worker_id"], row["dp_rank"]) for s in servers for row in loads(s) or []
                  if row not in want}  # fmt: skip
        for rank in sorted(differ):
            lines.append(f"calls of rank {rank} that were retried or refused:")
            lines += [f"  {line}" for line in traffic.irregular(rank)]
        return "\n".join(lines)

    wait_until(lambda: all(loads(s) == want for s in servers), timeout, "the ground truth on "
               "every instance", 0.005, describe)  # fmt: skip
    return time.monotonic() - started


def check_answers(traffic: Traffic) -> None:
    tally = traffic.tally
    assert tally.spurious_404 == [], tally.summary()
    assert tally.unexpected == [], tally.summary()
    assert tally.calls["add"] > 50 and tally.calls["free"] > 20, tally.summary()


def start_fleet(fleet_factory: FleetFactory, redis: RedisServer, ack: str) -> Fleet:
    fleet = fleet_factory(redis_url=redis.url, snapshot_interval_seconds=2,
                          env={"REPLICATION_ACK": ack})  # fmt: skip
    fleet.spawn(3)
    register_topology(fleet.servers[0].url)
    wait_until(lambda: all(loads(s) == loads(fleet.servers[0]) for s in fleet.servers), 10,
               "the topology everywhere")  # fmt: skip
    return fleet


@pytest.mark.parametrize("ack", ["local", "redis"])
def test_rolling_restart_under_traffic_converges_exactly(
    fleet_factory: FleetFactory, own_redis: RedisServer, ack: str
) -> None:
    """SIGTERM flushes the outbox before the process exits, and a restarted instance loads the
    shared state before it serves: restarting every instance in turn loses nothing."""
    fleet = start_fleet(fleet_factory, own_redis, ack)
    traffic = Traffic([s.url for s in fleet.servers], clients=6, seed=5)
    traffic.start()
    try:
        time.sleep(1.5)
        for server in fleet.servers:
            server.kill(signal.SIGTERM)
            fleet.restart(server, wait=False)
            server.wait_ready(timeout=30)
            time.sleep(1.0)
    finally:
        traffic.stop()
    converge(fleet.servers, traffic)
    check_answers(traffic)
    for server in fleet.servers:
        assert server.status()["dropped"] == 0
        log = server.log_path.read_text()
        assert log.count("Application shutdown complete") == 1, server.log_tail()  # graceful
        assert "not published" not in log, server.log_tail()  # the outbox was flushed


@pytest.mark.parametrize("ack", ["local", "redis"])
def test_any_call_to_any_instance_through_faults(
    fleet_factory: FleetFactory, own_redis: RedisServer, ack: str
) -> None:
    """The faults of ``inject_faults`` while six clients send lifecycle calls round robin.
    With local acknowledgements no call is refused at all, except by an instance still
    loading the shared state after its restart; with ``replication_ack = "redis"`` calls are
    refused (or not acknowledged) while Redis is away, and a SIGKILL loses nothing a client
    was told."""
    fleet = start_fleet(fleet_factory, own_redis, ack)
    traffic = Traffic([s.url for s in fleet.servers], clients=6, seed=17 if ack == "local" else 18)
    traffic.start()
    try:
        faults = inject_faults(fleet, own_redis, ack, step_s=2.0)
    finally:
        traffic.stop()
    converge(fleet.servers, traffic)
    check_answers(traffic)
    assert len(faults) == (4 if ack == "redis" else 3)
    refused = {k: v for k, v in traffic.tally.answers.items() if k.endswith(" 503")}
    if ack == "redis":
        assert refused, traffic.tally.summary()  # Redis was away: calls had to be refused
    for server in fleet.servers:
        assert server.status()["dropped"] == 0
