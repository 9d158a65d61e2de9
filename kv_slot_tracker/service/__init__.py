"""The service layer: commands in, core calls, domain errors out; replica records both ways.

``commands`` defines each operation's inputs once; ``service.SlotTrackerService`` executes them
against the ``registry`` of trackers; ``replica`` turns local changes into records for other
instances and applies theirs; ``errors`` holds the service's own domain errors. Nothing here
knows HTTP: the edge (``kv_slot_tracker.http``) maps every error class to a status.
"""

from kv_slot_tracker.core.limits import MAX_DP_SIZE, MAX_RANKS_PER_TRACKER
from kv_slot_tracker.service.commands import DEFAULT_ROUTING_GROUP, Key
from kv_slot_tracker.service.service import SlotTrackerService

__all__ = [
    "DEFAULT_ROUTING_GROUP",
    "MAX_DP_SIZE",
    "MAX_RANKS_PER_TRACKER",
    "Key",
    "SlotTrackerService",
]
