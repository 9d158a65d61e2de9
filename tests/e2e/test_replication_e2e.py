"""Replication between real service processes through Redis.

Each test starts its own ``python -m kv_slot_tracker`` processes (``tests/e2e/conftest.py``) on a namespace
of its own, drives them over HTTP with ``kv_slot_tracker_client.SlotTrackerClient`` and checks what every
instance answers against ``tests/e2e/traffic.Expected``, a model of the traffic sent that does
not use the service's code.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from kv_slot_tracker_client.errors import Unavailable

from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from tests.e2e.conftest import FleetFactory
from tests.e2e.servers import Fleet, ProxyThread, ServerProcess, wait_until
from tests.e2e.traffic import (
    Expected,
    Rank,
    Traffic,
    load_rows,
    load_view,
    potential_rows,
)
from tests.replication.helpers import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

CONVERGE_S = 10.0

M1, M2 = "llama", "qwen"
# (model, group, block size, worker id, dp_start, dp_size)
TOPOLOGY = [
    (M1, "default", 16, 1, 0, 2),
    (M1, "default", 16, 2, 4, 1),
    (M1, "default", 16, 3, 0, 2),
    (M2, "blue", 32, 1, 1, 2),
]
RANKS = [
    Rank(model, group, wid, rank)
    for model, group, _, wid, start, size in TOPOLOGY
    for rank in range(start, start + size)
]


def register_topology(server: ServerProcess, fleet_servers: list[ServerProcess]) -> None:
    """Register ``TOPOLOGY`` on ``server`` and wait until every instance has it."""
    for model, group, block, wid, start, size in TOPOLOGY:
        server.client.register(wid, model, block, start, size, routing_group=group)
    expected = workers(server)
    wait_until(
        lambda: all(workers(s) == expected for s in fleet_servers),
        CONVERGE_S,
        "the topology on every instance",
    )


def workers(server: ServerProcess) -> list[dict[str, Any]]:
    return [w.model_dump() for w in server.client.workers()]


def describe(servers: list[ServerProcess], expected: Expected | None) -> str:
    """Per rank, the load every instance reports next to the expected one."""
    lines = []
    want = {(r["model_name"], r["routing_group"], r["worker_id"], r["dp_rank"]): r for r in (
        expected.loads() if expected else []
    )}  # fmt: skip
    got = {}
    for s in servers:
        try:
            got[s.name] = {
                (r["model_name"], r["routing_group"], r["worker_id"], r["dp_rank"]): r
                for r in load_view(load_rows(s))
            }
        except Exception as e:  # the description must not hide the failure
            got[s.name] = {("error", str(e), 0, 0): {}}
    fields = ("active_requests", "active_decode_blocks", "active_prefill_tokens")
    for rank in sorted(set(want).union(*got.values()), key=str):
        values = {"expected": want.get(rank)} | {n: g.get(rank) for n, g in got.items()}
        shown = {n: tuple(v[f] for f in fields) if v else None for n, v in values.items()}
        marker = "  " if len(set(shown.values())) == 1 else "!!"
        lines.append(f"{marker} {rank}: {shown}")
    lines.append(f"(values are {fields})")
    for s in servers:
        lines.append(f"{s.name}: {s.status()}")
    return "\n".join(lines)


def wait_converged(
    servers: list[ServerProcess],
    traffic: Traffic,
    expected: Expected | None = None,
    timeout: float = CONVERGE_S,
) -> list[dict[str, Any]]:
    """Wait until every instance answers the same ``/loads`` and ``/potential_loads``, equal to
    the expected state; returns the ``/loads`` rows.

    A 503 is "not yet", as for a client that retries it: an instance that finds the stream
    switched (Redis restarted empty, a failover) is not ready while it re-reads it, and each
    instance finds that out on its own reconnect, one after the other. The wait stays bounded
    by ``timeout``."""
    expected = expected or traffic.expected
    queries = traffic.queries()
    want_loads = expected.loads()
    want_potential = [expected.potential(*q) for q in queries]

    def probe() -> list[dict[str, Any]] | None:
        try:
            return converged()
        except Unavailable:
            return None

    def converged() -> list[dict[str, Any]] | None:
        rows = [load_rows(s) for s in servers]
        if any(r != rows[0] for r in rows[1:]) or load_view(rows[0]) != want_loads:
            return None
        for query, want in zip(queries, want_potential, strict=True):
            if any(potential_rows(s, *query) != want for s in servers):
                return None
        return rows[0]

    return wait_until(
        probe,
        timeout,
        "identical /loads and /potential_loads, equal to the traffic sent",
        0.02,
        lambda: describe(servers, expected),
    )


def test_topology_registered_on_one_instance_appears_on_all(fleet: Fleet) -> None:
    a, b, c = fleet.servers
    for model, group, block, wid, start, size in TOPOLOGY:
        a.client.register(wid, model, block, start, size, routing_group=group)

    def same() -> bool:
        rows = [workers(s) for s in fleet.servers]
        return rows[0] == rows[1] == rows[2]

    wait_until(same, CONVERGE_S, "identical /workers")
    assert workers(c) == [
        {"worker_id": wid, "model_name": m, "routing_group": g, "block_size": bs,
         "dp_start": start, "dp_size": size}
        for m, g, bs, wid, start, size in TOPOLOGY
    ]  # fmt: skip

    # changes made on other instances travel too, and a registered rank takes traffic anywhere
    assert b.client.upsert(3, M1, 16, 0, 4) is False
    c.client.unregister(2, M1)
    c.client.register(5, M2, 32, 0, 1, routing_group="blue")
    wait_until(same, CONVERGE_S, "identical /workers after changes on b and c")
    assert [(w["model_name"], w["worker_id"], w["dp_size"]) for w in workers(a)] == [
        (M1, 1, 2),
        (M1, 3, 4),
        (M2, 1, 2),
        (M2, 5, 1),
    ]
    c.client.add(M1, "on-new-rank", 3, 3, [1, 2], new_isl_tokens=9)
    wait_until(
        lambda: all(
            any(r.worker_id == 3 and r.dp_rank == 3 and r.active_requests == 1
                for r in s.client.loads(M1))
            for s in (a, b)
        ),
        CONVERGE_S,
        "a request on a rank registered through another instance",
    )  # fmt: skip


def test_random_lifecycle_traffic_converges_on_every_instance(fleet: Fleet) -> None:
    register_topology(fleet.servers[0], fleet.servers)
    traffic = Traffic(fleet.servers, RANKS, seed=20240611)
    for _ in range(4):
        traffic.run(100)
        # some calls went to another instance than the request's owner, and every instance
        # ends up with the same state, which is the one the traffic implies
        wait_converged(fleet.servers, traffic)
    assert traffic.calls["add"] > 150 and traffic.calls["free"] > 80
    assert traffic.calls["duplicate_add"] > 0 and traffic.calls["prefill_complete"] > 30
    assert traffic.calls["crossed"] > 30  # calls for a request added on another instance


def watch_until_ready(server: ServerProcess, reference: ServerProcess) -> list[int | None]:
    """Poll ``server``'s ``/ready`` as fast as possible from its start until 200; right then its
    ``/loads`` must already equal ``reference``'s (no traffic is in flight): ready means caught
    up. Returns the distinct ``/ready`` answers seen in order (None: not listening yet)."""
    want = load_rows(reference)
    seen: list[int | None] = []
    deadline = time.monotonic() + 30
    while True:
        status = server.readiness()
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == 200:
            break
        assert server.alive, server.log_tail()
        assert time.monotonic() < deadline, f"not ready after 30 s: {seen}\n{server.log_tail()}"
        time.sleep(0.002)
    rows = load_rows(server)
    assert rows == want, "ready before it caught up:\n" + describe([reference, server], None)
    return seen


def test_instance_killed_and_restarted_recovers_identical_loads(
    fleet_factory: FleetFactory, own_redis: RedisServer
) -> None:
    fleet = fleet_factory(redis_url=own_redis.url, snapshot_interval_seconds=1)
    fleet.spawn(3)
    a, b, c = fleet.servers
    register_topology(a, fleet.servers)
    traffic = Traffic(fleet.servers, RANKS, seed=7)
    traffic.run(200)
    wait_converged(fleet.servers, traffic)
    # a snapshot covers part of the state, the stream the rest
    wait_until(lambda: a.status().get("snapshot_stream_id"), 10, "a snapshot")

    c.kill()  # SIGKILL: no shutdown, no flush
    traffic.run(100, targets=[0, 1])  # includes frees of requests that c added
    wait_converged([a, b], traffic)
    fleet.restart(c, wait=False)  # same port, namespace and instance id
    seen = watch_until_ready(c, a)
    assert set(seen) <= {None, 503, 200}, seen
    wait_converged(fleet.servers, traffic)

    # the restarted instance takes part in traffic again, in both directions
    traffic.run(100)
    wait_converged(fleet.servers, traffic)

    # restarted while Redis is out of its reach: alive, but 503 until it has caught up
    c.kill()
    traffic.run(50, targets=[0, 1])
    wait_converged([a, b], traffic)
    proxy = ProxyThread(own_redis.port)
    try:
        proxy.cut()
        fleet.restart(c, wait=False, REDIS_URL=proxy.url)
        wait_until(lambda: c.readiness() == 503, 30, "c to answer /ready with 503", 0.01)
        body = c.client.readiness()
        assert body.status == "not_ready" and body.reason, body
        assert c.client.health()
        time.sleep(0.5)
        assert c.readiness() == 503
        proxy.restore()
        c.wait_ready(timeout=15)
        wait_converged(fleet.servers, traffic)
    finally:
        c.kill()
        proxy.close()


def test_redis_restart_loses_no_event(fleet_factory: FleetFactory, own_redis: RedisServer) -> None:
    fleet = fleet_factory(redis_url=own_redis.url)
    fleet.spawn(3)
    register_topology(fleet.servers[0], fleet.servers)
    traffic = Traffic(fleet.servers, RANKS, seed=99)
    traffic.run(150)  # here lifecycle calls may cross instances
    wait_converged(fleet.servers, traffic)

    own_redis.stop()
    # Every instance keeps answering from its local state. Each call goes to the instance that
    # added the request: no instance can learn about another's new requests now.
    base = traffic.expected.copy()
    traffic.local = {i: base.copy() for i in range(3)}
    traffic.run(90, cross=False)
    for i, server in enumerate(fleet.servers):
        assert load_view(load_rows(server)) == traffic.local[i].loads(), server.name
        assert server.readiness() == 200
    wait_until(
        lambda: all(s.status()["connected"] is False for s in fleet.servers),
        10,
        "every instance to notice that Redis is gone",
    )
    traffic.run(90, cross=False)
    for i, server in enumerate(fleet.servers):
        assert load_view(load_rows(server)) == traffic.local[i].loads(), server.name
    traffic.local = None

    own_redis.start()  # same port, but empty: the stream and the snapshot are gone
    rows = wait_converged(fleet.servers, traffic)
    by_rank = {(r["model_name"], r["routing_group"], r["worker_id"], r["dp_rank"]): r for r in rows}
    for rank in RANKS:
        row = by_rank[(rank.model, rank.group, rank.worker_id, rank.dp_rank)]
        assert row["active_requests"] == traffic.added[rank] - traffic.freed[rank], rank
    statuses = [s.status() for s in fleet.servers]
    assert all(st["connected"] and st["dropped"] == 0 for st in statuses), statuses
    # every instance found the stream gone and re-read it (not ready meanwhile), and is done
    assert all(st["resets"] >= 1 and st["ready"] for st in statuses), statuses

    # business as usual afterwards, and an instance started now finds everything; it is
    # started once a snapshot exists in the new Redis (before that, see the last two tests)
    traffic.run(60)
    wait_converged(fleet.servers, traffic)
    client = redis.Redis.from_url(own_redis.url)
    try:
        snapshot_key = NamespaceKeys.of(fleet.namespace).snapshot
        wait_until(lambda: client.exists(snapshot_key), 10, "a snapshot in the new Redis")
    finally:
        client.close()
    fleet.spawn(1)
    traffic.run(60)
    wait_converged(fleet.servers, traffic)


@pytest.mark.parametrize("snapshot", [True, False], ids=["snapshot", "stream-only"])
def test_instance_started_late_catches_up(fleet_factory: FleetFactory, snapshot: bool) -> None:
    fleet = fleet_factory(snapshot_interval_seconds=1 if snapshot else 3600)
    a, b = fleet.spawn(2)
    register_topology(a, [a, b])
    traffic = Traffic(fleet.servers, RANKS, seed=31 if snapshot else 32)
    traffic.run(150)
    traffic.batch_add(0, 400)  # many records in one round trip
    traffic.run(100)
    wait_converged([a, b], traffic)
    if snapshot:
        wait_until(lambda: a.status().get("snapshot_stream_id"), 10, "a snapshot")
        traffic.run(50)  # and records after it
        wait_converged([a, b], traffic)
    else:
        assert a.status()["snapshot_stream_id"] is None

    (c,) = fleet.spawn(1, wait=False)
    watch_until_ready(c, a)
    assert workers(c) == workers(a)
    traffic.run(100)  # c takes part
    wait_converged(fleet.servers, traffic)


def test_namespaces_on_one_redis_are_isolated(fleet_factory: FleetFactory) -> None:
    blue, green = fleet_factory(), fleet_factory()
    blue.spawn(2, wait=False)
    green.spawn(2)
    for s in blue.servers:
        s.wait_ready()
    # the same model names, worker ids and request ids in both, different block sizes
    register_topology(blue.servers[0], blue.servers)
    g0 = green.servers[0]
    g0.client.register(1, M1, 64, 0, 1)
    g0.client.register(9, M1, 64, 0, 3)
    green_ranks = [Rank(M1, "default", 1, 0)] + [Rank(M1, "default", 9, r) for r in range(3)]
    wait_until(lambda: workers(green.servers[1]) == workers(g0), CONVERGE_S, "green topology")

    blue_traffic = Traffic(blue.servers, RANKS, seed=5)
    green_traffic = Traffic(green.servers, green_ranks, seed=5)
    for _ in range(3):
        blue_traffic.run(80)
        green_traffic.run(80)
    wait_converged(blue.servers, blue_traffic)
    wait_converged(green.servers, green_traffic)

    assert [w["worker_id"] for w in workers(green.servers[1])] == [1, 9]
    assert {w["block_size"] for w in workers(green.servers[1])} == {64}
    assert {(w["model_name"], w["block_size"]) for w in workers(blue.servers[1])} == {
        (M1, 16),
        (M2, 32),
    }
    # each instance applied exactly what its peer in the namespace published, nothing more
    for fleet in (blue, green):

        def balanced(fleet: Fleet = fleet) -> bool:
            s0, s1 = (s.status() for s in fleet.servers)
            return s0["applied"] == s1["published"] and s1["applied"] == s0["published"]

        wait_until(balanced, CONVERGE_S, "applied == published", describe=fleet.statuses)
    client = redis.Redis.from_url(blue.redis_url)
    try:
        for fleet in (blue, green):
            keys = {k.decode() for k in client.scan_iter(match="{" + fleet.namespace + "}:*")}
            assert f"{{{fleet.namespace}}}:events" in keys, keys
    finally:
        client.close()


def test_instance_started_right_after_redis_lost_its_data_catches_up(
    fleet_factory: FleetFactory, own_redis: RedisServer
) -> None:
    """Redis restarts without its data; the survivors re-send only their records of the last
    30 s (the resend window), so older ones exist only in their memory until one of them writes
    a snapshot again. An instance that starts meanwhile finds a stream that begins after a gap
    and no snapshot. It must neither report ready with that partial state (here: no topology,
    no requests) nor write a snapshot of it claiming to cover the gap, which every instance
    started later would load; it waits for the snapshot that a survivor writes as soon as it
    notices the loss, also when it had nothing to re-send, and also when another survivor's
    re-sent records recreated the stream first (its own last entry is gone, not the stream).

    ``stream_retention_seconds=2`` only shortens the 30 s resend window (it is the minimum of
    the two) so that the test need not wait 30 s; the stream is tiny, so nothing is trimmed.
    """
    fleet = fleet_factory(
        redis_url=own_redis.url,
        snapshot_interval_seconds=30,
        env={"STREAM_RETENTION_SECONDS": "2"},
    )
    a, b = fleet.spawn(2)
    register_topology(a, [a, b])
    traffic = Traffic(fleet.servers, RANKS, seed=3)
    traffic.run(100)
    wait_converged([a, b], traffic)
    time.sleep(2.5)  # these records are now older than the resend window

    own_redis.stop()
    traffic.run(10, targets=[0], cross=False)  # buffered in a's outbox
    own_redis.start()
    fleet.spawn(1)  # c
    time.sleep(3)
    fleet.spawn(1)  # d, which must not inherit c's view either
    wait_converged(fleet.servers, traffic, timeout=5)


def test_instance_replaying_the_resent_stream_sees_each_free_after_its_add(
    fleet_factory: FleetFactory, own_redis: RedisServer
) -> None:
    """Requests added on a and freed on b; Redis restarts empty; b publishes first, so its
    re-sent records (the frees, and marks) open the new stream and a's (the registrations and
    the adds) follow. An instance that replayed that stream would ignore each free (unknown
    request) and then apply the add: the request would stay active on it until it expires
    (300 s), and so would its prefill tokens. A starting instance must bootstrap from a
    snapshot written after the reset instead.

    The test holds the snapshot lease itself, as an instance could, and drops what an instance
    wrote before: the survivors, which noticed the loss, must write a snapshot anyway.
    """
    fleet = fleet_factory(redis_url=own_redis.url, snapshot_interval_seconds=3600)
    a, b = fleet.spawn(2)
    register_topology(a, [a, b])
    traffic = Traffic(fleet.servers, RANKS, seed=11)
    added = [traffic.add(0) for _ in range(20)]
    for req in added[:10]:
        traffic.free(1, req)  # waits until b has it
    wait_converged([a, b], traffic)

    own_redis.stop()
    own_redis.start()
    keys = NamespaceKeys.of(fleet.namespace)
    client = redis.Redis.from_url(own_redis.url)
    try:  # take the lease even if an instance was quicker, and drop what it wrote meanwhile
        client.set(keys.snapshot_lease, "held-by-the-test", px=60_000)
        client.delete(keys.snapshot)
    finally:
        client.close()

    def resent(server: ServerProcess) -> bool:
        st = server.status()
        return st["resent"] > 0 and st["outbox_depth"] == 0

    # b's reader may notice the loss first: b answers 503 until it has re-read the new stream
    # (empty); its publisher re-sends at its next append either way
    wait_until(b.client.ready, CONVERGE_S, "b to be ready on the new stream")
    traffic.add(1)  # b's append finds its last entry gone: it re-sends first
    wait_until(lambda: resent(b), CONVERGE_S, "b to re-send")
    # a re-reads the new stream (not ready, changes answered 503) before it takes the add
    wait_until(a.client.ready, CONVERGE_S, "a to catch up with the new stream")
    traffic.add(0)  # then a
    wait_until(lambda: resent(a), CONVERGE_S, "a to re-send")
    fleet.spawn(1)
    wait_converged(fleet.servers, traffic, timeout=3)
