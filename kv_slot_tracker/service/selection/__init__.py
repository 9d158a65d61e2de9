"""The selection service: Dynamo's selection API over the pure selection core.

``service`` holds :class:`SelectionService` (partitions, the selection itself, the one mutation
entry point); ``placement``, ``bookings``, ``reservations``, ``replica``, ``kv_events`` and
``receipt_keeper`` are the collaborators it holds: the worker catalog's changes, a reservation's
booking and calls, the reservation ids, the records and snapshots shared between instances, the
KV-event ingest's sink and the routing receipts; ``commands``, ``mutations``, ``types`` and
``wire`` are the operation inputs, the replicated mutations, the service's value types and their
record form.
"""
