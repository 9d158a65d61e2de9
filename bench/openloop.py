"""Open-loop latency: send /add + /free alternating at a fixed rate and measure each call from
its *scheduled* send time, so a slow server shows up as queueing delay (no coordinated
omission, unlike closed-loop tools such as wrk).

A small raw HTTP/1.1 client on uvloop (one keep-alive connection per slot, pre-encoded
requests), so the generator itself costs little. Used by bench/http_bench.py for the "p99 at half
of maximum throughput" figure.

    .venv/bin/python bench/openloop.py URL --rate 8000 --seconds 10 [--connections 64]
"""

from __future__ import annotations

import argparse
import asyncio
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


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    if length:
        await reader.readexactly(length)
    return status


async def run(url: str, rate: float, seconds: float, connections: int, tag: str) -> dict:
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    total = int(rate * seconds)
    # add k at slot 2k, free k (added 32 calls earlier) at slot 2k+1
    requests = []
    for i in range(total):
        k = i // 2
        requests.append(
            add_request(host, k, tag) if i % 2 == 0 else free_request(host, k - 16, tag)
        )
    latencies: list[float] = []
    errors = 0
    next_index = 0
    start = time.perf_counter() + 0.2
    lock = asyncio.Lock()

    async def conn() -> None:
        nonlocal next_index, errors
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while True:
                async with lock:
                    i = next_index
                    next_index += 1
                if i >= total:
                    return
                scheduled = start + i / rate
                delay = scheduled - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(requests[i])
                status = await read_response(reader)
                latencies.append(time.perf_counter() - scheduled)
                if status >= 300 and status != 404:
                    errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(conn() for _ in range(connections)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    q = statistics.quantiles(latencies, n=1000)
    return {
        "sent": total,
        "achieved_rps": total / elapsed,
        "p50_ms": q[499] * 1000,
        "p99_ms": q[989] * 1000,
        "max_ms": latencies[-1] * 1000,
        "errors": errors,
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
