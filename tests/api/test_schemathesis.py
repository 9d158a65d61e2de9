"""Property-based API tests generated from the application's own OpenAPI document.

Schemathesis reads ``/openapi.json`` from the ASGI app in-process (once without a key, once
with ``api_key`` set, sending it) and, for every operation,
sends schema-derived requests (documented examples, boundary values and random data, valid and
invalid). Every response must be free of server errors and carry a status code and content type
the document lists for that operation, with a body matching the documented schema; schema-invalid
requests must be refused with a 4xx, undeclared methods with a 405 naming the allowed ones, and
with a key, every protected route must refuse a caller without it. A stateful phase chains
calls through the links Schemathesis infers (ids one answer gives the next call).

So that the generated requests reach the real handlers and not only the "no slot tracker" 404, the
state is reset before every request to one tracker for the documented example model (``llama``,
block size 16, worker 1 with ranks 0 and 1) holding the documented example request ``r1``, and a
selection catalog holding that worker (schedulable, endpoint ``http://w1``). The selection API
answers 503 when a request leaves no schedulable candidate (another model, an empty
``allowed_worker_ids``): that documented 503 is its reference behaviour, not a server error.
"""

from __future__ import annotations

import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis.checks import CHECKS, load_all_checks, not_a_server_error

from kv_slot_tracker.core.selection.catalog import WorkerSpec
from kv_slot_tracker.main import create_app
from kv_slot_tracker.service.selection.commands import DeleteWorker, UpsertWorker
from kv_slot_tracker.settings import load_settings
from tests.calls import AddCall, reconcile

KEY = "fuzz-key"
app = create_app(load_settings(api_key="", redis_url=""))
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
keyed_app = create_app(load_settings(api_key=KEY, redis_url=""))
keyed_schema = schemathesis.openapi.from_asgi(
    "/openapi.json", keyed_app, headers={"Authorization": f"Bearer {KEY}"}
)


def not_a_server_error_but_no_worker(ctx, response, case):  # type: ignore[no-untyped-def]
    """``not_a_server_error``, except the selection API's documented 503 (no schedulable
    worker for the request)."""
    if case.path.startswith("/selection/") and response.status_code == 503:
        return None
    return not_a_server_error(ctx, response, case)


# Every check Schemathesis has: no 5xx; only documented status codes, content types, headers
# and response bodies; schema-invalid requests refused with a 4xx; undeclared methods answered
# 405 with a complete `Allow` header; authentication not ignored. Except one:
# ``positive_data_acceptance`` (every schema-valid request answered 2xx or 404/409) cannot hold
# for rules across fields and state that the reference answers 400 and a schema cannot state
# (dp_start + dp_size within u32, one prompt form, isl_tokens >= the prompt's tokens, ...).
load_all_checks()
ALL_CHECKS = [
    not_a_server_error_but_no_worker if c is not_a_server_error else c
    for c in CHECKS.get_all()
    if c.__name__ != "positive_data_acceptance"
]
EXAMPLE_KEY = ("llama", "default")


def reset_state(path: str, app: FastAPI = app) -> None:
    """Before every request: only the example tracker, with exactly worker 1 (ranks 0 and 1) and,
    except for ``/add``, the example request ``r1`` active on rank 0.

    Generated requests may register trackers with thousands of ranks; dropping them keeps the
    memory bounded, and a fixed topology lets a generated upsert both create and update.
    """
    service, selection = app.state.service, app.state.selection
    for record in selection.workers(None, None):
        selection.delete_worker(DeleteWorker(worker_id=record.spec.worker_id))
    for key, tracker in list(service.trackers.items()):
        reconcile(service, key, tracker.block_size, [])
    reconcile(service, EXAMPLE_KEY, 16, [(1, 0, 2)])
    worker = WorkerSpec(
        worker_id=1,
        model_name=EXAMPLE_KEY[0],
        endpoint="http://w1",
        block_size=16,
        data_parallel_size=2,
    )
    selection.upsert_worker(UpsertWorker(spec=worker))
    if path != "/add":
        service.add(AddCall(*EXAMPLE_KEY, "r1", 1, 0, [1, 2, 3], new_isl_tokens=48))


@schema.parametrize()
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)
def test_api_conforms_to_its_openapi_document(case: schemathesis.Case) -> None:
    reset_state(case.operation.path)
    case.call_and_validate(checks=ALL_CHECKS)


@keyed_schema.parametrize()
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)
def test_api_with_a_key_conforms_and_refuses_callers_without_it(case: schemathesis.Case) -> None:
    """The same with ``api_key`` set and sent; ``ignored_auth`` also sends each request without
    the key (and with a wrong one) and expects a 401 on every protected route."""
    reset_state(case.operation.path, keyed_app)
    case.call_and_validate(checks=ALL_CHECKS, headers={"Authorization": f"Bearer {KEY}"})


class Workflow(schema.as_state_machine()):  # type: ignore[misc]
    """The stateful phase: sequences of calls linked through the ids one answer gives the next
    (a worker created then patched, deleted, used by /register or /add; a reservation booked
    then completed or released), each answer checked like the single calls above."""

    def setup(self) -> None:
        reset_state("/stateful")

    def validate_response(self, response, case, **kwargs):  # type: ignore[no-untyped-def]
        case.validate_response(response, checks=ALL_CHECKS)


TestStatefulWorkflows = Workflow.TestCase
TestStatefulWorkflows.settings = settings(
    max_examples=15,
    stateful_step_count=6,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
