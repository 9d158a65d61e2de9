"""Load-balanced lifecycle traffic with a ground truth of what the service acknowledged, for the
consistency tests (``tests/e2e/test_consistency.py``) and ``bench/consistency_bench.py``.

Several clients (asyncio tasks on a thread of their own, so the caller can inject faults
meanwhile) each run requests of their own: add, then prefill completion and free, every call to
the next instance of a round-robin load balancer. A client updates the ground truth only with
what an answer acknowledged, and retries a call that got no definite answer (no connection,
503) on the next instance until it gets one: an add retried after an unknown outcome may find
the request already there (409), which acknowledges it too; a prefill completion and a free are
idempotent. The ground truth derives every rank's load (requests, unique prompt blocks,
prefill tokens) without the service's code; at the end every instance must report exactly it.

Answers are counted by kind: a 404 for a request the client was told exists is *spurious*; a
5xx other than the documented 503s (not ready; with ``replication_ack = "redis"``, Redis
unreachable) is *unexpected*.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.e2e.traffic import Prompts, chain

MODEL = "llama"
GROUP = "default"
BLOCK_SIZE = 16
# worker id -> dp_size
WORKERS = {1: 2, 2: 2, 3: 1}
RANKS = [(w, r) for w, size in sorted(WORKERS.items()) for r in range(size)]
CALL_DEADLINE_S = 60.0  # one call may be retried this long (Redis outages included)
RETRY_PAUSE_S = 0.02

DOCUMENTED_503 = ("not ready", "not accepted", "not acknowledged")


@dataclass
class Request:
    rid: str
    rank: tuple[int, int]
    hashes: tuple[int, ...]
    tokens: int
    prefill_done: bool = False


class GroundTruth:
    """What the service acknowledged: the active requests, and each rank's load from them."""

    def __init__(self) -> None:
        self.active: dict[str, Request] = {}
        self.lock = threading.Lock()

    def loads(self) -> list[dict[str, int]]:
        with self.lock:
            requests = list(self.active.values())
        rows = []
        for worker_id, dp_rank in RANKS:
            mine = [r for r in requests if r.rank == (worker_id, dp_rank)]
            blocks: set[int] = set()
            for r in mine:
                blocks.update(r.hashes)
            rows.append(
                {
                    "worker_id": worker_id,
                    "dp_rank": dp_rank,
                    "active_requests": len(mine),
                    "active_decode_blocks": len(blocks),
                    "active_prefill_tokens": sum(r.tokens for r in mine if not r.prefill_done),
                }
            )
        return rows


def load_view(rows: list[dict[str, Any]]) -> list[dict[str, int]]:
    fields = ("worker_id", "dp_rank", "active_requests", "active_decode_blocks",
              "active_prefill_tokens")  # fmt: skip
    return sorted(({f: row[f] for f in fields} for row in rows),
                  key=lambda r: (r["worker_id"], r["dp_rank"]))  # fmt: skip


@dataclass
class Tally:
    calls: Counter[str] = field(default_factory=Counter)  # definite answers by operation
    answers: Counter[str] = field(default_factory=Counter)  # "op status" of every answer
    retries: int = 0
    transport_errors: int = 0
    last_answer: float = 0.0  # time.monotonic() of the last definite answer
    spurious_404: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)  # answers no client should get

    def summary(self) -> dict[str, Any]:
        return {
            "calls": dict(self.calls),
            "answers": dict(sorted(self.answers.items())),
            "retries": self.retries,
            "transport_errors": self.transport_errors,
            "spurious_404": len(self.spurious_404),
            "unexpected": self.unexpected[:10],
        }


class LoadBalancer:
    """Round robin over the instances' base URLs, as a plain L4/L7 balancer does."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.turn = 0

    def next(self) -> str:
        url = self.urls[self.turn % len(self.urls)]
        self.turn += 1
        return url


class Traffic:
    """``clients`` tasks sending lifecycle calls until ``stop``; on a thread of their own."""

    def __init__(
        self,
        urls: list[str],
        *,
        clients: int = 6,
        seed: int = 1,
        pace_s: float = 0.0,
        prefix: str = "c",
        truth: GroundTruth | None = None,
        fresh_connections: bool = False,
    ) -> None:
        self.balancer = LoadBalancer(urls)
        self.truth = truth if truth is not None else GroundTruth()  # shared by earlier traffic
        self.tally = Tally()
        self.clients = clients
        self.seed = seed
        self.pace_s = pace_s  # pause between a client's calls (0: as fast as answered)
        self.prefix = prefix  # of request ids: traffic of its own in a namespace already used
        # a new connection for every call: behind one port served by several processes, the
        # calls of one request reach whichever process accepts each connection
        self.fresh_connections = fresh_connections
        self._stop = threading.Event()
        # every attempt of every call, per request id: (time.monotonic(), operation, instance,
        # status, or "transport error"), to tell what happened to a request an instance
        # disagrees on (``irregular``)
        self.journal: dict[str, list[tuple[float, str, str, int | str]]] = {}
        self.requests: dict[str, Request] = {}
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.prompts = Prompts(random.Random(seed))

    # -- running --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="consistency-traffic", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop after each client's call in flight got its definite answer."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=CALL_DEADLINE_S + 30)
        if self._thread.is_alive():
            raise AssertionError("traffic did not stop")
        if self._failure is not None:
            raise self._failure

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported by stop()
            self._failure = e

    async def _main(self) -> None:
        keepalive = 0 if self.fresh_connections else 32
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=keepalive)
        async with httpx.AsyncClient(timeout=10.0, limits=limits) as http:
            await asyncio.gather(*(self._client(http, i) for i in range(self.clients)))

    async def _client(self, http: httpx.AsyncClient, cid: int) -> None:
        rng = random.Random(self.seed * 1000 + cid)
        mine: list[Request] = []
        n = 0
        while not self._stop.is_set():
            roll = rng.random()
            if len(mine) < 3 or roll < 0.45:
                rank = rng.choice(RANKS)
                blocks = self.prompts.blocks(rng)
                req = Request(f"{self.prefix}{cid}-{n}", rank, chain(blocks), rng.randint(1, 4096))
                n += 1
                await self._add(http, req)
                mine.append(req)
                # often the very next call is about the new request: on the next instance, a
                # moment after the add (what a router does for short prompts and answers)
                follow = rng.random()
                if follow < 0.25:
                    await self._prefill_complete(http, req)
                elif follow < 0.4:
                    mine.pop()
                    await self._free(http, req)
            elif roll < 0.65:
                pending = [r for r in mine if not r.prefill_done]
                if pending:
                    await self._prefill_complete(http, rng.choice(pending))
            else:
                req = mine.pop(rng.randrange(len(mine)))
                await self._free(http, req)
            if self.pace_s:
                await asyncio.sleep(self.pace_s)

    # -- calls ------------------------------------------------------------------------------

    async def _call(
        self, http: httpx.AsyncClient, path: str, body: dict[str, Any]
    ) -> tuple[int, int]:
        """Send until a definite answer; returns (status, attempts)."""
        deadline = time.monotonic() + CALL_DEADLINE_S
        attempts = 0
        op = path.strip("/")
        while True:
            attempts += 1
            url = self.balancer.next()
            attempt = self.journal.setdefault(str(body.get("request_id")), [])
            try:
                r = await http.post(url + path, json=body)
            except httpx.TransportError:
                self.tally.transport_errors += 1
                attempt.append((time.monotonic(), op, url, "transport error"))
            else:
                attempt.append((time.monotonic(), op, url, r.status_code))
                self.tally.answers[f"{op} {r.status_code}"] += 1
                if r.status_code != 503 and r.status_code < 500:
                    self.tally.last_answer = time.monotonic()
                    return r.status_code, attempts
                message = _error(r)
                if r.status_code != 503 or not message.startswith(DOCUMENTED_503):
                    self.tally.unexpected.append(f"{op} {body.get('request_id')}: "
                                                 f"{r.status_code} {message}")  # fmt: skip
            if time.monotonic() > deadline:
                raise AssertionError(f"{op} {body} got no definite answer in {CALL_DEADLINE_S} s")
            self.tally.retries += 1
            await asyncio.sleep(RETRY_PAUSE_S)

    def irregular(self, rank: tuple[int, int], limit: int = 20) -> list[str]:
        """The call histories of ``rank``'s requests that took more than one attempt per call
        or got a 503: where to look when an instance disagrees with the ground truth on it."""
        out = []
        for rid, calls in self.journal.items():
            req = self.requests.get(rid)
            ops = [op for _, op, _, _ in calls]
            if (
                req is None
                or req.rank != rank
                or len(ops) == len(set(ops))
                and all(status != 503 for _, _, _, status in calls)
            ):
                continue
            state = "active" if rid in self.truth.active else "freed"
            steps = ", ".join(f"{t:.3f} {op} {url} {status}" for t, op, url, status in calls)
            out.append(f"{rid} ({state}): {steps}")
            if len(out) >= limit:
                break
        return out

    async def _add(self, http: httpx.AsyncClient, req: Request) -> None:
        self.requests[req.rid] = req
        body = {"model_name": MODEL, "routing_group": GROUP, "request_id": req.rid,
                "worker_id": req.rank[0], "dp_rank": req.rank[1],
                "sequence_hashes": [signed(h) for h in req.hashes],
                "new_isl_tokens": req.tokens}  # fmt: skip
        status, attempts = await self._call(http, "/add", body)
        if status == 201 or (status == 409 and attempts > 1):  # 409: an earlier try landed
            with self.truth.lock:
                self.truth.active[req.rid] = req
            self.tally.calls["add"] += 1
        else:
            self.tally.unexpected.append(f"add {req.rid}: {status} after {attempts} tries")
            raise AssertionError(self.tally.unexpected[-1])

    async def _prefill_complete(self, http: httpx.AsyncClient, req: Request) -> None:
        body = {"model_name": MODEL, "routing_group": GROUP, "request_id": req.rid}
        status, _ = await self._call(http, "/prefill_complete", body)
        if status == 200:
            with self.truth.lock:
                req.prefill_done = True
            self.tally.calls["prefill_complete"] += 1
        elif status == 404:
            self.tally.spurious_404.append(req.rid)
        else:
            self.tally.unexpected.append(f"prefill_complete {req.rid}: {status}")

    async def _free(self, http: httpx.AsyncClient, req: Request) -> None:
        body = {"model_name": MODEL, "routing_group": GROUP, "request_id": req.rid}
        status, _ = await self._call(http, "/free", body)
        if status == 200:
            with self.truth.lock:
                self.truth.active.pop(req.rid, None)
            self.tally.calls["free"] += 1
        else:
            self.tally.unexpected.append(f"free {req.rid}: {status}")


def signed(h: int) -> int:
    """A u64 block hash as the API's signed 64-bit integer (the same bits)."""
    return h - (1 << 64) if h >= 1 << 63 else h


def _error(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    return str(body.get("error", body)) if isinstance(body, dict) else str(body)


def register_topology(url: str) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        for worker_id, dp_size in sorted(WORKERS.items()):
            r = http.post("/register", json={"model_name": MODEL, "routing_group": GROUP,
                                             "worker_id": worker_id, "block_size": BLOCK_SIZE,
                                             "dp_start": 0, "dp_size": dp_size})  # fmt: skip
            assert r.status_code == 201, r.text


class Watcher:
    """Reads every instance's ``/loads`` at once (one keep-alive connection each), to tell
    when they all report the ground truth."""

    def __init__(self, urls: list[str]) -> None:
        self.clients = [httpx.Client(base_url=u, timeout=5) for u in urls]
        self.pool = ThreadPoolExecutor(len(urls))

    def _loads(self, client: httpx.Client) -> list[dict[str, int]] | None:
        try:
            r = client.get("/loads")
        except httpx.TransportError:
            return None
        return load_view(r.json()) if r.status_code == 200 else None

    def all_loads(self) -> list[list[dict[str, int]] | None]:
        return list(self.pool.map(self._loads, self.clients))

    def wait_for(self, want: list[dict[str, int]], timeout: float) -> float | None:
        """Until every instance reports ``want``: the time.monotonic() when a check found it
        (None after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(rows == want for rows in self.all_loads()):
                return time.monotonic()
            time.sleep(0.001)
        return None

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.pool.shutdown()


def inject_faults(fleet: Any, redis: Any, ack: str, step_s: float) -> list[str]:
    """The faults of a consistency run, ``step_s`` apart, while traffic runs (``fleet``: a
    ``tests.e2e.servers.Fleet`` of three; ``redis``: the ``RedisServer`` it uses):

    1. an instance stopped (SIGTERM; with ``replication_ack = "redis"`` killed with SIGKILL)
       and started again;
    2. the Redis server stopped with SIGSTOP for 4 s (what a network stall looks like);
    3. the Redis server killed and started again empty 1 s later;
    4. with ``replication_ack = "redis"``, another instance killed with SIGKILL and restarted.

    Returns what was done."""
    done = []
    servers = fleet.servers
    time.sleep(step_s)
    sig = signal.SIGKILL if ack == "redis" else signal.SIGTERM
    servers[1].kill(sig)
    fleet.restart(servers[1], wait=False)
    servers[1].wait_ready(60)
    done.append(f"{servers[1].name} {signal.Signals(sig).name} + restart")
    time.sleep(step_s)
    os.kill(redis.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(4.0)
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
    done.append("Redis SIGSTOP 4 s")
    time.sleep(step_s)
    redis.stop()
    time.sleep(1.0)
    redis.start()
    done.append("Redis killed, restarted empty 1 s later")
    time.sleep(step_s)
    if ack == "redis":
        servers[2].kill(signal.SIGKILL)
        fleet.restart(servers[2], wait=False)
        servers[2].wait_ready(60)
        done.append(f"{servers[2].name} SIGKILL + restart")
        time.sleep(step_s)
    return done
