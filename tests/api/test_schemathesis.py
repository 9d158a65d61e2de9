"""Property-based API tests generated from the application's own OpenAPI document.

Schemathesis reads ``/openapi.json`` from the ASGI app in-process and, for every operation,
sends schema-derived requests (documented examples, boundary values and random data, valid and
invalid). Every response must be free of server errors, carry a status code the document lists for
that operation, and match the documented response schema.

So that the generated requests reach the real handlers and not only the "no slot tracker" 404, a
tracker for the documented example model (``llama``, block size 16, worker 1 with ranks 0 and 1)
is put back before every request.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from app.main import create_app
from app.service import ServiceError
from app.settings import load_settings

app = create_app(load_settings(api_key="", redis_url=""))
schema = schemathesis.openapi.from_asgi("/openapi.json", app)

# No 5xx; only documented status codes, content types and response bodies; schema-invalid
# requests refused with a 4xx; undeclared methods answered 405 with an `Allow` header.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    unsupported_method,
]
EXAMPLE_KEY = ("llama", "default")


def ensure_example_tracker() -> None:
    service = app.state.service
    try:
        service.upsert(EXAMPLE_KEY, 1, 16, 0, 2)
    except ServiceError:
        # The generated requests re-created the tracker with another block size; start over.
        service.reconcile(EXAMPLE_KEY, service.tracker(EXAMPLE_KEY).block_size, [])
        service.upsert(EXAMPLE_KEY, 1, 16, 0, 2)


@schema.parametrize()
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)
def test_api_conforms_to_its_openapi_document(case: schemathesis.Case) -> None:
    ensure_example_tracker()
    case.call_and_validate(checks=CHECKS)
