"""What a slow, large or greedy client can cost a live server, over raw sockets.

Each test runs ``python -m kv_slot_tracker`` (uvicorn with the direct protocol, as deployed) in a
process of its own. The tests check events (answered, closed, refused), not durations: the time
such a client costs is measured by ``bench/http_limits_bench.py``. The only times asserted are
lower bounds the server's own timers set (a load on the machine can only lengthen them); the
waits for a close are bounds against a hang.
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
from tests.ports import free_port

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


def assert_healthy(server: ServerProcess) -> None:
    """``/health`` on a new connection is answered 200 (the server is not blocked)."""
    r = httpx.get(server.url + "/health", timeout=60)
    assert r.status_code == 200, r.text


def test_a_body_in_small_chunks_is_read_while_others_are_answered(start_server: Start) -> None:
    """The largest body, sent as 512-byte chunks (the most fragmented body the request rate
    floor lets through: ``http_min_bytes_per_read``, 256 bytes a piece on average; 1-byte
    chunks are refused, below), is answered; ``/health`` is answered between its parts.
    (Appending each chunk to the body so far once cost 7.8 s for 1 MiB of 1-byte chunks:
    bench/http_limits_bench.py measures it.)"""
    limit = 1 << 20
    server = start_server(max_body_bytes=str(limit))
    register = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert httpx.post(server.url + "/register", json=register).status_code == 201
    body = b'{"model_name":"m","sequence_hashes":[1,2,3]}'
    body += b" " * (limit - len(body))  # exactly the largest body allowed
    sock = connect(server)
    head = (b"POST /potential_loads HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
    framed = b"".join(b"200\r\n" + body[i : i + 512] + b"\r\n" for i in range(0, len(body), 512))
    sock.sendall(head)
    step = len(framed) // 8
    for i in range(0, len(framed), step):  # /health asked between parts of the upload
        sock.sendall(framed[i : i + step])
        assert_healthy(server)
    sock.sendall(b"0\r\n\r\n")
    status, answer = read_response(sock)
    sock.close()
    assert status == 200, answer[-300:]
    assert answer.endswith(
        b'[{"worker_id":1,"dp_rank":0,"potential_prefill_tokens":0,"potential_decode_blocks":3,'
        b'"active_requests":0}]'
    ), answer[-300:]


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
        except ConnectionResetError:  # closed while this side was still sending: the answer
            chunk = b""  # before it was read all the same (the kernel queues it first)
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
    assert_healthy(limited)


def test_slow_header_blocks_and_bodies_are_answered_408_and_closed(limited: ServerProcess) -> None:
    opened = time.monotonic()  # before the server accepted any: its timers start later
    silent, slow_head, slow_body, slow_direct_body = (connect(limited) for _ in range(4))
    slow_head.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n")
    slow_body.sendall(b"POST /register HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                      b"\r\ncontent-length: 100\r\n\r\n{\"model")  # fmt: skip
    slow_direct_body.sendall(b"POST /add HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                             b"\r\ncontent-length: 100\r\n\r\n{\"model")  # fmt: skip
    data, _ = closed_within(silent, 30)
    assert data == b""  # nothing sent, nothing answered: closed, not before the 2 s timeout
    assert time.monotonic() - opened >= 2.0 - 0.01  # (the loop's timers may fire 1 tick early)
    data, _ = closed_within(slow_head, 30)
    assert data.startswith(b"HTTP/1.1 408 ")
    assert data.endswith(b'{"error":"request header block not received within 2 s"}')
    for sock in (slow_body, slow_direct_body):
        data, _ = closed_within(sock, 30)
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
            data, _ = closed_within(sock, 30)  # by the 2 s keep-alive timeout
            assert data == b""


def test_beyond_the_connection_limit_requests_are_answered_503(start_server: Start) -> None:
    """Six connections each with a request under way (none idle, so none to close to make
    room): a seventh is answered 503; once they close, new ones are served again."""
    crowded = start_server(http_max_connections="6", http_header_timeout_seconds="300",
                           http_min_request_bytes_per_second="0")  # fmt: skip

    def busy() -> socket.socket:
        sock = connect(crowded)
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n")  # the header block under way
        return sock

    held = [busy() for _ in range(6)]
    try:
        for request in (b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n",
                        b"POST /add HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(ADD), ADD)):  # fmt: skip
            for _ in range(50):
                with connect(crowded) as sock:
                    sock.sendall(request)
                    status, answer = read_response(sock)
                if status == 503:
                    break
                # a held connection was accepted but its bytes not yet read: it was idle, and
                # closed to make room; replace it
                held = [s for s in held if not is_closed(s)]
                held += [busy() for _ in range(6 - len(held))]
            assert status == 503, answer
            assert answer.endswith(b'{"error":"too many open connections; try again later"}')
            assert b"content-type: application/json" in answer
    finally:
        for sock in held:
            sock.close()
    # once the server has seen the closes, a new connection is served again
    deadline = time.monotonic() + 30
    while httpx.get(crowded.url + "/health", timeout=60).status_code == 503:
        assert time.monotonic() < deadline, "still refusing connections after the others closed"
        time.sleep(0.02)
    assert_healthy(crowded)


def is_closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def responses_until_closed(sock: socket.socket, seconds: float = 10) -> list[tuple[int, bytes]]:
    """Every response the server sends until it closes the connection: (status, body)."""
    data, _ = closed_within(sock, seconds)
    out: list[tuple[int, bytes]] = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        out.append((int(head.split(b" ", 2)[1]), rest[:length]))
        data = rest[length:]
    return out


@pytest.mark.parametrize("path", [b"/register", b"/add"])  # ASGI and direct paths
def test_a_content_length_over_the_body_limit_is_refused_at_the_headers(
    limited: ServerProcess, path: bytes
) -> None:
    with connect(limited) as sock:
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 10000000\r\n\r\n{")  # fmt: skip
        answers = responses_until_closed(sock)
    # before: the server waited for the 10 MB and answered 408 at the body timeout
    assert answers == [
        (413, b'{"error":"Failed to buffer the request body: length limit exceeded"}')
    ]


@pytest.mark.parametrize("path", [b"/register", b"/add"])
def test_an_endless_chunked_body_is_refused_once_past_the_body_limit(
    limited: ServerProcess, path: bytes
) -> None:
    chunk = b"%x\r\n%s\r\n" % (4096, b" " * 4096)
    sent = 0
    with connect(limited) as sock:
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                     b"\r\ntransfer-encoding: chunked\r\n\r\n")  # fmt: skip
        with contextlib.suppress(OSError):
            while sent < 64 << 20:
                sock.sendall(chunk * 16)
                sent += 16 * 4096
        answers = responses_until_closed(sock)
    assert answers == [
        (413, b'{"error":"Failed to buffer the request body: length limit exceeded"}')
    ]
    assert sent < 16 << 20, sent  # the server stopped reading soon after 2 MiB


@pytest.mark.parametrize("path", [b"/register", b"/add"])
def test_a_request_sent_a_byte_per_packet_is_cut_after_a_few_dozen(
    limited: ServerProcess, path: bytes
) -> None:
    sent = 0
    with connect(limited) as sock:
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 100000\r\n\r\n")  # fmt: skip
        with contextlib.suppress(OSError):
            while sent < 1000:
                sock.sendall(b" ")
                sent += 1
                time.sleep(0.003)  # one byte per packet
                sock.setblocking(False)
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break  # answered
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
        answers = responses_until_closed(sock)
    assert len(answers) == 1 and answers[0][0] == 408, answers
    assert answers[0][1].startswith(b'{"error":"request arriving in pieces too small'), answers
    assert sent < 200, sent  # 64 reads allowed, then 256 bytes a read on average


def test_a_request_slower_than_the_rate_floor_is_cut_before_the_body_timeout(
    start_server: Start,
) -> None:
    server = start_server(http_body_timeout_seconds="60", http_request_rate_grace_seconds="1",
                          http_min_request_bytes_per_second="2000")  # fmt: skip
    with connect(server) as sock:
        sock.sendall(b"POST /register HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 100000\r\n\r\n")  # fmt: skip
        sent = 0
        with contextlib.suppress(OSError):
            while sent < 100_000:
                sock.sendall(b" " * 500)  # 1,000 bytes a second: half the floor
                sent += 500
                time.sleep(0.5)
                sock.setblocking(False)
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
        answers = responses_until_closed(sock)
    assert answers == [(408, b'{"error":"request arriving slower than 2000 bytes/s"}')]
    assert sent < 20_000, sent  # cut within seconds, not at the 60 s body timeout


def test_idle_connections_cannot_lock_a_live_client_out(start_server: Start) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 9000 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (9000, hard))  # the server inherits it
    server = start_server()  # http_max_connections = 4096 by default
    held: list[socket.socket] = []
    try:
        for _ in range(4200):  # connected, never sending: idle
            held.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        # a live client is served although more idle connections were opened than allowed
        for _ in range(3):
            r = httpx.post(server.url + "/register", timeout=30, json={
                "model_name": "m", "worker_id": len(held), "block_size": 16, "dp_start": 0,
                "dp_size": 1})  # fmt: skip
            assert r.status_code == 201, r.text
            held.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        # the room was made by closing the connections idle longest (the first opened)
        first = held[0]
        first.settimeout(10)
        assert first.recv(1) == b""
        last = held[-1]
        last.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        last.settimeout(10)
        assert read_response(last)[0] == 200
    finally:
        for sock in held:
            sock.close()


def test_one_client_address_cannot_take_every_connection(start_server: Start) -> None:
    server = start_server(
        http_max_connections_per_client="4", http_min_request_bytes_per_second="0"
    )

    def from_(address: str) -> socket.socket:
        return socket.create_connection(("127.0.0.1", server.port), source_address=(address, 0))

    def busy() -> socket.socket:  # 127.0.0.2, with a request under way: not idle
        sock = from_("127.0.0.2")
        sock.sendall(b"POST /register HTTP/1.1\r\nhost: t\r\ncontent-length: 50\r\n\r\n{")
        return sock

    held = [busy() for _ in range(4)]
    try:
        for _ in range(50):
            answers = responses_until_closed(from_("127.0.0.2"))
            if answers and answers[0][0] == 503:
                break
            # one held connection had not been read yet (idle): closed to make room; replace it
            held = [s for s in held if not is_closed(s)]
            held += [busy() for _ in range(4 - len(held))]
        assert answers == [(503, b'{"error":"too many open connections from this client address; '
                                 b'try again later"}')]  # fmt: skip
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # 127.0.0.1
        first = from_("127.0.0.3")
        others = [from_("127.0.0.3") for _ in range(4)]  # a fifth idle one closes the first
        first.settimeout(10)
        assert first.recv(1) == b""
        for sock in others:
            sock.close()
    finally:
        for sock in held:
            sock.close()


def post(path: bytes, body: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path, len(body), body))  # fmt: skip


@pytest.mark.parametrize(
    ("request_", "first"),
    [
        (post(b"/register",
              b'{"model_name":"pg","worker_id":9,"block_size":16,"dp_start":0,"dp_size":1}'), 201),
        (post(b"/free", b'{"model_name":"m","request_id":"r"}'), 404),
    ],
)  # fmt: skip
def test_garbage_pipelined_behind_a_request_is_answered_after_it(
    limited: ServerProcess, request_: bytes, first: int
) -> None:
    with connect(limited) as sock:
        sock.sendall(request_ + b"\x00\x01 not HTTP at all\r\n\r\n")
        answers = responses_until_closed(sock)
    assert answers == [(first, answers[0][1]), (400, b'{"error":"invalid HTTP request"}')], answers
    if first == 201:  # applied, and said so
        workers = httpx.get(limited.url + "/workers", params={"model_name": "pg"}).json()
        assert [w["worker_id"] for w in workers] == [9]


@pytest.mark.parametrize("path", [b"/register", b"/add"])
def test_a_body_in_1_byte_chunks_is_refused_after_a_few_dozen(
    limited: ServerProcess, path: bytes
) -> None:
    with connect(limited) as sock:
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: t\r\ncontent-type: application/json"
                     b"\r\ntransfer-encoding: chunked\r\n\r\n" + b"1\r\n \r\n" * 10_000)  # fmt: skip
        answers = responses_until_closed(sock)
    assert len(answers) == 1 and answers[0][0] == 408, answers
    assert answers[0][1].startswith(b'{"error":"request arriving in pieces too small'), answers


def test_an_oversized_body_that_is_not_json_is_answered_415_as_the_reference_does(
    limited: ServerProcess,
) -> None:
    with connect(limited) as sock:  # the reference checks the content type before the size
        sock.sendall(b"POST /register HTTP/1.1\r\nhost: t\r\ncontent-length: 10000000\r\n\r\n{")
        answers = responses_until_closed(sock)
    assert answers == [(415, b'{"error":"Expected request with `Content-Type: application/json`"}')]
