"""How long one large KV-event batch holds this service's event loop, and its memory.

Starts this service (KV events on), registers one worker whose publisher is in this process
(``tests/ingest/fake_engine.py``), then for each size publishes one batch of that many blocks
(``BlockStored``, block size 16, real-looking token ids) while a thread calls ``GET /health`` in
a loop. Prints per size: the message size, whether it was applied or rejected, the slowest
``/health`` answer while it was handled, and the server's resident memory before and after
(``VmRSS``) and its peak (``VmHWM``).

    .venv/bin/python bench/kv_big_batch.py --blocks 1000 16000 100000 700000
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import httpx
import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reference import start_ours  # noqa: E402
from tests.ingest.fake_engine import FakeEngine  # noqa: E402

BS = 16


def vm(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    return -1


def counters(client: httpx.Client) -> tuple[float, float, float]:
    m = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            m[k] = float(v)
    return (
        m.get("kv_slot_tracker_kv_events_batches_total", 0),
        m.get('kv_slot_tracker_kv_cache_event_warnings_total{warning_kind="batch_too_large"}', 0),
        m.get("kv_slot_tracker_kv_events_reconnects_total", 0),
    )


def ping(url: str, stop: threading.Event, worst: list[float]) -> None:
    """Call ``GET /health`` until ``stop``; the slowest answer in ``worst[0]``."""
    with httpx.Client(base_url=url, timeout=60) as p:
        while not stop.is_set():
            t = time.perf_counter()
            p.get("/health")
            worst[0] = max(worst[0], time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1_000, 16_000, 100_000])
    args = ap.parse_args(argv)
    srv = start_ours(env={**os.environ, "DYN_ROUTER_USE_KV_EVENTS": "true"})
    ctx = zmq.Context()
    engine = FakeEngine(ctx, replay=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            body = {"worker_id": 1, "endpoint": "http://w1", "block_size": BS,
                    "kv_events_endpoint": engine.endpoint}  # fmt: skip
            assert c.post("/selection/workers", json=body).json()["lifecycle"] == "schedulable"
            engine.wait_subscribed()
            idle, stop_idle = [0.0], threading.Event()
            t = threading.Thread(target=ping, args=(srv.url, stop_idle, idle))
            t.start()
            time.sleep(2.0)
            stop_idle.set()
            t.join()
            print(f"no batch: slowest /health in 2 s {idle[0] * 1000:.1f} ms")
            base = 1
            for n in args.blocks:
                hashes = list(range(base, base + n))
                tokens = [(base * 7 + i) % 150_000 for i in range(n * BS)]
                base += n
                events = [["BlockStored", hashes, None, tokens, BS, None, "GPU", None]]
                payload = msgpack.packb([0.0, events, 0])  # packed before the clock runs
                size = len(payload)
                seq, engine.next_seq = engine.next_seq, engine.next_seq + 1
                before = counters(c)
                rss0 = vm(srv.pid or 0, "VmRSS")
                worst = [0.0]
                stop = threading.Event()

                t = threading.Thread(target=ping, args=(srv.url, stop, worst))
                t.start()
                time.sleep(0.3)
                engine.raw([b"", seq.to_bytes(8, "big"), payload])
                deadline = time.monotonic() + 120
                while counters(c) == before and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.3)
                stop.set()
                t.join()
                after = counters(c)
                what = ("applied" if after[0] > before[0] else "rejected (cap)"
                        if after[1] > before[1] else "dropped (size), reconnected"
                        if after[2] > before[2] else "?")  # fmt: skip
                print(f"{n:>9} blocks {size / 1e6:7.2f} MB  {what:28} slowest /health "
                      f"{worst[0] * 1000:7.1f} ms  RSS {rss0} -> {vm(srv.pid or 0, 'VmRSS')} MB "
                      f"(peak {vm(srv.pid or 0, 'VmHWM')} MB)")  # fmt: skip
    finally:
        engine.close()
        ctx.destroy(linger=0)
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
