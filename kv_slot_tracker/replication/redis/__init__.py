"""Replicated mode: instances of one namespace share records through one Redis stream.

Each instance answers from its own in-memory trackers and keeps them in agreement with its
peers' by exchanging *records* (``kv_slot_tracker.replication.records``): every local change is published to
``{ns}:events``, every peer's change is read from it and applied. Where each rule lives:

* ``outbox``: the write path. ``publish`` numbers a record and queues it without waiting; one
  task appends batches to the stream, keeps them across outages, and re-sends recent records
  when Redis lost them.
* ``reader``: the read path. One task reads the stream in order, skips own records and
  duplicates, applies the rest in batches, notices gaps and a recreated or rolled-back stream.
* ``snapshots``: a periodic snapshot of the whole state (under a lease), what a starting or
  lagging instance loads first; the reset marker that says Redis lost data.
* ``bootstrap``: the state machine of a starting instance (not ready until caught up, waiting
  for a snapshot after Redis lost data) and when the local state is worth a snapshot.
* ``endpoint``: where Redis is (one server, Sentinels, a Cluster) and the credentials and TLS
  to reach it with; ``connection``: the Redis clients and the one retry policy.
* ``stream``: key names, stream ids and the two Lua scripts.
* ``facade``: ``RedisReplication``, the ``Replication`` port composed of the above.

Outages. Reads keep being answered from local state and writes keep being accepted (into the
outbox; with durable acknowledgements refused, and the publisher reconnects on its own). The
publisher, the reader and the snapshot round each retry on their own with backoff; the reader
resumes from its last id once the entry there is still in the stream as it read it, and else
re-reads from the newest of its checkpoints the stream still holds (not ready meanwhile). Redis
losing data (noticed by a publisher's refused append or by a reader) sets the reset marker and
asks for a snapshot at once, without the lease if need be. Until one is written, starting
instances stay not ready (for at most a minute). A Sentinel failover is the same case: the
connections find the promoted replica on their next connect, and a stream that is not the one
read so far is handled exactly as a Redis that restarted empty. Entries removed by the stream's
own bounds (never what the newest snapshot does not cover) are not taken for lost ones.
"""

from kv_slot_tracker.replication.redis.facade import RedisReplication

__all__ = ["RedisReplication"]
