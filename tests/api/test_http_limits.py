"""What a slow, large or greedy client can cost a live server, over raw sockets.

Each test runs ``python -m kv_slot_tracker`` (uvicorn with the direct protocol, as deployed) in a process of
its own, so that the timings seen by the test are the server's, not this process's. Bounds are
generous: they separate "answered" from "blocked for tens of seconds", nothing finer.
"""

from __future__ import annotations

import contextlib
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


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with short timeouts and few connections (the header limit as by default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env.update({ENV_PREFIX + "HTTP_HEADER_TIMEOUT_SECONDS": "2",
                ENV_PREFIX + "HTTP_BODY_TIMEOUT_SECONDS": "2",
                ENV_PREFIX + "HTTP_KEEP_ALIVE_SECONDS": "2",
                ENV_PREFIX + "HTTP_MAX_CONNECTIONS": "6",
                "PYTHONUNBUFFERED": "1"})  # fmt: skip
    s = ServerProcess("limited", free_port(), env, tmp_path_factory.mktemp("l") / "s.log")
    s.start()
    s.wait_ready()
    yield s
    s.close()


def closed_within(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and after how long."""
    sock.settimeout(seconds)
    started = time.monotonic()
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"still open after {seconds} s; got {data[:200]!r}") from None
        if not chunk:
            return data, time.monotonic() - started
        data += chunk


ADD = (b'{"model_name":"m","request_id":"r","worker_id":1,"dp_rank":0,'
       b'"sequence_hashes":[1]}')  # fmt: skip


@pytest.mark.parametrize("path", [b"GET /health", b"POST /add"])  # ASGI and direct paths
def test_a_header_block_over_64_kib_is_answered_431_and_closed(
    limited: ServerProcess, path: bytes
) -> None:
    fits = b"x-pad: " + b"a" * 60_000 + b"\r\n"
    too_big = b"x-pad: " + b"a" * 70_000 + b"\r\n"
    tail = b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(ADD), ADD)
    with connect(limited) as sock:
        sock.sendall(path + b" HTTP/1.1\r\nhost: t\r\n" + fits + tail)
        status, _ = read_response(sock)
        assert status in (200, 404)  # /add without a tracker: 404, answered all the same
    with connect(limited) as sock:
        sock.sendall(path + b" HTTP/1.1\r\nhost: t\r\n" + too_big + tail)
        data, _ = closed_within(sock, 10)
    assert data.startswith(b"HTTP/1.1 431 ")
    assert data.endswith(b'{"error":"request header block larger than 65536 bytes"}')
    assert b"content-type: application/json" in data
    with connect(limited) as sock:  # 64 MB of headers are not buffered: cut off early
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\nx-pad: ")
        sent = 0
        with contextlib.suppress(OSError):
            while sent < 64 << 20:
                sock.sendall(b"a" * 65536)
                sent += 65536
        assert sent < 4 << 20, sent
    assert health_seconds(limited) < 2


def test_slow_header_blocks_and_bodies_are_answered_408_and_closed(limited: ServerProcess) -> None:
    silent, slow_head, slow_body, slow_direct_body = (connect(limited) for _ in range(4))
    slow_head.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n")
    slow_body.sendall(b"POST /register HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                      b"\r\ncontent-length: 100\r\n\r\n{\"model")  # fmt: skip
    slow_direct_body.sendall(b"POST /add HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                             b"\r\ncontent-length: 100\r\n\r\n{\"model")  # fmt: skip
    data, took = closed_within(silent, 10)
    assert data == b"" and 1.5 < took < 8  # nothing sent, nothing answered: closed
    data, _ = closed_within(slow_head, 10)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert data.endswith(b'{"error":"request header block not received within 2 s"}')
    for sock in (slow_body, slow_direct_body):
        data, _ = closed_within(sock, 10)
        assert data.startswith(b"HTTP/1.1 408 ")
        assert data.endswith(b'{"error":"request body not received within 2 s"}')
    for sock in (silent, slow_head, slow_body, slow_direct_body):
        sock.close()


def test_an_idle_keep_alive_connection_is_closed(limited: ServerProcess) -> None:
    for request in (b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n",  # ASGI path
                    b"POST /free HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                    b"content-length: 35\r\n\r\n{\"model_name\":\"m\",\"request_id\":\"r\"}"):  # fmt: skip
        with connect(limited) as sock:
            sock.sendall(request)
            status, answer = read_response(sock)
            assert status in (200, 404), answer
            data, took = closed_within(sock, 10)
            assert data == b"" and took < 8


def test_beyond_the_connection_limit_requests_are_answered_503(limited: ServerProcess) -> None:
    held = [connect(limited) for _ in range(6)]
    try:
        time.sleep(0.2)  # the server has accepted them
        for request in (b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n",
                        b"POST /add HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(ADD), ADD)):  # fmt: skip
            with connect(limited) as sock:
                sock.sendall(request)
                status, answer = read_response(sock)
            assert status == 503, answer
            assert answer.endswith(b'{"error":"too many open connections; try again later"}')
            assert b"content-type: application/json" in answer
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)
    assert health_seconds(limited) < 2
