"""Dynamo's replica-sync peer routes, answered as a Dynamo instance without replica sync does.

Dynamo's slot tracker (1.6.1) and its newer selection service manage their ZMQ replica mesh at
``GET /replica_sync/peers`` and ``POST /replica_sync/register_peer|deregister_peer`` with an
``{"endpoint": "tcp://host:port"}`` body (an operator, e.g. Dynamo's gateway plugin, wires the
mesh as replicas come and go). Here instances share their state through Redis, so there is no
mesh to wire. A Dynamo client gets what Dynamo answers when replica sync is off, which it has to
handle already: the peer list is empty (200 ``[]``) and a change of it is 409
``replica sync is disabled`` (the reference's words, then what this service does instead). The
body is checked first, as the reference's JSON extractor does: 415, 400, 422 for a body that is
no ``{"endpoint": string}``. Nothing is changed by any of these calls.

The routes are served at the root (the slot tracker's dialect) and under ``/selection`` (the
selection service's, so at the root of ``selection_port`` too). They are left out of the OpenAPI
document: they are Dynamo's, not operations of this service (``docs/migrating-from-dynamo.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictStr
from starlette.datastructures import QueryParams
from starlette.responses import Response

from kv_slot_tracker.core.limits import MAX_TEXT_LENGTH
from kv_slot_tracker.http.answers import Result
from kv_slot_tracker.http.body import parse_json
from kv_slot_tracker.http.errors import EXPECTED, error_result
from kv_slot_tracker.http.responses import json_response
from kv_slot_tracker.replication.port import Replication

DISABLED = "replica sync is disabled"


class PeerBody(BaseModel):
    endpoint: Annotated[StrictStr, Field(max_length=MAX_TEXT_LENGTH)] = Field(
        description="A peer's ZMQ publisher, e.g. `tcp://selector-b:9092` (not used here)."
    )

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"endpoint": "tcp://selector-b:9092"}]}
    )


def disabled_message(replication: Replication) -> str:
    """The 409's text: the reference's, then how this instance shares its state."""
    if replication.mode == "embedded":
        how = "this instance runs alone; instances share their state through Redis (redis_url)"
    else:
        how = "instances share their state through Redis (redis_url), see GET /replication"
    return f"{DISABLED}: {how}, not a ZMQ mesh"


class ReplicaSync:
    """The three routes' handlers: the two calls (``get``) and the peer list (a query)."""

    def __init__(self, replication: Replication) -> None:
        self.conflict = orjson.dumps({"error": disabled_message(replication)})

    def get(self, name: str) -> Callable[[bytes], Result]:
        op: Callable[[bytes], Result] = getattr(self, name)

        def run(raw: bytes) -> Result:
            try:
                return op(raw)
            except EXPECTED as e:
                return error_result(e)

        return run

    def register_peer(self, raw: bytes) -> Result:
        parse_json(raw, PeerBody)
        return 409, self.conflict

    def deregister_peer(self, raw: bytes) -> Result:
        parse_json(raw, PeerBody)
        return 409, self.conflict

    def peers(self, params: QueryParams) -> Response:
        return json_response([])
