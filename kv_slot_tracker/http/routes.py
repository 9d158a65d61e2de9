"""The route table: every API route declared once.

A ``Route`` names its path, method, operation, summary, body and response models, path
parameters and documented errors. From this one table ``kv_slot_tracker.http.app`` builds both the FastAPI
routes (``kv_slot_tracker.http.endpoints``, and so the OpenAPI document and ``/docs``) and the lean
dispatcher's table of hot routes. A route belongs to one API (``api``): the slot tracker's
(``kv_slot_tracker.http.operations`` and ``kv_slot_tracker.http.queries.Queries``) or the selection
service's under ``/selection`` (``kv_slot_tracker.http.selection.operations``).
*Call* routes (a body or path parameters) run an operation ``op(body, *path parameters)``;
*query* routes run a queries method on the query string.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin

from fastapi import Response
from pydantic import BaseModel, TypeAdapter

from kv_slot_tracker.core.types import U64_MAX
from kv_slot_tracker.http import schemas
from kv_slot_tracker.http.errors import (
    CONTENT_TYPE,
    JSON_PARSE,
    JSON_SHAPE,
    TOO_LARGE,
    UNAUTHORIZED,
    HttpError,
)
from kv_slot_tracker.http.response_schemas import (
    BatchResponse,
    ErrorBody,
    LoadRow,
    LoraCounts,
    PotentialLoadRow,
    ProjectedLoadRow,
    ReadyBody,
    ReconcileResult,
    ReplicationStatus,
    StatusOk,
    WorkerRow,
)
from kv_slot_tracker.http.responses import JSON
from kv_slot_tracker.http.selection import schemas as selection_schemas
from kv_slot_tracker.http.selection.outcome import ReservationOutcomeBody
from kv_slot_tracker.http.selection.replica_sync import PeerBody
from kv_slot_tracker.http.selection.responses import (
    OverlapScoresResponse,
    PartitionDump,
    PartitionLoads,
    RankLoad,
    ReservationResponse,
    SelectAndReserveResponse,
    SelectionReady,
    SelectionStatus,
    SelectResponse,
    WorkerRecord,
)
from kv_slot_tracker.service import DEFAULT_ROUTING_GROUP

ERROR_DOCS: dict[int, str] = {
    400: "Malformed JSON or an invalid value.",
    401: "Missing or wrong bearer key (only when an API key is configured).",
    404: "No such tracker, worker or request.",
    409: "Conflicts with the current state.",
    413: "Body larger than the limit.",
    415: "Content type is not JSON.",
    422: "Well-formed JSON of the wrong shape.",
    503: 'Not ready (still loading the shared state); with `replication_ack = "redis"`, Redis '
    "cannot be reached; no schedulable worker for the partition (selection API). Retry, here or "
    "on another instance.",
}
BODY_ERRORS = (400, 401, 404, 413, 415, 422)
TOPOLOGY_ERRORS = (400, 401, 409, 413, 415, 422)
ADD_ERRORS = (400, 401, 404, 409, 413, 415, 422)


# One real answer per status, shown as the example of the documented error body.
ERROR_EXAMPLES: dict[int, str] = {
    400: JSON_PARSE + "EOF while parsing an object at line 1 column 18",
    401: UNAUTHORIZED,
    404: "Request r-1 not found",
    409: "Request r-1 already exists (assigned to worker WorkerWithDpRank { worker_id: 1, dp_rank: 0 })",
    413: TOO_LARGE,
    415: CONTENT_TYPE,
    422: JSON_SHAPE + "missing field `request_id`",
    503: "not ready: loading the shared state",
}


def error_responses(codes: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {
        c: {
            "model": ErrorBody,
            "description": ERROR_DOCS[c],
            "content": {JSON: {"example": {"error": ERROR_EXAMPLES[c]}}},
        }
        for c in codes
    }


# The OpenAPI document groups the operations by these tags (the slot tracker's four, then the
# selection API); each route names one.
TAGS: tuple[dict[str, str], ...] = (
    {"name": "topology", "description": "Which workers and data-parallel ranks a tracker has."},
    {"name": "lifecycle", "description": "Active requests: add, prefill done, output blocks, free."},
    {"name": "loads", "description": "Current and potential load of every rank."},
    {"name": "selection", "description": "Dynamo's selection API under `/selection`: workers, "
     "choosing a rank for a prompt, reservations."},
    {"name": "operations", "description": "Probes, replication status and metrics."},
)  # fmt: skip


@dataclass(frozen=True)
class QueryParam:
    name: str
    annotation: Any
    default: Any
    description: str
    schema: dict[str, Any] | None = None  # what the document says of it (else its annotation)


U64_PATH = r"\+?[0-9]+"


def parse_u64_path(value: str) -> int:
    """A ``u64`` path segment as Rust parses it (optional ``+``, digits only, in range)."""
    if value.isascii() and re.fullmatch(U64_PATH, value) and int(value) <= U64_MAX:
        return int(value)
    raise HttpError(400, f"Invalid URL: Cannot parse `{value}` to a `u64`")


def _text_path(value: str) -> str:
    return value


@dataclass(frozen=True)
class PathParam:
    name: str
    description: str
    parse: Callable[[str], Any] = _text_path  # raises ``HttpError`` on a bad value
    schema: dict[str, Any] | None = None  # what the document says of it (else a string)


@dataclass(frozen=True)
class Route:
    path: str
    method: str
    name: str  # the operation (body routes) or ``Queries`` method (query routes)
    summary: str
    body: type[BaseModel] | None = None  # a body route's request model (documented)
    response: Any = None  # the success model
    status: int = 200
    errors: tuple[int, ...] = BODY_ERRORS
    other_ok: dict[int, str] = field(default_factory=dict)
    query: tuple[QueryParam, ...] = ()
    lean: bool = False  # served by the lean dispatcher (hot routes)
    needs_state: bool = True  # reads or writes tracker state: 503 while not ready (gate.py)
    extra: dict[str, Any] = field(default_factory=dict)  # other FastAPI route arguments
    path_params: tuple[PathParam, ...] = ()
    api: str = "slot"  # "slot", "selection" or "replica_sync": which operations serve it
    tag: str = ""  # the OpenAPI group (``TAGS``); selection routes are all "selection"
    description: str = ""  # the OpenAPI description: what a caller needs beyond the summary
    op_id: str = ""  # the operationId, when the operation's name is served at two paths
    optional_body: bool = False  # ``body`` may be left out (read only when one is declared)

    @property
    def operation_id(self) -> str:
        """The stable, short OpenAPI ``operationId``: the operation's name, per API."""
        if self.op_id:
            return self.op_id
        return self.name if self.api == "slot" else f"{self.api}_{self.name}"

    @property
    def is_call(self) -> bool:
        """Runs an operation on the body and path parameters (else a query handler)."""
        return self.body is not None or bool(self.path_params)


_MODEL_Q = QueryParam("model_name", str | None, None, "Only this model.")
_GROUP_Q = QueryParam("routing_group", str | None, None, "Only this routing group.")
# A listing answers at most ``list_max_items`` items (or ``limit``); when more remain, the
# ``x-next-cursor`` response header gives the ``cursor`` of the next page. The body keeps the
# reference's shape.
_LIMIT_Q = QueryParam(
    "limit", str | None, None,
    "Most items to answer (at least 1; `list_max_items` when absent or larger).",
    {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
)  # fmt: skip
_CURSOR_Q = QueryParam(
    "cursor", str | None, None,
    "Where to continue: the `x-next-cursor` header of the previous page.",
    {"anyOf": [{"type": "string", "pattern": "^[0-9]{1,18}$"}, {"type": "null"}]},
)  # fmt: skip
PAGE_QUERY = (_LIMIT_Q, _CURSOR_Q)


# -- the selection API (SELECTION.md): Dynamo's selection service under /selection ------------

SEL = "/selection"
_SEL_ID = PathParam("selection_id", "Reservation (selection) id, percent-encoded.")
_WORKER_ID = PathParam(
    "worker_id",
    "Worker id (u64): anything else is answered 400.",
    parse_u64_path,
    {"type": "integer", "format": "uint64", "minimum": 0, "maximum": U64_MAX},
)
SELECT_ERRORS = (400, 401, 409, 413, 415, 422, 503)
BOOK_ERRORS = (400, 401, 404, 409, 413, 415, 422, 503)
QUERY_ERRORS = (400, 401, 413, 415, 422, 503)
LIFECYCLE_ERRORS = (401, 404)
OUTCOME_ERRORS = (400, 401, 404, 413, 415, 422)  # lifecycle calls with an optional body

SELECTION_ROUTES: tuple[Route, ...] = (
    Route(SEL + "/health", "GET", "health", "Selection API liveness", response=SelectionStatus,
          errors=(), api="selection", needs_state=False,
          description="Always 200 while the process runs; the selection API's own liveness answer, as the reference gives it."),
    Route(SEL + "/ready", "GET", "ready", "200 while some worker is schedulable, else 503",
          response=SelectionReady, errors=(), api="selection", needs_state=False,
          extra={"responses": {503: {"model": SelectionReady,
                                     "description": "No schedulable worker anywhere."}}},
          description='200 while at least one worker of any partition is schedulable (and, with `indexer_peers`, once the KV index is loaded from a peer or none answered), else 503 with the same body. Lists the worker catalog and, with KV events on, the publishers this instance cannot reach or has not heard from (`kv_events`).'),
    Route(SEL + "/workers", "POST", "upsert_worker",
          "Register a worker or replace it (it may move partition)", selection_schemas.WorkerBody,
          WorkerRecord, 201, (400, 401, 413, 415, 422), api="selection",
          description='Upsert by `worker_id`: a worker given again is replaced, and moves when its model or routing group changes. Answers the catalog record with its `lifecycle` (`schedulable`, `incomplete` with `not_schedulable_reasons`, or `unschedulable`); an incomplete worker is stored too.'),
    Route(SEL + "/workers", "GET", "workers", "The worker catalog",
          response=list[WorkerRecord], errors=(400, 401), query=(_MODEL_Q, _GROUP_Q, *PAGE_QUERY),
          api="selection",
          description="Every worker's catalog record, optionally only one model and/or routing group (an unknown filter answers `[]`); at most `list_max_items` (or `limit`) per answer, the `x-next-cursor` header giving the `cursor` of the next page."),
    Route(SEL + "/workers/{worker_id}", "PATCH", "patch_worker",
          "Change some fields of a worker", selection_schemas.WorkerPatchBody, WorkerRecord,
          errors=BODY_ERRORS, path_params=(_WORKER_ID,), lean=True, api="selection",
          description='Applies only the fields given (a `model_name` is ignored). Changing `data_parallel_size` adds or removes ranks at once.'),
    Route(SEL + "/workers/{worker_id}", "DELETE", "delete_worker",
          "Remove a worker; its reservations are freed", response=WorkerRecord,
          errors=(400, 401, 404), path_params=(_WORKER_ID,), lean=True, api="selection",
          description='The worker becomes `unschedulable` and leaves its partition; its reservations are freed from the loads, but their ids stay taken until a lifecycle call on each answers 404.'),
    Route(SEL + "/select", "POST", "select", "Choose a worker rank for a prompt (books nothing)",
          selection_schemas.SelectBody, SelectResponse, errors=SELECT_ERRORS, lean=True, api="selection",
          description="Runs the cost function over the partition's candidate ranks and answers the winner with every rank's logit. Books nothing; with a `selection_id` the choice is kept as a pending selection that `POST /selection/reservations` can book later."),
    Route(SEL + "/select_and_reserve", "POST", "select_and_reserve",
          "Choose a worker rank and book the prompt there", selection_schemas.SelectBody,
          SelectAndReserveResponse, errors=SELECT_ERRORS, lean=True, api="selection",
          description='Selection and booking in one call (200, as the reference answers): the prompt is added to the chosen rank under `selection_id` until that reservation is freed.'),
    Route(SEL + "/reservations", "POST", "reserve",
          "Book a pending selection, or a prompt on a given rank", selection_schemas.ReservationBody,
          ReservationResponse, 201, BOOK_ERRORS, lean=True, api="selection",
          description='Books either a pending selection (only `selection_id` and its partition) or a prompt on a rank given explicitly. 409 when the id is already booked.'),
    Route(SEL + "/reservations/{selection_id}/prefill_complete", "POST",
          "reservation_prefill_complete", "The reservation's prefill is done",
          ReservationOutcomeBody, response=SelectionStatus, errors=OUTCOME_ERRORS,
          path_params=(_SEL_ID,), lean=True, api="selection", optional_body=True,
          description="The reservation's prompt no longer counts as prefill load; idempotent while booked. The body is optional: `cached_tokens` reports the engine's cached prompt tokens for the selection's routing receipt."),
    Route(SEL + "/reservations/{selection_id}/output_block", "POST", "reservation_output_block",
          "Add a generated block to the reservation", selection_schemas.ReservationOutputBlockBody, SelectionStatus,
          errors=BODY_ERRORS, path_params=(_SEL_ID,), lean=True, api="selection",
          description="One more decode block on the reservation's rank; `decay_fraction` (0 to 1) also decays the prompt's remaining prefill."),
    Route(SEL + "/reservations/{selection_id}", "DELETE", "delete_reservation",
          "Free a reservation", ReservationOutcomeBody, response=SelectionStatus,
          errors=OUTCOME_ERRORS, path_params=(_SEL_ID,), lean=True, api="selection",
          optional_body=True,
          description='Frees the reservation and its blocks; a second free answers 404. The body is optional: `cached_tokens` reports the engine\'s cached prompt tokens for the selection\'s routing receipt.'),
    Route(SEL + "/loads", "GET", "loads", "Current load of every rank, per partition",
          response=list[PartitionLoads], errors=(400, 401), query=(_MODEL_Q, _GROUP_Q),
          api="selection",
          description="Per partition: every rank's active prefill tokens, decode blocks and requests, and the pending selections."),
    Route(SEL + "/potential_loads", "POST", "potential_loads",
          "Load of every rank if a prompt went there", selection_schemas.PromptBody, list[RankLoad],
          errors=QUERY_ERRORS, lean=True, api="selection",
          description="What every rank's prefill tokens and decode blocks would be if the prompt were booked there; changes nothing."),
    Route(SEL + "/overlap_scores", "POST", "overlap_scores",
          "Cached prefix of a prompt on every rank (approximate cache)", selection_schemas.PromptBody,
          OverlapScoresResponse, errors=QUERY_ERRORS, lean=True, api="selection",
          description="How many of the prompt's leading blocks each rank holds, per storage tier."),
    Route(SEL + "/dump", "GET", "dump", "The approximate caches as stored events",
          response=dict[str, PartitionDump], errors=(401,), api="selection",
          description="Each partition's cache contents as the stored-block events that would rebuild them."),
    Route(SEL + "/kv_index", "GET", "kv_index",
          "This instance's KV-event index, for another instance to start from", errors=(401, 404),
          api="selection",
          extra={"response_class": Response, "responses": {
              200: {"description": "NDJSON, one partition at a time (see the README's KV events section).",
                    "content": {"application/x-ndjson": {"schema": {"type": "string"}}}}}},
          description="What `indexer_peers` loads at start: per partition and rank, every block (tier, engine hash, parent hash, tokens hash) and the sequence number of the rank's last applied batch, so that the loader's listener continues from there. Streamed, one partition read at a time. 404 when KV events are off."),
)  # fmt: skip

# -- Dynamo's replica-sync peer routes (kv_slot_tracker.http.selection.replica_sync): the
# slot tracker's at the root, the selection service's under /selection; no ZMQ mesh here.

_PEER_ERRORS = (400, 401, 413, 415, 422)


def _replica_sync_routes(prefix: str, op_prefix: str) -> tuple[Route, ...]:
    """Left out of the OpenAPI document: compatibility for Dynamo's clients, never an operation
    of this service (a generated client would get calls that always answer 409)."""
    hidden = {"include_in_schema": False}
    return (
        Route(prefix + "/replica_sync/peers", "GET", "peers", "Dynamo's replica-sync peers: none",
              errors=(401,), needs_state=False, api="replica_sync", extra=hidden,
              op_id=op_prefix + "peers"),
        Route(prefix + "/replica_sync/register_peer", "POST", "register_peer",
              "Dynamo's replica-sync peer registration: 409", PeerBody, None, 409, _PEER_ERRORS,
              needs_state=False, api="replica_sync", extra=hidden, op_id=op_prefix + "register_peer"),
        Route(prefix + "/replica_sync/deregister_peer", "POST", "deregister_peer",
              "Dynamo's replica-sync peer removal: 409", PeerBody, None, 409, _PEER_ERRORS,
              needs_state=False, api="replica_sync", extra=hidden,
              op_id=op_prefix + "deregister_peer"),
    )  # fmt: skip


ROUTES: tuple[Route, ...] = (
    Route("/health", "GET", "health", "Liveness: 200 with an empty body", errors=(),
          needs_state=False,
          extra={"response_class": Response,
                 "responses": {200: {"description": "Alive.", "content": {}}}}, tag="operations",
          description='200 with an empty body while the process runs; never needs a key. Use `/ready` to know whether it can serve.'),
    Route("/ready", "GET", "ready", "Readiness: 200 once the instance can serve",
          response=ReadyBody, errors=(), needs_state=False,
          extra={"responses": {503: {"model": ReadyBody, "description": "Not ready (yet, or for now)."}}}, tag="operations",
          description="200 once the instance has loaded the shared state and can serve; 503 with the reason until then, while it re-reads the stream after a Redis failover, and, with `replication_ack = \"redis\"`, while it refuses changes (`writes refused: Redis unreachable`) (a load balancer's readiness probe)."),
    Route("/replication", "GET", "replication_status", "Replication status of this instance",
          response=ReplicationStatus, errors=(401,), needs_state=False, tag="operations",
          description='Mode, positions, counts and health of the replication between instances (`mode: embedded` for a single instance).'),
    Route("/register", "POST", "register", "Register a worker's ranks", schemas.RegisterBody,
          StatusOk, 201, TOPOLOGY_ERRORS, tag="topology",
          description='Adds ranks `dp_start … dp_start + dp_size - 1` of a worker to the tracker of `(model_name, routing_group)`, creating the tracker (with `block_size`) on first use. 409 when the worker id is registered already.'),
    Route("/upsert", "POST", "upsert", "Register a worker or replace its ranks (201 when created)",
          schemas.UpsertBody, StatusOk, 200, TOPOLOGY_ERRORS,
          other_ok={201: "Created: the worker id was new."}, tag="topology",
          description='Like `/register`, but replaces the ranks of a known worker (requests on removed ranks are freed): 201 when the id was new, 200 otherwise.'),
    Route("/unregister", "POST", "unregister", "Remove a worker with all its ranks and requests",
          schemas.UnregisterBody, StatusOk, tag="topology",
          description="Removes the worker's ranks and frees their active requests."),
    Route("/heartbeat", "POST", "heartbeat", "Renew a worker's lease", schemas.HeartbeatBody,
          StatusOk, 200, BODY_ERRORS, tag="topology",
          description="With `worker_ttl_seconds` set, a worker that is not renewed within that "
          "many seconds (by this call, `/register` or `/upsert`) is unregistered on every "
          "instance. Without it the call changes nothing. 404 for an unknown worker."),
    Route("/reconcile", "POST", "reconcile",
          "Make a list of workers the whole topology of a tracker", schemas.ReconcileBody,
          ReconcileResult, 200, TOPOLOGY_ERRORS, tag="topology",
          description="Makes the given workers the tracker's whole topology in one step: adds, replaces and removes ranks, and answers what changed."),
    Route("/workers", "GET", "workers", "Registered workers", response=list[WorkerRow],
          errors=(400, 401), query=(_MODEL_Q, _GROUP_Q, *PAGE_QUERY), tag="topology",
          description="Every tracker's registered workers and ranks, optionally only one model and/or routing group; at most `list_max_items` (or `limit`) per answer, the `x-next-cursor` header giving the `cursor` of the next page."),
    Route("/add", "POST", "add", "Add an active request to a rank", schemas.AddBody, StatusOk, 201,
          ADD_ERRORS, lean=True, tag="lifecycle",
          description='Adds an active request (its prompt as `sequence_hashes` or `token_ids`) to a rank: its new blocks become decode load and its input tokens prefill load until `/prefill_complete`. 409 for an id that is active already, 404 for an unknown rank.'),
    Route("/prefill_complete", "POST", "prefill_complete", "Mark a request's prefill as done",
          schemas.RequestBody, StatusOk, lean=True, tag="lifecycle",
          description="The request's prefill tokens stop counting. 404 for an unknown id."),
    Route("/free", "POST", "free", "Free a request (unknown ids succeed)", schemas.RequestBody,
          StatusOk, lean=True, tag="lifecycle",
          description='Removes the request and its blocks. An unknown or already freed id succeeds too, as in the reference (a retried free is harmless).'),
    Route("/output_block", "POST", "output_block", "Add a generated (output) block to a request",
          schemas.OutputBlockBody, StatusOk, lean=True, tag="lifecycle",
          description="One generated block more on the request's rank; `decay_fraction` also decays the remaining modeled prefill."),
    Route("/loads", "GET", "loads", "Current load of every rank", response=list[LoadRow],
          errors=(400, 401), query=(_MODEL_Q, _GROUP_Q), tag="loads",
          description="Every rank's active requests, decode blocks, prefill tokens and modeled remaining prefill time. An unknown `model_name` answers `[]`, as the reference does: check the spelling with `GET /workers`."),
    Route("/potential_loads", "POST", "potential_loads", "Load of every rank if a prompt went there",
          schemas.PotentialLoadsBody, list[PotentialLoadRow], lean=True, tag="loads",
          description="What every rank's prefill tokens and decode blocks would be if the prompt went there (blocks already active on a rank are not counted twice); changes nothing."),
    Route("/project_loads", "POST", "project_loads", "Projected load of every rank for a prompt",
          schemas.ProjectLoadsBody, list[ProjectedLoadRow], lean=True, tag="loads",
          description="Like `/potential_loads`, plus each rank's prefix overlap and modeled prefill time."),
    Route("/lora_counts", "GET", "lora_counts", "Active requests per LoRA name",
          response=LoraCounts, errors=(400, 401, 404),
          query=(QueryParam("model_name", str, ..., "Model name."),
                 QueryParam("routing_group", str, DEFAULT_ROUTING_GROUP, "Routing group."),
                 *PAGE_QUERY), tag="loads",
          description='Active requests per LoRA adapter name in one tracker, by name; at most `list_max_items` names (or `limit`) per answer, the `x-next-cursor` header giving the `cursor` of the next page.'),
    Route("/batch", "POST", "batch", "Apply many lifecycle operations in one call", schemas.BatchBody,
          BatchResponse, lean=True, tag="lifecycle",
          description='Many `add`, `prefill_complete`, `output_block` and `free` operations in one call, applied in order; each answers its own status, and one failing changes nothing for the others. At most `max_batch_operations` operations.'),
    *_replica_sync_routes("", "replica_sync_"),
    *SELECTION_ROUTES,
    *_replica_sync_routes(SEL, "selection_replica_sync_"),
)  # fmt: skip


def body_models() -> list[type[BaseModel]]:
    """Request models of the body routes, for the OpenAPI document's components."""
    seen: list[type[BaseModel]] = []
    for r in ROUTES:
        if r.body is not None and r.body not in seen and r.extra.get("include_in_schema", True):
            seen.append(r.body)
    return seen


def response_examples() -> dict[str, list[Any]]:
    """The examples of every success model (a list's or a dict's items too), by schema name,
    as the models give them: FastAPI's document drops their null values, this keeps them."""
    out: dict[str, list[Any]] = {}
    for r in ROUTES:
        model = r.response
        if get_origin(model) in (list, dict):
            model = get_args(model)[-1]
        if model is None or model is Response:
            continue
        examples = TypeAdapter(model).json_schema().get("examples")
        if examples:
            out[model.__name__] = examples
    return out
