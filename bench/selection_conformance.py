"""Differential conformance check of the selection API against Dynamo's selection service.

Generates seeded random sequences of HTTP requests over every route of SELECTION.md (valid and
malformed), sends each request to the reference (``python -m dynamo.select_service`` from
``ai-dynamo-runtime`` 1.6.1 in its own virtualenv, started with ``DYN_ROUTER_USE_KV_EVENTS=false``,
see ``bench/reference.py``; kv-slot-tracker likewise; ``bench/kv_conformance.py`` compares the
KV-events mode) at ``http://HOST:P`` and to kv-slot-tracker at
``http://HOST:P/selection``, and compares status codes and JSON bodies request by request.

    .venv/bin/python bench/selection_conformance.py --seed 1 --runs 40 --ops 300

Comparison rules:

* status codes must be equal;
* error bodies ``{"error": ...}`` must be equal, except the serde wording after
  ``Failed to parse the request body as JSON:`` / ``Failed to deserialize the JSON body into the
  target type:`` (only the prefix must match); the reference answers path and query-string errors
  as ``text/plain``, kv-slot-tracker as ``{"error": same text}``;
* success bodies must be equal as JSON, lists whose order the reference leaves unspecified
  (``/loads`` partitions and rows, ``/potential_loads``, ``/overlap_scores`` workers) compared as
  sorted lists; generated selection ids are masked; ``/dump`` is compared as the set of
  ``(partition, worker, dp_rank, block_hash, tokens_hash, parent)`` facts its events describe;
  ``/loads``, ``/ready`` and ``/dump`` are compared on the current run's partitions only (older
  runs' reservations and cached blocks expire on each server's own schedule);
* random tie-breaks (SELECTION.md §9): when the two pick different ranks, the reference is
  re-queried with a query-only ``/select`` on the same state (up to ``--requery`` times); the
  request agrees when it can choose our pick, and our body is then compared with the reference's
  body for that pick. The states are then made identical again: for ``/select`` with a
  ``selection_id`` the reference's select is repeated until it caches our pick; for
  ``/select_and_reserve`` the reference's booking is freed and re-booked explicitly on our rank,
  and we book the prompt on the reference's rank once (then free it), so both approximate caches
  hold the prompt on both ranks.

Every run uses fresh model names, worker ids and reservation ids (an id stays taken after its
worker is deleted). An id whose reservation kv-slot-tracker freed is never booked again in the
run (nor selected or replayed under that id): there the two differ by design. The reference
books a freed id again; kv-slot-tracker refuses it with 409 while its tombstone lasts
(``reservation_tombstone_ttl_seconds``), so that a late duplicate of a booking cannot hold a
reservation the client already freed (``tests/api/selection/test_selection_tombstones.py``). The temperature knob is left at 0 (a sampled pick cannot be re-queried
reliably). The last line is ``N requests, M differences, agreement P %``; exit code 1 when M > 0.

Other flags: ``--ref-url/--ours-url`` use running servers (ours without ``/selection``), ``-v``
prints every request, ``--show N`` examples per difference family.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reference import Server, free_port, start_ours, start_reference  # noqa: E402
from kv_slot_tracker.core.hashing import compute_seq_hash_for_block  # noqa: E402

REF_MODULE = "dynamo.select_service"
PREFIX = "/selection"
JSON_PARSE = "Failed to parse the request body as JSON: "
JSON_SHAPE = "Failed to deserialize the JSON body into the target type: "
SERDE_PREFIXES = (JSON_PARSE, JSON_SHAPE)
I64 = 1 << 63
U64 = 1 << 64


def signed(h: int) -> int:
    return h - U64 if h >= I64 else h


# ---------------------------------------------------------------------------------------------
# Requests, responses and the two servers


@dataclass
class Req:
    label: str  # operation class; differences are grouped by it
    method: str
    path: str  # relative to the API base (reference: "", ours: "/selection")
    body: Any = None  # JSON-serialisable, or raw bytes when ``raw`` is set
    raw: bytes | None = None
    ctype: str | None = "application/json"
    path_ours: str | None = None  # when the two sides address different (generated) ids
    kind: str = ""  # how success bodies are compared
    ids: tuple[str, str] | None = None  # (reference id, our id) of a generated reservation

    def payload(self) -> bytes | None:
        if self.raw is not None:
            return self.raw
        if self.body is None:
            return None
        return json.dumps(self.body, separators=(",", ":")).encode()

    def describe(self) -> str:
        data = self.payload()
        text = "" if data is None else "  " + data.decode("utf-8", "replace")[:1500]
        return f"{self.method} {self.path}{text}"


@dataclass
class Resp:
    status: int
    ctype: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> str:
        if self.ctype.startswith("application/json"):
            try:
                value = self.json()
            except ValueError:
                return self.body.decode("utf-8", "replace")
            if isinstance(value, dict) and "error" in value:
                return str(value["error"])
        return self.body.decode("utf-8", "replace")


class Side:
    def __init__(self, name: str, base: str) -> None:
        self.name = name
        self.base = base
        self.http = httpx.Client(timeout=30.0)

    def send(self, method: str, path: str, data: bytes | None, ctype: str | None) -> Resp:
        headers = {"content-type": ctype} if (ctype and data is not None) else {}
        r = self.http.request(method, self.base + path, content=data, headers=headers)
        return Resp(r.status_code, r.headers.get("content-type", ""), r.content)

    def post(self, path: str, body: Any) -> Resp:
        return self.send("POST", path, json.dumps(body).encode(), "application/json")

    def delete(self, path: str) -> Resp:
        return self.send("DELETE", path, None, None)


# ---------------------------------------------------------------------------------------------
# Comparison


def same_error(ref: Resp, ours: Resp, ids: tuple[str, str] | None = None) -> bool:
    a, b = ref.error(), ours.error()
    if ids is not None and ids[0] != ids[1]:
        b = b.replace(ids[1], ids[0])
    if a == b:
        return True
    for prefix in SERDE_PREFIXES:
        if a.startswith(prefix):
            return b.startswith(prefix)
    return False


def _sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r.get("worker_id"), r.get("dp_rank")))


def normalize(kind: str, value: Any, models: set[str]) -> Any:
    """The comparable form of a success body of ``kind``."""
    if kind == "reserve":  # a generated id differs by nature
        return {k: v for k, v in value.items() if k != "selection_id"}
    if kind == "loads":
        parts = [
            {**p, "loads": _sorted_rows(p["loads"])} for p in value if p["model_name"] in models
        ]
        return sorted(parts, key=lambda p: (p["model_name"], p["routing_group"]))
    if kind == "potential":
        return _sorted_rows(value)
    if kind == "overlap":
        return {**value, "workers": _sorted_rows(value["workers"])}
    if kind == "workers":
        return sorted(value, key=lambda w: (w["model_name"], w["routing_group"], w["worker_id"]))
    if kind == "ready":
        return {**value, "workers": normalize("workers", value["workers"], models)}
    if kind == "dump":
        facts = set()
        for key, part in value.items():
            if key.split(":", 1)[0] not in models:
                continue
            for ev in part["events"]:
                stored = ev["event"]["data"]["stored"]
                parent = stored["parent_hash"]
                for block in stored["blocks"]:
                    facts.add(
                        (
                            key,
                            part["block_size"],
                            ev["worker_id"],
                            ev["event"]["dp_rank"],
                            block["block_hash"],
                            block["tokens_hash"],
                            parent,
                        )
                    )
                    parent = block["block_hash"]
        return sorted(facts, key=repr)
    return value


# ---------------------------------------------------------------------------------------------
# The random operation generator


@dataclass
class World:
    """What one run has created so far (both servers got the same requests)."""

    run: int
    rng: random.Random
    models: list[tuple[str, int]]
    groups: list[str] = field(default_factory=lambda: ["default", "default", "g1"])
    workers: dict[int, tuple[str, str]] = field(default_factory=dict)
    prompts: dict[str, list[list[int]]] = field(default_factory=dict)
    token_prompts: list[list[int]] = field(default_factory=list)
    reservations: list[tuple[str, str]] = field(default_factory=list)  # (ref id, our id)
    shared_ids: list[str] = field(default_factory=list)  # ids both sides know by one name
    pending: list[tuple[str, str, str]] = field(default_factory=list)  # (id, model, group)
    next_id: int = 0

    @property
    def model_names(self) -> set[str]:
        return {m for m, _ in self.models}

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.run}-{self.next_id}"

    def released(self, sid: str) -> None:
        """``sid``'s reservation was freed: never booked, selected or replayed again (see the
        module docstring)."""
        self.shared_ids = [s for s in self.shared_ids if s != sid]
        self.pending = [p for p in self.pending if p[0] != sid]

    def worker_ids(self) -> list[int]:
        return [self.run * 100 + i for i in range(1, 7)]

    def model(self) -> tuple[str, int]:
        return self.rng.choice(self.models)

    def partition(self) -> dict[str, str]:
        m, _ = self.model()
        g = self.rng.choice(self.groups)
        out = {"model_name": m}
        if g != "default" or self.rng.random() < 0.5:
            out["routing_group"] = g
        return out

    def block_size(self, model: str) -> int:
        return dict(self.models).get(model, 4)

    # -- prompts ---------------------------------------------------------------------------

    def hash_prompt(self, model: str) -> list[int]:
        """Block hashes sharing prefixes with earlier prompts of the model."""
        rng = self.rng
        seen = self.prompts.setdefault(model, [])
        if seen and rng.random() < 0.7:
            base = rng.choice(seen)
            keep = rng.randint(0, len(base))
            blocks = base[:keep]
        else:
            blocks = []
        blocks = blocks + [rng.randrange(1, 1 << 62) for _ in range(rng.randint(0, 6))]
        if not blocks:
            blocks = [rng.randrange(1, 1 << 62)]
        seen.append(blocks)
        if len(seen) > 40:
            seen.pop(0)
        return blocks

    def prompt_fields(self, model: str, *, booking: bool = False) -> dict[str, Any]:
        rng = self.rng
        bs = self.block_size(model)
        if rng.random() < 0.25:
            if self.token_prompts and rng.random() < 0.6:
                base = rng.choice(self.token_prompts)
                tokens = base[: rng.randint(0, len(base))]
            else:
                tokens = []
            tokens = tokens + [rng.randrange(0, 50_000) for _ in range(rng.randint(0, 4 * bs))]
            self.token_prompts.append(tokens)
            out: dict[str, Any] = {"token_ids": tokens}
            if rng.random() < 0.2:
                out["lora_name"] = rng.choice(["ad1", "ad2"])
            return out
        blocks = self.hash_prompt(model)
        seq = [signed(h) for h in compute_seq_hash_for_block(blocks)]
        isl = len(blocks) * bs - rng.randint(0, bs - 1)
        if rng.random() < 0.1:
            isl += rng.randint(1, 2 * bs)
        out = {
            "block_hashes": [signed(b) for b in blocks],
            "sequence_hashes": seq,
            "isl_tokens": isl,
        }
        r = rng.random()
        if r < 0.03:
            out.pop("block_hashes")
        elif r < 0.05:
            out.pop("sequence_hashes")
        elif r < 0.07:
            out.pop("isl_tokens")
        elif r < 0.09 and not booking:
            out["isl_tokens"] = 0
        elif r < 0.11:
            out["sequence_hashes"] = seq[:-1]
        return out

    # -- operations ------------------------------------------------------------------------

    def op(self) -> Req:
        rng = self.rng
        table = [
            (10, self.op_register),
            (3, self.op_patch),
            (2, self.op_delete_worker),
            (14, self.op_select),
            (14, self.op_select_and_reserve),
            (5, self.op_replay),
            (7, self.op_explicit),
            (5, self.op_prefill_complete),
            (5, self.op_output_block),
            (6, self.op_free),
            (4, self.op_loads),
            (5, self.op_potential_loads),
            (5, self.op_overlap_scores),
            (2, self.op_workers),
            (1, self.op_ready),
            (1, self.op_dump),
            (5, self.op_malformed),
        ]
        total = sum(w for w, _ in table)
        pick = rng.uniform(0, total)
        for w, fn in table:
            pick -= w
            if pick <= 0:
                return fn()
        return table[-1][1]()

    def op_register(self) -> Req:
        rng = self.rng
        wid = rng.choice(self.worker_ids())
        part = self.partition()
        model = part["model_name"]
        body: dict[str, Any] = {"worker_id": wid, **part}
        r = rng.random()
        if r < 0.9:
            body["endpoint"] = f"http://w{wid}:8000"
        elif r < 0.95:
            body["endpoint"] = ""
        r = rng.random()
        if r < 0.9:
            body["block_size"] = self.block_size(model)
        elif r < 0.95:
            body["block_size"] = self.block_size(model) * 2
        if rng.random() < 0.5:
            body["data_parallel_start_rank"] = rng.choice([0, 2])
        if rng.random() < 0.7:
            body["data_parallel_size"] = rng.choice([1, 1, 2, 3, 0])
        if rng.random() < 0.3:
            body["max_num_batched_tokens"] = rng.choice([512, 8192])
        if rng.random() < 0.3:
            body["total_kv_blocks"] = rng.choice([1, 100_000])
        if rng.random() < 0.2:
            body["taints"] = ["t1"]
            body["topology_domains"] = {"rack": "r1"}
            body["kv_transfer_preferred_weight"] = rng.choice([0.1, 0.5, 1.3])
            body["kv_transfer_enforcement"] = rng.choice(["required", "preferred"])
        self.workers[wid] = (model, part.get("routing_group", "default"))
        return Req("workers:post", "POST", "/workers", body, kind="exact")

    def _worker_path(self) -> str:
        rng = self.rng
        r = rng.random()
        if r < 0.8:
            return f"/workers/{rng.choice(self.worker_ids())}"
        if r < 0.9:
            return "/workers/" + rng.choice(["abc", "-1", "18446744073709551616", "+7", "%31"])
        return f"/workers/{self.run * 100 + 99}"

    def op_patch(self) -> Req:
        rng = self.rng
        body: dict[str, Any] = {}
        for name, values in (
            ("data_parallel_size", [1, 2, 3, 0]),
            ("data_parallel_start_rank", [0, 1, 2]),
            ("endpoint", ["http://x", "", None]),
            ("block_size", [4, 8]),
            ("taints", [["a"], []]),
            ("max_num_batched_tokens", [100]),
            ("model_name", ["elsewhere"]),
        ):
            if rng.random() < 0.3:
                body[name] = rng.choice(values)
        return Req("workers:patch", "PATCH", self._worker_path(), body, kind="exact")

    def op_delete_worker(self) -> Req:
        return Req("workers:delete", "DELETE", self._worker_path(), kind="exact")

    def _selection_knobs(self, body: dict[str, Any]) -> None:
        rng = self.rng
        ranks = [(w, r) for w in self.worker_ids() for r in range(0, 5)]
        if rng.random() < 0.1:
            w, r = rng.choice(ranks)
            body["pinned_worker"] = {"worker_id": w, "dp_rank": r}
        if rng.random() < 0.15:
            ids = self.worker_ids()
            body["allowed_worker_ids"] = rng.sample(ids, rng.randint(0, 3))
        if rng.random() < 0.2:
            body["advisory"] = True
        self._override(body, 0.15)
        if rng.random() < 0.1:
            body["expected_output_tokens"] = 16

    def _override(self, body: dict[str, Any], p: float) -> None:
        if self.rng.random() < p:
            body["router_config_override"] = self.rng.choice(
                [
                    {"overlap_score_credit": 0.5},
                    {"prefill_load_scale": 2.0},
                    {"overlap_score_weight": 0},
                    {"track_prefill_tokens": False},
                    {"track_prefill_tokens": True},
                    {"prefill_load_scale": -1},
                ]
            )

    def op_select(self) -> Req:
        rng = self.rng
        part = self.partition()
        body: dict[str, Any] = {**part, **self.prompt_fields(part["model_name"])}
        if rng.random() < 0.4:
            sid = (
                self.new_id()
                if rng.random() < 0.7 or not self.pending
                else rng.choice(self.pending)[0]
            )
            body["selection_id"] = sid
            self.pending.append((sid, part["model_name"], part.get("routing_group", "default")))
        self._selection_knobs(body)
        return Req("select", "POST", "/select", body, kind="select")

    def op_select_and_reserve(self) -> Req:
        rng = self.rng
        part = self.partition()
        body: dict[str, Any] = {**part, **self.prompt_fields(part["model_name"])}
        r = rng.random()
        if r < 0.6:
            body["selection_id"] = self.new_id()
            self.shared_ids.append(body["selection_id"])
            self.reservations.append((body["selection_id"], body["selection_id"]))
        elif r < 0.7 and self.shared_ids:
            body["selection_id"] = rng.choice(self.shared_ids)
        self._selection_knobs(body)
        return Req("select_and_reserve", "POST", "/select_and_reserve", body, kind="reserve")

    def op_replay(self) -> Req:
        rng = self.rng
        if self.pending and rng.random() < 0.85:
            sid, model, group = rng.choice(self.pending)
            body: dict[str, Any] = {"selection_id": sid, "model_name": model}
            if group != "default" or rng.random() < 0.3:
                body["routing_group"] = group
            if rng.random() < 0.1:
                body["model_name"] = self.models[0][0] if model != self.models[0][0] else "zz"
            if rng.random() < 0.1:
                body["worker_id"] = None
        else:
            body = {"selection_id": self.new_id(), **self.partition()}
        return Req("reservations:replay", "POST", "/reservations", body, kind="exact")

    def op_explicit(self) -> Req:
        rng = self.rng
        part = self.partition()
        model = part["model_name"]
        body: dict[str, Any] = {
            "selection_id": self.new_id()
            if rng.random() < 0.85 or not self.shared_ids
            else rng.choice(self.shared_ids),
            **part,
            "worker_id": rng.choice(self.worker_ids()),
            **self.prompt_fields(model, booking=True),
        }
        if rng.random() < 0.7:
            body["dp_rank"] = rng.choice([0, 0, 1, 2, 3, 7])
        if rng.random() < 0.7:
            isl = body.get("isl_tokens", len(body.get("token_ids", [])))
            body["effective_prefill_tokens"] = rng.choice([0, isl // 2, isl, isl + 1])
        if rng.random() < 0.2:
            body["track_prefill_tokens"] = rng.choice([True, False])
        if rng.random() < 0.2:
            body.pop("block_hashes", None)
        if "sequence_hashes" in body and rng.random() < 0.05:
            body["sequence_hashes"], body["block_hashes"] = [], []
        self.reservations.append((body["selection_id"], body["selection_id"]))
        self.shared_ids.append(body["selection_id"])
        return Req("reservations:explicit", "POST", "/reservations", body, kind="exact")

    def _reservation(self, suffix: str) -> dict[str, Any]:
        """Path arguments of a lifecycle call: a known reservation most of the time."""
        rng = self.rng
        if self.reservations and rng.random() < 0.85:
            ref_id, our_id = rng.choice(self.reservations)
        elif rng.random() < 0.5:
            ref_id = our_id = rng.choice(["nope", "a b", "x/2", "", "é"])
        else:
            ref_id = our_id = self.new_id()
        return {
            "path": f"/reservations/{_quote(ref_id)}{suffix}",
            "path_ours": f"/reservations/{_quote(our_id)}{suffix}",
            "ids": (ref_id, our_id),
        }

    def op_prefill_complete(self) -> Req:
        where = self._reservation("/prefill_complete")
        return Req("lifecycle:prefill", "POST", **where, kind="exact")

    def op_output_block(self) -> Req:
        rng = self.rng
        where = self._reservation("/output_block")
        r = rng.random()
        body: Any = {}
        if r < 0.4:
            body = {"decay_fraction": rng.choice([0, 0.5, 1, 0.25, -0.1, 1.5])}
        elif r < 0.45:
            return Req("lifecycle:output_block", "POST", **where, ctype=None)
        return Req("lifecycle:output_block", "POST", body=body, **where, kind="exact")

    def op_free(self) -> Req:
        return Req("lifecycle:delete", "DELETE", **self._reservation(""), kind="exact")

    def _filters(self) -> str:
        rng = self.rng
        r = rng.random()
        m = rng.choice(sorted(self.model_names))
        if r < 0.4:
            return f"?model_name={m}"
        if r < 0.6:
            return f"?model_name={m}&routing_group={rng.choice(self.groups)}"
        if r < 0.7:
            return "?routing_group=g1"
        if r < 0.75:
            return f"?model_name={m}&model_name={m}"
        return ""

    def op_loads(self) -> Req:
        return Req("loads", "GET", "/loads" + self._filters(), kind="loads")

    def op_workers(self) -> Req:
        return Req("workers:get", "GET", "/workers" + self._filters(), kind="workers")

    def op_ready(self) -> Req:
        return Req("ready", "GET", "/ready", kind="ready")

    def op_dump(self) -> Req:
        return Req("dump", "GET", "/dump", kind="dump")

    def op_potential_loads(self) -> Req:
        part = self.partition()
        body = {**part, **self.prompt_fields(part["model_name"])}
        self._override(body, 0.15)
        return Req("potential_loads", "POST", "/potential_loads", body, kind="potential")

    def op_overlap_scores(self) -> Req:
        part = self.partition()
        body = {**part, **self.prompt_fields(part["model_name"])}
        if self.rng.random() < 0.05:
            body.pop("sequence_hashes", None)
            body.pop("token_ids", None)
        self._override(body, 0.05)
        return Req("overlap_scores", "POST", "/overlap_scores", body, kind="overlap")

    def op_malformed(self) -> Req:
        rng = self.rng
        m = self.models[0][0]
        cases: list[Req] = [
            Req("bad:not_json", "POST", "/select", raw=b"{not json"),
            Req("bad:empty", "POST", "/select_and_reserve", raw=b""),
            Req("bad:array", "POST", "/select", raw=b"[]"),
            Req("bad:no_ctype", "POST", "/select", {"model_name": m}, ctype=None),
            Req("bad:isl_str", "POST", "/select", {"model_name": m, "isl_tokens": "4"}),
            Req("bad:float_hash", "POST", "/select", {"model_name": m, "block_hashes": [1.5]}),
            Req("bad:big_hash", "POST", "/select", {"model_name": m, "sequence_hashes": [I64]}),
            Req("bad:big_token", "POST", "/select", {"model_name": m, "token_ids": [1 << 32]}),
            Req("bad:neg_worker", "POST", "/workers", {"worker_id": -1}),
            Req("bad:no_worker_id", "POST", "/workers", {"model_name": m}),
            Req("bad:num_sid", "POST", "/select", {"model_name": m, "selection_id": 5}),
            Req("bad:no_sid", "POST", "/reservations", {"model_name": m}),
            Req("bad:advisory_null", "POST", "/select", {"model_name": m, "advisory": None}),
            Req("bad:model_null", "POST", "/workers", {"worker_id": 1, "model_name": None}),
            Req("bad:route", "GET", "/nonexistent"),
            Req("bad:route_slash", "GET", "/workers/"),
            Req("bad:route_enc", "POST", "/%73elect", {"model_name": m}),
            Req("bad:method", "GET", "/select"),
            Req("bad:method", "PUT", "/workers"),
            Req("bad:method", "DELETE", "/select_and_reserve"),
            Req("bad:method", "GET", "/reservations/x"),
            Req("bad:method", "POST", "/loads"),
            Req("bad:method", "GET", "/reservations"),
            Req("bad:method", "POST", "/dump"),
            Req("bad:enforcement", "POST", "/workers", {"worker_id": 1, "kv_transfer_enforcement": "x"}),
            Req("bad:override", "POST", "/select", {"model_name": m, "router_config_override": {"router_temperature": "x"}}),
        ]  # fmt: skip
        return rng.choice(cases)


# ---------------------------------------------------------------------------------------------
# The runner


@dataclass
class Difference:
    family: str
    req: Req
    detail: str


class Runner:
    def __init__(self, ref: Side, ours: Side, *, requery: int, verbose: bool) -> None:
        self.ref, self.ours = ref, ours
        self.requery = requery
        self.verbose = verbose
        self.requests = 0
        self.ties = 0
        self.differences: list[Difference] = []
        self.coverage: Counter[str] = Counter()

    def differ(self, req: Req, family: str, detail: str) -> None:
        self.differences.append(Difference(f"{req.label}: {family}", req, detail))

    def run(self, world: World, ops: int) -> None:
        for _ in range(ops):
            req = world.op()
            self.step(world, req)

    def step(self, world: World, req: Req) -> None:
        self.requests += 1
        self.coverage[req.label] += 1
        data = req.payload()
        ours = self.ours.send(req.method, req.path_ours or req.path, data, req.ctype)
        if req.label == "lifecycle:delete" and ours.status == 200 and req.ids is not None:
            world.released(req.ids[1])
        before = None
        if req.kind == "reserve" and ours.status == 200:
            # a booking changes the state: ask now whether the reference can pick our rank
            before = self.requery_for(req, (ours.json()["worker_id"], ours.json()["dp_rank"]))
        ref = self.ref.send(req.method, req.path, data, req.ctype)
        if self.verbose:
            print(f"{req.describe()}\n   ref  {ref.status} {ref.body[:200]!r}")
        if ref.status != ours.status:
            self.differ(
                req, f"status {ref.status} vs {ours.status}", f"{ref.error()} | {ours.error()}"
            )
            return
        if ref.status >= 300:
            if not same_error(ref, ours, req.ids):
                self.differ(req, "error text", f"{ref.error()!r} vs {ours.error()!r}")
            return
        if req.kind in ("select", "reserve"):
            self.compare_selection(world, req, ref.json(), ours.json(), before)
            return
        a = normalize(req.kind, ref.json(), world.model_names)
        b = normalize(req.kind, ours.json(), world.model_names)
        if a != b:
            self.differ(req, "body", f"{json.dumps(a)[:600]}\n   ours {json.dumps(b)[:600]}")

    # -- selections and random ties ---------------------------------------------------------

    def requery_for(self, req: Req, pick: tuple[int, int]) -> dict | None:
        """The reference's query-only answer choosing ``pick`` on its current state, if it can
        choose it within ``requery`` tries (the first answer when there is no tie)."""
        query = {k: v for k, v in req.body.items() if k != "selection_id"}
        seen = set()
        for _ in range(self.requery):
            r = self.ref.post("/select", query)
            if r.status != 200:
                return None
            if (r.json()["worker_id"], r.json()["dp_rank"]) == pick:
                return r.json()
            seen.add((r.json()["worker_id"], r.json()["dp_rank"]))
        if self.verbose:
            print(f"   !! the reference picks {seen}, never {pick}")
            part = {k: req.body[k] for k in ("model_name", "routing_group") if k in req.body}
            q = "?" + "&".join(f"{k}={v}" for k, v in part.items())
            for side in (self.ref, self.ours):
                print(f"   {side.name} loads {side.send('GET', '/loads' + q, None, None).body!r}")
                print(f"   {side.name} overlap {side.post('/overlap_scores', query).body!r}")
                print(f"   {side.name} potential {side.post('/potential_loads', query).body!r}")
        return None

    def compare_selection(
        self, world: World, req: Req, ref: dict, ours: dict, before: dict | None
    ) -> None:
        reserve = req.kind == "reserve"
        body = req.body
        if reserve and "selection_id" not in body:
            world.reservations.append((ref["selection_id"], ours["selection_id"]))
        ref_pick = (ref["worker_id"], ref["dp_rank"])
        our_pick = (ours["worker_id"], ours["dp_rank"])
        if ref_pick == our_pick:
            a, b = normalize(req.kind, ref, set()), normalize(req.kind, ours, set())
            if a != b:
                self.differ(req, "body", f"{json.dumps(a)}\n   ours {json.dumps(b)}")
            return
        self.ties += 1
        alt = before if reserve else self.requery_for(req, our_pick)
        if alt is None:
            detail = f"reference {ref_pick} (never {our_pick}); ours {our_pick}"
            self.differ(req, "pick", detail)
            return
        # select_and_reserve accepts `advisory` but answers no worker_load
        skip = {"selection_id", "worker_load"} if reserve else {"selection_id"}
        common = {k: v for k, v in ours.items() if k in alt and k not in skip}
        expected = {k: v for k, v in alt.items() if k not in skip}
        if reserve:
            for k in ("sequence_hashes", "isl_tokens", "track_prefill_tokens"):
                if ref.get(k) != ours.get(k):
                    self.differ(req, "body", f"{k}: {ref.get(k)} vs {ours.get(k)}")
                    return
        if common != expected:
            self.differ(req, "body (tie)", f"{json.dumps(expected)}\n   ours {json.dumps(common)}")
        self.resync(req, ref, ours, ref_pick, our_pick)

    def resync(self, req: Req, ref: dict, ours: dict, ref_pick: tuple, our_pick: tuple) -> None:
        """Make the reference's state equal ours again after a tie broken differently."""
        body = req.body
        prompt_keys = ("token_ids", "lora_name", "block_hashes", "sequence_hashes", "isl_tokens")
        prompt = {k: body[k] for k in prompt_keys if k in body}
        part = {k: body[k] for k in ("model_name", "routing_group") if k in body}
        if req.kind == "select":
            if "selection_id" not in body:
                return
            for _ in range(4 * self.requery):
                r = self.ref.post("/select", body)
                if (r.json()["worker_id"], r.json()["dp_rank"]) == our_pick:
                    return
            self.differ(req, "resync", "the reference never cached our pick")
            return
        sid = ref["selection_id"]
        self.ref.delete(f"/reservations/{_quote(sid)}")
        rebook = {
            "selection_id": sid,
            **part,
            "worker_id": our_pick[0],
            "dp_rank": our_pick[1],
            **prompt,
        }
        if ours["track_prefill_tokens"]:
            rebook["effective_prefill_tokens"] = ours["effective_prefill_tokens"]
        else:
            rebook["track_prefill_tokens"] = False
        r = self.ref.post("/reservations", rebook)
        if r.status != 201:
            self.differ(req, "resync", f"re-booking on the reference: {r.status} {r.error()}")
        tmp = f"tie-{self.ties}-{random.getrandbits(32)}"
        throwaway = {
            "selection_id": tmp,
            **part,
            "worker_id": ref_pick[0],
            "dp_rank": ref_pick[1],
            **prompt,
        }
        r = self.ours.post("/reservations", throwaway)
        if r.status != 201:
            self.differ(req, "resync", f"throw-away booking on ours: {r.status} {r.error()}")
        self.ours.delete(f"/reservations/{tmp}")


def _quote(s: str) -> str:
    return httpx.URL("http://h/").copy_with(path="/" + s).raw_path.decode()[1:]


def summary(runner: Runner, show: int) -> int:
    families: dict[str, list[Difference]] = {}
    for d in runner.differences:
        families.setdefault(d.family, []).append(d)
    for family, diffs in sorted(families.items(), key=lambda kv: -len(kv[1])):
        print(f"\n{len(diffs):5d}  {family}")
        for d in diffs[:show]:
            print(f"       {d.req.describe()}\n       {d.detail}")
    n, m = runner.requests, len(runner.differences)
    print("\ncoverage:", dict(sorted(runner.coverage.items())))
    print(f"ties re-queried: {runner.ties}")
    agreement = 100.0 * (n - m) / n if n else 100.0
    print(f"{n} requests, {m} differences, agreement {agreement:.2f} %")
    return 1 if m else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--requery", type=int, default=64)
    ap.add_argument("--ref-url")
    ap.add_argument("--ours-url")
    ap.add_argument("--show", type=int, default=3)
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--only-run", type=int, help="replay one run of the seed")
    ap.add_argument(
        "--selection-port",
        action="store_true",
        help="compare ours at the root of its selection_port (started with --selection-port)",
    )
    args = ap.parse_args(argv)

    servers: list[Server] = []
    try:
        if args.ref_url:
            ref_url = args.ref_url
        else:
            env = {**os.environ, "DYN_ROUTER_USE_KV_EVENTS": "false"}
            ref = start_reference(module=REF_MODULE, env=env)
            servers.append(ref)
            ref_url = ref.url
        if args.ours_url:
            ours_url = args.ours_url
        else:
            # both in the approximate-cache mode (KV events off), which this harness compares
            extra = ["--selection-port", str(free_port())] if args.selection_port else []
            ours = start_ours(
                extra_args=extra, env={**os.environ, "DYN_ROUTER_USE_KV_EVENTS": "false"}
            )
            servers.append(ours)
            ours_url = ours.url
            if args.selection_port:  # the selection routes at the root, as the reference's
                ours_url = f"http://127.0.0.1:{extra[1]}"
        runner = Runner(
            Side("reference", ref_url),
            Side("ours", ours_url if args.selection_port else ours_url + PREFIX),
            requery=args.requery,
            verbose=args.verbose,
        )
        started = time.monotonic()
        for run in range(args.runs):
            if args.only_run is not None and run != args.only_run:
                continue
            rng = random.Random(args.seed * 100_003 + run)
            tag = f"{args.seed}r{run}"
            world = World(run + 1 + args.seed * 1000, rng, [(f"a{tag}", 4), (f"b{tag}", 8)])
            runner.run(world, args.ops)
        print(f"elapsed {time.monotonic() - started:.1f} s")
        return summary(runner, args.show)
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    sys.exit(main())
