"""What a slow, large or greedy client can cost a live server, over raw sockets.

Each test runs ``python -m app`` (uvicorn with the direct protocol, as deployed) in a process of
its own, so that the timings seen by the test are the server's, not this process's. Bounds are
generous: they separate "answered" from "blocked for tens of seconds", nothing finer.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.servers import ENV_PREFIX, ServerProcess
from tests.replication.helpers import free_port

Start = Callable[..., ServerProcess]


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Start]:
    servers: list[ServerProcess] = []

    def start(**settings: str) -> ServerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env["PYTHONUNBUFFERED"] = "1"
        for key, value in settings.items():
            env[ENV_PREFIX + key.upper()] = value
        s = ServerProcess(f"s{len(servers)}", free_port(), env, tmp_path / f"s{len(servers)}.log")
        servers.append(s)
        s.start()
        s.wait_ready()
        return s

    yield start
    for s in servers:
        s.close()


def connect(server: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """Status and the whole raw answer of one response (``connection: close`` not assumed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ", 2)[1]), head + b"\r\n\r\n" + body


def health_seconds(server: ServerProcess) -> float:
    started = time.monotonic()
    r = httpx.get(server.url + "/health", timeout=60)
    assert r.status_code == 200
    return time.monotonic() - started


def test_a_body_in_one_byte_chunks_costs_time_in_proportion(start_server: Start) -> None:
    limit = 1 << 20
    server = start_server(max_body_bytes=str(limit))
    register = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert httpx.post(server.url + "/register", json=register).status_code == 201
    body = b'{"model_name":"m","sequence_hashes":[1,2,3]}'
    body += b" " * (limit - len(body))  # exactly the largest body allowed
    sock = connect(server)
    head = (b"POST /potential_loads HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
    framed = b"".join(b"1\r\n" + body[i : i + 1] + b"\r\n" for i in range(len(body)))
    started = time.monotonic()
    sock.sendall(head)
    slowest_health = 0.0
    step = len(framed) // 8
    for i in range(0, len(framed), step):  # /health asked between parts of the upload
        sock.sendall(framed[i : i + step])
        slowest_health = max(slowest_health, health_seconds(server))
    sock.sendall(b"0\r\n\r\n")
    status, answer = read_response(sock)
    took = time.monotonic() - started
    sock.close()
    assert status == 200, answer[-300:]
    assert b'"dp_rank":0' in answer, answer[-300:]
    # appending each chunk to the body so far took 7.8 s for 1 MiB (and 39 s for 2 MiB)
    assert took < 6.0, took
    assert slowest_health < 2.0, slowest_health
