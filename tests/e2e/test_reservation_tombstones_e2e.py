"""A booking that reaches a paused instance only after its reservation was booked elsewhere,
used and freed: two real ``python -m kv_slot_tracker`` processes on one Redis.

The client's ``select_and_reserve`` to instance A sits in A's socket while A is stopped
(SIGSTOP); the client gives up on it and retries on B, where the booking is made, its prefill
completed and the reservation freed. Then A resumes (SIGCONT) and runs the stale call: refused
(409) when A read the free first, else booked and then dropped (A's copy by the free, its
records on B as a released id's). Either way, once every record is applied, no instance holds
the reservation. Before released ids were remembered, A, B or both ended holding it.
"""

from __future__ import annotations

import json
import os
import signal
import socket

import httpx
import pytest
import redis

from tests.e2e.conftest import FleetFactory
from tests.e2e.servers import ServerProcess, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

SEL = "/selection"
BODY = {"model_name": "m", "selection_id": "late", "block_hashes": [1, 2, 3],
        "sequence_hashes": [1, 2, 3], "isl_tokens": 12}  # fmt: skip


def send_raw(port: int, path: str, body: dict) -> socket.socket:
    """Send one HTTP request and leave its answer unread (the bytes wait in the socket of a
    stopped process: the kernel accepts the connection for it)."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(head.encode() + data)
    return sock


def read_status(sock: socket.socket) -> int:
    sock.settimeout(30)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    return int(answer.split(b" ", 2)[1])


def held(server: ServerProcess) -> list[tuple[int, int]]:
    """``(active_requests, prefill tokens)`` of every rank, from the selection and slot views."""
    with httpx.Client(base_url=server.url, timeout=5) as client:
        parts = client.get(SEL + "/loads").json()
        rows = [(r["active_requests"], r["potential_prefill_tokens"])
                for p in parts for r in p["loads"]]  # fmt: skip
        rows += [(r["active_requests"], r["active_prefill_tokens"])
                 for r in client.get("/loads").json()]  # fmt: skip
    return rows


def test_a_stale_booking_run_by_a_resumed_instance_after_the_free_holds_nothing(
    fleet_factory: FleetFactory, redis_url: str
) -> None:
    fleet = fleet_factory(env={"ROUTER_USE_KV_EVENTS": "false"})
    a, b = fleet.spawn(2)
    worker = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
    with (
        httpx.Client(base_url=a.url, timeout=10) as ca,
        httpx.Client(base_url=b.url, timeout=10) as cb,
    ):
        assert ca.post(SEL + "/workers", json=worker).status_code == 201
        wait_until(lambda: cb.get(SEL + "/workers").json(), 10, "the worker on b")

        os.kill(a.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            stale = send_raw(a.port, SEL + "/select_and_reserve", BODY)
            # the client timed out on a: retried on b, where it is booked, used and freed
            r = cb.post(SEL + "/select_and_reserve", json=BODY)
            assert r.status_code == 200, r.text
            assert cb.post(SEL + "/reservations/late/prefill_complete").status_code == 200
            assert cb.delete(SEL + "/reservations/late").status_code == 200
            wait_until(lambda: b.status()["outbox_depth"] == 0, 10, "b's records in the stream")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        answer = read_status(stale)
        assert answer in (200, 409), answer

        stream = redis.Redis.from_url(redis_url)
        key = "{" + fleet.namespace + "}:events"

        def settled() -> bool:
            (last,) = stream.xrevrange(key, count=1)
            statuses = [s.status() for s in (a, b)]
            return all(
                s["outbox_depth"] == 0 and s["stream_position"] == last[0].decode()
                for s in statuses
            )

        wait_until(settled, 20, "every record applied on both instances", describe=fleet.statuses)
        stream.close()
        for server in (a, b):
            assert all(row == (0, 0) for row in held(server)), (server.name, held(server))
        if answer == 200:  # booked on a before it read the free: its records dropped on b
            assert b.status()["records_rejected"]["released"] == 2
        # refused from now on, on both
        for client in (ca, cb):
            r = client.post(SEL + "/select_and_reserve", json=BODY)
            assert r.status_code == 409, r.text
        assert all(row == (0, 0) for s in (a, b) for row in held(s))
