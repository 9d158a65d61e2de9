"""The surface the app wires: ids, modes, status, metrics, key names."""

from __future__ import annotations

import pytest
import redis
from prometheus_client import CollectorRegistry

from kv_slot_tracker.replication.embedded import EmbeddedReplication
from kv_slot_tracker.replication.redis import RedisReplication
from kv_slot_tracker.replication.redis.stream import NamespaceKeys
from kv_slot_tracker.settings import Settings
from tests.calls import register
from tests.replication.helpers import KEY, Cluster, eventually

STATUS_FIELDS = {
    "mode", "instance_id", "namespace", "connected", "stream_position", "outbox_depth",
    "published", "applied", "duplicates", "dropped", "gaps", "last_applied_lag_ms",
    "snapshot_age_seconds", "ready", "not_ready_reason",
}  # fmt: skip


def test_embedded_mode_surface() -> None:
    rep = EmbeddedReplication(Settings())
    assert rep.instance_id != 0
    rep.publish(b"anything", 1)
    assert rep.ready()
    status = rep.status()
    assert set(status.as_dict()) >= STATUS_FIELDS
    assert status.mode == "embedded"
    assert status.instance_id == rep.instance_id


def test_instance_id_is_configured_or_random_non_zero() -> None:
    settings = Settings(redis_url="redis://127.0.0.1:1/0")
    assert (
        RedisReplication(
            settings.model_copy(update={"instance_id": 42}), CollectorRegistry()
        ).instance_id
        == 42
    )
    ids = {RedisReplication(settings, CollectorRegistry()).instance_id for _ in range(5)}
    assert 0 not in ids and len(ids) == 5
    with pytest.raises(ValueError):
        RedisReplication(Settings(), CollectorRegistry())  # no redis_url: embedded mode


def test_keys_share_one_cluster_slot() -> None:
    keys = NamespaceKeys.of("prod-a")
    assert keys.events == "{prod-a}:events"
    assert keys.snapshot == "{prod-a}:snapshot"
    assert keys.snapshot_lease == "{prod-a}:snapshot-lease"


@pytest.mark.redis
async def test_status_and_metrics_of_a_running_instance(cluster: Cluster) -> None:
    a = await cluster.node()
    b = await cluster.node()
    register(a.service, KEY, 1, 4, 0, 1)
    a.add("r1")
    await eventually(lambda: b.rep.status().applied == 2)
    assert await a.rep.write_snapshot()
    st = b.rep.status()
    assert set(st.as_dict()) >= STATUS_FIELDS
    assert st.mode == "redis"
    assert st.namespace == cluster.namespace
    assert st.connected and st.ready and not st.degraded
    assert st.stream_position != "0-0"
    assert st.last_applied_lag_ms is not None
    sa = a.rep.status()
    assert sa.published == 2 and sa.outbox_depth == 0
    assert sa.snapshot_age_seconds is not None and sa.snapshot_age_seconds < 60
    reg = a.registry
    assert reg.get_sample_value("kv_slot_tracker_replication_published_total") == 2
    assert reg.get_sample_value("kv_slot_tracker_replication_snapshots_written_total") == 1
    assert reg.get_sample_value("kv_slot_tracker_replication_connected") == 1
    assert b.registry.get_sample_value("kv_slot_tracker_replication_lag_seconds_count") == 2
    client = redis.Redis.from_url(cluster.redis_url)
    keys = {k.decode() for k in client.scan_iter(match=f"*{cluster.namespace}*")}
    client.close()
    assert keys == {f"{{{cluster.namespace}}}:events", f"{{{cluster.namespace}}}:snapshot"}
