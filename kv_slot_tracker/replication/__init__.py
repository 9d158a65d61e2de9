"""Replication: the slot trackers of several instances of one namespace kept in agreement.

Where each rule lives:

* ``port``: the seam. ``Replication`` (what the app calls), ``ReplicatedState`` (what replication
  calls on the service) and ``ReplicationStatus`` (``GET /replication``).
* ``embedded``: one instance, nothing to replicate (no ``redis_url``).
* ``local/``: the processes of one ``--workers`` supervisor without Redis, sharing records
  through a hub in the supervisor over a Unix socket.
* ``redis/``: instances sharing records through one Redis stream; its package docstring is the
  overview of that design (outbox, reader, snapshots, bootstrap, connections).
* ``records``: a record on the wire, its numbering, and the ledger of what was applied; and the
  instance id (``resolve_instance_id``).
* ``queue``: the bounded publish queue and its errors; ``metrics``: the Prometheus series.

``make_replication`` is the one place that picks the mode.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kv_slot_tracker.replication.embedded import EmbeddedReplication
from kv_slot_tracker.replication.port import ReplicatedState, Replication, ReplicationStatus
from kv_slot_tracker.settings import Settings

__all__ = ["ReplicatedState", "Replication", "ReplicationStatus", "make_replication"]


def make_replication(
    settings: Settings, registry: CollectorRegistry, hub_socket: str | None = None
) -> Replication:
    """The replication of ``settings`` (its metrics go into ``registry``); not started.
    ``hub_socket``: a process of a ``--workers`` supervisor without Redis, sharing its state
    through the supervisor's hub there."""
    if hub_socket and settings.embedded:
        from kv_slot_tracker.replication.local import LocalReplication

        return LocalReplication(settings, registry, hub_socket)
    if settings.embedded:
        return EmbeddedReplication(settings)
    # imported here: embedded mode needs neither redis-py nor the Redis machinery
    from kv_slot_tracker.replication.redis import RedisReplication

    return RedisReplication(settings, registry)
