"""The selection service: Dynamo's selection API over the pure selection core.

``service`` holds :class:`SelectionService` (worker catalog, partitions, select and reserve);
``reservations`` and ``replica`` are its collaborators for the reservation lifecycle and for
records replicated between instances; ``commands``, ``mutations``, ``types`` and ``wire`` are the
operation inputs, the replicated mutations, the service's value types and their record form.
"""
