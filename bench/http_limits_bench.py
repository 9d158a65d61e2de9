"""What a client sending the largest body as one-byte chunks costs a live server, and how fast
the server answers others meanwhile (the figures ``tests/api/test_http_limits.py`` once asserted).

For each body size: the upload's wall time (chunked, 1-byte chunks, sent in 8 parts), the
server's CPU seconds for it, and the slowest of the ``/health`` calls made on a new connection
between the parts. A server that appended each chunk to the body so far took 7.8 s for 1 MiB and
39 s for 2 MiB (quadratic); the CPU time should grow in proportion to the size. A benchmark, not
a test: the figures depend on the machine and its load.

    .venv/bin/python bench/http_limits_bench.py [--sizes-kib 256,1024,2048]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.http_bench import cpu_seconds  # noqa: E402
from bench.reference import start_ours  # noqa: E402


def upload(url: str, port: int, size: int) -> tuple[float, float, int]:
    """(wall seconds of the upload, slowest /health seconds meanwhile, status)."""
    body = b'{"model_name":"m","sequence_hashes":[1,2,3]}'
    body += b" " * (size - len(body))
    framed = b"".join(b"1\r\n" + body[i : i + 1] + b"\r\n" for i in range(len(body)))
    sock = socket.create_connection(("127.0.0.1", port), timeout=300)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = (b"POST /potential_loads HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
    started = time.monotonic()
    sock.sendall(head)
    slowest = 0.0
    step = len(framed) // 8
    for i in range(0, len(framed), step):
        sock.sendall(framed[i : i + step])
        t0 = time.monotonic()
        assert httpx.get(url + "/health", timeout=300).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
    sock.sendall(b"0\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    took = time.monotonic() - started
    sock.close()
    return took, slowest, int(data.split(b" ", 2)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-kib", default="256,1024,2048")
    args = ap.parse_args()
    sizes = [int(s) * 1024 for s in args.sizes_kib.split(",")]
    server = start_ours(extra_args=["--max-body-bytes", str(max(sizes))])
    try:
        register = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0,
                    "dp_size": 1}  # fmt: skip
        assert httpx.post(server.url + "/register", json=register).status_code == 201
        for size in sizes:
            cpu_before = cpu_seconds(server.pid)
            took, slowest, status = upload(server.url, server.port, size)
            cpu = cpu_seconds(server.pid) - cpu_before
            print(json.dumps({"body_kib": size // 1024, "status": status, "upload_s": round(took, 3),
                              "server_cpu_s": round(cpu, 3), "slowest_health_s": round(slowest, 3)}))  # fmt: skip
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
