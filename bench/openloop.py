"""Open-loop latency: send /add + /free alternating at a fixed rate and measure each call from
its *scheduled* send time, so a slow server shows up as queueing delay (no coordinated
omission, unlike closed-loop tools such as wrk).

A small raw HTTP/1.1 client on uvloop: pre-encoded requests, keep-alive connections with one
request in flight each (a request due while all are busy waits for the first free one, its delay
counted), responses read by a protocol without a coroutine per call, and a send loop that polls
instead of sleeping on millisecond timers. The generator itself costs little and adds no timer
delay; it uses its whole core. Used by bench/http_bench.py for the "p99 at half
of maximum throughput" figure.

    .venv/bin/python bench/openloop.py URL --rate 8000 --seconds 10 [--connections 64]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import time
from urllib.parse import urlsplit

PREFIX = ",".join(str(1000003 * i) for i in range(1, 17))


def add_request(host: str, k: int, tag: str) -> bytes:
    rank = k % 64
    tail = ",".join(str(k * 64 + i) for i in range(1, 17))
    body = (
        f'{{"model_name":"bench","request_id":"{tag}{k}","worker_id":{rank // 4},'
        f'"dp_rank":{rank % 4},"sequence_hashes":[{PREFIX},{tail}],"new_isl_tokens":512}}'
    ).encode()
    return _post(host, "/add", body)


def free_request(host: str, k: int, tag: str) -> bytes:
    return _post(host, "/free", f'{{"model_name":"bench","request_id":"{tag}{k}"}}'.encode())


def _post(host: str, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request in flight (no pipelining, which the
    servers answer on a slower path), responses read from a buffer without a coroutine."""

    def __init__(self, gen: _Generator) -> None:
        self.gen = gen
        self.buf = b""
        self.scheduled = 0.0  # the scheduled send time of the request in flight
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        """Before every answer is in, a lost connection ends the run with an error (its
        request would never be answered)."""
        if not self.gen.done.done():
            self.gen.done.set_exception(ConnectionError(f"a connection was lost: {exc}"))

    def send(self, request: bytes, scheduled: float) -> None:
        self.scheduled = scheduled
        self.transport.write(request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end].lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                line_end = head.find(b"\r\n", at)
                length = int(head[at + 15 : line_end if line_end >= 0 else len(head)])
            if len(buf) < end + 4 + length:
                break
            status = int(head[9:12])
            buf = buf[end + 4 + length :]
            self.gen.answered(self, status)
        self.buf = buf


class _Generator:
    """Sends request i at ``start + i / rate`` on an idle connection (or as soon as one is
    free), and records each answer's delay from that scheduled time."""

    def __init__(self, requests: list[bytes], rate: float) -> None:
        self.requests = requests
        self.rate = rate
        # idle connections, longest idle first: every connection is used in turn, so none
        # sits idle long enough for the server's keep-alive timeout to close it
        self.idle: collections.deque[_Connection] = collections.deque()
        self.waiting: collections.deque[tuple[int, float]] = collections.deque()
        self.latencies: list[float] = []
        self.errors = 0
        self.done = asyncio.get_running_loop().create_future()

    def answered(self, conn: _Connection, status: int) -> None:
        now = time.perf_counter()
        self.latencies.append(now - conn.scheduled)
        if status >= 300 and status != 404:
            self.errors += 1
        if self.waiting:
            i, scheduled = self.waiting.popleft()
            conn.send(self.requests[i], scheduled)
        else:
            self.idle.append(conn)
        if len(self.latencies) == len(self.requests) and not self.done.done():
            self.done.set_result(None)

    async def run(self, start: float) -> None:
        """Send every request at its time. The loop is polled (``sleep(0)``) instead of
        sleeping on a timer: the event loops' timers fire on whole milliseconds, which would
        add up to a millisecond to every measured latency. The generator owns its core."""
        requests, rate, idle, waiting = self.requests, self.rate, self.idle, self.waiting
        i, total = 0, len(requests)
        while i < total:
            now = time.perf_counter()
            while i < total and start + i / rate <= now:
                scheduled = start + i / rate
                if idle:
                    idle.popleft().send(requests[i], scheduled)
                else:
                    waiting.append((i, scheduled))
                i += 1
            await asyncio.sleep(0)
        await self.done


async def run(url: str, rate: float, seconds: float, connections: int, tag: str) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    total = int(rate * seconds)
    # add k at slot 2k, free k (added 32 calls earlier) at slot 2k+1
    requests = [
        add_request(host, i // 2, tag) if i % 2 == 0 else free_request(host, i // 2 - 16, tag)
        for i in range(total)
    ]
    gen = _Generator(requests, rate)
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(connections):
        _, conn = await loop.create_connection(lambda: _Connection(gen), host, port)
        conns.append(conn)
        gen.idle.append(conn)
    start = time.perf_counter() + 0.2
    try:
        await gen.run(start)
    finally:
        for conn in conns:
            conn.transport.close()
    elapsed = time.perf_counter() - start
    latencies = sorted(gen.latencies)
    q = statistics.quantiles(latencies, n=1000)
    return {
        "sent": total,
        "achieved_rps": total / elapsed,
        "p50_ms": q[499] * 1000,
        "p99_ms": q[989] * 1000,
        "max_ms": latencies[-1] * 1000,
        "errors": gen.errors,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--tag", default="ol")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    res = asyncio.run(run(args.url, args.rate, args.seconds, args.connections, args.tag))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
