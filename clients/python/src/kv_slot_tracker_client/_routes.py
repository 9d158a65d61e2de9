"""Every route of the service, described once: signature, documentation, body and answer.

Each method of ``Routes`` takes a route's arguments as the clients expose them and returns the
``Call`` to send. ``SlotTrackerClient`` and ``AsyncSlotTrackerClient`` turn each into a method
that sends it (``client.py``), and ``BatchBuilder`` the lifecycle ones into methods that queue
it (``batch.py``): a route's arguments, defaults and body are written here only. A new route is a
method here plus one line in each client.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import httpx
from pydantic import TypeAdapter

from kv_slot_tracker_client import _call as c
from kv_slot_tracker_client._call import Call
from kv_slot_tracker_client.models import (
    BatchResponse,
    BatchResult,
    LoadRow,
    LoraCounts,
    PotentialLoadRow,
    ProjectedLoadRow,
    ReadyBody,
    ReconcileResult,
    ReplicationStatus,
    WorkerRow,
)

DEFAULT_ROUTING_GROUP = "default"

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
U64_MAX = 2**64 - 1


def to_i64(value: int) -> int:
    """A sequence hash in the signed 64-bit form the API takes.

    Accepts unsigned (0 .. 2^64-1) and signed (-2^63 .. 2^63-1) values: values >= 2^63 become
    ``value - 2^64``, the same 64 bits read as signed, which the service reinterprets as unsigned
    again. Rejects booleans and non-integers (``TypeError``) and values outside both ranges
    (``ValueError``) here, where the mistake is, rather than as a 422 from the service.
    """
    if isinstance(value, bool):
        raise TypeError("a sequence hash must be an integer, not a bool")
    v = operator.index(value)
    if v < I64_MIN or v > U64_MAX:
        raise ValueError(f"sequence hash {v} is outside both the i64 and the u64 range")
    return v - (1 << 64) if v > I64_MAX else v


class WorkerRange(Protocol):
    """Anything with ``worker_id``, ``dp_start`` and ``dp_size``, such as the ``WorkerRow``s of
    ``workers()``."""

    @property
    def worker_id(self) -> int: ...

    @property
    def dp_start(self) -> int: ...

    @property
    def dp_size(self) -> int: ...


# -- building bodies ---------------------------------------------------------------------------


def _hashes(values: Iterable[int] | None) -> list[int] | None:
    return None if values is None else [to_i64(v) for v in values]


def _tokens(values: Iterable[int] | None) -> list[int] | None:
    return None if values is None else list(values)


def _without_none(body: dict[str, Any]) -> dict[str, Any]:
    """Drop unset optional fields: the service rejects an explicit ``null`` for most of them."""
    return {k: v for k, v in body.items() if v is not None}


def _worker_range(w: WorkerRange | tuple[int, int, int]) -> dict[str, int]:
    if isinstance(w, tuple):
        worker_id, dp_start, dp_size = w
    else:
        worker_id, dp_start, dp_size = w.worker_id, w.dp_start, w.dp_size
    return {"worker_id": worker_id, "dp_start": dp_start, "dp_size": dp_size}


def _topology(
    worker_id: int, model_name: str, block_size: int, dp_start: int, dp_size: int, group: str
) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "model_name": model_name,
        "routing_group": group,
        "block_size": block_size,
        "dp_start": dp_start,
        "dp_size": dp_size,
    }


def _request(model_name: str, request_id: str, group: str) -> dict[str, Any]:
    return {"model_name": model_name, "routing_group": group, "request_id": request_id}


def _outcome(body: dict[str, Any], cached_tokens: int | None) -> dict[str, Any]:
    """``body`` with the reported ``cached_tokens``, when given."""
    if cached_tokens is not None:
        body["cached_tokens"] = cached_tokens
    return body


def _prompt(
    model_name: str,
    group: str,
    sequence_hashes: Iterable[int] | None,
    token_ids: Iterable[int] | None,
    lora_name: str | None,
) -> dict[str, Any]:
    return _without_none(
        {
            "model_name": model_name,
            "routing_group": group,
            "sequence_hashes": _hashes(sequence_hashes),
            "token_ids": _tokens(token_ids),
            "lora_name": lora_name,
        }
    )


def _join_lora_counts(before: LoraCounts, page: LoraCounts) -> LoraCounts:
    return before.model_copy(update={"lora_counts": {**before.lora_counts, **page.lora_counts}})


def _filters(model_name: str | None, routing_group: str | None) -> dict[str, str]:
    return _without_none({"model_name": model_name, "routing_group": routing_group})


# -- reading answers (the adapters are built once, not per call) -------------------------------

_WORKERS = c.reader(list[WorkerRow])
_LOADS = c.reader(list[LoadRow])
_POTENTIAL = c.reader(list[PotentialLoadRow])
_PROJECTED = c.reader(list[ProjectedLoadRow])
_RECONCILE = c.reader(ReconcileResult)
_LORA = c.reader(LoraCounts)
_BATCH = c.reader(BatchResponse)
_READY = TypeAdapter(ReadyBody)
_REPLICATION = c.reader(ReplicationStatus)
_OPENAPI = c.reader(dict[str, Any])


def _batch_results(response: httpx.Response) -> list[BatchResult]:
    return _BATCH(response).results


def _readiness(response: httpx.Response) -> ReadyBody:
    if response.status_code != 503:  # not ready is a valid readiness answer, not an error
        c.raise_for_status(response)
    return c.validated(_READY, response)


# -- the routes --------------------------------------------------------------------------------


class Routes:
    """One method per route, returning the request to send. Stateless: ``ROUTES`` serves all."""

    # -- topology

    def register(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        dp_start: int = 0,
        dp_size: int = 1,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Call[None]:
        """Register a worker's data-parallel ranks ``dp_start .. dp_start + dp_size - 1``.

        The first worker of a ``(model_name, routing_group)`` creates its tracker and fixes its
        ``block_size``. Raises ``Conflict`` when the worker is already registered or the block
        size differs; use ``upsert`` where announcing a worker twice must be harmless.
        """
        body = _topology(worker_id, model_name, block_size, dp_start, dp_size, routing_group)
        return c.post("/register", body, c.no_content)

    def upsert(
        self,
        worker_id: int,
        model_name: str,
        block_size: int,
        dp_start: int = 0,
        dp_size: int = 1,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Call[bool]:
        """Register a worker or replace its ranks; True when the worker id was new.

        Idempotent, so a worker can announce itself on every (re)start. Ranks it no longer has
        are dropped with their requests; the ranks it keeps keep their load.
        """
        body = _topology(worker_id, model_name, block_size, dp_start, dp_size, routing_group)
        return c.post("/upsert", body, c.created)

    def unregister(
        self, worker_id: int, model_name: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> Call[None]:
        """Remove a worker with all its ranks and requests (``NotFound`` when not registered).

        Removing the last worker drops the tracker, so the next registration may pick another
        block size.
        """
        body = {"worker_id": worker_id, "model_name": model_name, "routing_group": routing_group}
        return c.post("/unregister", body, c.no_content)

    def heartbeat(
        self, worker_id: int, model_name: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> Call[None]:
        """Renew a worker's lease (``NotFound`` when not registered).

        A service run with ``worker_ttl_seconds`` unregisters a worker not renewed (by this,
        ``register`` or ``upsert``) within that many seconds: call it every third of the ttl.
        """
        body = {"worker_id": worker_id, "model_name": model_name, "routing_group": routing_group}
        return c.post("/heartbeat", body, c.no_content)

    def reconcile(
        self,
        model_name: str,
        block_size: int,
        workers: Iterable[WorkerRange | tuple[int, int, int]],
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Call[ReconcileResult]:
        """Make ``workers`` the tracker's whole topology; returns the ranks added and removed.

        For a controller that periodically lists the live workers from its discovery service:
        workers missing from the list are removed, new ones added, changed ranges updated.
        ``workers`` holds ``(worker_id, dp_start, dp_size)`` tuples or objects with those
        attributes, such as the rows of ``workers()``.
        """
        body = {
            "model_name": model_name,
            "routing_group": routing_group,
            "block_size": block_size,
            "workers": [_worker_range(w) for w in workers],
        }
        return c.post("/reconcile", body, _RECONCILE)

    def workers(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> Call[list[WorkerRow]]:
        """Registered workers sorted by model, routing group and worker id; a ``None`` filter
        matches everything."""
        return c.listing("/workers", _WORKERS, operator.add, _filters(model_name, routing_group))

    # -- request lifecycle

    def add(
        self,
        model_name: str,
        request_id: str,
        worker_id: int,
        dp_rank: int,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        new_isl_tokens: int = 0,
        expected_prefill_ms: float | None = None,
        track_prefill_tokens: bool | None = None,
        expected_output_tokens: int | None = None,
        lora_name: str | None = None,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Call[None]:
        """Record a request routed to ``(worker_id, dp_rank)``.

        Give the prompt either as ``sequence_hashes`` (block hashes, u64 or i64) or as
        ``token_ids`` (the service then hashes the full blocks itself, as Dynamo does, with
        ``lora_name``). ``new_isl_tokens`` are the prompt tokens still to prefill on that rank
        (those not cached there); with ``expected_prefill_ms`` they decay linearly over that
        time instead of counting fully until ``prefill_complete``. ``track_prefill_tokens``
        defaults to ``new_isl_tokens > 0``. Raises ``NotFound`` for an unknown tracker or rank
        and ``Conflict`` for a request id already active in the tracker.
        """
        body = _without_none(
            {
                "model_name": model_name,
                "routing_group": routing_group,
                "request_id": request_id,
                "worker_id": worker_id,
                "dp_rank": dp_rank,
                "sequence_hashes": _hashes(sequence_hashes),
                "token_ids": _tokens(token_ids),
                "new_isl_tokens": new_isl_tokens,
                "expected_prefill_ms": expected_prefill_ms,
                "track_prefill_tokens": track_prefill_tokens,
                "expected_output_tokens": expected_output_tokens,
                "lora_name": lora_name,
            }
        )
        return c.post("/add", body, c.no_content)

    def prefill_complete(
        self,
        model_name: str,
        request_id: str,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
        cached_tokens: int | None = None,
    ) -> Call[None]:
        """The request's prefill is done: its prefill tokens stop counting, its blocks stay.

        ``cached_tokens``: the prompt tokens the engine found cached (its
        ``usage.prompt_tokens_details.cached_tokens``), for the routing receipt of the
        selection whose id is ``request_id``; ``None`` sends the reference's body.
        """
        body = _outcome(_request(model_name, request_id, routing_group), cached_tokens)
        return c.post("/prefill_complete", body, c.no_content)

    def free(
        self,
        model_name: str,
        request_id: str,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
        cached_tokens: int | None = None,
    ) -> Call[None]:
        """The request finished: release its blocks and tokens.

        Succeeds for unknown or already freed ids too, so a router may free unconditionally;
        only an unknown tracker raises ``NotFound``. ``cached_tokens`` as for
        ``prefill_complete``.
        """
        body = _outcome(_request(model_name, request_id, routing_group), cached_tokens)
        return c.post("/free", body, c.no_content)

    def output_block(
        self,
        model_name: str,
        request_id: str,
        decay_fraction: float | None = None,
        *,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Call[None]:
        """The request generated another full block of output, which now occupies KV cache.

        ``decay_fraction`` (0..1) weights the blocks held only by this request, for requests
        expected to finish soon; ``None`` counts them fully.
        """
        body = _request(model_name, request_id, routing_group)
        if decay_fraction is not None:
            body["decay_fraction"] = decay_fraction
        return c.post("/output_block", body, c.no_content)

    def batch(self, operations: Iterable[Mapping[str, Any]]) -> Call[list[BatchResult]]:
        """Apply many lifecycle operations in one round trip; one result per operation, in order.

        A failed operation does not raise: check each result's ``status`` (201 for an add, 200
        for the others) and ``error``. ``operations`` is a ``BatchBuilder`` or raw dicts with an
        ``op`` field, sent as they are (without hash conversion).
        """
        body = {"operations": [dict(op) for op in operations]}
        return c.post("/batch", body, _batch_results)

    # -- reads

    def loads(
        self, model_name: str | None = None, routing_group: str | None = None
    ) -> Call[list[LoadRow]]:
        """Current load of every matching rank, sorted by model, group, worker and rank."""
        return c.get("/loads", _LOADS, _filters(model_name, routing_group))

    def potential_loads(
        self,
        model_name: str,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        lora_name: str | None = None,
        new_isl_tokens: int = 0,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Call[list[PotentialLoadRow]]:
        """Every rank's load if this prompt went there: the input of a routing decision.

        ``potential_decode_blocks`` adds the prompt's blocks not already active on the rank
        (prefix overlap); ``potential_prefill_tokens`` adds ``new_isl_tokens`` on every rank.
        The rows come in no particular order.
        """
        body = _prompt(model_name, routing_group, sequence_hashes, token_ids, lora_name)
        body["new_isl_tokens"] = new_isl_tokens
        return c.post("/potential_loads", body, _POTENTIAL)

    def project_loads(
        self,
        model_name: str,
        sequence_hashes: Iterable[int] | None = None,
        *,
        token_ids: Iterable[int] | None = None,
        lora_name: str | None = None,
        routing_group: str = DEFAULT_ROUTING_GROUP,
    ) -> Call[list[ProjectedLoadRow]]:
        """Every rank's current load and the blocks this prompt would add there, sorted by
        worker and rank."""
        body = _prompt(model_name, routing_group, sequence_hashes, token_ids, lora_name)
        return c.post("/project_loads", body, _PROJECTED)

    def lora_counts(
        self, model_name: str, *, routing_group: str = DEFAULT_ROUTING_GROUP
    ) -> Call[LoraCounts]:
        """Active requests per LoRA adapter in one tracker (``NotFound`` for an unknown one)."""
        params = {"model_name": model_name, "routing_group": routing_group}
        return c.listing("/lora_counts", _LORA, _join_lora_counts, params)

    # -- operations

    def health(self) -> Call[bool]:
        """Liveness: True when the process answers. Returns False rather than raising when it
        is unreachable or failing, so it can drive a wait loop."""
        return Call("GET", "/health", c.probe, unreachable=c.unreachable_is_no)

    def ready(self) -> Call[bool]:
        """Readiness: True once the instance serves consistent state (with Redis replication,
        after catching up). False when not ready or unreachable."""
        return Call("GET", "/ready", c.probe, unreachable=c.unreachable_is_no)

    def readiness(self) -> Call[ReadyBody]:
        """The readiness answer, with the ``reason`` when not ready (503 does not raise)."""
        return c.get("/ready", _readiness)

    def replication_status(self) -> Call[ReplicationStatus]:
        """Replication state of the instance: ``mode`` plus the mode's counters as extra
        fields."""
        return c.get("/replication", _REPLICATION)

    def metrics(self) -> Call[str]:
        """The Prometheus exposition text of ``/metrics``."""
        return c.get("/metrics", c.text)

    def openapi(self) -> Call[dict[str, Any]]:
        """The service's OpenAPI document (``/openapi.json``), e.g. to check its version."""
        return c.get("/openapi.json", _OPENAPI)

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Call[httpx.Response]:
        """Send any request with this client's connection, key and error mapping; returns the
        raw response on success. For routes this client does not wrap (yet)."""
        return Call(method.upper(), path, c.raw, json, params, content, headers)


ROUTES = Routes()
