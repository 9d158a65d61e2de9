"""The engines' own KV-event publishers against the reference and this service, in one run.

vLLM's and SGLang's real ``ZmqEventPublisher`` and event structs (loaded from their wheels by
``bench/engine_publishers.py``; no engine code in the repository) publish scripted batches; the
reference (Dynamo 1.6.1, ``python -m dynamo.select_service``, KV events on: its default) and this
service (``/selection`` with ``DYN_ROUTER_USE_KV_EVENTS=true``) both register each worker with the
publisher's endpoints and subscribe to the same PUB socket (ZMQ fan-out), so they receive the very
same bytes. At each checkpoint of a scenario, once both have settled, the harness compares:

* ``dump blocks``: the stored blocks of the scenario's partition as a set of facts ``(worker,
  dp_rank, tier, block_hash, tokens_hash, parent)``; ``dump events``: the number of events
  ``/dump`` lists for it (how the blocks are grouped);
* ``overlap <prompt>``: ``/overlap_scores`` rows (every column, rows sorted) and ``num_blocks``;
* ``select <prompt>``: the set of tied best ranks, gathered by ``--draws`` query-only ``/select``
  calls on each side (the pick among ties is random), and, for each rank in both sets, the body;
* ``workers`` (gap scenarios): each worker's ``lifecycle`` and ``not_schedulable_reasons``.

Scenarios run per engine, each on its own model name (partition) and workers: *live* ones (chains,
branches, removals, clears, LoRA, extra keys, tiers, unknown parents and media, the engines' own
fields) and *gap* ones (late joiner, skipped sequence number, dropped connection, publisher
restarted from 0, dp-2 worker with one replay endpoint; with and without a replay endpoint).

    .venv/bin/python bench/engine_conformance.py [--engines vllm,sglang] [--json FILE|-]
        [--wheels DIR] [--scenarios SUBSTR,...] [--draws 24] [--settle 3] [--gap-wait 3]

Output: per engine and scenario ``agreed/total``, the engine's live and gap totals, then every
differing check with both answers. The harness measures; it does not gate: the exit code is 0
unless the harness itself fails. ``make engines ARGS='--json -'`` runs it from the Makefile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import xxhash
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_publishers import ENGINES, Engine, cache_dir, load  # noqa: E402
from bench.reference import Server, start_ours, start_reference  # noqa: E402

BS = 4
BLOCKS = 8
REF_MODULE = "dynamo.select_service"

# ---------------------------------------------------------------------------------------------
# Comparison (pure: the smoke test runs it on canned answers)


def dump_facts(body: dict, model: str) -> tuple[set[tuple], int]:
    """The stored-block facts of ``model``'s default partition in a ``/dump`` body, and the
    number of events it lists."""
    events = body.get(f"{model}:default", {}).get("events", [])
    facts = set()
    for ev in events:
        stored = ev["event"]["data"].get("stored")
        if stored is None:
            continue
        parent = stored["parent_hash"]
        for b in stored["blocks"]:
            facts.add((ev["worker_id"], ev["event"]["dp_rank"], ev.get("storage_tier"),
                       b["block_hash"], b["tokens_hash"], parent))  # fmt: skip
            parent = b["block_hash"]
    return facts, len(events)


def overlap_view(status: int, body: Any) -> Any:
    if status != 200 or not isinstance(body, dict):
        return [status, body]
    rows = sorted(
        [w.get(k) for k in ("worker_id", "dp_rank", "device_blocks", "host_pinned_blocks",
                            "disk_blocks", "host_pinned_extension_blocks",
                            "disk_extension_blocks")]
        for w in body.get("workers", [])
    )  # fmt: skip
    return {"num_blocks": body.get("num_blocks"), "rows": rows}


def workers_view(body: Any) -> Any:
    if not isinstance(body, list):
        return body
    return sorted(
        [w.get("worker_id"), w.get("lifecycle"), sorted(w.get("not_schedulable_reasons") or [])]
        for w in body
    )


@dataclass
class SelectAnswer:
    """What one side answered to repeated ``/select`` calls for one prompt."""

    status: int
    picks: dict[str, Any] = field(default_factory=dict)  # "worker/rank" -> body (or error)

    def view(self) -> Any:
        if self.status != 200:
            return [self.status, next(iter(self.picks.values()), None)]
        return {"tied": sorted(self.picks)}


def compare_select(ref: SelectAnswer, ours: SelectAnswer) -> tuple[bool, Any, Any]:
    """Equal tie sets, and equal bodies for every rank both can pick."""
    if ref.view() != ours.view():
        return False, ref.view(), ours.view()
    for pick in sorted(set(ref.picks) & set(ours.picks)):
        if ref.picks[pick] != ours.picks[pick]:
            return False, {"pick": pick, "body": ref.picks[pick]}, {
                "pick": pick, "body": ours.picks[pick]}  # fmt: skip
    return True, ref.view(), ours.view()


def compare_dump(ref: set[tuple], ours: set[tuple]) -> tuple[bool, Any, Any]:
    """Equal sets of stored-block facts; each side shows the facts only it has (at most 8)."""
    if ref == ours:
        return True, {"blocks": len(ref)}, {"blocks": len(ours)}
    return (
        False,
        {"blocks": len(ref), "only_here": [list(f) for f in sorted(ref - ours, key=repr)][:8]},
        {"blocks": len(ours), "only_here": [list(f) for f in sorted(ours - ref, key=repr)][:8]},
    )


@dataclass
class Check:
    scenario: str
    kind: str  # "live" | "gap"
    name: str  # "<checkpoint>: <what>"
    ok: bool
    ref: Any = None
    ours: Any = None


@dataclass
class Tally:
    agreed: int = 0
    total: int = 0

    def add(self, ok: bool) -> None:
        self.total += 1
        self.agreed += ok

    def __str__(self) -> str:
        return f"{self.agreed}/{self.total}"


def family(name: str) -> str:
    """What a check compares: ``dump blocks``, ``dump events``, ``overlap``, ``select``,
    ``workers``, ``subscribed ranks`` (its name without the checkpoint and the prompt)."""
    what = name.rsplit(": ", 1)[-1]
    return what.split(" ", 1)[0] if what.startswith(("overlap ", "select ")) else what


def summarize(checks: list[Check]) -> dict[str, Any]:
    """Per scenario, per kind (live, gap) and per kind and check family: checks agreed / total,
    and the differing checks."""
    scenarios: dict[str, dict[str, Any]] = {}
    kinds: dict[str, Tally] = {}
    families: dict[str, dict[str, Tally]] = {}
    for c in checks:
        s = scenarios.setdefault(c.scenario, {"kind": c.kind, "tally": Tally()})
        s["tally"].add(c.ok)
        kinds.setdefault(c.kind, Tally()).add(c.ok)
        families.setdefault(c.kind, {}).setdefault(family(c.name), Tally()).add(c.ok)
    return {
        "scenarios": [
            {"scenario": name, "kind": s["kind"], "agreed": s["tally"].agreed,
             "total": s["tally"].total}
            for name, s in scenarios.items()
        ],
        "totals": {k: {"agreed": t.agreed, "total": t.total} for k, t in kinds.items()},
        "families": {
            k: {f: {"agreed": t.agreed, "total": t.total} for f, t in fs.items()}
            for k, fs in families.items()
        },
        "differences": [asdict(c) for c in checks if not c.ok],
    }  # fmt: skip


def short(value: Any, limit: int = 400) -> str:
    text = json.dumps(value, separators=(",", ":"), default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def render(report: dict[str, Any], limit: int = 400) -> str:
    out: list[str] = []
    for eng in report["engines"]:
        out.append(f"{eng['engine']} {eng['version']}  ({eng['wheel']})")
        width = max((len(s["scenario"]) for s in eng["scenarios"]), default=10)
        for s in eng["scenarios"]:
            out.append(f"  {s['kind']:4}  {s['scenario']:{width}}  {s['agreed']}/{s['total']}")
        for kind in ("live", "gap"):
            t = eng["totals"].get(kind)
            if t:
                fams = ", ".join(
                    f"{f} {v['agreed']}/{v['total']}" for f, v in eng["families"][kind].items()
                )
                out.append(f"  {eng['engine']} {kind}: {t['agreed']}/{t['total']} agree ({fams})")
    for eng in report["engines"]:
        if not eng["differences"]:
            continue
        out.append(f"differences, {eng['engine']}:")
        for d in eng["differences"]:
            out.append(f"  [{d['kind']}] {d['scenario']} / {d['name']}")
            out.append(f"      reference: {short(d['ref'], limit)}")
            out.append(f"      ours:      {short(d['ours'], limit)}")
    out.append(
        "summary: " + "; ".join(
            f"{e['engine']} live {e['totals'].get('live', {}).get('agreed', 0)}/"
            f"{e['totals'].get('live', {}).get('total', 0)}, gap "
            f"{e['totals'].get('gap', {}).get('agreed', 0)}/"
            f"{e['totals'].get('gap', {}).get('total', 0)}"
            for e in report["engines"]
        )
    )  # fmt: skip
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Publishers: one engine publisher per worker rank, both services subscribed to it


def free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free ports (the engines offset a rank's port by it)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                t = socket.socket()
                socks.append(t)
                t.bind(("0.0.0.0", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no consecutive free ports")


class _Dropping:
    """Stands in for a publisher's PUB socket: the next ``n`` messages are not sent (the batch
    still enters the replay buffer, as a message the PUB socket dropped)."""

    def __init__(self, sock: zmq.Socket, n: int) -> None:
        self.sock, self.n = sock, n

    def send_multipart(self, frames: Any, *a: Any, **k: Any) -> Any:
        if self.n > 0:
            self.n -= 1
            return None
        return self.sock.send_multipart(frames, *a, **k)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class RankPublisher:
    """The engine's ``ZmqEventPublisher`` of one dp rank, bound on ``tcp://*:base+rank``."""

    def __init__(self, engine: Engine, dp_rank: int, base: int, replay_base: int | None) -> None:
        self.engine, self.dp_rank, self.base, self.replay_base = engine, dp_rank, base, replay_base
        self.endpoint = f"tcp://127.0.0.1:{base + dp_rank}"
        self.replay_endpoint = (
            None if replay_base is None else f"tcp://127.0.0.1:{replay_base + dp_rank}"
        )
        self.pub: Any = None
        self.monitor: zmq.Socket | None = None
        self.handshakes = 0
        self.expected = 2  # subscribers once registered (fewer if a service did not subscribe)
        self.start()

    def start(self) -> None:
        """Create the engine's publisher (again after ``restart``: it counts from 0)."""
        replay = None if self.replay_base is None else f"tcp://*:{self.replay_base}"
        last: Exception | None = None
        for _ in range(100):  # the port of a socket just closed may take a moment to free
            try:
                self.pub = self.engine.publisher(self.dp_rank, f"tcp://*:{self.base}", replay)
                break
            except zmq.ZMQError as e:
                last = e
                time.sleep(0.02)
        else:
            raise RuntimeError(f"publisher could not bind: {last}")
        self._watch(self.pub._pub)

    def _watch(self, sock: zmq.Socket) -> None:
        if self.monitor is not None:
            self.monitor.close(0)
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.handshakes = 0

    def subscribers(self) -> int:
        assert self.monitor is not None
        while self.monitor.poll(0):
            self.monitor.recv_multipart()
            self.handshakes += 1
        return self.handshakes

    def wait_subscribers(self, n: int, timeout: float = 10.0) -> bool:
        """Wait until ``n`` subscribers have connected since the socket was bound (False when
        ``timeout`` passes first: a service that does not subscribe is an outcome, measured)."""
        deadline = time.monotonic() + timeout
        while self.subscribers() < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        time.sleep(0.2)  # the subscription message follows the handshake
        return True

    def publish(self, events: list[Any], *, drop: bool = False) -> None:
        """Publish one batch through the engine's queue and thread; ``drop``: the PUB socket
        loses it (it stays in the replay buffer)."""
        real = self.pub._pub
        if drop:
            self.pub._pub = _Dropping(real, 1)
        self.pub.publish(self.engine.batch(events, time.time()))
        self.drain()
        self.pub._pub = real

    def drain(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.pub._event_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)

    def drop_connection(self, during: list[list[Any]]) -> None:
        """Close the PUB socket (subscribers see the connection drop), publish ``during`` while
        it is closed (batches the subscribers never get; the replay buffer keeps them), bind a
        new PUB socket on the same port and wait for both subscribers to come back."""
        old = self.pub._pub
        assert self.monitor is not None
        self.monitor.close(0)
        self.monitor = None
        old.close(linger=0)
        for events in during:
            self.pub._pub = _Dropping(old, 1)
            self.pub.publish(self.engine.batch(events, time.time()))
            self.drain()
        new: zmq.Socket = zmq.Context.instance().socket(zmq.PUB)
        new.set_hwm(self.pub._hwm)
        self._watch(new)
        for _ in range(200):
            try:
                new.bind(f"tcp://*:{self.base + self.dp_rank}")
                break
            except zmq.ZMQError:
                time.sleep(0.02)
        self.pub._pub = new
        self.wait_subscribers(self.expected)

    def restart(self) -> None:
        """The engine process restarts: its publisher is shut down and a new one counts from
        0 on the same ports."""
        self.close()
        self.start()
        self.wait_subscribers(self.expected)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(0)
            self.monitor = None
        if self.pub is not None:
            self.pub.shutdown()
            self.pub = None


# ---------------------------------------------------------------------------------------------
# Services, workers and the checks


@dataclass
class Sides:
    ref: httpx.Client
    ours: httpx.Client

    def both(self, method: str, path: str, **kw: Any) -> tuple[httpx.Response, httpx.Response]:
        return self.ref.request(method, path, **kw), self.ours.request(method, path, **kw)


def _body(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


@dataclass
class Worker:
    worker_id: int
    ranks: list[RankPublisher]


class Scenario:
    """One scenario's partition, workers and checks (``kind`` live or gap)."""

    def __init__(self, run: EngineRun, name: str, kind: str) -> None:
        self.run, self.name, self.kind = run, name, kind
        self.engine = run.engine
        self.model = f"{run.engine.name}-{name}"
        self.workers: list[Worker] = []
        self.prompts: dict[str, dict[str, Any]] = {}
        self.add_prompts()

    # -- workers -----------------------------------------------------------------------------

    def worker(self, dp: int = 1, *, replay: bool = False, register: bool = True) -> Worker:
        base = free_ports(dp)
        replay_base = free_ports(dp) if replay else None
        ranks = [RankPublisher(self.engine, r, base, replay_base) for r in range(dp)]
        w = Worker(self.run.next_worker_id(), ranks)
        self.workers.append(w)
        self.run.publishers.extend(ranks)
        if register:
            self.register(w)
        return w

    def register(self, w: Worker) -> None:
        body: dict[str, Any] = {
            "worker_id": w.worker_id, "model_name": self.model,
            "endpoint": f"http://worker-{w.worker_id}", "block_size": BS,
            "data_parallel_size": len(w.ranks),
        }  # fmt: skip
        if len(w.ranks) == 1:
            body["kv_events_endpoint"] = w.ranks[0].endpoint
        else:
            body["kv_events_endpoints"] = {str(p.dp_rank): p.endpoint for p in w.ranks}
        if w.ranks[0].replay_endpoint is not None:  # the worker's one replay endpoint (rank 0)
            body["replay_endpoint"] = w.ranks[0].replay_endpoint
        # one side after the other, so that each side's subscriptions are seen (handshakes)
        joined: dict[str, list[int]] = {}
        for side, client in (("ref", self.run.sides.ref), ("ours", self.run.sides.ours)):
            before = [p.subscribers() for p in w.ranks]
            r = client.post("/workers", json=body)
            if r.status_code != 201:
                raise RuntimeError(f"POST /workers ({side}): {r.status_code} {r.text}")
            timeout = self.run.args.subscribe_timeout
            joined[side] = [p.dp_rank for p, n in zip(w.ranks, before, strict=True)
                            if p.wait_subscribers(n + 1, timeout)]  # fmt: skip
        for p in w.ranks:
            p.expected = p.subscribers()
        if self.kind == "gap":
            self.note(f"worker {w.worker_id} registered: subscribed ranks", joined["ref"] == joined[
                "ours"], joined["ref"], joined["ours"])  # fmt: skip

    # -- blocks ------------------------------------------------------------------------------

    def tokens(self, base: int, start: int, n: int) -> list[int]:
        return self.run.bases[base][start * BS : (start + n) * BS]

    def h(self, base: int, depth: int, salt: str = "") -> int:
        """The engine's hash of block ``depth`` of base prompt ``base``: content-addressed (same
        prefix, same hash; ``salt`` stands for what else the engine hashes in: LoRA, extra keys).
        vLLM's hashes are unsigned 64-bit, SGLang's signed."""
        prefix = self.run.bases[base][: (depth + 1) * BS]
        data = salt.encode() + b"".join(t.to_bytes(4, "little") for t in prefix)
        v = xxhash.xxh64_intdigest(data)
        return v - (1 << 64) if self.engine.name == "sglang" and v >= 1 << 63 else v

    def hashes(self, base: int, start: int, n: int, salt: str = "") -> list[int]:
        return [self.h(base, d, salt) for d in range(start, start + n)]

    def store(self, base: int, start: int, n: int, *, parent: int | None | str = "auto",
              salt: str = "", medium: str | None = "GPU", **fields: Any) -> Any:  # fmt: skip
        """A ``BlockStored`` of blocks ``start .. start+n-1`` of a base prompt, chained to the
        block before (``parent="auto"``) or to the parent given."""
        if parent == "auto":
            parent = self.h(base, start - 1, salt) if start else None
        return self.engine.stored(self.hashes(base, start, n, salt), parent,  # type: ignore[arg-type]
                                  self.tokens(base, start, n), BS, medium, **fields)  # fmt: skip

    def remove(self, hashes: list[int], medium: str | None = "GPU", **fields: Any) -> Any:
        return self.engine.removed(hashes, medium, **fields)

    def send(self, w: Worker, *events: Any, rank: int = 0, drop: bool = False) -> None:
        w.ranks[rank].publish(list(events), drop=drop)

    # -- prompts and checkpoints -------------------------------------------------------------

    def add_prompts(self, **extra: dict[str, Any]) -> None:
        """The prompts every checkpoint asks about (more per scenario through ``extra``)."""
        if not self.prompts:
            b = self.run.bases
            self.prompts = {
                "b0": {"token_ids": b[0]},
                "b0[:3]+2": {"token_ids": b[0][: 3 * BS] + [7, 8]},
                "b1": {"token_ids": b[1]},
                "b2[:5]": {"token_ids": b[2][: 5 * BS]},
            }
        self.prompts.update(extra)

    def checkpoint(self, label: str, *, wait: float | None = None) -> None:
        """Let both services settle, then compare them."""
        run = self.run
        if wait is None:
            wait = run.args.gap_wait if self.kind == "gap" else run.args.live_wait
        ref_dump, ours_dump = self.settle(wait)
        self.note(f"{label}: dump blocks", *compare_dump(ref_dump[0], ours_dump[0]))
        self.note(f"{label}: dump events", ref_dump[1] == ours_dump[1], ref_dump[1], ours_dump[1])
        if self.kind == "gap":
            a, b = run.sides.both("GET", "/workers", params={"model_name": self.model})
            va, vb = workers_view(_body(a)), workers_view(_body(b))
            self.note(f"{label}: workers", va == vb, va, vb)
        for name, prompt in self.prompts.items():
            body = {"model_name": self.model, **prompt}
            a, b = run.sides.both("POST", "/overlap_scores", json=body)
            va, vb = overlap_view(a.status_code, _body(a)), overlap_view(b.status_code, _body(b))
            self.note(f"{label}: overlap {name}", va == vb, va, vb)
            if self.kind == "live":
                sa = self.select(run.sides.ref, body)
                sb = self.select(run.sides.ours, body)
                self.note(f"{label}: select {name}", *compare_select(sa, sb))

    def select(self, client: httpx.Client, body: dict[str, Any]) -> SelectAnswer:
        """Up to ``--draws`` calls; fewer once every rank of the partition has been picked."""
        ans = SelectAnswer(0)
        ranks = sum(len(w.ranks) for w in self.workers)
        for _ in range(self.run.args.draws):
            if len(ans.picks) >= ranks:
                break
            r = client.post("/select", json=body)
            ans.status = r.status_code
            if r.status_code != 200:
                ans.picks = {"error": _body(r)}
                return ans
            got = r.json()
            ans.picks.setdefault(f"{got['worker_id']}/{got['dp_rank']}", got)
        return ans

    def settle(self, min_wait: float) -> tuple[tuple[set[tuple], int], tuple[set[tuple], int]]:
        """Wait ``min_wait`` (at least 0.1 s: delivery), then until both dumps agree twice in a
        row, or neither has changed for ``--stable`` seconds (a difference that stays is what is
        measured), or ``--settle`` seconds have passed."""
        time.sleep(max(min_wait, 0.1))
        args = self.run.args
        deadline = time.monotonic() + args.settle
        agreed, last, since = 0, None, time.monotonic()
        while True:
            a = dump_facts(_body(self.run.sides.ref.get("/dump")), self.model)
            b = dump_facts(_body(self.run.sides.ours.get("/dump")), self.model)
            now = time.monotonic()
            if (a, b) != last:
                last, since = (a, b), now
            agreed = agreed + 1 if a == b else 0
            if agreed >= 2 or now - since >= args.stable or now > deadline:
                return a, b
            time.sleep(0.05)

    def note(self, name: str, ok: bool, ref: Any, ours: Any) -> None:
        self.run.checks.append(Check(self.name, self.kind, name, ok, ref, ours))
        if self.run.args.verbose and not ok:
            print(f"  differs: {self.name} / {name}\n    ref  {short(ref)}\n    ours {short(ours)}",
                  file=sys.stderr)  # fmt: skip


class EngineRun:
    def __init__(self, engine: Engine, sides: Sides, args: argparse.Namespace,
                 first_worker: int) -> None:  # fmt: skip
        self.engine, self.sides, self.args = engine, sides, args
        self.checks: list[Check] = []
        self.publishers: list[RankPublisher] = []
        self._worker_id = first_worker
        # three base prompts of BLOCKS blocks; base 1 shares base 0's first 3 blocks
        self.bases = [[1000 * (b + 1) + i for i in range(BS * BLOCKS)] for b in range(3)]
        self.bases[1][: 3 * BS] = self.bases[0][: 3 * BS]

    def next_worker_id(self) -> int:
        self._worker_id += 1
        return self._worker_id

    def scenario(self, name: str, kind: str) -> Scenario:
        return Scenario(self, name, kind)

    def close(self) -> None:
        for p in self.publishers:
            with contextlib.suppress(Exception):
                p.close()
        self.publishers.clear()


# ---------------------------------------------------------------------------------------------
# Scenarios. Each takes a fresh Scenario; the engine's own field names are used as they are.

ScenarioFn = Callable[[Scenario], None]
LIVE: dict[str, ScenarioFn] = {}
GAP: dict[str, ScenarioFn] = {}


def live(
    name: str, engines: tuple[str, ...] = ("vllm", "sglang")
) -> Callable[[ScenarioFn], ScenarioFn]:
    def wrap(fn: ScenarioFn) -> ScenarioFn:
        LIVE[name] = fn
        fn.engines = engines  # type: ignore[attr-defined]
        return fn

    return wrap


def gap(name: str) -> Callable[[ScenarioFn], ScenarioFn]:
    def wrap(fn: ScenarioFn) -> ScenarioFn:
        GAP[name] = fn
        fn.engines = ("vllm", "sglang")  # type: ignore[attr-defined]
        return fn

    return wrap


def cpu(s: Scenario) -> str:
    return s.engine.module.StorageMedium.CPU.value if s.engine.name == "sglang" else "CPU"


def disk(s: Scenario) -> str:
    return s.engine.module.StorageMedium.DISK.value if s.engine.name == "sglang" else "DISK"


@live("chain")
def _chain(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(0, 0, 4))
    s.checkpoint("stored 4")
    s.send(w, s.store(0, 4, 2))
    s.checkpoint("extended to 6")
    s.send(w, s.store(0, 6, 1), s.store(0, 7, 1))  # two events in one batch
    s.checkpoint("extended to 8 in one batch")


@live("branches")
def _branches(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(0, 0, 5))
    s.send(w, s.store(1, 3, 4))  # base 1 shares blocks 0-2: a branch at depth 3
    s.checkpoint("two branches")
    s.send(w, s.store(0, 0, 3))  # the shared prefix again
    s.checkpoint("prefix stored again")


@live("removals")
def _removals(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(0, 0, 6))
    s.send(w, s.store(1, 3, 3))
    s.send(w, s.remove([s.h(0, 5)]))
    s.checkpoint("leaf removed")
    s.send(w, s.remove([s.h(0, 1)]))
    s.checkpoint("middle removed")
    s.send(w, s.store(0, 5, 2, parent=s.h(0, 4)))
    s.checkpoint("stored under a block cut off")
    s.send(w, s.remove([s.h(2, 0), s.h(1, 4)]))  # one unknown, one held
    s.checkpoint("unknown and held removed")


@live("clears")
def _clears(s: Scenario) -> None:
    w = s.worker(dp=2)
    s.send(w, s.store(0, 0, 4), rank=0)
    s.send(w, s.store(1, 0, 6), rank=1)
    s.checkpoint("two ranks")
    s.send(w, s.engine.cleared(), rank=0)
    s.checkpoint("rank 0 cleared")
    s.send(w, s.store(2, 0, 3), rank=0)
    s.checkpoint("stored after the clear")


@live("lora")
def _lora(s: Scenario) -> None:
    s.add_prompts(**{
        "b0 lora a": {"token_ids": s.run.bases[0], "lora_name": "adapter-a"},
        "b0 lora b": {"token_ids": s.run.bases[0], "lora_name": "adapter-b"},
    })  # fmt: skip
    w, v = s.worker(), s.worker()
    if s.engine.name == "vllm":  # vLLM: the name, and each block's extra keys start with it
        ev = s.store(0, 0, 4, salt="a", lora_name="adapter-a", extra_keys=[("adapter-a",)] * 4)
    else:
        ev = s.store(0, 0, 4, salt="a", lora_name="adapter-a", lora_id=1)
    s.send(w, ev)
    s.send(v, s.store(0, 0, 2))
    s.checkpoint("LoRA blocks on one worker, base blocks on another")


@live("extra-keys", engines=("vllm",))
def _extra_keys(s: Scenario) -> None:
    w = s.worker()
    mm = [(("img-1", 0),), (("img-1", 4),), None, None]  # (mm identifier, offset) pairs
    s.send(w, s.store(2, 0, 4, salt="mm", extra_keys=mm))
    s.send(w, s.store(0, 0, 3, extra_keys=[None, None, None]))
    s.checkpoint("multimodal extra keys")


@live("cache-salt")
def _cache_salt(s: Scenario) -> None:
    s.add_prompts(**{
        "b0 salt": {"token_ids": s.run.bases[0], "cache_salt": "tenant-a"},
        "b0 other salt": {"token_ids": s.run.bases[0], "cache_salt": "tenant-b"},
    })  # fmt: skip
    w = s.worker()
    if s.engine.name == "vllm":  # vLLM: the salt is the first block's extra key
        ev = s.store(0, 0, 4, salt="tenant-a", extra_keys=[("tenant-a",), None, None, None])
    else:  # SGLang: the field, and the hashes namespaced by its own function
        m = s.engine.module
        seed = m.kv_event_namespace_seed(extra_key=None, cache_salt="tenant-a")
        hashes = [m.namespaced_block_hash(h, namespace_seed=seed) for h in s.hashes(0, 0, 4)]
        ev = s.engine.stored(hashes, None, s.tokens(0, 0, 4), BS, "GPU", cache_salt="tenant-a")
    s.send(w, ev)
    s.checkpoint("salted blocks")


@live("tiers")
def _tiers(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(0, 0, 3), s.store(0, 3, 2, medium=cpu(s)), s.store(0, 5, 2, medium=disk(s)))
    s.checkpoint("device, host and disk")
    s.send(w, s.store(1, 0, 5, medium=cpu(s)))  # host blocks whose prefix is on the device
    s.checkpoint("host run over a device prefix")
    s.send(w, s.remove([s.h(0, 3)], medium=cpu(s)))
    s.checkpoint("host block removed")
    s.send(w, s.remove([s.h(0, 1)], medium=cpu(s)))  # a device block named with the host tier
    s.checkpoint("removal in the wrong tier")


@live("unknown-parents")
def _unknown_parents(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(2, 2, 2, parent=0x1234_5678_9ABC))
    s.send(w, s.store(2, 4, 2, parent=0x2234_5678_9ABC, medium=cpu(s)))
    s.checkpoint("device and host stores under unknown parents")
    s.send(w, s.store(2, 0, 2))
    s.send(w, s.store(2, 2, 1))
    s.checkpoint("the chain filled in")


@live("medium-storage", engines=("vllm",))
def _storage(s: Scenario) -> None:
    w = s.worker()
    m = s.engine.module
    s.send(w, s.store(0, 0, 3, medium=m.MEDIUM_GPU), s.store(0, 3, 3, medium=m.MEDIUM_STORAGE))
    s.checkpoint("STORAGE after GPU")
    s.send(w, s.remove([s.h(0, 4)], medium=m.MEDIUM_STORAGE))
    s.checkpoint("STORAGE block removed")


@live("locality-remote", engines=("vllm",))
def _remote(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(0, 0, 4, locality="REMOTE"))
    s.send(w, s.store(1, 0, 3, medium="CPU", locality="LOCAL"))
    s.checkpoint("REMOTE device blocks, LOCAL host blocks")
    s.send(w, s.remove([s.h(0, 3)], locality="REMOTE"))
    s.checkpoint("REMOTE block removed")


@live("ownership", engines=("vllm",))
def _ownership(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(0, 0, 3))
    s.send(w, s.store(0, 3, 3, medium="CPU", ownership="offload-tier-2"))
    s.send(w, s.store(1, 0, 2, ownership="offload-tier-2"))
    s.checkpoint("non-primary ownership")
    s.send(w, s.remove([s.h(0, 4)], medium="CPU", ownership="offload-tier-2"))
    s.checkpoint("non-primary block removed")


@live("kv-cache-groups", engines=("vllm",))
def _groups(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(0, 0, 4, group_idx=0, kv_cache_spec_kind="full_attention"))
    s.send(w, s.store(1, 0, 4, salt="sw", group_idx=1, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=8))  # fmt: skip
    s.checkpoint("full and sliding-window groups")
    s.send(w, s.remove([s.h(0, 3)], group_idx=1))
    s.checkpoint("removal in another group")


@live("unknown-medium")
def _unknown_medium(s: Scenario) -> None:
    w = s.worker()
    s.send(w, s.store(0, 0, 3, medium="HBM_POOL_7"), s.store(2, 0, 2, medium=None))
    s.checkpoint("unknown medium and no medium")


@live("medium-external", engines=("sglang",))
def _external(s: Scenario) -> None:
    w = s.worker()
    ext = s.engine.module.StorageMedium.EXTERNAL.value
    s.send(w, s.store(0, 0, 3), s.store(0, 3, 3, medium=ext))
    s.send(w, s.store(1, 0, 3, medium=ext))
    s.checkpoint("EXTERNAL after GPU, EXTERNAL alone")
    s.send(w, s.remove([s.h(0, 4)], medium=ext))
    s.checkpoint("EXTERNAL block removed")


@live("second-rank-host")
def _second_rank_host(s: Scenario) -> None:
    w = s.worker(dp=2)
    v = s.worker()
    s.send(w, s.store(0, 0, 6), rank=0)
    s.send(w, s.store(0, 0, 6, medium=cpu(s)), rank=1)  # the same tokens, on rank 1's host tier
    s.send(v, s.store(0, 0, 2))
    s.checkpoint("same blocks on rank 0 device and rank 1 host")
    s.send(w, s.remove([s.h(0, 2)]), rank=0)
    s.checkpoint("rank 0 lost a device block")


# -- gaps ------------------------------------------------------------------------------------


@gap("late-joiner-replay")
def _late_replay(s: Scenario) -> None:
    w = s.worker(replay=True, register=False)
    s.send(w, s.store(0, 0, 3))  # nobody listens yet: batches 0-1 are only in the buffer
    s.send(w, s.store(0, 3, 2))
    s.register(w)
    s.send(w, s.store(1, 3, 2))
    s.checkpoint("joined after 2 batches")


@gap("late-joiner-no-replay")
def _late_no_replay(s: Scenario) -> None:
    w = s.worker(register=False)
    s.send(w, s.store(0, 0, 3))
    s.send(w, s.store(0, 3, 2))
    s.register(w)
    s.send(w, s.store(1, 3, 2))
    s.checkpoint("joined after 2 batches")


def _skipped(s: Scenario, replay: bool) -> None:
    w = s.worker(replay=replay)
    s.send(w, s.store(0, 0, 3))
    s.send(w, s.store(0, 3, 2), drop=True)
    s.checkpoint("batch 1 not delivered yet")
    s.send(w, s.store(1, 3, 2))
    s.checkpoint("batch 2 shows the gap")


@gap("skipped-seq-replay")
def _skipped_replay(s: Scenario) -> None:
    _skipped(s, True)


@gap("skipped-seq-no-replay")
def _skipped_no_replay(s: Scenario) -> None:
    _skipped(s, False)


def _dropped(s: Scenario, replay: bool) -> None:
    w = s.worker(replay=replay)
    s.send(w, s.store(0, 0, 3))
    w.ranks[0].drop_connection(during=[[s.store(0, 3, 2)], [s.store(1, 3, 2)]])
    s.checkpoint("reconnected, 2 batches missed")
    s.send(w, s.store(2, 0, 2))
    s.checkpoint("next batch shows the gap")


@gap("connection-dropped-replay")
def _dropped_replay(s: Scenario) -> None:
    _dropped(s, True)


@gap("connection-dropped-no-replay")
def _dropped_no_replay(s: Scenario) -> None:
    _dropped(s, False)


@gap("publisher-restarted")
def _restarted(s: Scenario) -> None:
    w = s.worker(replay=True)
    for d in range(0, 6, 2):
        s.send(w, s.store(0, d, 2))
    s.checkpoint("3 batches")
    w.ranks[0].restart()  # a new engine: empty cache, sequence numbers from 0
    s.send(w, s.store(1, 0, 3))
    s.checkpoint("restarted, batch 0")
    s.send(w, s.store(1, 3, 2))
    s.checkpoint("restarted, batch 1")


@gap("dp2-one-replay-endpoint")
def _dp2_replay(s: Scenario) -> None:
    w = s.worker(dp=2, replay=True)
    s.send(w, s.store(0, 0, 3), rank=0)
    s.send(w, s.store(1, 0, 3), rank=1)
    s.send(w, s.store(1, 3, 2), rank=1, drop=True)
    s.send(w, s.store(2, 0, 2), rank=1)
    s.checkpoint("gap on rank 1")
    s.send(w, s.store(0, 3, 2), rank=0, drop=True)
    s.send(w, s.store(0, 5, 2), rank=0)
    s.checkpoint("gap on rank 0")


# ---------------------------------------------------------------------------------------------


def selected(table: dict[str, ScenarioFn], engine: str, only: list[str] | None) -> Iterator[str]:
    for name, fn in table.items():
        if engine in fn.engines and (not only or any(o in name for o in only)):  # type: ignore[attr-defined]
            yield name


def run_engine(engine: Engine, sides: Sides, args: argparse.Namespace, first_worker: int,
               ) -> dict[str, Any]:  # fmt: skip
    run = EngineRun(engine, sides, args, first_worker)
    started = time.monotonic()
    try:
        for kind, table in (("live", LIVE), ("gap", GAP)):
            for name in selected(table, engine.name, args.scenarios):
                if args.verbose:
                    print(f"{engine.name} {kind} {name}", file=sys.stderr)
                table[name](run.scenario(name, kind))
                run.close()
    finally:
        run.close()
    return {
        "engine": engine.name,
        "version": engine.spec.version,
        "wheel": engine.wheel.name,
        "from_wheel": engine.loaded_from_wheel,
        "shims": list(engine.spec.shims),
        "seconds": round(time.monotonic() - started, 1),
        **summarize(run.checks),
    }


def git_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parent, check=False)  # fmt: skip
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="vllm,sglang", help="comma-separated (vllm, sglang)")
    ap.add_argument(
        "--wheels",
        help="wheel cache directory ($KV_ENGINE_WHEELS, "
        "default ~/.cache/kv-slot-tracker/engines); missing wheels are downloaded",
    )
    ap.add_argument(
        "--scenarios",
        type=lambda v: v.split(","),
        help="run only scenarios whose name contains one of these",
    )
    ap.add_argument("--draws", type=int, default=24, help="/select calls per prompt and side")
    ap.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds to wait for the two dumps to agree at a checkpoint",
    )
    ap.add_argument(
        "--stable",
        type=float,
        default=0.5,
        help="seconds both dumps must stay unchanged to count a difference",
    )
    ap.add_argument(
        "--live-wait",
        type=float,
        default=0.15,
        help="seconds before a live checkpoint reads anything",
    )
    ap.add_argument(
        "--gap-wait",
        type=float,
        default=3.0,
        help="seconds before a gap checkpoint reads (replay timeouts play out)",
    )
    ap.add_argument(
        "--subscribe-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for a service to subscribe to a registered rank",
    )
    ap.add_argument("--json", metavar="FILE", help="also write the report as JSON ('-': stdout)")
    ap.add_argument("--width", type=int, default=400, help="characters per answer shown")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r} (known: {', '.join(ENGINES)})")
    logging.basicConfig(level=logging.ERROR)  # the engines' publishers log at INFO/WARNING
    loaded = [load(e, cache_dir(args.wheels)) for e in engines]

    env = {k: v for k, v in os.environ.items() if k != "DYN_ROUTER_USE_KV_EVENTS"}
    ref_srv: Server = start_reference(module=REF_MODULE, env=env)
    ours_srv: Server | None = None
    report: dict[str, Any] = {"commit": git_commit(), "reference": "ai-dynamo-runtime 1.6.1 "
                              f"({REF_MODULE}, KV events on)", "draws": args.draws, "engines": []}  # fmt: skip
    try:
        ours_srv = start_ours(env={**env, "DYN_ROUTER_USE_KV_EVENTS": "true"})
        with (
            httpx.Client(base_url=ref_srv.url, timeout=15) as ref,
            httpx.Client(base_url=ours_srv.url + "/selection", timeout=15) as ours,
        ):
            sides = Sides(ref, ours)
            for i, eng in enumerate(loaded):
                report["engines"].append(run_engine(eng, sides, args, 1000 * (i + 1)))
    finally:
        if ours_srv is not None:
            ours_srv.stop()
        ref_srv.stop()
    text = render(report, args.width)
    if args.json == "-":
        print(json.dumps(report, indent=1, default=str))
    else:
        print(text)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
