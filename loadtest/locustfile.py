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

A share of the routers asks ``/project_loads`` instead, a share of the traffic goes through
``/batch``, and one user polls ``/loads`` and ``/lora_counts`` like a dashboard. A share of
requests injects errors a router can cause: a second ``/add`` of an id that is still active
(409) and an ``/add`` to a rank that does not exist (404). Those count as successes when exactly
that status comes back and as failures otherwise; every other call must answer 200/201.
Before its random mix, each router runs a fixed warm-up calling each of its routes once (both
load queries, both injected errors, a ``/batch`` lifecycle; each way of booking a selection), so
a short run covers every route whatever the draw; with ``--stop-timeout`` a warm-up under way
when the time is up finishes first.

Routers that let the service choose (``SelectionRouterUser``, weight ``--lt-selection-weight``)
use the selection API on ``--lt-selection-workers`` workers of ``--lt-selection-dp-size`` ranks:
``select_and_reserve``; ``select`` with a ``selection_id`` then the booking of that pending
selection (``POST /selection/reservations``); their own pick from ``overlap_scores`` and
``potential_loads`` booked on a given rank; each booking then ``prefill_complete``,
``output_block``s and ``DELETE``. One ``SelectionPoller`` reads ``/selection/loads``,
``/selection/workers``, ``/selection/ready``, ``/selection/health``, ``/selection/dump`` and
``/selection/kv_index`` and patches a worker now and then, as an operator's tools do.

The selection workers' engines are simulated by ``loadtest/kv_engines.py``, a process started
for the run (``--lt-kv-rate`` batches a second per rank; 0: no engines) that publishes KV events
on one ZMQ socket per rank in the engines' own framing, storing and evicting the load test's
prompts: with KV events on (the service's default) overlap scores are real and the ingest is
loaded all along. The run fails unless the service indexed what they published and some
selection found a prompt's blocks cached (``--lt-kv-host``: the address the service reaches
them at, 127.0.0.1 by default).

At the end a table gives each route's calls, failures and 50/95/99th percentile latency (also
written next to the CSV files as ``<prefix>_routes.json``).

The run fails (exit code 1, reasons printed) on any failure, any exception in this file, a
failed setup, no request at all, or, with ``--lt-check-drained``, load left on the ranks after
every request was freed. Options (``--lt-*``, listed by ``locust --help``) also read
``LOADTEST_*`` environment variables; ``SLOT_TRACKER_API_KEY`` is sent as a bearer key.

Several instances sharing one state: ``--lt-hosts URL,URL,...`` sends every call to one of them
at random (setup and the final checks go to ``-H``), so one request's ``/add``, ``/prefill_complete``
and ``/free`` usually reach different instances, as behind a load balancer without affinity. The
run starts once every instance lists the workers; every instance subscribes to the engines.

Needs the service's runtime install plus Locust (``pip install '.[loadtest]'``).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
from locust import FastHttpUser, between, constant, events, task
from locust import stats as locust_stats
from locust.env import Environment
from locust.runners import LocalRunner, MasterRunner

from kv_slot_tracker.core.hashing import sequence_hashes_for_tokens

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kv_engines import VOCAB, system_prompts  # noqa: E402

log = logging.getLogger("loadtest")

I64_SIGN = 1 << 63
U64 = 1 << 64
LORAS = ("adapter-sql", "adapter-chat")

# Names of the expected-failure classes in the stats (the tests look for them in the CSV).
DUPLICATE_ADD = "/add [expect 409 duplicate id]"
UNKNOWN_RANK_ADD = "/add [expect 404 unknown rank]"
UNKNOWN_RANK_BATCH = "/batch [add, one expect 404 unknown rank]"

# The selection API's workers get ids of their own, apart from the slot API's.
SELECTION_WORKER_ID_BASE = 1_000_000

# Problems outside the HTTP stats (setup, drain check), reported by the quitting listener.
PROBLEMS: list[str] = []

# What the selection calls saw of the engines' caches: answers read, and those in which a rank
# held some of the prompt's blocks (overlap scores, a selection's overlap).
OVERLAP = {"answers": 0, "hits": 0}


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
    opt("--lt-selection-dp-size", "LOADTEST_SELECTION_DP_SIZE", 2, "ranks per selection worker",
        type=int)  # fmt: skip
    opt(
        "--lt-kv-rate",
        "LOADTEST_KV_RATE",
        10.0,
        "KV-event batches a second each simulated engine rank publishes (0: no engines)",
        type=float,
    )
    opt("--lt-kv-capacity", "LOADTEST_KV_CAPACITY", 4096, "blocks each engine rank caches",
        type=int)  # fmt: skip
    opt(
        "--lt-kv-host",
        "LOADTEST_KV_HOST",
        "127.0.0.1",
        "address the engines' publishers bind, which the service must reach",
        type=str,
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
    selection_dp_size: int = 1
    kv_rate: float = 0.0
    kv_capacity: int = 4096
    kv_host: str = "127.0.0.1"
    prefix_blocks: int = 0
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> dict[str, str]:
        return {"model_name": self.model, "routing_group": self.group}

    @property
    def ranks(self) -> list[tuple[int, int]]:
        return [(w, r) for w in self.worker_ids for r in range(self.dp_size)]

    @property
    def selection_ranks(self) -> list[tuple[int, int]]:
        return [(w, r) for w in self.selection_worker_ids for r in range(self.selection_dp_size)]

    def url(self, path: str, rng: random.Random) -> str:
        """``path`` on one of ``hosts`` at random; the user's own host when none are given."""
        return rng.choice(self.hosts) + path if self.hosts else path


def workload_from(environment: Environment) -> Workload:
    """The workload the options describe; the same on every runner, so nothing is shared."""
    cached = getattr(environment, "_kv_workload", None)
    if cached is not None:
        return cached
    o = environment.parsed_options
    if min(o.lt_workers, o.lt_dp_size, o.lt_block_size, o.lt_batch_size,
           o.lt_selection_dp_size) < 1:  # fmt: skip
        raise ValueError(
            "--lt-workers, --lt-dp-size, --lt-block-size, --lt-batch-size, "
            "--lt-selection-dp-size must be >= 1"
        )
    # the same system prompts on every runner, in every run and in the simulated engines
    prefixes = system_prompts(max(o.lt_prefixes, 0), o.lt_prefix_blocks, o.lt_block_size)
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
        selection_dp_size=o.lt_selection_dp_size,
        kv_rate=max(o.lt_kv_rate, 0.0),
        kv_capacity=max(o.lt_kv_capacity, 1),
        kv_host=o.lt_kv_host,
        prefix_blocks=o.lt_prefix_blocks,
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
    """The lowest potential load: prefill blocks plus decode blocks (Dynamo's cost, weight 1),
    from ``/potential_loads`` rows, or from ``/project_loads`` rows (the active load plus the
    blocks the prompt would add)."""

    def cost(row: dict[str, Any]) -> float:
        if "additional_active_blocks" in row:
            return (row["active_prefill_tokens"] / block_size + row["active_decode_blocks"]
                    + row["additional_active_blocks"])  # fmt: skip
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

    def on_start(self) -> None:
        """A fixed warm-up before the random mix: each kind of call once (both load queries,
        both injected errors, a batched lifecycle), so even a short run on a slow machine
        covers every route whatever the draw."""
        self.llm_request(projected=False, inject="unknown rank")
        self.llm_request(projected=True, inject="duplicate")
        self.batched_requests(inject=False)

    @task(10)
    def random_llm_request(self) -> None:
        rng = self.rng
        inject = rng.random() < self.wl.inject_ratio
        kind = ("unknown rank" if rng.random() < 0.5 else "duplicate") if inject else None
        # a share of routers projects the active load instead
        self.llm_request(projected=rng.random() < 0.3, inject=kind)

    def llm_request(self, projected: bool, inject: str | None) -> None:
        """One LLM request's lifecycle; ``inject``: "unknown rank" (an /add to a rank that does
        not exist first) or "duplicate" (a second /add of the id while it is active)."""
        wl, rng = self.wl, self.rng
        prompt = make_prompt(wl, rng)
        fields = prompt.fields(wl.block_size)
        isl = len(prompt.tokens)

        if projected:
            path, query = "/project_loads", {**wl.key, **fields}
        else:
            path, query = "/potential_loads", {**wl.key, **fields, "new_isl_tokens": isl}
        with self.client.post(
            wl.url(path, rng), json=query, name=path, catch_response=True
        ) as resp:
            if not check(resp, 200):
                return
            rows = json_of(resp)
            if not isinstance(rows, list) or not rows:
                resp.failure(f"no ranks in the answer: {str(rows)[:200]}")
                return
        worker_id, dp_rank = pick_rank(rows, wl.block_size, rng)

        if inject == "unknown rank":
            self.add_to_unknown_rank(fields, isl)

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
        if inject == "duplicate":
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
        both accept it, and the first in stream order wins everywhere (see docs/redis-ha.md).
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
    def random_batched_requests(self) -> None:
        self.batched_requests(inject=self.rng.random() < self.wl.inject_ratio)

    def batched_requests(self, inject: bool) -> None:
        """A router that batches lifecycle calls: adds, then prefill + output blocks, then frees;
        ``inject``: one more add, to an unknown rank."""
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
        if inject:  # one add to an unknown rank; the others still apply
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


def count_overlap(cached_blocks: int) -> None:
    OVERLAP["answers"] += 1
    if cached_blocks > 0:
        OVERLAP["hits"] += 1


class SelectionRouterUser(_RouterBase):
    """A router that lets the service choose the rank, or books its own choice: the selection
    API's selections and reservations."""

    ID_PREFIX = "lt-sel"

    def on_start(self) -> None:
        """A fixed warm-up before the random mix: each way of booking once, so even a short run
        on a slow machine covers every selection route whatever the draw."""
        self.reserved_request()
        self.selected_then_booked()
        self.scored_and_booked()

    def call(self, method: str, path: str, name: str, expected: int, body: Any = None) -> Any:
        """One call to a random instance; the parsed answer, or None when it failed."""
        url = self.wl.url(path, self.rng)
        with self.client.request(method, url, json=body, name=name, catch_response=True) as resp:
            if not check(resp, expected):
                return None
            return json_of(resp)

    def prompt_body(self) -> tuple[dict[str, Any], str]:
        """A new prompt's body fields (token ids, as a router holding the text sends them) and
        a new selection id."""
        wl = self.wl
        prompt = make_prompt(wl, self.rng)
        body: dict[str, Any] = {**wl.key, "token_ids": prompt.tokens}
        if prompt.lora_name is not None:
            body["lora_name"] = prompt.lora_name
        return body, f"{self.id_prefix}-{next(_request_seq)}"

    def picked(self, answer: Any) -> bool:
        """A selection's answer names a registered worker; its overlap is counted."""
        if answer is None:
            return False
        if (answer.get("worker_id"), answer.get("dp_rank")) not in self.wl.selection_ranks:
            PROBLEMS.append(f"a selection picked an unregistered rank: {str(answer)[:300]}")
            return False
        count_overlap(int((answer.get("overlap") or {}).get("gpu") or 0))
        return True

    @task(3)
    def reserved_request(self) -> None:
        """``select_and_reserve``: the service chooses and books in one call."""
        if not self.wl.selection_worker_ids:
            return
        body, selection_id = self.prompt_body()
        body.update(selection_id=selection_id,
                    expected_output_tokens=self.wl.output_blocks * self.wl.block_size)  # fmt: skip
        self.outstanding.add(selection_id)
        answer = self.call("POST", "/selection/select_and_reserve",
                           "/selection/select_and_reserve", 200, body)  # fmt: skip
        if self.picked(answer):
            self.run_reservation(selection_id)

    @task(2)
    def selected_then_booked(self) -> None:
        """``select`` keeps the pick under a ``selection_id``; the router books it later."""
        wl = self.wl
        if not wl.selection_worker_ids:
            return
        body, selection_id = self.prompt_body()
        body["selection_id"] = selection_id
        if not self.picked(self.call("POST", "/selection/select", "/selection/select", 200, body)):
            return
        self.outstanding.add(selection_id)
        booking = {**wl.key, "selection_id": selection_id}
        answer = self.call("POST", "/selection/reservations",
                           "/selection/reservations [pending selection]", 201, booking)  # fmt: skip
        if answer is not None:
            self.run_reservation(selection_id)

    @task(2)
    def scored_and_booked(self) -> None:
        """A router scoring ranks itself: overlap scores and potential loads, then a booking on
        the rank it chose."""
        wl, rng = self.wl, self.rng
        if not wl.selection_worker_ids:
            return
        body, selection_id = self.prompt_body()
        scores = self.call("POST", "/selection/overlap_scores", "/selection/overlap_scores", 200,
                           body)  # fmt: skip
        loads = self.call("POST", "/selection/potential_loads", "/selection/potential_loads", 200,
                          body)  # fmt: skip
        if scores is None or not isinstance(loads, list) or not loads:
            return
        cached = {(w["worker_id"], w["dp_rank"]): w["device_blocks"] for w in scores["workers"]}
        count_overlap(max(cached.values(), default=0))

        def cost(row: dict[str, Any]) -> float:  # the prompt's blocks a rank holds save prefill
            saved = cached.get((row["worker_id"], row["dp_rank"]), 0)
            return (row["potential_prefill_tokens"] / wl.block_size - saved
                    + row["potential_decode_blocks"])  # fmt: skip

        best = min(cost(r) for r in loads)
        row = rng.choice([r for r in loads if cost(r) == best])
        self.outstanding.add(selection_id)
        booking = {**body, "selection_id": selection_id, "worker_id": row["worker_id"],
                   "dp_rank": row["dp_rank"]}  # fmt: skip
        answer = self.call("POST", "/selection/reservations",
                           "/selection/reservations [given rank]", 201, booking)  # fmt: skip
        if answer is not None:
            self.run_reservation(selection_id)

    def run_reservation(self, selection_id: str) -> None:
        """A booked request's life: prefill, a few output blocks, release."""
        wl, rng = self.wl, self.rng
        base = f"/selection/reservations/{selection_id}"
        gevent.sleep(wl.prefill_s * rng.uniform(0.5, 1.5))
        self.call("POST", base + "/prefill_complete",
                  "/selection/reservations/{id}/prefill_complete", 200, {})  # fmt: skip
        for _ in range(rng.randint(1, wl.output_blocks)):
            gevent.sleep(wl.decode_block_s * rng.uniform(0.5, 1.5))
            self.call("POST", base + "/output_block",
                      "/selection/reservations/{id}/output_block", 200, {})  # fmt: skip
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


class SelectionPoller(FastHttpUser):
    """An operator's tools on the selection API: its loads, catalog and readiness once a
    second; its index (``dump``, ``kv_index``) and a worker patch every fifth turn, the first
    turn included (so a short run covers them whatever the machine's speed)."""

    fixed_count = 1
    wait_time = constant(1.0)

    def __init__(self, environment: Environment) -> None:
        self.wl = workload_from(environment)
        self.default_headers = self.wl.headers
        super().__init__(environment)
        self.turn = 0

    def get(self, path: str, name: str, expected: tuple[int, ...] = (200,)) -> Any:
        with self.client.get(path, name=name, catch_response=True) as resp:
            if resp.status_code in expected:
                resp.success()
                return resp
            check(resp, expected[0])
            return None

    @task
    def poll(self) -> None:
        wl = self.wl
        if not wl.selection_worker_ids:
            return
        self.turn += 1
        query = f"?model_name={wl.model}&routing_group={wl.group}"
        self.get("/selection/loads" + query, "/selection/loads")
        self.get("/selection/workers" + query, "/selection/workers [list]")
        self.get("/selection/health", "/selection/health")
        self.get("/selection/ready", "/selection/ready")
        if self.turn % 5 == 1:
            self.get("/selection/dump" + query, "/selection/dump")
            # 404 when the service routes on its approximate cache (KV events off)
            self.get("/selection/kv_index", "/selection/kv_index", (200, 404))
        if self.turn % 5 == 1:
            worker_id = random.choice(wl.selection_worker_ids)
            with self.client.request(
                "PATCH",
                f"/selection/workers/{worker_id}",
                json={"total_kv_blocks": wl.kv_capacity},
                name="/selection/workers/{id} [patch]",
                catch_response=True,
            ) as resp:
                check(resp, 200)


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
        with self.client.get(
            f"/lora_counts?model_name={wl.model}&routing_group={wl.group}",
            name="/lora_counts",
            catch_response=True,
        ) as resp:
            check(resp, 200)


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
    endpoints = start_engines(wl) if wl.selection_worker_ids else []
    if endpoints is None:
        setup_failed(environment, "the simulated engines (loadtest/kv_engines.py) did not start")
        return
    dp = wl.selection_dp_size
    for i, worker_id in enumerate(wl.selection_worker_ids):
        # the simulated engines' publishers, one per rank; without them, nothing listens at
        # the address given (the worker stays schedulable, its cache empty)
        publishers = {str(r): endpoints[i * dp + r] if endpoints else "tcp://127.0.0.1:9"
                      for r in range(dp)}  # fmt: skip
        body = {
            **wl.key,
            "worker_id": worker_id,
            "block_size": wl.block_size,
            "endpoint": f"http://127.0.0.1:9/worker-{worker_id}",
            "data_parallel_size": dp,
            "kv_events_endpoints": publishers,
        }
        with client.post("/selection/workers", json=body, catch_response=True) as resp:
            if not check(resp, 201):
                setup_failed(environment, f"/selection/workers {worker_id}: {resp.status_code}")
                return
            if (json_of(resp) or {}).get("lifecycle") != "schedulable":
                resp.failure(f"selection worker {worker_id} not schedulable: {resp.text[:300]}")
                setup_failed(environment, f"selection worker {worker_id} is not schedulable")
                return
    if not every_host_knows_the_workers(client, wl):
        setup_failed(environment, f"not every instance listed the workers within {SETUP_WAIT_S} s")
        return
    log.info(
        "registered %d workers x %d ranks for model=%s routing_group=%s",
        len(wl.worker_ids),
        wl.dp_size,
        wl.model,
        wl.group,
    )


SETUP_WAIT_S = 30.0

# The simulated engines' process while the run lasts, and the figures it reported at the end.
ENGINES: dict[str, Any] = {}


def start_engines(wl: Workload) -> list[str] | None:
    """Start loadtest/kv_engines.py for every selection worker rank; its publishers' endpoints
    (an empty list with ``--lt-kv-rate 0``, None when it failed)."""
    if wl.kv_rate <= 0:
        return []
    ranks = len(wl.selection_ranks)
    cmd = [sys.executable, str(HERE / "kv_engines.py"), "--ranks", str(ranks),
           "--dp-size", str(wl.selection_dp_size), "--block-size", str(wl.block_size),
           "--prefixes", str(len(wl.prefixes)), "--prefix-blocks", str(wl.prefix_blocks),
           "--rate", str(wl.kv_rate), "--capacity", str(wl.kv_capacity),
           "--subscribers", str(max(len(wl.hosts), 1)), "--host", wl.kv_host]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        hello = json.loads(proc.stdout.readline() or "null")
    except ValueError:
        hello = None
    if not isinstance(hello, dict) or len(hello.get("endpoints", [])) != ranks:
        proc.kill()
        return None
    ENGINES["proc"] = proc
    log.info("simulated engines: %d ranks publishing KV events on %s", ranks, wl.kv_host)
    return hello["endpoints"]


def stop_engines() -> dict[str, Any]:
    """Stop the simulated engines; what they published (empty when none ran)."""
    proc = ENGINES.pop("proc", None)
    if proc is None:
        return ENGINES.get("figures", {})
    proc.stdin.close()  # they end when their stdin does
    try:
        out, _ = proc.communicate(timeout=10)
        figures = json.loads(out.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        proc.kill()
        figures = {}
    ENGINES["figures"] = figures
    return figures


def every_host_knows_the_workers(client: Any, wl: Workload) -> bool:
    """Until every instance lists the registered workers (several instances apply each
    other's registrations a moment later), at most ``SETUP_WAIT_S``."""
    query = f"?model_name={wl.model}&routing_group={wl.group}"
    deadline = time.monotonic() + SETUP_WAIT_S
    for host in wl.hosts or ("",):
        while True:
            workers = client.get(host + "/workers" + query, name="/workers [setup]")
            selection = client.get(host + "/selection/workers" + query,
                                   name="/selection/workers [setup]")  # fmt: skip
            try:
                known = len(json.loads(workers.text or "")) >= len(wl.worker_ids) and len(
                    json.loads(selection.text or "")
                ) >= len(wl.selection_worker_ids)
            except (ValueError, TypeError):
                known = False
            if known:
                break
            if time.monotonic() > deadline:
                return False
            gevent.sleep(0.1)
    return True


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


def kv_events_problem(client: Any, wl: Workload, published: dict[str, Any]) -> str | None:
    """Why the engines' KV events did not do their part, or None: the service indexed none of
    what they published, or no selection ever found a prompt's blocks cached."""
    if not published.get("batches"):
        return "the simulated engines published nothing (no instance subscribed)"
    ready = client.get("/selection/ready", name="/selection/ready [kv check]")
    try:
        kv_on = json.loads(ready.text or "").get("kv_events") is not None
    except (ValueError, AttributeError):
        return f"kv check: /selection/ready answered {ready.status_code}"
    if not kv_on:
        return None  # the service routes on its approximate cache: the events are not read
    metrics = client.get("/metrics", name="/metrics [kv check]").text or ""
    batches = [line for line in metrics.splitlines()
               if line.startswith("kv_slot_tracker_kv_events_batches_total ")]  # fmt: skip
    if not batches or float(batches[0].split()[-1]) <= 0:
        return "kv check: the service applied no KV-event batch of the simulated engines"
    if OVERLAP["answers"] and not OVERLAP["hits"]:
        return (f"kv check: no selection found a prompt's blocks cached on any rank "
                f"({OVERLAP['answers']} answers read)")  # fmt: skip
    return None


@events.test_stop.add_listener
def drain_check_and_unregister(environment: Environment, **_: Any) -> None:
    if not controls_topology(environment):
        return
    published = stop_engines()
    if not environment.host or PROBLEMS:
        return
    wl = workload_from(environment)
    client = setup_client(environment, wl)
    if wl.selection_worker_ids and wl.kv_rate > 0:
        problem = kv_events_problem(client, wl, published)
        if problem is not None:
            PROBLEMS.append(problem)
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


def report_routes(environment: Environment, published: dict[str, Any]) -> None:
    """Each route's calls, failures and latency percentiles (ms), printed and, with ``--csv``,
    written to ``<prefix>_routes.json`` with the engines' and the overlap figures."""
    rows = []
    for entry in sorted(environment.stats.entries.values(), key=lambda e: (e.name, e.method)):
        if not entry.num_requests:
            continue
        rows.append({
            "method": entry.method, "name": entry.name, "requests": entry.num_requests,
            "failures": entry.num_failures,
            **{f"p{q}": entry.get_response_time_percentile(q / 100) for q in (50, 95, 99)},
            "max": round(entry.max_response_time or 0, 1),
        })  # fmt: skip
    print(f"\n{'route':<62} {'calls':>7} {'fail':>5} {'p50':>6} {'p95':>6} {'p99':>6} (ms)")
    for r in rows:
        print(f"{r['method'] + ' ' + r['name']:<62.62} {r['requests']:>7} {r['failures']:>5} "
              f"{r['p50']:>6} {r['p95']:>6} {r['p99']:>6}")  # fmt: skip
    if published:
        print(f"KV events published by the simulated engines: {published}")
    print(f"selection answers with the prompt's blocks cached on some rank: "
          f"{OVERLAP['hits']} of {OVERLAP['answers']}", flush=True)  # fmt: skip
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        Path(f"{prefix}_routes.json").write_text(
            json.dumps(
                {"routes": rows, "kv_events_published": published, "overlap": OVERLAP}, indent=1
            )
        )


@events.quitting.add_listener
def verdict(environment: Environment, **_: Any) -> None:
    """Exit code 1, with the reasons printed, unless the run was clean."""
    if environment.runner is not None and not controls_topology(environment):
        return  # a worker runner: the master judges the whole run
    stop_engines()  # (when the run ended before its test_stop)
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
    report_routes(environment, ENGINES.get("figures", {}))
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
