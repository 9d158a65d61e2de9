"""What carrying one replica record between the processes of one host costs, per transport.

``--workers N`` shares the state of N processes by sending every change to every other
process. Per record, this measures the CPU time (of this process, ``time.process_time``, so a
busy machine moves it less than wall time) of the Python side of each transport, on a private
``redis-server`` over a Unix socket as the supervisor starts it:

  redis_append   the outbox's append script (one EVALSHA per batch, one XADD per record inside
                 Redis: the stream's format today), with msgpack encoding: sending; the
                 ``redis_server`` column is the Redis server's CPU for it
  redis_xread    XREAD of those entries and msgpack-decoding each record: receiving
  redis_packed   one XADD carrying a batch of records packed into one msgpack value, then its
                 XREAD and decode: sending and receiving
  unix_frames    a length-prefixed msgpack batch over a plain Unix socket pair (asyncio
                 streams): sending and receiving

and, for scale, what a process pays to serve a lifecycle call (``bench/http_bench.py``,
server CPU per call) is in ``bench/RESULTS.md``.

Run:  .venv/bin/python bench/transport_bench.py [--records 20000] [--batch 100]
Needs: redis-server on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
from redis.asyncio import Redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kv_slot_tracker.replication.redis.stream import APPEND_SCRIPT  # noqa: E402


def record(i: int) -> dict:
    """A replica record shaped like an add's (32 block hashes)."""
    return {
        "model_name": "bench",
        "routing_group": "default",
        "block_size": 16,
        "origin": 12345678901234567,
        "incarnation": 987654321,
        "seq": i,
        "ts": 1_796_000_000_000_000_000 + i,
        "event": {
            "kind": "add",
            "request_id": f"r{i}",
            "worker_id": i % 16,
            "dp_rank": i % 4,
            "hashes": [(1000003 * k + i) & 0x7FFFFFFFFFFFFFFF for k in range(32)],
            "isl_tokens": 512,
        },
    }


class PrivateRedis:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="transport-bench-"))
        self.path = self.dir / "redis.sock"
        binary = shutil.which("redis-server")
        if not binary:
            raise SystemExit("redis-server not on PATH")
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                "0",
                "--unixsocket",
                str(self.path),
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                str(self.dir / "redis.log"),
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def redis_per_record(
    url: str, server_pid: int, records: list[dict], batch: int
) -> dict[str, float]:
    client = Redis.from_url(url)
    append = client.register_script(APPEND_SCRIPT)
    await client.delete("s1", "s2")
    server0 = server_cpu_s(server_pid)
    t0 = time.process_time()
    for i in range(0, len(records), batch):
        payloads = [msgpack.packb(r) for r in records[i : i + batch]]
        await append(keys=["s1", "reset", "snap"], args=["", "0", "0", "", *payloads])
    send = time.process_time() - t0
    server = server_cpu_s(server_pid) - server0
    t0 = time.process_time()
    last, got = "0-0", 0
    while got < len(records):
        reply = await client.xread({"s1": last}, count=batch)
        for _, entries in reply:
            for entry_id, fields in entries:
                msgpack.unpackb(fields[b"d"])
                last = entry_id
                got += 1
    receive = time.process_time() - t0
    t0 = time.process_time()
    for i in range(0, len(records), batch):
        await client.xadd("s2", {b"d": msgpack.packb(records[i : i + batch])})
    last, got = "0-0", 0
    while got < len(records):
        reply = await client.xread({"s2": last}, count=16)
        for _, entries in reply:
            for entry_id, fields in entries:
                got += len(msgpack.unpackb(fields[b"d"]))
                last = entry_id
    packed = time.process_time() - t0
    await client.delete("s1", "s2")
    await client.aclose()
    n = len(records) / 1e6
    return {"redis_append": send / n, "redis_server": server / n, "redis_xread": receive / n,
            "redis_packed": packed / n}  # fmt: skip


async def unix_frames_per_record(records: list[dict], batch: int) -> float:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader, reader_side = await asyncio.open_unix_connection(sock=b)
    _, writer = await asyncio.open_unix_connection(sock=a)

    async def receive() -> int:
        got = 0
        while got < len(records):
            size = int.from_bytes(await reader.readexactly(4), "little")
            got += len(msgpack.unpackb(await reader.readexactly(size)))
        return got

    t0 = time.process_time()
    task = asyncio.create_task(receive())
    for i in range(0, len(records), batch):
        frame = msgpack.packb(records[i : i + batch])
        writer.write(len(frame).to_bytes(4, "little") + frame)
        await writer.drain()
    await task
    spent = time.process_time() - t0
    writer.close()
    reader_side.close()
    return spent / len(records) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()
    records = [record(i) for i in range(args.records)]
    server = PrivateRedis()
    try:
        url = f"unix://{server.path}"
        redis = asyncio.run(redis_per_record(url, server.proc.pid, records, args.batch))
    finally:
        server.close()
    frames = asyncio.run(unix_frames_per_record(records, args.batch))
    print(f"records {args.records}, batches of {args.batch}; CPU microseconds per record:")
    for name, value in {**redis, "unix_frames": frames}.items():
        print(f"  {name:13s} {value:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
