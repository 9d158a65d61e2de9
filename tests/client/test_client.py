"""The typed client (``kv_slot_tracker_client``, in clients/python) against real service instances.

* ``server``: a ``python -m kv_slot_tracker`` subprocess on a free port (shared by the module; every test uses
  its own model name, so tests never see each other's trackers). ``client`` talks to it.
* ``keyed_server``: a second process started with ``SLOT_TRACKER_API_KEY`` for the 401 mapping.
* ``aclient``: the async client on an in-process app through ``httpx.ASGITransport``, with a
  ``FakeClock`` so prefill decay is exact.
* ``httpx.MockTransport`` stands in for the service where it cannot be made to answer a given way
  (5xx, a malformed success body) and where the exact request sent is asserted.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from kv_slot_tracker_client import (
    AsyncSlotTrackerClient,
    BadRequest,
    BatchBuilder,
    BatchResult,
    Conflict,
    LoadRow,
    NotFound,
    PotentialLoadRow,
    ProjectedLoadRow,
    Rank,
    ReconcileResult,
    ServerError,
    SlotTrackerClient,
    SlotTrackerError,
    TransportError,
    Unauthorized,
    Unavailable,
    WorkerRow,
    to_i64,
)
from kv_slot_tracker_client import __version__ as client_version

from kv_slot_tracker import __version__ as app_version
from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import load_settings
from tests.fakes import FakeClock
from tests.ports import free_port
from tests.servers import live_server

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
EXAMPLE = REPO / "docs" / "client_example.py"
API_KEY = "client-test-key"
JSON_SHAPE = "Failed to deserialize the JSON body into the target type: "
U64_MAX = 2**64 - 1


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory.mktemp("server")) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory.mktemp("keyed"), SLOT_TRACKER_API_KEY=API_KEY) as url:
        yield url


@pytest.fixture
def client(server: str) -> Iterator[SlotTrackerClient]:
    with SlotTrackerClient(server) as c:
        yield c


@pytest.fixture
def model() -> str:
    """A model name no other test uses, so each test has its own trackers on the shared server."""
    return f"m-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def aclient(clock: FakeClock) -> AsyncIterator[AsyncSlotTrackerClient]:
    app = create_app(load_settings(), clock=clock.now)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncSlotTrackerClient("http://tracker", transport=transport) as c:
            yield c


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts TCP connections (the kernel completes the handshake) and never
    answers: every request to it times out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


Handler = Callable[[httpx.Request], httpx.Response]


def mock_client(handler: Handler, **kwargs: object) -> SlotTrackerClient:
    return SlotTrackerClient("http://tracker", transport=httpx.MockTransport(handler), **kwargs)  # type: ignore[arg-type]


class Recorder:
    """A MockTransport handler that records requests and answers with a fixed response."""

    def __init__(self, status: int = 200, body: object = None, **kwargs: object) -> None:
        self.requests: list[httpx.Request] = []
        self.status, self.body, self.kwargs = status, body, kwargs

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.body is None:
            return httpx.Response(self.status, json={"status": "ok"})
        return httpx.Response(self.status, json=self.body, **self.kwargs)  # type: ignore[arg-type]

    @property
    def last_json(self) -> object:
        return json.loads(self.requests[-1].content)


def by_rank(rows):
    return sorted(rows, key=lambda r: (r.worker_id, r.dp_rank))


# -- SPEC §7.6 worked example, every lifecycle route -------------------------------------------


def test_spec_worked_example(client: SlotTrackerClient, model: str) -> None:
    assert client.register(1, model, 4, 0, 2) is None
    client.add(model, "r1", 1, 0, [1, 2, 3], new_isl_tokens=12)
    assert [(r.active_prefill_tokens, r.active_decode_blocks) for r in client.loads(model)] == [
        (12, 3),
        (0, 0),
    ]
    client.add(model, "r2", 1, 0, [1, 2, 4, 5], new_isl_tokens=16)
    loads = client.loads(model)
    assert loads == [
        LoadRow(
            model_name=model,
            routing_group="default",
            worker_id=1,
            dp_rank=0,
            active_prefill_tokens=28,
            active_decode_blocks=5,
            active_requests=2,
            modeled_remaining_prefill_ms=None,  # HTTP prefills without a duration
        ),
        LoadRow(
            model_name=model,
            routing_group="default",
            worker_id=1,
            dp_rank=1,
            active_prefill_tokens=0,
            active_decode_blocks=0,
            active_requests=0,
            modeled_remaining_prefill_ms=0,
        ),
    ]
    potential = client.potential_loads(model, [1, 2, 3, 5], new_isl_tokens=7)
    assert all(isinstance(r, PotentialLoadRow) for r in potential)
    assert by_rank(potential) == [
        PotentialLoadRow(
            worker_id=1,
            dp_rank=0,
            potential_prefill_tokens=35,
            potential_decode_blocks=6,
            active_requests=2,
        ),
        PotentialLoadRow(
            worker_id=1,
            dp_rank=1,
            potential_prefill_tokens=7,
            potential_decode_blocks=4,
            active_requests=0,
        ),
    ]

    def rank0() -> tuple[int, int]:
        row = client.loads(model)[0]
        return row.active_prefill_tokens, row.active_decode_blocks

    client.prefill_complete(model, "r1")
    assert rank0() == (16, 5)
    client.prefill_complete(model, "r1")  # repeating it is fine
    client.free(model, "r1")
    assert rank0() == (16, 4)
    client.free(model, "r2")
    assert rank0() == (0, 0)
    client.free(model, "r2")  # unknown ids free successfully


def test_project_loads(client: SlotTrackerClient, model: str) -> None:
    client.register(1, model, 4, 0, 2)
    client.add(model, "r1", 1, 0, [1, 2, 3], new_isl_tokens=12)
    assert client.project_loads(model, [1, 2, 9]) == [
        ProjectedLoadRow(
            worker_id=1,
            dp_rank=0,
            active_prefill_tokens=12,
            active_decode_blocks=3,
            additional_active_blocks=1,
            potential_decode_blocks=4,
        ),
        ProjectedLoadRow(
            worker_id=1,
            dp_rank=1,
            active_prefill_tokens=0,
            active_decode_blocks=0,
            additional_active_blocks=3,
            potential_decode_blocks=3,
        ),
    ]


def test_output_blocks_with_fractional_decay(client: SlotTrackerClient, model: str) -> None:
    """SPEC §2.9 through the API."""
    client.register(7, model, 4)

    def blocks() -> int:
        return client.loads(model)[0].active_decode_blocks

    client.add(model, "r1", 7, 0, [1, 2, 3], new_isl_tokens=12)
    assert blocks() == 3
    client.output_block(model, "r1", 0.5)
    assert blocks() == 2
    client.add(model, "r2", 7, 0, [1, 2], new_isl_tokens=8)
    assert blocks() == 2
    client.output_block(model, "r1", 0.0)
    assert blocks() == 1
    client.output_block(model, "r2")  # no fraction: one more full block
    assert blocks() == 2
    client.free(model, "r2")
    client.free(model, "r1")
    assert client.loads(model)[0].active_decode_blocks == 0
    with pytest.raises(NotFound, match="Request r1 not found"):
        client.output_block(model, "r1")


def test_token_ids_and_lora_counts(client: SlotTrackerClient, model: str) -> None:
    client.register(1, model, 4, 0, 2)
    tokens = list(range(10))  # two full blocks of 4; the last 2 tokens are no block
    client.add(model, "a1", 1, 0, token_ids=tokens, new_isl_tokens=10, lora_name="a")
    client.add(model, "a2", 1, 1, [5], lora_name="a")
    client.add(model, "b1", 1, 1, [6], lora_name="b", expected_output_tokens=64)
    client.add(model, "plain", 1, 1, [7])
    counts = client.lora_counts(model)
    assert (counts.model_name, counts.routing_group, counts.lora_counts) == (
        model,
        "default",
        {"a": 2, "b": 1},
    )
    assert client.loads(model)[0].active_decode_blocks == 2
    same = {r.dp_rank: r for r in client.potential_loads(model, token_ids=tokens, lora_name="a")}
    assert same[0].potential_decode_blocks == 2  # the 2 blocks overlap
    other = {r.dp_rank: r for r in client.potential_loads(model, token_ids=tokens)}
    assert other[0].potential_decode_blocks == 4  # without the LoRA the hashes differ
    projected = client.project_loads(model, token_ids=tokens, lora_name="a")
    assert [p.additional_active_blocks for p in projected] == [0, 2]
    with pytest.raises(NotFound, match="no slot tracker"):
        client.lora_counts(model, routing_group="elsewhere")


def test_track_prefill_tokens_flag(client: SlotTrackerClient, model: str) -> None:
    client.register(1, model, 4)
    client.add(model, "quiet", 1, 0, [1], new_isl_tokens=50, track_prefill_tokens=False)
    assert client.loads(model)[0].active_prefill_tokens == 0
    client.add(model, "loud", 1, 0, [2], new_isl_tokens=5, track_prefill_tokens=True)
    assert client.loads(model)[0].active_prefill_tokens == 5


# -- topology ----------------------------------------------------------------------------------


def test_upsert_workers_unregister(client: SlotTrackerClient, model: str) -> None:
    assert client.upsert(3, model, 16, 0, 2) is True
    assert client.upsert(3, model, 16, 0, 2) is False
    assert client.upsert(3, model, 16, 1, 3) is False  # new ranks, same worker
    client.register(1, model, 16, routing_group="g2")
    assert client.workers(model) == [
        WorkerRow(
            worker_id=3,
            model_name=model,
            routing_group="default",
            block_size=16,
            dp_start=1,
            dp_size=3,
        ),
        WorkerRow(
            worker_id=1, model_name=model, routing_group="g2", block_size=16, dp_start=0, dp_size=1
        ),
    ]
    assert [w.worker_id for w in client.workers(model, "g2")] == [1]
    assert client.workers(model, "nope") == []
    assert [(r.worker_id, r.dp_rank) for r in client.loads(model, "default")] == [
        (3, 1),
        (3, 2),
        (3, 3),
    ]
    client.unregister(3, model)
    assert [w.routing_group for w in client.workers(model)] == ["g2"]
    with pytest.raises(NotFound) as err:
        client.unregister(3, model)
    assert err.value.status == 404
    assert err.value.message == f"worker 3 not found for model={model} routing_group=default"


def test_reconcile(client: SlotTrackerClient, model: str) -> None:
    client.register(1, model, 8, 0, 2)
    client.register(2, model, 8)
    result = client.reconcile(model, 8, [(1, 0, 1), (3, 0, 2)])
    assert isinstance(result, ReconcileResult)
    assert sorted(result.added, key=lambda r: (r.worker_id, r.dp_rank)) == [
        Rank(worker_id=3, dp_rank=0),
        Rank(worker_id=3, dp_rank=1),
    ]
    assert sorted(result.removed, key=lambda r: (r.worker_id, r.dp_rank)) == [
        Rank(worker_id=1, dp_rank=1),
        Rank(worker_id=2, dp_rank=0),
    ]
    # the rows of workers() are accepted as they are: reconciling to the same topology is a no-op
    same = client.reconcile(model, 8, client.workers(model))
    assert (same.added, same.removed) == ([], [])
    with pytest.raises(Conflict, match="block_size mismatch"):
        client.reconcile(model, 4, [(1, 0, 1)])
    with pytest.raises(BadRequest, match="listed more than once"):
        client.reconcile(model, 8, [(1, 0, 1), (1, 0, 1)])


# -- batch -------------------------------------------------------------------------------------


def test_batch_builder_results_in_order(client: SlotTrackerClient, model: str) -> None:
    client.register(1, model, 4, 0, 2)
    builder = (
        BatchBuilder()
        .add(model, "r1", 1, 0, [1, 2], new_isl_tokens=8)
        .add(model, "r2", 1, 1, [U64_MAX], new_isl_tokens=4, expected_prefill_ms=60_000)
        .add(model, "r1", 1, 0, [3])  # duplicate id
        .prefill_complete(model, "r1")
        .output_block(model, "r2", 0.5)
        .free(model, "ghost")  # unknown ids free successfully
        .prefill_complete(model, "ghost")
        .add(model, "r3", 9, 0, [1])  # unregistered worker
        .free(model, "r1", routing_group="other")  # no such tracker
        .add(model, "r4", 1, 0)  # no prompt
    )
    assert len(builder) == 10
    assert builder.operations[1]["sequence_hashes"] == [-1]
    results = client.batch(builder)
    assert all(isinstance(r, BatchResult) for r in results)
    assert [(r.status, r.error) for r in results] == [
        (201, None),
        (201, None),
        (
            409,
            "Request r1 already exists (assigned to worker WorkerWithDpRank { worker_id: 1, dp_rank: 0 })",
        ),
        (200, None),
        (200, None),
        (200, None),
        (404, "Request ghost not found"),
        (404, "Worker WorkerWithDpRank { worker_id: 9, dp_rank: 0 } not found"),
        (404, "no slot tracker for model=" + model + " routing_group=other"),
        (422, JSON_SHAPE + "missing field `sequence_hashes`"),
    ]
    loads = client.loads(model)
    assert [(r.active_prefill_tokens, r.active_requests) for r in loads] == [(0, 1), (4, 1)]
    assert client.batch([]) == []
    raw = client.batch([{"op": "free", "model_name": model, "request_id": "r1"}, {"op": "x"}])
    assert [r.status for r in raw] == [200, 422]
    builder.clear()
    assert len(builder) == 0 and list(builder) == []


# -- hashes ------------------------------------------------------------------------------------


def test_to_i64() -> None:
    assert to_i64(0) == 0
    assert to_i64(2**63 - 1) == 2**63 - 1
    assert to_i64(2**63) == -(2**63)
    assert to_i64(U64_MAX) == -1
    assert to_i64(-1) == -1
    assert to_i64(-(2**63)) == -(2**63)
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError):
            to_i64(bad)
    for wrong in (True, 1.0, "1", None):
        with pytest.raises(TypeError):
            to_i64(wrong)  # type: ignore[arg-type]


def test_big_hashes_round_trip(client: SlotTrackerClient, model: str) -> None:
    """u64 hashes >= 2^63 are sent as their negative i64; the service sees the same blocks."""
    client.register(1, model, 4, 0, 2)
    client.add(model, "big", 1, 0, [U64_MAX, 2**63, 5], new_isl_tokens=3)
    assert client.loads(model)[0].active_decode_blocks == 3
    # the same prefix given in the signed form overlaps completely
    rows = {r.dp_rank: r for r in client.potential_loads(model, [-1, -(2**63), 5])}
    assert rows[0].potential_decode_blocks == 3 and rows[1].potential_decode_blocks == 3
    # the raw API itself rejects the unsigned form, which is why the client converts
    with pytest.raises(BadRequest) as err:
        client.request(
            "POST", "/potential_loads", json={"model_name": model, "sequence_hashes": [U64_MAX]}
        )
    assert err.value.status == 422
    with pytest.raises(ValueError):
        client.add(model, "too-big", 1, 0, [2**64])


def test_bodies_sent() -> None:
    """Unset options are omitted (the service rejects most explicit nulls); hashes converted."""
    rec = Recorder(201)
    with mock_client(rec) as c:
        c.add("m", "r", 1, 0, iter([U64_MAX, 2]))
        assert rec.last_json == {
            "model_name": "m",
            "routing_group": "default",
            "request_id": "r",
            "worker_id": 1,
            "dp_rank": 0,
            "sequence_hashes": [-1, 2],
            "new_isl_tokens": 0,
        }
        c.add(
            "m",
            "r",
            1,
            0,
            token_ids=(1, 2),
            new_isl_tokens=5,
            expected_prefill_ms=2.5,
            track_prefill_tokens=False,
            expected_output_tokens=9,
            lora_name="l",
            routing_group="g",
        )
        assert rec.last_json == {
            "model_name": "m",
            "routing_group": "g",
            "request_id": "r",
            "worker_id": 1,
            "dp_rank": 0,
            "token_ids": [1, 2],
            "new_isl_tokens": 5,
            "expected_prefill_ms": 2.5,
            "track_prefill_tokens": False,
            "expected_output_tokens": 9,
            "lora_name": "l",
        }
        c.output_block("m", "r")
        assert rec.last_json == {"model_name": "m", "routing_group": "default", "request_id": "r"}
        request = rec.requests[-1]
        assert request.headers["content-type"] == "application/json"
        assert "authorization" not in request.headers


# -- errors ------------------------------------------------------------------------------------


def test_error_mapping_live(client: SlotTrackerClient, model: str) -> None:
    client.register(1, model, 4)
    with pytest.raises(Conflict) as conflict:
        client.register(1, model, 4)
    assert conflict.value.status == 409
    assert (
        conflict.value.message
        == f"worker 1 already registered for model={model} routing_group=default"
    )
    assert str(conflict.value) == f"POST /register -> 409: {conflict.value.message}"
    client.add(model, "r1", 1, 0, [1])
    with pytest.raises(Conflict, match="Request r1 already exists"):
        client.add(model, "r1", 1, 0, [1])

    with pytest.raises(NotFound) as nf:
        client.add(model, "r2", 1, 5, [1])
    assert nf.value.message == "Worker WorkerWithDpRank { worker_id: 1, dp_rank: 5 } not found"
    with pytest.raises(
        NotFound, match=f"no slot tracker for model={model}-x routing_group=default"
    ):
        client.free(model + "-x", "r1")
    with pytest.raises(NotFound, match="Request nope not found"):
        client.prefill_complete(model, "nope")
    with pytest.raises(NotFound, match="no slot tracker"):
        client.potential_loads(model, [1], routing_group="none")

    with pytest.raises(BadRequest) as bad:  # a value the service rejects: 400
        client.register(2, model, 0)
    assert (bad.value.status, bad.value.message) == (400, "block_size must be greater than 0")
    with pytest.raises(BadRequest) as shape:  # wrong shape: 422
        client.add(model, "r3", 1, 0)
    assert shape.value.status == 422
    assert shape.value.message == JSON_SHAPE + "missing field `sequence_hashes`"
    with pytest.raises(BadRequest) as both:
        client.project_loads(model, [1], token_ids=[1, 2, 3, 4])
    assert both.value.status == 422
    with pytest.raises(BadRequest) as negative:  # the service validates, not the client
        client.register(-1, model, 4)
    assert negative.value.status == 422


def test_error_mapping_raw(client: SlotTrackerClient, model: str) -> None:
    with pytest.raises(BadRequest) as unsupported:
        client.request("POST", "/add", content=b"{}", headers={"content-type": "text/plain"})
    assert (unsupported.value.status, unsupported.value.message) == (
        415,
        "Expected request with `Content-Type: application/json`",
    )
    with pytest.raises(BadRequest) as malformed:
        client.request("POST", "/add", content=b"{", headers={"content-type": "application/json"})
    assert malformed.value.status == 400
    assert malformed.value.message.startswith("Failed to parse the request body as JSON: ")
    with pytest.raises(NotFound) as route:
        client.request("GET", "/nope")
    assert (route.value.status, route.value.message) == (404, "route not found")
    with pytest.raises(SlotTrackerError) as method:
        client.request("get", "/add")
    assert type(method.value) is SlotTrackerError  # no dedicated class for 405
    assert (method.value.status, method.value.message, method.value.method) == (
        405,
        "method not allowed",
        "GET",
    )
    ok = client.request("GET", "/workers", params={"model_name": model})
    assert (ok.status_code, ok.json()) == (200, [])


def test_body_too_large(client: SlotTrackerClient, model: str) -> None:
    client.register(1, model, 4)
    with pytest.raises(BadRequest) as err:
        client.potential_loads(model, [-(2**63)] * 110_000)  # > 2 MiB of JSON
    assert err.value.status == 413
    assert err.value.message == "Failed to buffer the request body: length limit exceeded"


def test_unauthorized(keyed_server: str) -> None:
    with SlotTrackerClient(keyed_server) as anonymous:
        assert anonymous.health() is True  # probes stay open
        assert anonymous.ready() is True
        assert anonymous.openapi()["info"]["title"] == "kv-slot-tracker"  # open too
        with pytest.raises(Unauthorized) as err:
            anonymous.loads()
        assert (err.value.status, err.value.message) == (401, "missing or invalid bearer key")
        with pytest.raises(Unauthorized):
            anonymous.replication_status()
    with SlotTrackerClient(keyed_server, api_key="wrong") as wrong, pytest.raises(Unauthorized):
        wrong.register(1, "m", 4)
    with SlotTrackerClient(keyed_server, api_key=API_KEY) as keyed:
        keyed.register(1, "m", 4)
        assert [w.worker_id for w in keyed.workers("m")] == [1]
        assert keyed.replication_status().mode == "embedded"


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_server_errors(status: int) -> None:
    with mock_client(Recorder(status, {"error": "boom"})) as c, pytest.raises(ServerError) as err:
        c.loads()
    assert (err.value.status, err.value.message, err.value.path) == (status, "boom", "/loads")
    assert isinstance(err.value, Unavailable) == (status == 503)


def test_error_message_fallbacks() -> None:
    def text(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, text="upstream died\n")

    with mock_client(text) as c, pytest.raises(ServerError, match="upstream died"):
        c.free("m", "r")

    def empty(request: httpx.Request) -> httpx.Response:
        return httpx.Response(418)

    with mock_client(empty) as c, pytest.raises(SlotTrackerError) as err:
        c.free("m", "r")
    assert (err.value.status, err.value.message) == (418, "I'm a teapot")


def test_unexpected_success_body() -> None:
    """A 2xx that does not match the schema (not a slot tracker behind base_url) is an error."""
    with (
        mock_client(Recorder(200, {"hello": "world"})) as c,
        pytest.raises(SlotTrackerError) as err,
    ):
        c.loads()
    assert type(err.value) is SlotTrackerError
    assert err.value.status == 200
    assert err.value.message.startswith("unexpected response body")


def test_every_error_is_a_slot_tracker_error() -> None:
    for cls in (BadRequest, Unauthorized, NotFound, Conflict, ServerError, TransportError):
        assert issubclass(cls, SlotTrackerError)
    assert issubclass(Unavailable, ServerError)


# -- transport errors and timeouts -------------------------------------------------------------


def test_closed_port_raises_transport_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there any more
    with SlotTrackerClient(url, timeout=2) as c:
        with pytest.raises(TransportError) as err:
            c.loads()
        assert err.value.status is None
        assert err.value.timed_out is False
        assert isinstance(err.value.__cause__, httpx.ConnectError)
        assert (err.value.method, err.value.path) == ("GET", "/loads")
        assert c.health() is False  # probes answer "no" instead of raising
        assert c.ready() is False


def test_timeout_raises_transport_error(silent_port: int) -> None:
    with SlotTrackerClient(f"http://127.0.0.1:{silent_port}", timeout=0.3) as c:
        with pytest.raises(TransportError) as err:
            c.add("m", "r", 1, 0, [1])  # the server never answers: only the timeout ends it
        assert err.value.timed_out is True
        assert isinstance(err.value.__cause__, httpx.ReadTimeout)
        assert str(err.value).startswith("POST /add: timed out")
        assert c.health() is False


async def test_async_timeout_raises_transport_error(silent_port: int) -> None:
    async with AsyncSlotTrackerClient(f"http://127.0.0.1:{silent_port}", timeout=0.3) as c:
        with pytest.raises(TransportError) as err:
            await c.loads()
        assert err.value.timed_out is True
        assert await c.ready() is False


# -- probes, replication, metrics --------------------------------------------------------------


def test_probes_and_status(client: SlotTrackerClient, model: str) -> None:
    assert client.health() is True
    assert client.ready() is True
    readiness = client.readiness()
    assert (readiness.status, readiness.reason) == ("ready", None)
    status = client.replication_status()
    assert status.mode == "embedded"
    assert status.ready is True and status.connected is None and status.model_extra == {}
    client.register(1, model, 4)
    assert f'model_name="{model}"' in client.metrics()
    doc = client.openapi()
    assert (doc["info"]["title"], doc["info"]["version"]) == ("kv-slot-tracker", app_version)
    assert "/potential_loads" in doc["paths"]


def test_probe_answers() -> None:
    not_ready = {"status": "not_ready", "reason": "catching up"}
    with mock_client(Recorder(503, not_ready)) as c:
        assert c.ready() is False
        assert c.health() is False
        readiness = c.readiness()
        assert (readiness.status, readiness.reason) == ("not_ready", "catching up")
    # a 4xx is a wrong base_url or route, not "not up yet": it raises
    with mock_client(Recorder(404, {"error": "route not found"})) as c, pytest.raises(NotFound):
        c.health()


# -- client plumbing ---------------------------------------------------------------------------


def test_connection_reuse_and_close(client: SlotTrackerClient) -> None:
    def local_port(response: httpx.Response) -> int:
        return response.extensions["network_stream"].get_extra_info("client_addr")[1]

    first = client.request("GET", "/health")
    second = client.request("GET", "/ready")
    assert local_port(first) == local_port(second)  # one keep-alive connection
    client.close()
    with pytest.raises(RuntimeError):
        client.health()


def test_headers_key_and_base_url_prefix() -> None:
    rec = Recorder(200, [])
    with mock_client(rec, api_key="k", headers={"x-caller": "router-1"}) as c:
        assert c.workers() == []
        assert c.loads(model_name="", routing_group="g") == []
    workers, loads = rec.requests
    assert workers.headers["authorization"] == "Bearer k"
    assert workers.headers["x-caller"] == "router-1"
    assert workers.headers["user-agent"] == f"kv-slot-tracker-client/{client_version}"
    assert str(workers.url) == "http://tracker/workers"
    assert str(loads.url) == "http://tracker/loads?model_name=&routing_group=g"

    prefixed = Recorder(200, [])
    transport = httpx.MockTransport(prefixed)
    with SlotTrackerClient("http://gw/tracker", transport=transport) as c:
        c.loads()
        assert c.base_url == "http://gw/tracker/"
        assert repr(c) == "SlotTrackerClient('http://gw/tracker/')"
    assert prefixed.requests[0].url.path == "/tracker/loads"


def test_sync_and_async_clients_have_the_same_methods() -> None:
    def public(cls: type) -> dict[str, inspect.Signature]:
        return {
            name: inspect.signature(fn)
            for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_") and name not in ("close", "aclose")
        }

    sync, async_ = public(SlotTrackerClient), public(AsyncSlotTrackerClient)
    assert sorted(sync) == sorted(async_)
    for name, signature in sync.items():
        assert str(async_[name]) == str(signature), name
        assert inspect.iscoroutinefunction(getattr(AsyncSlotTrackerClient, name)), name
    builder = {n for n in vars(BatchBuilder) if not n.startswith("_")}
    assert {"add", "prefill_complete", "free", "output_block"} <= builder
    for name in ("add", "prefill_complete", "free", "output_block"):
        params = list(inspect.signature(getattr(BatchBuilder, name)).parameters.values())
        client_params = list(
            inspect.signature(getattr(SlotTrackerClient, name)).parameters.values()
        )
        assert params == client_params, name


# -- async client, in-process with a fake clock ------------------------------------------------


async def test_async_lifecycle_with_modeled_prefill(
    aclient: AsyncSlotTrackerClient, clock: FakeClock
) -> None:
    assert await aclient.health() is True
    assert await aclient.ready() is True
    assert await aclient.upsert(1, "m", 4, 0, 2) is True
    await aclient.register(2, "m", 4)
    await aclient.add("m", "r1", 1, 0, [1, 2], new_isl_tokens=100, expected_prefill_ms=10_000)
    clock.advance(2.5)
    rows = await aclient.loads("m")
    assert [(r.worker_id, r.dp_rank) for r in rows] == [(1, 0), (1, 1), (2, 0)]
    assert (rows[0].active_prefill_tokens, rows[0].modeled_remaining_prefill_ms) == (75, 7500)
    clock.advance(10)
    assert (await aclient.loads("m"))[0].active_prefill_tokens == 0

    potential = {
        (r.worker_id, r.dp_rank): r
        for r in await aclient.potential_loads("m", [1, 9], new_isl_tokens=3)
    }
    assert potential[(1, 0)].potential_decode_blocks == 3
    assert potential[(2, 0)].potential_prefill_tokens == 3
    projected = await aclient.project_loads("m", [1, 9])
    assert [p.additional_active_blocks for p in projected] == [1, 2, 2]
    await aclient.output_block("m", "r1")
    await aclient.prefill_complete("m", "r1")
    assert (await aclient.loads("m", "default"))[0].active_decode_blocks == 3
    results = await aclient.batch(
        BatchBuilder().free("m", "r1").add("m", "r2", 2, 0, [U64_MAX], lora_name="x")
    )
    assert [r.status for r in results] == [200, 201]
    assert (await aclient.lora_counts("m")).lora_counts == {"x": 1}
    await aclient.free("m", "r2")
    assert [(r.active_requests, r.active_decode_blocks) for r in await aclient.loads("m")] == [
        (0, 0)
    ] * 3

    result = await aclient.reconcile("m", 4, [(2, 0, 1)])
    assert result.removed == [Rank(worker_id=1, dp_rank=0), Rank(worker_id=1, dp_rank=1)]
    assert [w.worker_id for w in await aclient.workers()] == [2]
    await aclient.unregister(2, "m")
    assert await aclient.workers() == []
    assert (await aclient.readiness()).status == "ready"
    assert (await aclient.replication_status()).mode == "embedded"
    assert "kv_slot_tracker" in await aclient.metrics()
    raw = await aclient.request("GET", "/loads")
    assert raw.json() == []


async def test_async_errors(aclient: AsyncSlotTrackerClient) -> None:
    with pytest.raises(NotFound, match="no slot tracker"):
        await aclient.add("m", "r", 1, 0, [1])
    await aclient.register(1, "m", 4)
    with pytest.raises(Conflict):
        await aclient.register(1, "m", 8)
    with pytest.raises(BadRequest) as err:
        await aclient.request(
            "POST", "/free", content=b"[]", headers={"content-type": "application/json"}
        )
    assert err.value.status == 422


async def test_async_unauthorized(clock: FakeClock) -> None:
    app = create_app(load_settings(api_key="k"), clock=clock.now)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with AsyncSlotTrackerClient("http://tracker", transport=transport) as anonymous:
            with pytest.raises(Unauthorized):
                await anonymous.workers()
        async with AsyncSlotTrackerClient(
            "http://tracker", api_key="k", transport=transport
        ) as keyed:
            assert await keyed.workers() == []


# -- the README example ------------------------------------------------------------------------


def test_example_runs(server: str, client: SlotTrackerClient) -> None:
    for _ in range(2):  # idempotent: it can run again against the same instance
        done = subprocess.run(
            [PYTHON, str(EXAMPLE)],
            env={**os.environ, "SLOT_TRACKER_URL": server},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == "1 0 32 2\n1 1 0 0\n"
    assert [(r.active_requests, r.active_decode_blocks) for r in client.loads("llama")] == [
        (0, 0)
    ] * 2


@pytest.mark.parametrize("url", ["127.0.0.1:8091", "localhost:8091", "ftp://h:1", "h"])
def test_a_base_url_without_http_is_refused_at_construction(url: str) -> None:
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        SlotTrackerClient(url)
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        AsyncSlotTrackerClient(url)


def test_http_and_https_base_urls_are_taken() -> None:
    for url in ["http://127.0.0.1:8091", "https://tracker.example:443/prefix/", "HTTP://h"]:
        with SlotTrackerClient(url) as c:
            assert c.base_url.lower().startswith(url.split("://")[0].lower())


async def test_listings_in_pages_are_fetched_whole(clock: FakeClock) -> None:
    """With ``list_max_items`` 2 the service answers listings in pages; the client follows the
    ``x-next-cursor`` header and returns every item, as one answer, in the service's order."""
    app = create_app(load_settings(list_max_items=2), clock=clock.now)
    sent: list[httpx.Request] = []
    transport = httpx.ASGITransport(app=app)
    handle = transport.handle_async_request

    async def recording(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return await handle(request)

    transport.handle_async_request = recording  # type: ignore[method-assign]
    client = AsyncSlotTrackerClient("http://tracker", transport=transport)
    async with app.router.lifespan_context(app), client as c:
        for wid in (5, 3, 1, 4, 2):
            await c.register(wid, "m", 4)
        for i, lora in enumerate("edcba"):
            await c.add("m", f"r{i}", 1, 0, [i], lora_name=lora)
        for wid in (7, 9, 8):
            await c.selection.upsert_worker(wid)
        sent.clear()
        workers = await c.workers("m")
        assert [w.worker_id for w in workers] == [1, 2, 3, 4, 5]
        assert [r.url.params.get("cursor") for r in sent] == [None, "2", "4"]
        counts = await c.lora_counts("m")
        assert counts.lora_counts == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1}
        assert list(counts.lora_counts) == ["a", "b", "c", "d", "e"]
        records = await c.selection.workers()
        assert [r.worker_id for r in records] == [7, 8, 9]
        assert len(sent) == 3 + 3 + 2


def test_a_listing_whose_cursor_does_not_move_ends() -> None:
    """A cursor equal to the one sent would loop for ever: the client takes the last page."""
    row = {"model_name": "m", "routing_group": "default", "worker_id": 1, "dp_start": 0,
           "dp_size": 1, "block_size": 4}  # fmt: skip
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, json=[row], headers={"x-next-cursor": "1"})

    with mock_client(handler) as c:
        assert [w.worker_id for w in c.workers()] == [1, 1]
    assert [r.url.params.get("cursor") for r in calls] == [None, "1"]
