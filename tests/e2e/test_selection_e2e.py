"""The selection API across real service processes sharing one Redis.

Three ``python -m kv_slot_tracker`` processes; every call goes to a randomly chosen instance, as behind a
round-robin load balancer: workers upserted on one, selections reserved on another, their prefill
completed and their release on a third, selections made on one and replayed on another. The test
keeps its own record of what the instances acknowledged (``Truth``, which does not use the
service's code) and checks, after the traffic, that every instance reports exactly that load for
every rank, the same catalog and the same approximate cache. One instance is stopped (SIGTERM)
and restarted in the middle of the traffic; it comes back from the snapshot and the stream.
"""

from __future__ import annotations

import random
import signal
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FleetFactory
from tests.e2e.servers import ServerProcess, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

SEL = "/selection"
MODEL = "m"
BS = 4
# worker id -> data-parallel size
WORKERS = {1: 2, 2: 1, 3: 2}


@dataclass
class Booking:
    rank: tuple[int, int]
    blocks: list[int]
    prefill: int  # prefill tokens booked while the prefill is not complete
    completed: bool = False


@dataclass
class Truth:
    """What the instances acknowledged: the live reservations."""

    live: dict[str, Booking] = field(default_factory=dict)

    def loads(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """Per rank: (prefill tokens, active blocks, active requests)."""
        out = {}
        for wid, size in WORKERS.items():
            for rank in range(size):
                mine = [b for b in self.live.values() if b.rank == (wid, rank)]
                out[(wid, rank)] = (
                    sum(b.prefill for b in mine if not b.completed),
                    len({h for b in mine for h in b.blocks}),
                    len(mine),
                )
        return out


def loads(client: httpx.Client) -> dict[tuple[int, int], tuple[int, int, int]]:
    parts = client.get(SEL + "/loads").json()
    return {
        (r["worker_id"], r["dp_rank"]): (
            r["potential_prefill_tokens"], r["potential_decode_blocks"], r["active_requests"]
        )
        for p in parts
        for r in p["loads"]
    }  # fmt: skip


def dump(client: httpx.Client) -> list[Any]:
    parts = client.get(SEL + "/dump").json()
    return sorted(repr(sorted(map(repr, events))) for events in parts.values())


class Traffic:
    def __init__(self, servers: list[ServerProcess], seed: int) -> None:
        self.rng = random.Random(seed)
        self.clients = {s.name: httpx.Client(base_url=s.url, timeout=10) for s in servers}
        self.truth = Truth()
        self.pending: dict[str, tuple[tuple[int, int], list[int], int]] = {}
        self.n = 0
        self.statuses: Counter[int] = Counter()

    def call(self, up: list[str], method: str, path: str, body: Any = None) -> httpx.Response:
        client = self.clients[self.rng.choice(up)]
        r = client.request(method, SEL + path, json=body)
        self.statuses[r.status_code] += 1
        assert r.status_code < 500, (path, r.status_code, r.text)
        return r

    def prompt(self) -> dict[str, Any]:
        blocks = [self.rng.randint(1, 8) for _ in range(self.rng.randint(1, 6))]
        return {"model_name": MODEL, "block_hashes": blocks, "sequence_hashes": blocks,
                "isl_tokens": BS * len(blocks)}  # fmt: skip

    def step(self, up: list[str]) -> None:
        self.n += 1
        sid = f"s{self.n}"
        kind = self.rng.random()
        live = sorted(self.truth.live)
        if kind < 0.35 or not live:
            body = {**self.prompt(), "selection_id": sid}
            r = self.call(up, "POST", "/select_and_reserve", body)
            assert r.status_code == 200, r.text
            a = r.json()
            track = a["track_prefill_tokens"]
            self.truth.live[sid] = Booking(
                (a["worker_id"], a["dp_rank"]), body["sequence_hashes"],
                a["effective_prefill_tokens"] if track else 0,
            )  # fmt: skip
        elif kind < 0.5:
            body = {**self.prompt(), "selection_id": sid}
            r = self.call(up, "POST", "/select", body)
            assert r.status_code == 200, r.text
            a = r.json()
            self.pending[sid] = (
                (a["worker_id"], a["dp_rank"]), body["sequence_hashes"],
                a["effective_prefill_tokens"],
            )  # fmt: skip
        elif kind < 0.6 and self.pending:
            psid = self.rng.choice(sorted(self.pending))
            rank, blocks, prefill = self.pending.pop(psid)
            r = self.call(up, "POST", "/reservations", {"model_name": MODEL, "selection_id": psid})
            assert r.status_code == 201, r.text
            assert (r.json()["worker_id"], r.json()["dp_rank"]) == rank
            self.truth.live[psid] = Booking(rank, blocks, prefill)
        elif kind < 0.8:
            target = self.rng.choice(live)
            r = self.call(up, "POST", f"/reservations/{target}/prefill_complete", {})
            assert r.status_code == 200, r.text
            self.truth.live[target].completed = True
        else:
            target = self.rng.choice(live)
            r = self.call(up, "DELETE", f"/reservations/{target}")
            assert r.status_code == 200, r.text
            del self.truth.live[target]

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def test_selection_traffic_spread_over_instances_converges_to_what_was_acknowledged(
    fleet_factory: FleetFactory,
) -> None:
    fleet = fleet_factory(snapshot_interval_seconds=1)
    servers = fleet.spawn(3)
    a, b, c = servers
    names = [s.name for s in servers]
    traffic = Traffic(servers, seed=7)
    try:
        for i, (wid, size) in enumerate(WORKERS.items()):
            body = {"worker_id": wid, "model_name": MODEL, "endpoint": f"http://w{wid}",
                    "block_size": BS, "data_parallel_size": size}  # fmt: skip
            client = traffic.clients[names[i]]
            assert client.post(SEL + "/workers", json=body).status_code == 201
        for _ in range(150):
            traffic.step(names)
        b.kill(signal.SIGTERM)
        for _ in range(100):
            traffic.step([a.name, c.name])
        fleet.restart(b)
        for _ in range(150):
            traffic.step(names)

        want = traffic.truth.loads()
        clients = [traffic.clients[n] for n in names]

        def converged() -> bool:
            return all(loads(cl) == want for cl in clients)

        wait_until(converged, 10.0, "every instance at the acknowledged loads")
        workers = [cl.get(SEL + "/workers").json() for cl in clients]
        assert workers[0] == workers[1] == workers[2]
        assert [w["worker_id"] for w in workers[0]] == sorted(WORKERS)
        assert dump(clients[0]) == dump(clients[1]) == dump(clients[2])
        assert set(traffic.statuses) <= {200, 201}, traffic.statuses
        # every live reservation is known everywhere: releasing each on any instance works
        for sid in sorted(traffic.truth.live):
            r = traffic.call(names, "DELETE", f"/reservations/{sid}")
            assert r.status_code == 200, (sid, r.text)
        empty = Truth().loads()
        wait_until(lambda: all(loads(cl) == empty for cl in clients), 10.0, "all released")
    finally:
        traffic.close()
