"""Redis Cluster: three primaries on loopback ports joined by ``redis-cli --cluster create``.
Every key of a namespace carries its hash tag, so the stream, the snapshot, its lease and the
reset marker share one slot (the append script touches two of them at once). Two
``python -m kv_slot_tracker`` processes with ``redis_cluster = true`` take lifecycle traffic while that slot
migrates to another primary; at the end both report exactly what the clients were acknowledged.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path

import pytest
import redis

from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from tests.e2e.consistency import Traffic, Watcher, register_topology
from tests.e2e.servers import Fleet
from tests.ha.topology import LocalCluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.redis]


def test_every_key_of_a_namespace_is_on_one_slot(local_cluster: LocalCluster) -> None:
    keys = NamespaceKeys.of("model-a")
    with local_cluster.nodes[0].client() as c:
        slots = {c.execute_command("CLUSTER KEYSLOT", k) for k in vars_of(keys)}
        assert len(vars_of(keys)) == 5 and len(slots) == 1
        other = NamespaceKeys.of("model-b")
        assert c.execute_command("CLUSTER KEYSLOT", other.events) not in slots


def vars_of(keys: NamespaceKeys) -> list[str]:
    """Every key of a namespace (each field of ``NamespaceKeys``)."""
    return [getattr(keys, f.name) for f in dataclasses.fields(keys)]


def migrate_slot(cluster: LocalCluster, slot: int) -> tuple[int, int]:
    """Move ``slot`` with its keys to another primary (what ``redis-cli --cluster reshard``
    does, for one slot); returns (from port, to port)."""
    clients = {n.port: n.client(decode_responses=True) for n in cluster.nodes}
    try:
        ids = {port: c.execute_command("CLUSTER MYID") for port, c in clients.items()}
        src = next(p for p, c in clients.items() if c.execute_command("CLUSTER COUNTKEYSINSLOT",
                                                                      slot) > 0)  # fmt: skip
        dst = next(p for p in clients if p != src)
        clients[dst].execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[src])
        clients[src].execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[dst])
        while keys := clients[src].execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
            clients[src].execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
        for c in clients.values():
            c.execute_command("CLUSTER SETSLOT", slot, "NODE", ids[dst])
        return src, dst
    finally:
        for c in clients.values():
            c.close()


@pytest.mark.timeout(120)
def test_traffic_through_a_slot_migration(
    local_cluster: LocalCluster, fleets: list[Fleet], tmp_path: Path
) -> None:
    namespace = f"cl-{uuid.uuid4().hex[:10]}"
    fleet = Fleet(local_cluster.url, namespace, tmp_path / "logs", snapshot_interval_seconds=1,
                  env={"REDIS_CLUSTER": "true", "REPLICATION_ACK": "redis"})  # fmt: skip
    fleets.append(fleet)
    fleet.spawn(2)
    urls = [s.url for s in fleet.servers]
    register_topology(urls[0])
    watcher = Watcher(urls)
    try:
        wait_for(lambda: len({str(v) for v in watcher.all_loads()}) == 1, 10,
                 "the topology on every instance")  # fmt: skip
        with local_cluster.nodes[0].client() as c:
            slot = c.execute_command("CLUSTER KEYSLOT", NamespaceKeys.of(namespace).events)
        traffic = Traffic(urls, clients=4, seed=7, pace_s=0.01)
        traffic.start()
        try:
            time.sleep(2.0)
            src, dst = migrate_slot(local_cluster, slot)
            time.sleep(2.0)
        finally:
            traffic.stop()
        want = traffic.truth.loads()
        assert watcher.wait_for(want, timeout=15) is not None, (want, watcher.all_loads())
        tally = traffic.tally
        assert tally.unexpected == [] and tally.spurious_404 == [], tally.summary()
        assert tally.calls["add"] > 20, tally.summary()
        # the namespace now lives on the other primary, stream and snapshot alike
        dst_node = next(n for n in local_cluster.nodes if n.port == dst)
        with dst_node.client() as c:
            keys = NamespaceKeys.of(namespace)
            assert c.exists(keys.events) and c.exists(keys.snapshot)
        for s in fleet.servers:
            st = s.status()
            assert st["redis"] == f"cluster {local_cluster.url}", st
            assert st["connected"] and st["dropped"] == 0, st
    finally:
        watcher.close()
    source = next(n for n in local_cluster.nodes if n.port == src)
    with source.client() as c, pytest.raises(redis.ResponseError, match=f"{slot} 127.0.0.1:{dst}"):
        c.xlen(NamespaceKeys.of(namespace).events)
