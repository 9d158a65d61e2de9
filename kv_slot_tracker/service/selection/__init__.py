"""The selection service: Dynamo's selection API over the pure selection core.

``service`` holds :class:`SelectionService` (worker catalog, partitions, select and reserve);
``reservations``, ``replica`` and ``kv_events`` are the collaborators it holds: the reservation
ids, the records and snapshots shared between instances, and the KV-event ingest's sink; ``commands``, ``mutations``, ``types`` and ``wire`` are the
operation inputs, the replicated mutations, the service's value types and their record form.
"""
