"""Host-local replication: the server processes of one supervisor (``workers`` > 1, no Redis)
share records through a hub in the supervisor, over a Unix socket.

Why not a private Redis: a redis-py command costs 150-200 us of CPU per batch, where a
length-prefixed frame on a Unix socket costs a few microseconds. Measured side by side
(``bench/workers_cost.py``, ``bench/RESULTS.md``), a private redis-server cost 1.3-2.2 x the CPU
per replicated write and 2-4 x the visibility lag, so it was removed as an option. Redis stays
what links hosts.

The shape follows ``replication/redis``, with the hub in the place of the stream:

* ``framing``: the frames on the socket and a reader that cuts them out of a byte stream;
* ``hub``: the ordering point (in the supervisor): one total order, fan-out to every process,
  the state for a joining process from a sibling, the read barrier's head;
* ``retained``: the frames the hub keeps, bounded in bytes;
* ``outbox``: the write path (numbering, batching, acknowledgements);
* ``follower``: the read path (apply in order, own read-back, the state, the read barrier);
* ``metrics``: the Prometheus series of this mode (position applied, the hub's figures);
* ``facade``: ``LocalReplication``, the ``Replication`` port composed of the above.

The same records as with Redis (``replication.records``), validated by ``apply_remote`` the
same way; the hub is the durable point of one host (it outlives every server process).
"""

from kv_slot_tracker.replication.local.facade import LocalReplication

__all__ = ["LocalReplication"]
