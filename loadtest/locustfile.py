"""Locust load test of kv-slot-tracker: the control-plane traffic of a KV-aware LLM router.

Run it with ``make loadtest`` (starts a local instance), or against any deployment::

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 50 -r 10 -t 2m \\
        -H https://tracker.example --csv loadtest/out/run

At test start one runner (the local or master one) registers ``--lt-workers`` workers of
``--lt-dp-size`` data-parallel ranks each for ``--lt-model`` (a re-run finds them registered and
upserts them instead). Every simulated LLM request then does what a router does:

1. ``/potential_loads`` for its prompt: a popular shared system prompt of ``--lt-prefix-blocks``
   blocks plus a random suffix, sent as signed 64-bit sequence hashes computed here or as
   ``token_ids`` that the service hashes (both give the same hashes, so they share prefixes);
2. picks the rank with the lowest potential load and ``/add``s itself there;
3. ``/prefill_complete`` after a prefill delay, a few ``/output_block``s, then ``/free``.

A share of the traffic goes through ``/batch``, one user polls ``/loads`` like a dashboard, a
router that lets the service choose (``SelectionRouterUser``, weight ``--lt-selection-weight``)
registers ``--lt-selection-workers`` workers with the selection API and runs
``/selection/select_and_reserve`` → ``prefill_complete`` → ``output_block`` → ``DELETE``, and
a share of requests injects errors a router can cause: a second ``/add`` of an id that is still
active (409) and an ``/add`` to a rank that does not exist (404). Those count as successes when
exactly that status comes back and as failures otherwise; every other call must answer 200/201.

The run fails (exit code 1, reasons printed) on any failure, any exception in this file, a
failed setup, no request at all, or, with ``--lt-check-drained``, load left on the ranks after
every request was freed. Options (``--lt-*``, listed by ``locust --help``) also read
``LOADTEST_*`` environment variables; ``SLOT_TRACKER_API_KEY`` is sent as a bearer key.

Several instances sharing one state: ``--lt-hosts URL,URL,...`` sends every call to one of them
at random (setup and the final checks go to ``-H``), so one request's ``/add``, ``/prefill_complete``
and ``/free`` usually reach different instances, as behind a load balancer without affinity.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import gevent
from locust import FastHttpUser, between, constant, events, task
from locust import stats as locust_stats
from locust.env import Environment
from locust.runners import LocalRunner, MasterRunner

from kv_slot_tracker.core.hashing import sequence_hashes_for_tokens

log = logging.getLogger("loadtest")

I64_SIGN = 1 << 63
U64 = 1 << 64
VOCAB = 128_000
LORAS = ("adapter-sql", "adapter-chat")

# Names of the expected-failure classes in the stats (the tests look for them in the CSV).
DUPLICATE_ADD = "/add [expect 409 duplicate id]"
UNKNOWN_RANK_ADD = "/add [expect 404 unknown rank]"
UNKNOWN_RANK_BATCH = "/batch [add, one expect 404 unknown rank]"

# The selection API's workers get ids of their own, apart from the slot API's.
SELECTION_WORKER_ID_BASE = 1_000_000

# Problems outside the HTTP stats (setup, drain check), reported by the quitting listener.
PROBLEMS: list[str] = []


# -- options -----------------------------------------------------------------------------------


@events.init_command_line_parser.add_listener
def add_arguments(parser: Any) -> None:
    def opt(name: str, env: str, default: Any, help: str, **kw: Any) -> None:
        parser.add_argument(name, env_var=env, default=default, help=help, **kw)

    opt("--lt-model", "LOADTEST_MODEL", "loadtest-model", "model name of the tracker", type=str)
    opt("--lt-routing-group", "LOADTEST_ROUTING_GROUP", "default", "routing group", type=str)
    opt("--lt-workers", "LOADTEST_WORKERS", 16, "workers to register", type=int)
    opt("--lt-dp-size", "LOADTEST_DP_SIZE", 4, "data-parallel ranks per worker", type=int)
    opt("--lt-worker-id-base", "LOADTEST_WORKER_ID_BASE", 1, "first worker id", type=int)
    opt("--lt-block-size", "LOADTEST_BLOCK_SIZE", 16, "tokens per KV block", type=int)
    opt("--lt-prefixes", "LOADTEST_PREFIXES", 8, "shared system prompts", type=int)
    opt("--lt-prefix-blocks", "LOADTEST_PREFIX_BLOCKS", 64, "blocks per system prompt", type=int)
    opt("--lt-suffix-blocks", "LOADTEST_SUFFIX_BLOCKS", 32, "most random blocks after it", type=int)
    opt(
        "--lt-unique-ratio",
        "LOADTEST_UNIQUE_RATIO",
        0.1,
        "share of prompts without a shared system prompt",
        type=float,
    )
    opt(
        "--lt-token-ids-ratio",
        "LOADTEST_TOKEN_IDS_RATIO",
        0.25,
        "share of requests sending token_ids instead of sequence hashes",
        type=float,
    )
    opt("--lt-lora-ratio", "LOADTEST_LORA_RATIO", 0.1, "share of LoRA requests", type=float)
    opt("--lt-prefill-ms", "LOADTEST_PREFILL_MS", 40.0, "mean prefill time", type=float)
    opt(
        "--lt-decode-block-ms",
        "LOADTEST_DECODE_BLOCK_MS",
        40.0,
        "mean time per output block",
        type=float,
    )
    opt("--lt-output-blocks", "LOADTEST_OUTPUT_BLOCKS", 4, "most output blocks", type=int)
    opt("--lt-batch-size", "LOADTEST_BATCH_SIZE", 8, "requests per /batch lifecycle", type=int)
    opt(
        "--lt-inject-ratio",
        "LOADTEST_INJECT_RATIO",
        0.05,
        "share of requests injecting an expected error (409 or 404)",
        type=float,
    )
    opt(
        "--lt-check-drained",
        "LOADTEST_CHECK_DRAINED",
        False,
        "at the end, fail unless the model's ranks hold no load (needs a tracker of its own)",
        action="store_true",
    )
    opt(
        "--lt-keep-workers",
        "LOADTEST_KEEP_WORKERS",
        False,
        "leave the workers registered at the end (default: unregister them)",
        action="store_true",
    )
    opt(
        "--lt-hosts",
        "LOADTEST_HOSTS",
        "",
        "comma-separated base URLs of instances sharing one state; each call picks one",
        type=str,
    )
    opt(
        "--lt-selection-weight",
        "LOADTEST_SELECTION_WEIGHT",
        1,
        "weight of the selection-API router user (0: none)",
        type=int,
    )
    opt(
        "--lt-selection-workers",
        "LOADTEST_SELECTION_WORKERS",
        8,
        "workers registered with the selection API",
        type=int,
    )
    parser.add_argument(
        "--lt-api-key",
        env_var="SLOT_TRACKER_API_KEY",
        default="",
        help="bearer key, when the service requires one",
        is_secret=True,
    )


@dataclass(frozen=True)
class Workload:
    model: str
    group: str
    worker_ids: tuple[int, ...]
    dp_size: int
    block_size: int
    prefixes: tuple[tuple[int, ...], ...]  # token ids of each shared system prompt
    suffix_blocks: int
    unique_ratio: float
    token_ids_ratio: float
    lora_ratio: float
    prefill_s: float
    decode_block_s: float
    output_blocks: int
    batch_size: int
    inject_ratio: float
    check_drained: bool
    keep_workers: bool
    hosts: tuple[str, ...] = ()
    selection_worker_ids: tuple[int, ...] = ()
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> dict[str, str]:
        return {"model_name": self.model, "routing_group": self.group}

    @property
    def ranks(self) -> list[tuple[int, int]]:
        return [(w, r) for w in self.worker_ids for r in range(self.dp_size)]

    def url(self, path: str, rng: random.Random) -> str:
        """``path`` on one of ``hosts`` at random; the user's own host when none are given."""
        return rng.choice(self.hosts) + path if self.hosts else path


def workload_from(environment: Environment) -> Workload:
    """The workload the options describe; the same on every runner, so nothing is shared."""
    cached = getattr(environment, "_kv_workload", None)
    if cached is not None:
        return cached
    o = environment.parsed_options
    if min(o.lt_workers, o.lt_dp_size, o.lt_block_size, o.lt_batch_size) < 1:
        raise ValueError(
            "--lt-workers, --lt-dp-size, --lt-block-size, --lt-batch-size must be >= 1"
        )
    rng = random.Random(1234)  # the same system prompts on every runner and in every run
    prefixes = tuple(
        tuple(rng.randrange(VOCAB) for _ in range(o.lt_prefix_blocks * o.lt_block_size))
        for _ in range(max(o.lt_prefixes, 0))
    )
    wl = Workload(
        model=o.lt_model,
        group=o.lt_routing_group,
        worker_ids=tuple(range(o.lt_worker_id_base, o.lt_worker_id_base + o.lt_workers)),
        dp_size=o.lt_dp_size,
        block_size=o.lt_block_size,
        prefixes=prefixes,
        suffix_blocks=max(o.lt_suffix_blocks, 1),
        unique_ratio=o.lt_unique_ratio,
        token_ids_ratio=o.lt_token_ids_ratio,
        lora_ratio=o.lt_lora_ratio,
        prefill_s=max(o.lt_prefill_ms, 0) / 1000,
        decode_block_s=max(o.lt_decode_block_ms, 0) / 1000,
        output_blocks=max(o.lt_output_blocks, 1),
        batch_size=o.lt_batch_size,
        inject_ratio=o.lt_inject_ratio,
        check_drained=o.lt_check_drained,
        keep_workers=o.lt_keep_workers,
        hosts=tuple(h.strip().rstrip("/") for h in o.lt_hosts.split(",") if h.strip()),
        selection_worker_ids=tuple(
            range(SELECTION_WORKER_ID_BASE, SELECTION_WORKER_ID_BASE + o.lt_selection_workers)
        )
        if o.lt_selection_weight > 0
        else (),
        headers={"Authorization": f"Bearer {o.lt_api_key}"} if o.lt_api_key else {},
    )
    environment._kv_workload = wl  # type: ignore[attr-defined]
    return wl


# -- prompts -----------------------------------------------------------------------------------


def signed_i64(h: int) -> int:
    """A u64 hash as the signed 64-bit integer the API takes."""
    return h - U64 if h >= I64_SIGN else h


@dataclass
class Prompt:
    tokens: list[int]
    lora_name: str | None
    use_token_ids: bool

    def fields(self, block_size: int) -> dict[str, Any]:
        """The prompt part of a /potential_loads or /add body."""
        body: dict[str, Any] = {}
        if self.use_token_ids:
            body["token_ids"] = self.tokens
        else:
            hashes = sequence_hashes_for_tokens(self.tokens, block_size, self.lora_name)
            body["sequence_hashes"] = [signed_i64(h) for h in hashes]
        if self.lora_name is not None:
            body["lora_name"] = self.lora_name
        return body


def make_prompt(wl: Workload, rng: random.Random) -> Prompt:
    """A shared system prompt (popular ones more often) and a random user part."""
    tokens: list[int] = []
    if wl.prefixes and rng.random() >= wl.unique_ratio:
        weights = [1 / (i + 1) for i in range(len(wl.prefixes))]
        tokens.extend(rng.choices(wl.prefixes, weights)[0])
    suffix = rng.randint(1, wl.suffix_blocks) * wl.block_size + rng.randrange(wl.block_size)
    tokens.extend(rng.randrange(VOCAB) for _ in range(suffix))
    lora = rng.choice(LORAS) if rng.random() < wl.lora_ratio else None
    return Prompt(tokens, lora, rng.random() < wl.token_ids_ratio)


def pick_rank(rows: list[dict[str, Any]], block_size: int, rng: random.Random) -> tuple[int, int]:
    """The lowest potential load: prefill blocks plus decode blocks (Dynamo's cost, weight 1)."""

    def cost(row: dict[str, Any]) -> float:
        return row["potential_prefill_tokens"] / block_size + row["potential_decode_blocks"]

    best = min(cost(r) for r in rows)
    row = rng.choice([r for r in rows if cost(r) == best])
    return row["worker_id"], row["dp_rank"]


# -- classification ----------------------------------------------------------------------------


def check(resp: Any, expected: int) -> bool:
    """Inside ``catch_response``: a success iff the status is ``expected``."""
    if resp.status_code == expected:
        resp.success()
        return True
    detail = (resp.text or "")[:200] if resp.status_code else repr(resp.error)
    resp.failure(f"expected {expected}, got {resp.status_code}: {detail}")
    return False


def json_of(resp: Any) -> Any:
    """The parsed body, or None after marking the response failed."""
    try:
        return resp.json()
    except (ValueError, TypeError) as exc:
        resp.failure(f"invalid JSON answer: {exc}")
        return None


# -- users -------------------------------------------------------------------------------------

_request_seq = itertools.count()


class _RouterBase(FastHttpUser):
    """What both kinds of router share: the workload, the key, ids of their own, and the
    requests (or reservations) started and not yet freed, which a stop frees."""

    abstract = True
    wait_time = between(0.0, 0.05)
    ID_PREFIX = "lt"

    def __init__(self, environment: Environment) -> None:
        self.wl = workload_from(environment)
        self.default_headers = self.wl.headers
        super().__init__(environment)
        self.rng = random.Random()
        self.id_prefix = f"{self.ID_PREFIX}-{uuid.uuid4().hex[:10]}"
        self.outstanding: set[str] = set()  # started (or maybe started) and not yet freed


class RouterUser(_RouterBase):
    """One stream of LLM requests through a router that consults the tracker."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        self.last_url = ""  # where the last post went

    def new_id(self) -> str:
        return f"{self.id_prefix}-{next(_request_seq)}"

    def post(
        self,
        path: str,
        body: dict[str, Any],
        expected: int,
        name: str | None = None,
        url: str | None = None,
    ) -> bool:
        url = url or self.wl.url(path, self.rng)
        self.last_url = url
        with self.client.post(url, json=body, name=name or path, catch_response=True) as resp:
            return check(resp, expected)

    @task(10)
    def llm_request(self) -> None:
        wl, rng = self.wl, self.rng
        prompt = make_prompt(wl, rng)
        fields = prompt.fields(wl.block_size)
        isl = len(prompt.tokens)

        with self.client.post(
            wl.url("/potential_loads", rng),
            json={**wl.key, **fields, "new_isl_tokens": isl},
            name="/potential_loads",
            catch_response=True,
        ) as resp:
            if not check(resp, 200):
                return
            rows = json_of(resp)
            if not isinstance(rows, list) or not rows:
                resp.failure(f"no ranks in the answer: {str(rows)[:200]}")
                return
        worker_id, dp_rank = pick_rank(rows, wl.block_size, rng)

        inject = rng.random() < wl.inject_ratio
        if inject and rng.random() < 0.5:
            self.add_to_unknown_rank(fields, isl)
            inject = False

        request_id = self.new_id()
        add = {
            **wl.key,
            **fields,
            "request_id": request_id,
            "worker_id": worker_id,
            "dp_rank": dp_rank,
            "new_isl_tokens": isl,
            "expected_output_tokens": wl.output_blocks * wl.block_size,
        }
        prefill_s = wl.prefill_s * rng.uniform(0.5, 1.5)
        if rng.random() < 0.5:
            add["expected_prefill_ms"] = round(prefill_s * 1000, 3)
        self.outstanding.add(request_id)  # before sending: a stop during the call still frees it
        if not self.post("/add", add, 201):
            return
        if inject:
            self.add_duplicate(add)

        gevent.sleep(prefill_s)
        ref = {**wl.key, "request_id": request_id}
        self.post("/prefill_complete", ref, 200)
        for _ in range(rng.randint(1, wl.output_blocks)):
            gevent.sleep(wl.decode_block_s * rng.uniform(0.5, 1.5))
            block = dict(ref)
            if rng.random() < 0.3:
                block["decay_fraction"] = round(rng.random(), 3)
            self.post("/output_block", block, 200)
        if self.post("/free", ref, 200):
            self.outstanding.discard(request_id)

    def add_duplicate(self, add: dict[str, Any]) -> None:
        """A retried /add of an id that is still active, routed elsewhere: 409.

        Sent to the instance that took the add: two instances taking one id at the same moment
        both accept it, and the first in stream order wins everywhere (see the README).
        """
        worker_id, dp_rank = self.rng.choice(self.wl.ranks)
        body = {**add, "worker_id": worker_id, "dp_rank": dp_rank}
        self.post("/add", body, 409, DUPLICATE_ADD, url=self.last_url)

    def add_to_unknown_rank(self, fields: dict[str, Any], isl: int) -> None:
        """An /add to a rank the tracker does not know: 404, and nothing is added."""
        wl, rng = self.wl, self.rng
        if rng.random() < 0.5:  # an unregistered worker
            worker_id, dp_rank = max(wl.worker_ids) + rng.randint(1, 1000), 0
        else:  # a registered worker, past its last rank
            worker_id, dp_rank = rng.choice(wl.worker_ids), wl.dp_size + rng.randint(0, 7)
        body = {
            **wl.key,
            **fields,
            "request_id": self.new_id(),
            "worker_id": worker_id,
            "dp_rank": dp_rank,
            "new_isl_tokens": isl,
        }
        self.post("/add", body, 404, UNKNOWN_RANK_ADD)

    @task(1)
    def batched_requests(self) -> None:
        """A router that batches lifecycle calls: adds, then prefill + output blocks, then frees."""
        wl, rng = self.wl, self.rng
        ids = [self.new_id() for _ in range(wl.batch_size)]
        ops: list[dict[str, Any]] = []
        for request_id in ids:
            prompt = make_prompt(wl, rng)
            worker_id, dp_rank = rng.choice(wl.ranks)
            ops.append(
                {
                    "op": "add",
                    **wl.key,
                    **prompt.fields(wl.block_size),
                    "request_id": request_id,
                    "worker_id": worker_id,
                    "dp_rank": dp_rank,
                    "new_isl_tokens": len(prompt.tokens),
                }
            )
        expected = [201] * len(ops)
        name = "/batch [add]"
        if rng.random() < wl.inject_ratio:  # one add to an unknown rank; the others still apply
            ops.append({**ops[0], "request_id": self.new_id(), "worker_id": max(wl.worker_ids) + 1})
            expected.append(404)
            name = UNKNOWN_RANK_BATCH
        self.outstanding.update(ids)
        self.batch(name, ops, expected)

        gevent.sleep(wl.prefill_s)
        ops = [{"op": "prefill_complete", **wl.key, "request_id": i} for i in ids]
        ops += [{"op": "output_block", **wl.key, "request_id": i} for i in ids]
        self.batch("/batch [prefill_complete, output_block]", ops, [200] * len(ops))

        gevent.sleep(wl.decode_block_s)
        ops = [{"op": "free", **wl.key, "request_id": i} for i in ids]
        if self.batch("/batch [free]", ops, [200] * len(ops)):
            self.outstanding.difference_update(ids)

    def batch(self, name: str, ops: list[dict[str, Any]], expected: list[int]) -> bool:
        with self.client.post(
            self.wl.url("/batch", self.rng),
            json={"operations": ops},
            name=name,
            catch_response=True,
        ) as resp:
            if not check(resp, 200):
                return False
            answer = json_of(resp)
            if answer is None:
                return False
            got = [r.get("status") for r in answer.get("results", [])]
            if got != expected:
                resp.failure(f"operation statuses {got}, expected {expected}")
                return False
            return True

    def on_stop(self) -> None:
        """Free what a stop interrupted, so the tracker ends empty (freeing unknown ids is fine)."""
        if self.outstanding:
            ops = [{"op": "free", **self.wl.key, "request_id": i} for i in sorted(self.outstanding)]
            if self.batch("/batch [free on stop]", ops, [200] * len(ops)):
                self.outstanding.clear()


class SelectionRouterUser(_RouterBase):
    """A router that lets the service choose the rank: the selection API's reservations."""

    ID_PREFIX = "lt-sel"

    def call(self, method: str, path: str, name: str, expected: int, body: Any = None) -> Any:
        """One call to a random instance; the parsed answer, or None when it failed."""
        url = self.wl.url(path, self.rng)
        with self.client.request(method, url, json=body, name=name, catch_response=True) as resp:
            if not check(resp, expected):
                return None
            return json_of(resp)

    @task
    def reserved_request(self) -> None:
        wl, rng = self.wl, self.rng
        if not wl.selection_worker_ids:
            return
        prompt = make_prompt(wl, rng)
        selection_id = f"{self.id_prefix}-{next(_request_seq)}"
        body: dict[str, Any] = {
            **wl.key,
            "selection_id": selection_id,
            "token_ids": prompt.tokens,
            "expected_output_tokens": wl.output_blocks * wl.block_size,
        }
        if prompt.lora_name is not None:
            body["lora_name"] = prompt.lora_name
        self.outstanding.add(selection_id)
        picked = self.call(
            "POST", "/selection/select_and_reserve", "/selection/select_and_reserve", 200, body
        )
        if picked is None:
            return
        if picked.get("worker_id") not in wl.selection_worker_ids:
            PROBLEMS.append(f"select_and_reserve picked an unregistered worker: {picked}")
            return
        base = f"/selection/reservations/{selection_id}"
        gevent.sleep(wl.prefill_s * rng.uniform(0.5, 1.5))
        self.call(
            "POST",
            base + "/prefill_complete",
            "/selection/reservations/{id}/prefill_complete",
            200,
            {},
        )
        for _ in range(rng.randint(1, wl.output_blocks)):
            gevent.sleep(wl.decode_block_s * rng.uniform(0.5, 1.5))
            self.call(
                "POST", base + "/output_block", "/selection/reservations/{id}/output_block", 200, {}
            )
        if self.call("DELETE", base, "/selection/reservations/{id} [free]", 200) is not None:
            self.outstanding.discard(selection_id)

    def on_stop(self) -> None:
        """Free what a stop interrupted (an id never reserved answers 404, which is fine)."""
        for selection_id in sorted(self.outstanding):
            path = f"/selection/reservations/{selection_id}"
            with self.client.request(
                "DELETE",
                path,
                name="/selection/reservations/{id} [free on stop]",
                catch_response=True,
            ) as resp:
                if resp.status_code in (200, 404):
                    resp.success()
                else:
                    check(resp, 200)
        self.outstanding.clear()


class LoadsPoller(FastHttpUser):
    """A dashboard or scorer reading every rank's current load once a second."""

    fixed_count = 1
    wait_time = constant(1.0)

    def __init__(self, environment: Environment) -> None:
        self.wl = workload_from(environment)
        self.default_headers = self.wl.headers
        super().__init__(environment)

    @task
    def loads(self) -> None:
        wl = self.wl
        with self.client.get(
            f"/loads?model_name={wl.model}&routing_group={wl.group}",
            name="/loads",
            catch_response=True,
        ) as resp:
            if check(resp, 200):
                rows = json_of(resp)
                if isinstance(rows, list) and len(rows) < len(wl.ranks):
                    resp.failure(f"{len(rows)} ranks listed, {len(wl.ranks)} registered")


# -- setup, teardown and verdict ---------------------------------------------------------------


def controls_topology(environment: Environment) -> bool:
    """Registration and the final checks run once: on the local or the master runner."""
    return isinstance(environment.runner, (LocalRunner, MasterRunner))


class _SetupClient(FastHttpUser):
    """Not a simulated user: its client makes the setup and teardown calls, recorded in the stats
    like any other (built through a user so the client's signature, which varies between Locust
    versions, is Locust's business)."""

    abstract = True


def setup_client(environment: Environment, wl: Workload) -> Any:
    _SetupClient.host = environment.host
    _SetupClient.default_headers = wl.headers
    return _SetupClient(environment).client


def setup_failed(environment: Environment, why: str) -> None:
    PROBLEMS.append(why)
    log.error("setup failed: %s; stopping", why)
    gevent.spawn_later(0, environment.runner.quit)


@events.test_start.add_listener
def register_workers(environment: Environment, **_: Any) -> None:
    if not controls_topology(environment):
        return
    if not environment.host:
        setup_failed(environment, "no host: pass -H URL")
        return
    try:
        wl = workload_from(environment)
    except ValueError as exc:
        setup_failed(environment, str(exc))
        return
    client = setup_client(environment, wl)
    for worker_id in wl.worker_ids:
        body = {**wl.key, "worker_id": worker_id, "block_size": wl.block_size}
        body.update(dp_start=0, dp_size=wl.dp_size)
        with client.post("/register", json=body, catch_response=True) as resp:
            if resp.status_code == 201:
                resp.success()
                continue
            if resp.status_code != 409 or "already registered" not in (resp.text or ""):
                check(resp, 201)
                setup_failed(environment, f"/register of worker {worker_id}: {resp.status_code}")
                return
            resp.success()  # left by an earlier run: make its ranks ours with /upsert
        with client.post("/upsert", json=body, catch_response=True) as resp:
            if not check(resp, 200):
                setup_failed(environment, f"/upsert of worker {worker_id}: {resp.status_code}")
                return
    for worker_id in wl.selection_worker_ids:
        body = {
            **wl.key,
            "worker_id": worker_id,
            "block_size": wl.block_size,
            "endpoint": f"http://127.0.0.1:9/worker-{worker_id}",
            # nothing publishes there: a service routing on KV events keeps the worker
            # schedulable and its cache empty; one without them ignores the field
            "kv_events_endpoint": "tcp://127.0.0.1:9",
        }
        with client.post("/selection/workers", json=body, catch_response=True) as resp:
            if not check(resp, 201):
                setup_failed(environment, f"/selection/workers {worker_id}: {resp.status_code}")
                return
            if (json_of(resp) or {}).get("lifecycle") != "schedulable":
                resp.failure(f"selection worker {worker_id} not schedulable: {resp.text[:300]}")
                setup_failed(environment, f"selection worker {worker_id} is not schedulable")
                return
    log.info(
        "registered %d workers x %d ranks for model=%s routing_group=%s",
        len(wl.worker_ids),
        wl.dp_size,
        wl.model,
        wl.group,
    )


DRAIN_WAIT_S = 10.0


def drain_problem(client: Any, wl: Workload) -> str | None:
    """Why the model's ranks are not all empty (slot and selection APIs), or None."""
    resp = client.get(
        f"/loads?model_name={wl.model}&routing_group={wl.group}", name="/loads [drain check]"
    )
    try:
        rows = json.loads(resp.text or "")
    except ValueError:
        rows = None
    if not isinstance(rows, list):
        return f"drain check: /loads answered {resp.status_code}"
    busy = [
        r
        for r in rows
        if r["active_requests"] or r["active_decode_blocks"] or r["active_prefill_tokens"]
    ]
    if busy:
        return f"drain check: {len(busy)} ranks still hold load, e.g. {busy[0]}"
    if not wl.selection_worker_ids:
        return None
    resp = client.get(
        f"/selection/loads?model_name={wl.model}&routing_group={wl.group}",
        name="/selection/loads [drain check]",
    )
    try:
        parts = json.loads(resp.text or "")
    except ValueError:
        parts = None
    if not isinstance(parts, list):
        return f"drain check: /selection/loads answered {resp.status_code}"
    busy = [r for part in parts for r in part["loads"] if r["active_requests"]]
    if busy:
        return f"drain check: {len(busy)} selection ranks still busy, e.g. {busy[0]}"
    return None


@events.test_stop.add_listener
def drain_check_and_unregister(environment: Environment, **_: Any) -> None:
    if not controls_topology(environment) or not environment.host or PROBLEMS:
        return
    wl = workload_from(environment)
    client = setup_client(environment, wl)
    if wl.check_drained:
        # several instances apply each other's last frees a little later: give them a moment
        deadline = time.monotonic() + (DRAIN_WAIT_S if wl.hosts else 0)
        while True:
            problem = drain_problem(client, wl)
            if problem is None or time.monotonic() >= deadline:
                break
            gevent.sleep(0.2)
        if problem is not None:
            PROBLEMS.append(problem)
        else:
            log.info("drain check: every rank is empty")
    if not wl.keep_workers:
        for worker_id in wl.worker_ids:
            client.post("/unregister", json={**wl.key, "worker_id": worker_id})
        for worker_id in wl.selection_worker_ids:
            client.delete(f"/selection/workers/{worker_id}", name="/selection/workers/{id}")


@events.quitting.add_listener
def verdict(environment: Environment, **_: Any) -> None:
    """Exit code 1, with the reasons printed, unless the run was clean."""
    if environment.runner is not None and not controls_topology(environment):
        return  # a worker runner: the master judges the whole run
    if getattr(environment.parsed_options, "csv_prefix", None):
        # The CSV writer rewrites the files every CSV_STATS_INTERVAL_SEC; let it catch up with
        # the requests made while stopping (frees, drain check, unregister) before files close.
        gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.2)
    reasons = list(PROBLEMS)
    stats = environment.stats
    for err in stats.errors.values():
        reasons.append(f"{err.occurrences} x {err.method} {err.name}: {err.error}")
    runner = environment.runner
    for exc in (runner.exceptions if runner else {}).values():
        reasons.append(f"{exc['count']} x exception in the locustfile: {exc['msg']}")
    if stats.total.num_requests == 0:
        reasons.append("no request was made")
    total = stats.total
    if reasons:
        print("\nLOAD TEST FAILED:", flush=True)
        for reason in reasons:
            print(f"  - {reason}", flush=True)
        environment.process_exit_code = 1
    else:
        print(
            f"\nLOAD TEST PASSED: {total.num_requests} requests, {total.total_rps:.1f} req/s, "
            "no unexpected failures",
            flush=True,
        )
