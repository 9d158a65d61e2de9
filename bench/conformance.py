"""Differential conformance check: kv-slot-tracker against Dynamo's standalone slot tracker.

Generates seeded random sequences of HTTP requests (valid and malformed), sends each sequence to a
fresh reference server (``python -m dynamo.slot_tracker`` from ``ai-dynamo-runtime`` 1.6.1, in its
own virtualenv, see ``bench/reference.py``) and to a fresh kv-slot-tracker, and compares status
codes and JSON bodies request by request.

    .venv/bin/python bench/conformance.py --seed 1 --runs 20 --ops 300

Comparison rules (SPEC §7, §9.6, §10):

* status codes must be equal;
* success bodies must be equal as JSON; ``/loads`` rows may carry our extra fields
  ``active_requests`` and ``modeled_remaining_prefill_ms`` (ignored); ``/potential_loads`` rows are
  in hash-map order on the reference and are compared as sorted lists;
* error bodies are ``{"error": ...}``; messages must be equal, except the serde parser wording
  after ``Failed to parse the request body as JSON:`` and
  ``Failed to deserialize the JSON body into the target type:``, where only that prefix must match
  (``--strict-wording`` compares the whole text; the mismatches are listed with ``--wording``);
* query-string errors on GET routes are ``text/plain`` on the reference and ``{"error": same text}``
  on ours (deliberate); ``/replica_sync/*`` and our extension routes are not exercised.

Inputs are kept out of the documented difference D3: sequence hashes come from one global prefix
tree, so a hash never repeats inside a prompt and always stands for the same prefix. Prefill tokens
added over HTTP have no duration on the reference, so loads do not depend on time.

Before the random runs, fixed scenarios (SPEC §9.6 H01–H18 and hand-picked parser/order edges) run
once (``--no-fixed`` skips them). Every difference is printed with the request that caused it; the
first difference of each family (operation kind + both statuses + mismatch kind) is minimized to a
short reproducer by replaying subsets of the requests since the servers were last empty (on
servers emptied by unregistering every worker; a longer reproducer is re-checked on freshly
started servers). After a difference where either side succeeded, both servers are emptied so
that later requests start from equal states again. The summary lists difference families, the
finer classes with one example each, and (``--coverage``) the requests sent per operation kind.
The last line is ``N requests, M differences``; the exit code is 1 when M > 0.

Other flags: ``--workers N`` runs ours as N processes on one port (``python -m kv_slot_tracker --workers
N``), ``--only-run K`` replays one run of a seed, ``--ref-url/--ours-url`` use running
servers, ``-v`` prints every request with the reference's answer, ``--array-bodies`` also sends
positional-array bodies (a serde quirk that SPEC §7.3 makes optional).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reference import Server, start_ours, start_reference  # noqa: E402

JSON_PARSE = "Failed to parse the request body as JSON: "
JSON_SHAPE = "Failed to deserialize the JSON body into the target type: "
SERDE_PREFIXES = (JSON_PARSE, JSON_SHAPE)
OUR_EXTRA_LOAD_FIELDS = ("active_requests", "modeled_remaining_prefill_ms")
BODY_LIMIT = 2_097_152

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

MODELS = ["m0", "m1", "é模"]
GROUPS = [None, None, "g1", "default", ""]  # None = field omitted (→ "default")
WORKERS = [1, 2, 3, 0, U64_MAX]
REQUEST_IDS = [f"r{i}" for i in range(16)] + ["", "请求-1"]
POST_ROUTES = ["/register", "/unregister", "/add", "/prefill_complete", "/free", "/potential_loads"]
# Paths that must be 404 on both. Our extension routes (/upsert, /reconcile, /output_block,
# /project_loads, /lora_counts, /batch, /ready, /replication, /metrics, /docs, /redoc,
# /openapi.json) and /replica_sync/* are deliberate differences and are not sent.
UNKNOWN_PATHS = [
    "/nonexistent",
    "/health/",
    "/register/",
    "/Register",
    "/add/x",
    "/loads/",
    "//add",
    "/peers",
    "/dump",
    "/register_peer",
    "/replica_sync",
    "/%61dd",
    "/",
]
WRONG_METHODS = [
    ("GET", "/add"),
    ("GET", "/register"),
    ("PUT", "/register"),
    ("DELETE", "/free"),
    ("GET", "/unregister"),
    ("GET", "/prefill_complete"),
    ("GET", "/potential_loads"),
    ("POST", "/health"),
    ("POST", "/workers"),
    ("POST", "/loads"),
    ("PATCH", "/loads"),
    ("PUT", "/workers"),
    ("DELETE", "/health"),
    ("OPTIONS", "/add"),
]


# ---------------------------------------------------------------------------------------------
# Requests and responses


@dataclass
class Req:
    label: str  # operation class, e.g. "register:dup"; differences are grouped by it
    method: str
    path: str  # with the raw query string
    body: bytes | None = None
    ctype: str | None = "application/json"

    def describe(self, limit: int = 400) -> str:
        head = f"{self.method} {self.path}"
        if self.body is None:
            return head
        ct = self.ctype if self.ctype is not None else "(none)"
        body = self.body.decode("utf-8", "backslashreplace")
        if len(body) > limit:
            body = body[:limit] + f"... ({len(self.body)} bytes)"
        return f"{head}  [content-type: {ct}]  {body}"


@dataclass
class Resp:
    status: int
    ctype: str | None
    body: bytes

    def text(self, limit: int = 400) -> str:
        t = self.body.decode("utf-8", "backslashreplace")
        return t if len(t) <= limit else t[:limit] + f"... ({len(self.body)} bytes)"

    def json(self) -> Any:
        return json.loads(self.body)

    def describe(self) -> str:
        ct = (
            f" [{self.ctype}]"
            if self.ctype and not self.ctype.startswith("application/json")
            else ""
        )
        return f"{self.status}{ct} {self.text()}".rstrip()


def send(client: httpx.Client, base: str, req: Req) -> Resp:
    headers = {}
    if req.body is not None and req.ctype is not None:
        headers["content-type"] = req.ctype
    try:
        r = client.request(req.method, base + req.path, content=req.body, headers=headers)
    except httpx.HTTPError as e:
        return Resp(-1, None, f"{type(e).__name__}: {e}".encode())
    return Resp(r.status_code, r.headers.get("content-type"), r.content)


def jdump(obj: Any, ascii_only: bool = False) -> bytes:
    return json.dumps(obj, ensure_ascii=ascii_only, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------
# Comparison


@dataclass
class Mismatch:
    kind: str  # status | body | ctype | wording
    detail: str


def _mime(ctype: str | None) -> str | None:
    return ctype.split(";", 1)[0].strip().lower() if ctype else None


def _error_text(resp: Resp) -> str | None:
    if _mime(resp.ctype) == "text/plain":
        return resp.body.decode("utf-8", "replace")
    try:
        obj = resp.json()
    except ValueError:
        return None
    if isinstance(obj, dict) and set(obj) == {"error"} and isinstance(obj["error"], str):
        return obj["error"]
    return None


def _normalize_success(req: Req, obj: Any) -> Any:
    path = req.path.split("?", 1)[0]
    if path == "/loads" and isinstance(obj, list):
        obj = [
            {k: v for k, v in row.items() if k not in OUR_EXTRA_LOAD_FIELDS}
            if isinstance(row, dict)
            else row
            for row in obj
        ]
    if path == "/potential_loads" and isinstance(obj, list):
        obj = sorted(obj, key=lambda r: json.dumps(r, sort_keys=True))
    return obj


def compare(req: Req, ref: Resp, ours: Resp, strict_wording: bool) -> list[Mismatch]:
    if ref.status != ours.status:
        return [Mismatch("status", f"status ref={ref.status} ours={ours.status}")]
    out: list[Mismatch] = []
    if req.method == "HEAD":
        if ours.body:
            out.append(Mismatch("body", "HEAD answer has a body"))
        return out
    if 200 <= ref.status < 300:
        if not ref.body or not ours.body:
            if ref.body != ours.body:
                out.append(Mismatch("body", "one body is empty"))
            if _mime(ref.ctype) != _mime(ours.ctype):
                out.append(Mismatch("ctype", f"content-type ref={ref.ctype} ours={ours.ctype}"))
            return out
        try:
            a, b = ref.json(), ours.json()
        except ValueError:
            return [Mismatch("body", "a success body is not JSON")]
        na, nb = _normalize_success(req, a), _normalize_success(req, b)
        if na != nb:
            detail = "success bodies differ"
            if isinstance(na, list) and isinstance(nb, list):
                if len(na) != len(nb):
                    detail += f" (rows: ref {len(na)}, ours {len(nb)})"
                for x, y in zip(na, nb, strict=False):
                    if x != y:
                        detail += f"; first differing row: ref {x} ours {y}"
                        break
            out.append(Mismatch("body", detail))
        if _mime(ref.ctype) != _mime(ours.ctype):
            out.append(Mismatch("ctype", f"content-type ref={ref.ctype} ours={ours.ctype}"))
        return out
    ref_msg, our_msg = _error_text(ref), _error_text(ours)
    if ref_msg is None or our_msg is None:
        if ref.body != ours.body:
            out.append(Mismatch("body", "error bodies differ (not both {error})"))
        return out
    ref_query_text = _mime(ref.ctype) == "text/plain"
    if not ref_query_text and _mime(ref.ctype) != _mime(ours.ctype):
        out.append(Mismatch("ctype", f"content-type ref={ref.ctype} ours={ours.ctype}"))
    if ref_msg == our_msg:
        return out
    prefix = next((p for p in SERDE_PREFIXES if ref_msg.startswith(p)), None)
    if prefix is not None and our_msg.startswith(prefix) and not strict_wording:
        out.append(Mismatch("wording", "serde wording differs"))
    else:
        out.append(Mismatch("body", "error messages differ"))
    return out


# ---------------------------------------------------------------------------------------------
# Generator


class HashTree:
    """Lineage-consistent sequence hashes: every hash is one node of a global prefix tree, so it
    never repeats within a prompt and always continues the same prefix (no SPEC §10 D3 input)."""

    EDGE = [I64_MIN, I64_MAX, -1, 0, 2**53 + 1, -(2**62)]

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[int] = set()
        self.kids: dict[int | None, list[int]] = {None: []}
        self.edges = list(self.EDGE)
        rng.shuffle(self.edges)

    def fresh(self) -> int:
        rng = self.rng
        while True:
            roll = rng.random()
            if self.edges and roll < 0.03:
                h = self.edges.pop()
            elif roll < 0.55:
                h = rng.randint(1, 999)
            elif roll < 0.7:
                h = -rng.randint(1, 999)
            else:
                h = rng.randint(I64_MIN, I64_MAX)
            if h not in self.used:
                self.used.add(h)
                self.kids[h] = []
                return h

    def prompt(self, max_len: int = 8, share: float = 0.7) -> list[int]:
        rng = self.rng
        n = 0 if rng.random() < 0.08 else rng.randint(1, max_len)
        out: list[int] = []
        cur: int | None = None
        for _ in range(n):
            kids = self.kids[cur]
            if kids and rng.random() < share:
                h = rng.choice(kids)
            else:
                h = self.fresh()
                kids.append(h)
            out.append(h)
            cur = h
        return out

    def chain(self, n: int) -> list[int]:
        """A new chain of ``n`` fresh hashes hanging off the root."""
        out: list[int] = []
        cur: int | None = None
        for _ in range(n):
            h = self.fresh()
            self.kids[cur].append(h)
            out.append(h)
            cur = h
        return out


@dataclass
class Model:
    """What the generator believes the servers hold (updated from the reference's answers)."""

    block_size: dict[tuple[str, str], int] = field(default_factory=dict)
    workers: dict[tuple[str, str], dict[int, tuple[int, int]]] = field(default_factory=dict)
    requests: dict[tuple[str, str], dict[str, tuple[int, int]]] = field(default_factory=dict)

    def clear(self) -> None:
        self.block_size.clear()
        self.workers.clear()
        self.requests.clear()


def key_fields(model: str, group: str | None) -> dict[str, Any]:
    d: dict[str, Any] = {"model_name": model}
    if group is not None:
        d["routing_group"] = group
    return d


def key_of(body: dict[str, Any]) -> tuple[str, str]:
    return body["model_name"], body.get("routing_group", "default")


class Generator:
    def __init__(
        self, rng: random.Random, array_bodies: bool = False, malformed: bool = True
    ) -> None:
        self.rng = rng
        self.malformed_weight = 14 if malformed else 0
        self.tree = HashTree(rng)
        self.model = Model()
        self.array_bodies = array_bodies
        self.big_done = 0

    # -- choices ---------------------------------------------------------------------------

    def pick_key(self, known: float = 0.8) -> tuple[str, str | None]:
        rng = self.rng
        if self.model.workers and rng.random() < known:
            m, g = rng.choice(sorted(self.model.workers))
            if g == "default" and rng.random() < 0.7:
                return m, None
            return m, g
        return rng.choice(MODELS), rng.choice(GROUPS)

    def known_worker(self, key: tuple[str, str]) -> tuple[int, tuple[int, int]] | None:
        ws = self.model.workers.get(key)
        if not ws:
            return None
        wid = self.rng.choice(sorted(ws))
        return wid, ws[wid]

    def pick_rid(self, key: tuple[str, str], active: float) -> str:
        reqs = self.model.requests.get(key, {})
        if reqs and self.rng.random() < active:
            return self.rng.choice(sorted(reqs))
        return self.rng.choice(REQUEST_IDS)

    def isl(self) -> int:
        roll = self.rng.random()
        if roll < 0.35:
            return 0
        if roll < 0.95:
            return self.rng.randint(1, 5000)
        return self.rng.randint(2**32, 2**40)

    # -- valid bodies ----------------------------------------------------------------------

    def register_body(self) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        m, g = self.pick_key(known=0.5)
        key = (m, g if g is not None else "default")
        bs = self.model.block_size.get(key) or rng.choice([1, 4, 16, 64])
        ws = self.model.workers.get(key, {})
        wid = rng.choice(WORKERS)
        start, size = rng.choice([(0, 1), (0, 2), (0, 3), (1, 2), (2, 1), (4294967294, 1)])
        label = "register"
        roll = rng.random()
        if roll < 0.06:
            bs, label = 0, "register:block_size0"
            if rng.random() < 0.5:
                size = 0
        elif roll < 0.12:
            size, label = 0, "register:dp_size0"
        elif roll < 0.16:
            start, size = rng.choice([(U32_MAX, 1), (U32_MAX - 100, 4096), (U32_MAX - 1, 2)])
            label = "register:overflow"
        elif roll < 0.19:
            start, size = rng.choice(
                [(0, 4097), (2**31, 2**31), (1, U32_MAX), (U32_MAX, U32_MAX), (0, 65536)]
            )
            label = "register:dp_size_max"
            if rng.random() < 0.2:
                start, size, label = 0, 4096, "register:dp_size4096"
        elif roll < 0.3 and key in self.model.block_size:
            bs = rng.choice([b for b in (1, 4, 16, 64) if b != bs])
            label = "register:bs_mismatch"
            if ws and rng.random() < 0.5:
                wid = rng.choice(sorted(ws))
        elif roll < 0.42 and ws:
            wid, label = rng.choice(sorted(ws)), "register:duplicate"
        body = {"worker_id": wid, **key_fields(m, g), "block_size": bs}
        body.update(dp_start=start, dp_size=size)
        return label, body

    def unregister_body(self) -> tuple[str, dict[str, Any]]:
        m, g = self.pick_key()
        key = (m, g if g is not None else "default")
        kw = self.known_worker(key)
        if kw is not None and self.rng.random() < 0.7:
            return "unregister", {"worker_id": kw[0], **key_fields(m, g)}
        return "unregister:unknown", {"worker_id": self.rng.choice(WORKERS), **key_fields(m, g)}

    def add_body(self) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        m, g = self.pick_key(known=0.9)
        key = (m, g if g is not None else "default")
        kw = self.known_worker(key)
        label = "add"
        if kw is None:
            wid, rank = rng.choice(WORKERS), rng.randint(0, 2)
            label = "add:no_tracker" if key not in self.model.workers else "add:unknown_worker"
        else:
            wid, (start, size) = kw
            rank = start + rng.randrange(size)
            roll = rng.random()
            if roll < 0.08:
                rank, label = start + size + rng.randint(0, 2), "add:unknown_rank"
                rank = min(rank, U32_MAX)
                if start <= rank < start + size:
                    label = "add"
            elif roll < 0.12:
                wid, label = rng.choice([w for w in WORKERS if w != wid]), "add:other_worker"
        rid = self.pick_rid(key, active=0.15)
        if rid in self.model.requests.get(key, {}):
            label = "add:duplicate" if label == "add" else label
        hashes = self.tree.prompt()
        if not hashes:
            label += ":empty_hashes"
        body: dict[str, Any] = {**key_fields(m, g), "request_id": rid, "worker_id": wid}
        body.update(dp_rank=rank, sequence_hashes=hashes)
        tokens = self.isl()
        if tokens or rng.random() < 0.5:
            body["new_isl_tokens"] = tokens
        return label, body

    def request_body(self, route: str) -> tuple[str, dict[str, Any]]:
        m, g = self.pick_key(known=0.9)
        key = (m, g if g is not None else "default")
        rid = self.pick_rid(key, active=0.7)
        known = rid in self.model.requests.get(key, {})
        label = route.strip("/") + ("" if known else ":unknown")
        if key not in self.model.workers:
            label = route.strip("/") + ":no_tracker"
        return label, {**key_fields(m, g), "request_id": rid}

    def potential_body(self) -> tuple[str, dict[str, Any]]:
        m, g = self.pick_key(known=0.9)
        key = (m, g if g is not None else "default")
        body: dict[str, Any] = {**key_fields(m, g), "sequence_hashes": self.tree.prompt()}
        tokens = self.isl() if self.rng.random() < 0.7 else None
        if tokens is not None:
            body["new_isl_tokens"] = min(tokens, 10**6)
        return (
            "potential_loads" if key in self.model.workers else "potential_loads:no_tracker"
        ), body

    def valid_post(self, route: str | None = None) -> tuple[str, str, dict[str, Any]]:
        route = route or self.rng.choice(POST_ROUTES)
        if route == "/register":
            label, body = self.register_body()
        elif route == "/unregister":
            label, body = self.unregister_body()
        elif route == "/add":
            label, body = self.add_body()
        elif route == "/potential_loads":
            label, body = self.potential_body()
        else:
            label, body = self.request_body(route)
        return route, label, body

    # -- reads -----------------------------------------------------------------------------

    def get_query(self) -> tuple[str, str]:
        rng = self.rng
        m, g = self.pick_key(known=0.8)
        enc = lambda s: quote(s, safe="")  # noqa: E731
        options = [
            ("all", ""),
            ("model", f"?model_name={enc(m)}"),
            ("group", f"?routing_group={enc(g if g is not None else 'default')}"),
            (
                "both",
                f"?model_name={enc(m)}&routing_group={enc(g if g is not None else 'default')}",
            ),
            ("empty_model", "?model_name"),
            ("empty_model_eq", "?model_name="),
            ("unknown_key", "?tenant_id=g1"),
            ("unknown_model", "?model_name=zzz"),
            ("plus_space", "?model_name=m+0"),
            ("dup_model", f"?model_name={enc(m)}&model_name={enc(m)}"),
            ("dup_group", "?routing_group=a&routing_group=b"),
            ("bad_percent", "?model_name=%ZZ"),
            ("trailing_amp", f"?model_name={enc(m)}&"),
        ]
        weights = [6, 6, 3, 4, 1, 1, 1, 1, 1, 1, 1, 1, 1]
        name, q = rng.choices(options, weights)[0]
        return name, q

    # -- malformed bodies ------------------------------------------------------------------

    def malformed(self) -> Req:
        rng = self.rng
        route, label, body = self.valid_post()
        kinds = [
            ("bad_json", 5),
            ("empty_body", 2),
            ("ctype", 5),
            ("ctype_ok", 3),
            ("missing_field", 6),
            ("wrong_type", 6),
            ("out_of_range", 6),
            ("number_form", 4),
            ("dup_key", 3),
            ("extra_fields", 4),
            ("scalar_body", 2),
            ("hashes_shape", 4),
            ("truncated_after_bad_type", 2),
            ("string_escapes", 3),
            ("deep_nesting", 2),
            ("trailing_junk", 3),
            ("nonfinite_extra", 2),
            ("invalid_utf8_extra", 1),
            ("unknown_route", 4),
            ("wrong_method", 4),
            ("head", 1),
            ("big_body", 1 if self.big_done < 3 else 0),
            ("array_body", 2 if self.array_bodies else 0),
        ]
        kind = rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
        tag = f"malformed:{kind}"
        if kind == "bad_json":
            raw = rng.choice(
                [
                    b"{",
                    b'{"model_name":',
                    b'{"model_name":"m0",}',
                    b"[1,2",
                    b"nul",
                    b'{"worker_id":1}x',
                    b"{'model_name':'m0'}",
                    b'{"a":NaN}',
                    b'{"a":01}',
                    b'{"a":1e400}',
                    b"// c\n{}",
                    b'{"model_name":"m0" "x":1}',
                    b"\xef\xbb\xbf{}",
                ]
            )
            return Req(f"{tag}:{raw[:12]!r}", "POST", route, raw)
        if kind == "empty_body":
            return Req(tag, "POST", route, rng.choice([b"", b"   ", b"\n"]))
        if kind == "ctype":
            ct = rng.choice([None, "text/plain", "application/x-www-form-urlencoded", "json", ""])
            return Req(f"{tag}:{ct}", "POST", route, jdump(body), ct)
        if kind == "ctype_ok":
            ct = rng.choice(
                [
                    "application/json; charset=utf-8",
                    "application/vnd.api+json",
                    "APPLICATION/JSON",
                    "application/json;charset=UTF-8",
                    "application/problem+json",
                ]
            )
            return self._mutating(Req(f"{tag}:{ct}", "POST", route, jdump(body), ct), route, body)
        if kind == "missing_field":
            name = rng.choice(sorted(body))
            body.pop(name)
            return Req(f"{tag}:{route}.{name}", "POST", route, jdump(body))
        if kind == "wrong_type":
            name = rng.choice(sorted(body))
            bad = rng.choice(['"3"', "1.5", "true", "null", "[]", "{}", "-3", '"m0"', "4.0"])
            value = json.loads(bad)
            if value == body[name] or (isinstance(body[name], str) and isinstance(value, str)):
                value = None
            body[name] = value
            return Req(f"{tag}:{route}.{name}={json.dumps(value)}", "POST", route, jdump(body))
        if kind == "out_of_range":
            ints = [k for k, v in body.items() if isinstance(v, int) and not isinstance(v, bool)]
            if "sequence_hashes" in body:
                ints.append("sequence_hashes")
            if not ints:
                return Req(tag + ":none", "POST", route, jdump(body))
            name = rng.choice(ints)
            if name == "sequence_hashes":
                v = rng.choice([2**63, I64_MIN - 1, U64_MAX, 2**64])
                body[name] = [*body[name], v]
                return Req(f"{tag}:{route}.hash={v}", "POST", route, jdump(body))
            u32 = name in ("block_size", "dp_start", "dp_size", "dp_rank")
            v = rng.choice([-1, U32_MAX + 1] if u32 else [-1, U64_MAX + 1, -(2**63)])
            body[name] = v
            return Req(f"{tag}:{route}.{name}={v}", "POST", route, jdump(body))
        if kind == "number_form":
            ints = [k for k, v in body.items() if isinstance(v, int) and not isinstance(v, bool)]
            if not ints:
                return Req(tag + ":none", "POST", route, jdump(body))
            name = rng.choice(ints)
            form = rng.choice(["-0", "1e2", "1E0", "2.0", "0.0", "100000000000000000000000"])
            text = jdump(body).decode()
            old = f'"{name}":{json.dumps(body[name])}'
            raw = text.replace(old, f'"{name}":{form}', 1).encode()
            return self._mutating(Req(f"{tag}:{name}={form}", "POST", route, raw), route, None)
        if kind == "dup_key":
            name = rng.choice(sorted(body))
            other = self._alt_value(name, body[name])
            text = jdump(body).decode()
            raw = (text[:-1] + "," + json.dumps(name) + ":" + json.dumps(other) + "}").encode()
            return self._mutating(Req(f"{tag}:{route}.{name}", "POST", route, raw), route, None)
        if kind == "extra_fields":
            extra = rng.choice(
                [
                    {"extra": 5},
                    {"tenant_id": "t1"},
                    {"extra": {"nested": [1, {"a": None}]}},
                    {"lora_name": None},
                    {"x": "y", "z": [1.5, True]},
                ]
            )
            body.update(extra)
            return self._mutating(
                Req(f"{tag}:{route}:{sorted(extra)}", "POST", route, jdump(body)), route, body
            )
        if kind == "scalar_body":
            raw = rng.choice([b"5", b'"x"', b"null", b"true", b"[]", b"{}", b"-1.5"])
            return Req(f"{tag}:{raw.decode()}", "POST", route, raw)
        if kind == "hashes_shape":
            route, label, body = self.valid_post(rng.choice(["/add", "/potential_loads"]))
            bad = rng.choice(
                ['"abc"', "{}", "[[1]]", "[null]", "[true]", "[1.5]", '["1"]', "null", "5"]
            )
            body["sequence_hashes"] = json.loads(bad)
            return Req(f"{tag}:{route}={bad}", "POST", route, jdump(body))
        if kind == "truncated_after_bad_type":
            name = rng.choice(sorted(body))
            body[name] = [1] if isinstance(body[name], str) else "x"
            text = jdump(body).decode()
            cut = text.index(json.dumps(name)) + len(json.dumps(name)) + 1
            cut += len(json.dumps(body[name]))
            raw = text[:cut].encode() + rng.choice([b"", b",", b", junk", b"}}"])
            return Req(f"{tag}:{route}.{name}", "POST", route, raw)
        if kind == "string_escapes":
            strs = [k for k, v in body.items() if isinstance(v, str)]
            name = rng.choice(strs)
            esc = rng.choice(
                [
                    ("\\u006d0", "escaped_ok"),  # "m0"
                    ("\\ud800", "lone_surrogate"),
                    ("\\ud83d\\ude00", "surrogate_pair"),
                    ("a\nb", "raw_newline"),
                    ("\\x41", "bad_escape"),
                    ("\xff", "invalid_utf8"),
                    ("\\u0000", "nul_escape"),
                ]
            )
            text = jdump(body).decode()
            old = f'"{name}":{json.dumps(body[name])}'
            new = f'"{name}":"{esc[0]}"'
            raw = text.replace(old, new, 1).encode("utf-8", "surrogateescape")
            if esc[1] == "invalid_utf8":
                raw = text.replace(old, f'"{name}":"XX"', 1).encode().replace(b"XX", b"\xff\xfe")
            return self._mutating(Req(f"{tag}:{esc[1]}", "POST", route, raw), route, None)
        if kind == "trailing_junk":
            junk = rng.choice([b" x", b"}", b",", b"{}", b"[", b" 5", b'"s"', b"\x00"])
            return self._mutating(
                Req(f"{tag}:{junk!r}", "POST", route, jdump(body) + junk), route, body
            )
        if kind == "nonfinite_extra":
            lit = rng.choice([b"NaN", b"Infinity", b"-Infinity"])
            raw = jdump(body)[:-1] + b',"extra":' + lit + b"}"
            return self._mutating(Req(f"{tag}:{lit.decode()}", "POST", route, raw), route, body)
        if kind == "invalid_utf8_extra":
            raw = jdump(body)[:-1] + b',"extra":"\xff\xfe"}'
            return self._mutating(Req(tag, "POST", route, raw), route, body)
        if kind == "deep_nesting":
            depth = rng.choice([127, 128, 129, 200, 256, 1000])
            obj = rng.random() < 0.5
            body["extra"] = "@@"
            inner = b'{"a":' * depth + b"1" + b"}" * depth if obj else b"[" * depth + b"]" * depth
            raw = jdump(body).replace(b'"@@"', inner)
            shape = "objects" if obj else "arrays"
            return self._mutating(Req(f"{tag}:{depth} {shape}", "POST", route, raw), route, None)
        if kind == "unknown_route":
            path = rng.choice(UNKNOWN_PATHS)
            method = rng.choice(["GET", "POST"])
            return Req(
                f"{tag}:{method} {path}", method, path, jdump(body) if method == "POST" else None
            )
        if kind == "wrong_method":
            method, path = rng.choice(WRONG_METHODS)
            data = jdump(body) if method in ("PUT", "PATCH", "POST") else None
            return Req(f"{tag}:{method} {path}", method, path, data)
        if kind == "head":
            path = rng.choice(["/health", "/workers", "/loads", "/loads?model_name=m0"])
            return Req(f"{tag}:{path}", "HEAD", path)
        if kind == "big_body":
            self.big_done += 1
            return self.big_body()
        # array_body: serde accepts a positional array (OPTIONAL quirk in SPEC §7.3)
        order = {
            "/register": [
                "worker_id",
                "model_name",
                "routing_group",
                "block_size",
                "dp_start",
                "dp_size",
            ],
        }.get(route)
        if order is None:
            return Req(f"{tag}:none", "POST", route, jdump([]))
        body.setdefault("routing_group", "default")
        return self._mutating(
            Req(f"{tag}:{route}", "POST", route, jdump([body[k] for k in order])), route, None
        )

    def big_body(self) -> Req:
        rng = self.rng
        m, g = self.pick_key(known=0.95)
        which = rng.choice(["exact", "over", "many_hashes"])
        if which == "many_hashes":
            hashes = self.tree.chain(70_000)
            body = {**key_fields(m, g), "sequence_hashes": hashes}
            return Req("malformed:big_body:70000_hashes", "POST", "/potential_loads", jdump(body))
        base = {**key_fields(m, g), "sequence_hashes": self.tree.prompt(), "pad": ""}
        size = BODY_LIMIT + (0 if which == "exact" else 1)
        raw = jdump(base)
        pad = size - len(raw)
        raw = raw.replace(b'"pad":""', b'"pad":"' + b"x" * pad + b'"')
        assert len(raw) == size, (len(raw), size)
        return Req(f"malformed:big_body:{which}", "POST", "/potential_loads", raw)

    def _alt_value(self, name: str, value: Any) -> Any:
        if isinstance(value, bool):
            return not value
        if isinstance(value, int):
            return 2 if value != 2 else 1
        if isinstance(value, str):
            return value + "x"
        if isinstance(value, list):
            return self.tree.prompt()
        return value

    def _mutating(self, req: Req, route: str, body: dict[str, Any] | None) -> Req:
        req.route_body = (route, body)  # type: ignore[attr-defined]
        return req

    # -- top level -------------------------------------------------------------------------

    def next(self) -> Req:
        rng = self.rng
        ops = [
            ("register", 11),
            ("unregister", 4),
            ("add", 24),
            ("prefill_complete", 7),
            ("free", 11),
            ("workers", 4),
            ("loads", 8),
            ("potential_loads", 12),
            ("health", 1),
            ("malformed", self.malformed_weight),
        ]
        op = rng.choices([o for o, _ in ops], [w for _, w in ops])[0]
        if op == "malformed":
            return self.malformed()
        if op == "health":
            return Req("health", "GET", "/health")
        if op in ("workers", "loads"):
            name, q = self.get_query()
            return Req(f"{op}:{name}", "GET", f"/{op}{q}")
        route, label, body = self.valid_post("/" + op)
        req = Req(label, "POST", route, jdump(body, ascii_only=rng.random() < 0.3))
        req.route_body = (route, body)  # type: ignore[attr-defined]
        return req

    def observe(self, req: Req, ref: Resp) -> None:
        """Update the model from the reference's answer to a request."""
        route_body = getattr(req, "route_body", None)
        if route_body is None or not 200 <= ref.status < 300:
            return
        route, body = route_body
        if body is None:
            try:
                body = json.loads(req.body or b"")
            except (ValueError, RecursionError):
                return
            if not isinstance(body, dict):
                return
        try:
            key = key_of(body)
            if route == "/register":
                self.model.block_size[key] = body["block_size"]
                self.model.workers.setdefault(key, {})[body["worker_id"]] = (
                    body["dp_start"],
                    body["dp_size"],
                )
            elif route == "/unregister":
                ws = self.model.workers.get(key, {})
                ws.pop(body["worker_id"], None)
                reqs = self.model.requests.get(key, {})
                for rid in [r for r, (w, _) in reqs.items() if w == body["worker_id"]]:
                    del reqs[rid]
                if not ws:
                    self.model.workers.pop(key, None)
                    self.model.block_size.pop(key, None)
                    self.model.requests.pop(key, None)
            elif route == "/add":
                self.model.requests.setdefault(key, {})[body["request_id"]] = (
                    body["worker_id"],
                    body["dp_rank"],
                )
            elif route == "/free":
                self.model.requests.get(key, {}).pop(body["request_id"], None)
        except (KeyError, TypeError):
            pass


# ---------------------------------------------------------------------------------------------
# Fixed scenarios (SPEC §9.6 and hand-picked edges), run once on empty servers before the runs


def _p(label: str, path: str, body: Any, ctype: str | None = "application/json") -> Req:
    raw = body if isinstance(body, bytes) else jdump(body)
    return Req(f"fixed:{label}", "POST", path, raw, ctype)


def _g(label: str, path: str, method: str = "GET") -> Req:
    return Req(f"fixed:{label}", method, path)


def _reg(label: str, wid: int, model: str, bs: int, start: int, size: int, **kw: Any) -> Req:
    body = {"worker_id": wid, "model_name": model, **kw, "block_size": bs}
    body.update(dp_start=start, dp_size=size)
    return _p(label, "/register", body)


def _add(
    label: str,
    model: str,
    rid: str,
    wid: int,
    rank: int,
    hashes: Any,
    isl: int | None = None,
    **kw: Any,
) -> Req:
    body: dict[str, Any] = {"model_name": model, **kw, "request_id": rid, "worker_id": wid}
    body.update(dp_rank=rank, sequence_hashes=hashes)
    if isl is not None:
        body["new_isl_tokens"] = isl
    return _p(label, "/add", body)


def _rq(label: str, path: str, model: str, rid: str, **kw: Any) -> Req:
    return _p(label, path, {"model_name": model, **kw, "request_id": rid})


def _pot(label: str, model: str, hashes: Any, isl: int | None = None, **kw: Any) -> Req:
    body: dict[str, Any] = {"model_name": model, **kw, "sequence_hashes": hashes}
    if isl is not None:
        body["new_isl_tokens"] = isl
    return _p(label, "/potential_loads", body)


def fixed_scenarios(array_bodies: bool = False) -> list[list[Req]]:
    g: list[list[Req]] = []
    g.append([_g("H01:health", "/health"), _g("H01:head_health", "/health", "HEAD")])
    g.append(
        [
            _reg("H02:register", 1, "m", 16, 2, 2),
            _g("H02:workers", "/workers"),
            _g("H02:loads", "/loads"),
            _g("H02:head_loads", "/loads", "HEAD"),
        ]
    )
    g.append(
        [
            _reg("H03:bs0_dp0", 1, "h3", 0, 0, 0),
            _reg("H03:dp0", 1, "h3", 8, 0, 0),
            _reg("H03:overflow", 1, "h3", 8, U32_MAX, 1),
            _reg("H03:max_start", 1, "h3", 8, U32_MAX - 1, 1),
            _reg("H03:dp_size_4097", 2, "h3", 8, 0, 4097),
            _reg("H03:dp_size_4097_bs0", 2, "h3", 0, 0, 4097),
            _reg("H03:dp_size_4097_overflow", 2, "h3", 8, U32_MAX, 4097),
            _reg("H03:dp_size_4096_overflow", 2, "h3", 8, U32_MAX - 100, 4096),
            _reg("H03:dp_size_4097_mismatch", 2, "h3", 4, 0, 4097),
            _reg("H03:dp_size_4096", 3, "h3", 8, 0, 4096),
            _g("H03:loads_4096", "/loads?model_name=h3"),
        ]
    )
    g.append(
        [
            _reg("H04:first", 1, "m4", 4, 0, 2),
            _reg("H04:duplicate", 1, "m4", 4, 0, 2),
            _reg("H04:mismatch", 2, "m4", 8, 0, 2),
            _reg("H04:mismatch_before_dup", 1, "m4", 8, 0, 2),
        ]
    )
    g.append(
        [
            _reg("H05:setup", 1, "m5", 4, 0, 1),
            _p("H05:unknown_worker", "/unregister", {"worker_id": 99, "model_name": "m5"}),
            _p("H05:unknown_model", "/unregister", {"worker_id": 1, "model_name": "nomodel"}),
            _p("H05:existing", "/unregister", {"worker_id": 1, "model_name": "m5"}),
            _p("H05:repeat", "/unregister", {"worker_id": 1, "model_name": "m5"}),
        ]
    )
    g.append(
        [
            _add("H06:no_tracker", "m6", "r1", 1, 0, [1, 2]),
            _reg("H06:setup", 1, "m6", 4, 0, 2),
            _add("H06:r1", "m6", "r1", 1, 0, [1, 2]),
            _add("H06:dup_same_rank", "m6", "r1", 1, 0, [1, 2]),
            _add("H06:dup_other_rank", "m6", "r1", 1, 1, [1, 2]),
            _add("H06:rank_not_registered", "m6", "r2", 1, 2, [1]),
            _add("H06:worker_not_registered", "m6", "r2", 9, 0, [1]),
        ]
    )
    g.append(
        [
            _reg("H07:setup", 1, "h7", 16, 0, 1),
            _rq("H07:free_early", "/free", "h7", "early-free"),
            _rq("H07:complete_early", "/prefill_complete", "h7", "early-complete"),
            _add("H07:bad_rank", "h7", "bad-rank", 1, 1, [1, 2], 8),
            _add("H07:add", "h7", "early-free", 1, 0, [1, 2], 8),
            _add("H07:add_again", "h7", "early-free", 1, 0, [1, 2], 8),
            _rq("H07:complete1", "/prefill_complete", "h7", "early-free"),
            _rq("H07:complete2", "/prefill_complete", "h7", "early-free"),
            _rq("H07:free1", "/free", "h7", "early-free"),
            _rq("H07:free2", "/free", "h7", "early-free"),
            _rq("H07:complete_after_free", "/prefill_complete", "h7", "early-free"),
            _add("H07:add2", "h7", "early-complete", 1, 0, [3], 8),
            _g("H07:loads", "/loads?model_name=h7"),
            _rq("H07:free3", "/free", "h7", "early-complete"),
            _g("H07:loads_after", "/loads?model_name=h7"),
        ]
    )
    g.append(
        [
            _reg("H08:setup", 1, "h8", 16, 0, 1),
            _add("H08:add", "h8", "req-1", 1, 0, [1, 2, 3], 8),
            _pot("H08:potential", "h8", [1, 2, 4], 5),
        ]
    )
    g.append(
        [
            _reg("H09:register", 1, "m2", 4, 0, 2),
            _add("H09:r1", "m2", "r1", 1, 0, [1, 2, 3], 12),
            _g("H09:loads1", "/loads?model_name=m2"),
            _add("H09:r2", "m2", "r2", 1, 0, [1, 2, 4, 5], 16),
            _g("H09:loads2", "/loads?model_name=m2"),
            _pot("H09:potential", "m2", [1, 2, 3, 5], 7),
            _rq("H09:complete_r1", "/prefill_complete", "m2", "r1"),
            _g("H09:loads3", "/loads?model_name=m2"),
            _rq("H09:free_r1", "/free", "m2", "r1"),
            _g("H09:loads4", "/loads?model_name=m2"),
            _rq("H09:free_r2", "/free", "m2", "r2"),
            _g("H09:loads5", "/loads?model_name=m2"),
        ]
    )
    g.append(
        [
            _reg("H10:setup", 1, "t", 4, 0, 1),
            _add("H10:a", "t", "a", 1, 0, [1, 2, 3]),
            _add("H10:b", "t", "b", 1, 0, [1, 4, 5]),
            _pot("H10:q143", "t", [1, 4, 3]),
            _pot("H10:q45", "t", [4, 5]),
            _pot("H10:q2", "t", [2]),
            _pot("H10:q12345", "t", [1, 2, 3, 4, 5]),
            _g("H10:loads", "/loads?model_name=t"),
        ]
    )
    g.append(
        [
            _reg("H11:setup", 1, "s", 4, 0, 1),
            _add("H11:signed", "s", "a", 1, 0, [-1, I64_MAX]),
            _g("H11:loads", "/loads?model_name=s"),
            _add("H11:u64max", "s", "b", 1, 0, [U64_MAX]),
            _add("H11:2^63", "s", "b", 1, 0, [2**63]),
            _add("H11:float", "s", "b", 1, 0, [1.5]),
            _add("H11:string", "s", "b", 1, 0, ["1"]),
            _add("H11:null", "s", "b", 1, 0, None),
            _p(
                "H11:missing",
                "/add",
                {"model_name": "s", "request_id": "b", "worker_id": 1, "dp_rank": 0},
            ),
            _add("H11:isl_negative", "s", "b", 1, 0, [1], -1),
            _p(
                "H11:missing_rank",
                "/add",
                {"model_name": "s", "request_id": "b", "worker_id": 1, "sequence_hashes": []},
            ),
            _pot("H11:potential_negative", "s", [-1, I64_MAX, 7]),
        ]
    )
    g.append(
        [
            _reg("H12:w1", 1, "m3", 4, 0, 1),
            _reg("H12:w2", 2, "m3", 4, 0, 1),
            _add("H12:a", "m3", "a", 1, 0, [1, 2], 8),
            _add("H12:b", "m3", "b", 2, 0, [1, 2, 3], 12),
            _p("H12:unregister1", "/unregister", {"worker_id": 1, "model_name": "m3"}),
            _g("H12:loads", "/loads?model_name=m3"),
            _rq("H12:complete_a", "/prefill_complete", "m3", "a"),
            _rq("H12:free_a", "/free", "m3", "a"),
            _add("H12:readd_a", "m3", "a", 2, 0, [1, 2], 8),
            _g("H12:loads2", "/loads?model_name=m3"),
            _reg("H12:register1_again", 1, "m3", 4, 0, 1),
            _g("H12:loads3", "/loads?model_name=m3"),
            _p("H13:unregister1", "/unregister", {"worker_id": 1, "model_name": "m3"}),
            _p("H13:unregister2", "/unregister", {"worker_id": 2, "model_name": "m3"}),
            _g("H13:workers", "/workers?model_name=m3"),
            _g("H13:loads", "/loads?model_name=m3"),
            _rq("H13:free_a", "/free", "m3", "a"),
            _p("H13:unregister2_again", "/unregister", {"worker_id": 2, "model_name": "m3"}),
            _reg("H13:new_block_size", 2, "m3", 16, 0, 1),
        ]
    )
    g.append(
        [
            _reg("H14:default", 1, "h", 16, 0, 1),
            _reg("H14:a", 1, "h", 16, 0, 1, routing_group="a"),
            _reg("H14:b", 1, "h", 32, 0, 1, routing_group="b"),
            _g("H14:workers", "/workers"),
            _add("H14:same_id_default", "h", "x", 1, 0, [1]),
            _add("H14:same_id_a", "h", "x", 1, 0, [1], routing_group="a"),
            _add("H14:zzz", "h", "y", 1, 0, [1], routing_group="zzz"),
            _p(
                "H14:unregister_zzz",
                "/unregister",
                {"worker_id": 1, "model_name": "h", "routing_group": "zzz"},
            ),
            _g("H14:loads", "/loads"),
        ]
    )
    valid = {"worker_id": 1, "model_name": "j", "block_size": 4, "dp_start": 0, "dp_size": 1}
    vb = jdump(valid)
    g.append(
        [
            _p("H15:open_brace", "/register", b"{"),
            _p("H15:empty", "/register", b""),
            _p("H15:no_ctype", "/register", vb, None),
            _p("H15:text_plain", "/register", vb, "text/plain"),
            _p(
                "H15:charset",
                "/register",
                {**valid, "worker_id": 5},
                "application/json; charset=utf-8",
            ),
            _p("H15:plus_json", "/register", {**valid, "worker_id": 6}, "application/vnd.x+json"),
            _p("H15:upper", "/register", {**valid, "worker_id": 7}, "Application/JSON"),
            _p("H15:missing", "/register", {k: v for k, v in valid.items() if k != "dp_size"}),
            _p("H15:negative", "/register", {**valid, "worker_id": -3}),
            _p("H15:string", "/register", {**valid, "worker_id": "3"}),
            _p("H15:null_group", "/register", {**valid, "routing_group": None}),
            _p("H15:bs_2^32", "/register", {**valid, "block_size": 2**32}),
            _p(
                "H15:body_limit",
                "/potential_loads",
                _sized({"model_name": "j", "sequence_hashes": [1], "pad": ""}, BODY_LIMIT),
            ),
            _p(
                "H15:body_limit+1",
                "/potential_loads",
                _sized({"model_name": "j", "sequence_hashes": [1], "pad": ""}, BODY_LIMIT + 1),
            ),
            _p("H15:body_limit+1_no_ctype", "/potential_loads", b"x" * (BODY_LIMIT + 1), None),
            _p("H15:body_limit+1_bad_json", "/potential_loads", b"{" * (BODY_LIMIT + 1)),
        ]
    )
    g.append(
        [
            _g("H16:get_nonexistent", "/nonexistent"),
            _p("H16:post_nonexistent", "/nonexistent", {}),
            _g("H16:health_slash", "/health/"),
            _g("H16:unregister_get", "/unregister"),
            _p("H16:health_post", "/health", {}),
            _p("H16:workers_post", "/workers", {}),
            _g("H16:add_get", "/add"),
            Req("fixed:H16:register_put", "PUT", "/register", vb),
            Req("fixed:H16:free_delete", "DELETE", "/free"),
            Req("fixed:H16:add_options", "OPTIONS", "/add"),
            Req("fixed:H16:head_add", "HEAD", "/add"),
            _g("H16:percent_encoded_path", "/%61dd"),
            _p("H16:percent_encoded_path_post", "/%72egister", {**valid, "worker_id": 8}),
            _g("H16:double_slash", "//workers"),
            _g("H16:query_on_post_route", "/workers?"),
        ]
    )
    g.append(
        [
            _p(
                "H17:tenant_id",
                "/register",
                {**valid, "model_name": "k", "tenant_id": "t1", "extra": 5},
            ),
            _g("H17:workers", "/workers?model_name=k"),
            _add("H17:lora_eot", "k", "r", 1, 0, [1], 4, lora_name="l1", expected_output_tokens=9),
            _g("H17:loads", "/loads?model_name=k"),
        ]
    )
    g.append(
        [
            _reg("H18:setup", 1, "m", 4, 0, 1, routing_group="g0"),
            _g("H18:group_g1", "/workers?routing_group=g1"),
            _g("H18:model_zzz", "/workers?model_name=zzz"),
            _g("H18:tenant", "/workers?tenant_id=g1"),
            _g("H18:dup_model", "/workers?model_name=m&model_name=n"),
            _g("H18:dup_model_loads", "/loads?model_name=m&model_name=n"),
            _g("H18:empty_model", "/workers?model_name"),
            _g("H18:head_dup", "/workers?model_name=m&model_name=n", "HEAD"),
        ]
    )
    # Order of checks: deserialization (422) before the tracker lookup (404), etc.
    g.append(
        [
            _p(
                "X:add_no_hashes_no_tracker",
                "/add",
                {"model_name": "nt", "request_id": "r", "worker_id": 1, "dp_rank": 0},
            ),
            _add("X:add_null_hashes_no_tracker", "nt", "r", 1, 0, None),
            _p("X:potential_no_hashes_no_tracker", "/potential_loads", {"model_name": "nt"}),
            _pot("X:potential_null_hashes_no_tracker", "nt", None),
        ]
    )
    # Each of these on servers holding just tracker "nt" (a divergence empties both servers).
    edge: list[Req] = [
        _p(
            "X:add_no_hashes",
            "/add",
            {"model_name": "nt", "request_id": "r", "worker_id": 1, "dp_rank": 0},
        ),
        _add("X:add_null_hashes", "nt", "r", 1, 0, None),
        _p("X:potential_no_hashes", "/potential_loads", {"model_name": "nt"}),
        _pot("X:potential_null_hashes", "nt", None),
        _add("X:add_null_isl", "nt", "r", 1, 0, [1], None, new_isl_tokens=None),
        _pot("X:potential_null_isl", "nt", [1], None, new_isl_tokens=None),
        _p("X:nan_in_extra", "/register", vb[:-1] + b',"extra":NaN}'),
        _p(
            "X:infinity_in_extra",
            "/add",
            b'{"model_name":"nt","request_id":"inf","worker_id":1,"dp_rank":0,"sequence_hashes":[],"x":-Infinity}',
        ),
        _p(
            "X:minus_zero",
            "/add",
            b'{"model_name":"nt","request_id":"z","worker_id":1,"dp_rank":-0,"sequence_hashes":[]}',
        ),
        _p(
            "X:dup_key",
            "/add",
            b'{"model_name":"nt","request_id":"d","request_id":"e","worker_id":1,"dp_rank":0,"sequence_hashes":[]}',
        ),
        _p(
            "X:dup_unknown_key",
            "/add",
            b'{"model_name":"nt","request_id":"u","worker_id":1,"dp_rank":0,"sequence_hashes":[],"x":1,"x":2}',
        ),
        _p("X:type_error_then_eof", "/add", b'{"model_name":5'),
        _p("X:missing_then_trailing", "/free", b'{"model_name":"nt"} x'),
        _p("X:valid_then_trailing", "/free", b'{"model_name":"nt","request_id":"r"} x'),
        _p("X:array_then_eof", "/free", b'["nt"'),
        _p(
            "X:deep_129",
            "/free",
            b'{"model_name":"nt","request_id":"r","x":' + b"[" * 129 + b"]" * 129 + b"}",
        ),
        _p(
            "X:deep_128",
            "/free",
            b'{"model_name":"nt","request_id":"r","x":' + b"[" * 128 + b"]" * 128 + b"}",
        ),
        _p(
            "X:deep_127",
            "/free",
            b'{"model_name":"nt","request_id":"r","x":' + b"[" * 127 + b"]" * 127 + b"}",
        ),
        _p(
            "X:deep_obj_200",
            "/free",
            b'{"model_name":"nt","request_id":"r","x":' + b'{"a":' * 200 + b"1" + b"}" * 200 + b"}",
        ),
        _p(
            "X:deep_arr_1000",
            "/free",
            b'{"model_name":"nt","request_id":"r","x":' + b"[" * 1000 + b"]" * 1000 + b"}",
        ),
        _p("X:bom", "/free", b'\xef\xbb\xbf{"model_name":"nt","request_id":"r"}'),
        _p("X:lone_surrogate", "/free", b'{"model_name":"nt","request_id":"\\ud800"}'),
        _p("X:invalid_utf8", "/free", b'{"model_name":"nt","request_id":"\xff"}'),
        _p(
            "X:invalid_utf8_unknown_field",
            "/free",
            b'{"model_name":"nt","request_id":"r","x":"\xff"}',
        ),
        _p(
            "X:nul_in_name",
            "/add",
            {
                "model_name": "nt",
                "request_id": "a\u0000b",
                "worker_id": 1,
                "dp_rank": 0,
                "sequence_hashes": [],
            },
        ),
        _p(
            "X:bool_for_int",
            "/add",
            {
                "model_name": "nt",
                "request_id": "b",
                "worker_id": True,
                "dp_rank": 0,
                "sequence_hashes": [],
            },
        ),
        _p(
            "X:exp_int",
            "/add",
            b'{"model_name":"nt","request_id":"e","worker_id":1e0,"dp_rank":0,"sequence_hashes":[]}',
        ),
        _p(
            "X:big_int_literal",
            "/add",
            b'{"model_name":"nt","request_id":"e","worker_id":123456789012345678901234567890,"dp_rank":0,"sequence_hashes":[]}',
        ),
        _p(
            "X:huge_exponent",
            "/add",
            b'{"model_name":"nt","request_id":"e","worker_id":1,"dp_rank":0,"sequence_hashes":[],"x":1e400}',
        ),
        _p("X:scalar", "/free", b"5"),
        _p("X:null_body", "/free", b"null"),
        _p("X:whitespace_only", "/free", b"  \n "),
    ]
    g.extend(
        [_reg("X:setup", 1, "nt", 4, 0, 1), r, _g("X:loads", "/loads?model_name=nt")] for r in edge
    )
    if array_bodies:
        g.append(
            [
                _p("Q:array_register", "/register", [5, "arr", "default", 4, 0, 1]),
                _p("Q:array_add", "/add", ["arr", "default", "r", 5, 0, [1, 2], 3]),
                _p("Q:array_short", "/register", [5, "arr"]),
                _g("Q:loads", "/loads?model_name=arr"),
            ]
        )
    return g


def _sized(body: dict[str, Any], size: int) -> bytes:
    raw = jdump(body)
    pad = size - len(raw)
    raw = raw.replace(b'"pad":""', b'"pad":"' + b"x" * pad + b'"')
    assert len(raw) == size
    return raw


# ---------------------------------------------------------------------------------------------
# Driver


@dataclass
class Difference:
    run: int | str
    index: int
    req: Req
    ref: Resp
    ours: Resp
    mismatches: list[Mismatch]

    @property
    def family(self) -> tuple[str, ...]:
        """Coarser grouping: operation kind (first two label parts), statuses, mismatch kinds."""
        return (":".join(self.req.label.split(":")[:2]), *self.cls[1:])

    @property
    def cls(self) -> tuple[str, ...]:
        label = self.req.label
        kinds = ",".join(sorted({m.kind for m in self.mismatches}))
        return (label, str(self.ref.status), str(self.ours.status), kinds)


class Pair:
    """The two servers under test (started here, or given by URL)."""

    def __init__(
        self, ref_url: str | None, ours_url: str | None, log_dir: Path | None, workers: int = 1
    ) -> None:
        self.given = ref_url is not None and ours_url is not None
        self.workers = workers  # ours as ``python -m kv_slot_tracker --workers N``
        self.ref_url, self.ours_url = ref_url, ours_url
        self.log_dir = log_dir
        self.servers: list[Server] = []
        self.ref_client = httpx.Client(timeout=20.0)
        self.ours_client = httpx.Client(timeout=20.0)

    def start(self) -> None:
        if self.given:
            return
        self.stop()
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(start_reference, log_dir=self.log_dir),
                pool.submit(
                    start_ours, log_dir=self.log_dir, extra_args=["--workers", str(self.workers)]
                ),
            ]
            errors = []
            for f in futures:
                try:
                    self.servers.append(f.result())
                except Exception as e:
                    errors.append(e)
        if errors:
            self.stop()
            raise errors[0]
        ref, ours = self.servers
        self.ref_url, self.ours_url = ref.url, ours.url
        # fresh connections for the fresh servers
        self.ref_client.close()
        self.ours_client.close()
        self.ref_client = httpx.Client(timeout=20.0)
        self.ours_client = httpx.Client(timeout=20.0)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers.clear()

    def alive(self) -> bool:
        return all(s.alive() for s in self.servers)

    def both(self, req: Req) -> tuple[Resp, Resp]:
        assert self.ref_url and self.ours_url
        return send(self.ref_client, self.ref_url, req), send(self.ours_client, self.ours_url, req)

    def reset(self) -> bool:
        """Unregister every worker on both servers (drops every tracker and request)."""
        for client, url in ((self.ref_client, self.ref_url), (self.ours_client, self.ours_url)):
            try:
                rows = client.get(f"{url}/workers").json()
                for row in rows:
                    client.post(
                        f"{url}/unregister",
                        json={
                            "worker_id": row["worker_id"],
                            "model_name": row["model_name"],
                            "routing_group": row["routing_group"],
                        },
                    )
                if client.get(f"{url}/workers").json() or client.get(f"{url}/loads").json():
                    return False
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return False
        return True


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        log_dir = Path(args.log_dir) if args.log_dir else None
        self.pair = Pair(args.ref_url, args.ours_url, log_dir, args.workers)
        self.requests = 0
        self.diffs: list[Difference] = []
        self.classes: dict[tuple[str, ...], list[Difference]] = {}
        self.wording: dict[tuple[str, str], tuple[Req, int]] = {}
        self.wording_total = Counter()
        self.replays = 0
        self.coverage: dict[str, Counter[int]] = {}
        self.minimized: set[tuple[str, ...]] = set()

    # -- one run ---------------------------------------------------------------------------

    def run(self, run: int) -> None:
        args = self.args
        rng = random.Random(f"{args.seed}:{run}")
        gen = Generator(rng, array_bodies=args.array_bodies, malformed=not args.no_malformed)
        self._fresh_servers()
        segment: list[Req] = []
        for i in range(args.ops):
            self.step(run, i, gen.next(), segment, gen)

    def run_fixed(self) -> None:
        """The SPEC §9.6 scenarios and other hand-picked requests, each group on empty servers."""
        self._fresh_servers()
        i = 0
        for group in fixed_scenarios(self.args.array_bodies):
            if not self.pair.reset():
                self.pair.start()
            segment: list[Req] = []
            for req in group:
                self.step("fixed", i, req, segment, None)
                i += 1

    def _fresh_servers(self) -> None:
        if self.pair.given:
            if not self.pair.reset():
                raise RuntimeError("could not reset the given servers")
        else:
            reusable = self.args.reuse_servers and self.pair.servers and self.pair.alive()
            if not reusable or not self.pair.reset():
                self.pair.start()

    def step(
        self, run: int | str, i: int, req: Req, segment: list[Req], gen: Generator | None
    ) -> None:
        """Send one request to both servers and compare; ``segment`` holds the requests since
        the servers were last empty (it is cleared when they are emptied again)."""
        args = self.args
        ref, ours = self.pair.both(req)
        self.requests += 1
        family = ":".join(req.label.split(":")[:2])
        self.coverage.setdefault(family, Counter())[ref.status] += 1
        if gen is not None:
            gen.observe(req, ref)
        req.statuses = (ref.status, ours.status)  # type: ignore[attr-defined]
        segment.append(req)
        mism = compare(req, ref, ours, args.strict_wording)
        self._note_wording(req, ref, ours)
        if args.verbose:
            same = "==" if not mism else "!="
            print(f"[run {run} op {i}] {same} {req.label}: {req.describe(300)}")
            print(f"    ref  {ref.describe()[:300]}")
            if mism:
                print(f"    ours {ours.describe()[:300]}")
        failed = ref.status == -1 or ours.status == -1
        if not failed and all(m.kind == "wording" for m in mism):
            return
        if not mism:
            mism = [Mismatch("status", "no answer from either server")]
        d = Difference(run, i, req, ref, ours, mism)
        self.diffs.append(d)
        self.classes.setdefault(d.cls, []).append(d)
        first = d.family not in self.minimized
        self.minimized.add(d.family)
        self.print_diff(d)
        if first and not args.no_minimize:
            self.minimize(d, segment[:-1])
            # minimization left other state behind: rebuild this segment's state
            if not self.pair.reset():
                self.pair.start()
            for r in segment:
                self.pair.both(r)
        if (not self.pair.given and not self.pair.alive()) or failed:
            print("  (a server failed; restarting both)")
            self.pair.start()
        elif ref.status >= 400 and ours.status >= 400:
            return  # both refused: no state changed
        elif not self.pair.reset():
            # The states may have diverged: start over from empty servers.
            print("  (reset failed; restarting both)")
            self.pair.start()
        if gen is not None:
            gen.model.clear()
        segment.clear()

    def _note_wording(self, req: Req, ref: Resp, ours: Resp) -> None:
        if ref.status != ours.status or ref.status < 400:
            return
        a, b = _error_text(ref), _error_text(ours)
        if a is None or b is None or not a.startswith(SERDE_PREFIXES):
            return
        self.wording_total["same" if a == b else "different"] += 1
        if a != b:
            k = (a, b)
            if k not in self.wording:
                self.wording[k] = (req, ref.status)

    # -- output ----------------------------------------------------------------------------

    def print_diff(self, d: Difference) -> None:
        what = "; ".join(m.detail for m in d.mismatches)
        print(f"[run {d.run} op {d.index}] DIFF {d.req.label}: {what}")
        print(f"  request:   {d.req.describe()}")
        print(f"  reference: {d.ref.describe()}")
        print(f"  ours:      {d.ours.describe()}")
        sys.stdout.flush()

    # -- minimization ----------------------------------------------------------------------

    def _replay(self, prefix: list[Req], final: Req, cls: tuple[str, ...], fresh: bool) -> bool:
        self.replays += 1
        if (fresh and not self.pair.given) or not self.pair.reset():
            self.pair.start()
        for r in prefix:
            self.pair.both(r)
        ref, ours = self.pair.both(final)
        mism = compare(final, ref, ours, self.args.strict_wording)
        if not mism:
            return False
        return Difference(0, 0, final, ref, ours, mism).cls == cls

    def minimize(self, d: Difference, prefix: list[Req]) -> None:
        deadline = time.monotonic() + self.args.minimize_seconds
        cur = list(prefix)

        def fails(cand: list[Req]) -> bool:
            return self._replay(cand, d.req, d.cls, fresh=False)

        # Requests that failed on both servers changed nothing; reads change nothing.
        mutating = [
            r
            for r in cur
            if r.method == "POST"
            and r.path.split("?")[0]
            in ("/register", "/unregister", "/add", "/prefill_complete", "/free")
            and any(200 <= st < 300 for st in getattr(r, "statuses", (200,)))
        ]
        if fails([]):
            cur = []
        else:
            if len(mutating) < len(cur) and fails(mutating):
                cur = mutating
            n = 2
            while len(cur) >= 2 and time.monotonic() < deadline:
                chunk = math.ceil(len(cur) / n)
                reduced = False
                for start in range(0, len(cur), chunk):
                    cand = cur[:start] + cur[start + chunk :]
                    if fails(cand):
                        cur, reduced = cand, True
                        break
                    if time.monotonic() > deadline:
                        break
                if reduced:
                    n = max(n - 1, 2)
                elif chunk == 1:
                    break
                else:
                    n = min(len(cur), n * 2)
        # A one-request reproducer ran on reset (verified empty) servers; longer ones are
        # replayed once more on freshly started servers.
        verified = not cur or self._replay(cur, d.req, d.cls, fresh=True)
        # show the reproducer with both answers, on a fresh state
        if not self.pair.reset():
            self.pair.start()
        note = "reproduced on empty servers" if verified else "NOT reproduced on fresh servers"
        print(f"  minimized reproducer ({len(cur) + 1} requests, {note}):")
        for r in [*cur, d.req]:
            a, b = self.pair.both(r)
            mark = "  " if (a.status, a.body) == (b.status, b.body) else "≠ "
            print(f"   {mark}{r.describe(300)}")
            print(f"       ref {a.describe()[:300]}")
            if mark != "  ":
                print(f"       ours {b.describe()[:300]}")
        # leave the servers empty for the caller, which resets or restarts anyway
        sys.stdout.flush()

    # -- summary ---------------------------------------------------------------------------

    def summary(self, elapsed: float) -> None:
        families: dict[tuple[str, ...], list[Difference]] = {}
        for ds in self.classes.values():
            families.setdefault(ds[0].family, []).extend(ds)
        print()
        print(f"== {len(families)} difference families (operation kind, statuses, mismatch) ==")
        for fam, ds in sorted(families.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            print(f"  {fam[0]:40s} ref {fam[1]} vs ours {fam[2]:4s} {fam[3]:8s} x{len(ds)}")
        print()
        print(f"== {len(self.classes)} difference classes ==")
        for cls, ds in sorted(self.classes.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            d = ds[0]
            print(f"- {cls[0]} | ref {cls[1]} vs ours {cls[2]} | {cls[3]} | x{len(ds)}")
            print(f"    e.g. {d.req.describe(200)}")
            print(f"    ref  {d.ref.describe()[:300]}")
            print(f"    ours {d.ours.describe()[:300]}")
        if self.args.coverage:
            print()
            print("== requests per operation class (reference status: count) ==")
            for fam, cnt in sorted(self.coverage.items()):
                stats = ", ".join(f"{st}:{n}" for st, n in sorted(cnt.items()))
                print(f"  {fam:42s} {sum(cnt.values()):5d}  {stats}")
        same, diff = self.wording_total["same"], self.wording_total["different"]
        print()
        print(
            f"serde error wording: {same} identical, {diff} differing "
            f"({len(self.wording)} distinct pairs; --wording lists them)"
        )
        if self.args.wording:
            for (a, b), (req, status) in sorted(self.wording.items()):
                print(f"  [{status}] {req.describe(160)}")
                print(f"      ref:  {a}")
                print(f"      ours: {b}")
        print(f"time {elapsed:.1f}s, {self.replays} minimization replays")
        print(f"{self.requests} requests, {len(self.diffs)} differences")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=300, help="requests per run")
    ap.add_argument("--runs", type=int, default=20, help="runs, each on fresh servers")
    ap.add_argument("--only-run", type=int, help="replay just this run index of the seed")
    ap.add_argument("--ref-url", help="use a running reference instead of starting one")
    ap.add_argument("--ours-url", help="use a running kv-slot-tracker instead of starting one")
    ap.add_argument("--log-dir", help="where server logs go (default: a temp dir)")
    ap.add_argument(
        "--workers", type=int, default=1, help="run ours as python -m kv_slot_tracker --workers N"
    )
    ap.add_argument("--strict-wording", action="store_true", help="compare serde texts exactly")
    ap.add_argument("--wording", action="store_true", help="list differing serde texts")
    ap.add_argument(
        "--array-bodies",
        action="store_true",
        help="also send positional-array bodies (a serde quirk that SPEC §7.3 makes optional)",
    )
    ap.add_argument("--coverage", action="store_true", help="count requests per class")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every request and answer")
    ap.add_argument("--no-fixed", action="store_true", help="skip the fixed scenarios")
    ap.add_argument(
        "--no-malformed", action="store_true", help="random runs send well-formed requests only"
    )
    ap.add_argument(
        "--reuse-servers",
        action="store_true",
        help="empty the servers between runs instead of restarting them (faster)",
    )
    ap.add_argument("--no-minimize", action="store_true")
    ap.add_argument("--minimize-seconds", type=float, default=20.0)
    args = ap.parse_args(argv)
    if (args.ref_url is None) != (args.ours_url is None):
        ap.error("--ref-url and --ours-url go together")

    h = Harness(args)
    t0 = time.monotonic()
    try:
        if not args.no_fixed and args.only_run is None:
            h.run_fixed()
        runs = [args.only_run] if args.only_run is not None else range(args.runs)
        for run in runs:
            h.run(run)
    finally:
        h.pair.stop()
    h.summary(time.monotonic() - t0)
    return 1 if h.diffs else 0


if __name__ == "__main__":
    sys.exit(main())
