"""The global budgets and the connection limits, measured on a real server process.

Part 1, memory at each budget's edge: a server started with the given budgets (small ones by
default, so the run is short) is filled up to each edge through the API (ranks by
``/register``, active requests and prompt hashes by ``/batch`` adds, selection workers by
``POST /selection/workers``) until it answers 503; the server's resident memory (``VmRSS``)
is read after each phase, and the growth divided by the items gives what one item costs (the
constants of ``kv_slot_tracker.core.limits`` that size the default budgets). A ``/metrics``
scrape at the end gives the scrape's size and time at the edge.

Part 2, what a greedy client costs a live one: the live client's ``/add`` + ``/free`` latency
(p50, p99, max over a few seconds) alone, then while 4,200 idle connections are held, while a
client trickles a body a byte per packet (``/add``, direct path, and ``/register``, the ASGI
path), and while a client streams an endless chunked body.

Run:  .venv/bin/python bench/budget_bench.py [--seconds 3] [--skip-connections]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.reference import Server, start_ours  # noqa: E402

MB = 1 << 20


def cpu_seconds(server: Server) -> float:
    import os

    fields = Path(f"/proc/{server.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss(server: Server) -> int:
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def fill(post: Callable[[int], httpx.Response]) -> tuple[int, str]:
    """Call ``post(i)`` for i = 0, 1, ... until it is refused; (calls accepted, the refusal)."""
    i = 0
    while True:
        r = post(i)
        if r.status_code == 503:
            return i, r.json()["error"]
        if r.status_code >= 300:
            raise RuntimeError(f"call {i}: {r.status_code} {r.text[:200]}")
        i += 1


def memory_part(args: argparse.Namespace) -> None:
    """Each budget filled in a server of its own (freed memory is reused by the allocator: a
    phase after another would look cheaper than it is)."""
    import os

    env = {
        **os.environ,
        "SLOT_TRACKER_MAX_RANKS": str(args.ranks),
        "SLOT_TRACKER_MAX_ACTIVE_REQUESTS": str(args.requests),
        "SLOT_TRACKER_MAX_BLOCK_HASHES": str(args.hashes),
        "SLOT_TRACKER_MAX_SELECTION_WORKERS": str(args.workers),
        "SLOT_TRACKER_MAX_TRACKERS": "100000",
    }
    rows: list[tuple[str, int, int, int, str, float, int]] = []

    def phase(name: str, run: Callable[[httpx.Client], tuple[int, str]]) -> None:
        server = start_ours(env=env)
        try:
            c = httpx.Client(base_url=server.url, timeout=120)
            c.post("/register", json={"model_name": "q", "worker_id": 1, "block_size": 16,
                                      "dp_start": 0, "dp_size": 1})  # fmt: skip
            before = rss(server)
            items, why = run(c)
            after = rss(server)
            started = time.perf_counter()
            scrape = c.get("/metrics")
            took = time.perf_counter() - started
            rows.append((name, items, before, after, why, took, len(scrape.content)))
        finally:
            server.stop()

    def ranks(c: httpx.Client) -> tuple[int, str]:
        def register(i: int) -> httpx.Response:  # trackers of 4,096 ranks, each a new name
            return c.post("/register", json={"model_name": f"r{i}", "worker_id": i,
                                             "block_size": 16, "dp_start": 0, "dp_size": 4096})  # fmt: skip

        calls, why = fill(register)
        return calls * 4096, why

    def requests(c: httpx.Client) -> tuple[int, str]:
        def batch(i: int) -> httpx.Response:  # adds of 8 hashes and a LoRA name each
            ops = [{"op": "add", "model_name": "q", "request_id": f"q{i}-{j}", "worker_id": 1,
                    "dp_rank": 0, "sequence_hashes": [i * 1000 + j] * 8,
                    "lora_name": f"lora-{i}-{j}"} for j in range(1000)]  # fmt: skip
            r = c.post("/batch", json={"operations": ops})
            results = r.json()["results"]
            refused = [o for o in results if o["status"] == 503]
            if refused:
                return httpx.Response(503, json={"error": refused[0]["error"]})
            return r

        fill(batch)
        text = c.get("/metrics").text
        held = text.split('kv_slot_tracker_budget_used{budget="active requests"} ')[1]
        return int(float(held.split()[0])), "refused at the budget"

    def hashes(c: httpx.Client) -> tuple[int, str]:
        n = 100_000

        def big_add(i: int) -> httpx.Response:
            return c.post("/add", json={"model_name": "q", "request_id": f"h{i}", "worker_id": 1,
                                        "dp_rank": 0, "sequence_hashes": list(range(i * n, (i + 1) * n))})  # fmt: skip

        calls, why = fill(big_add)
        return calls * n, why

    def workers(c: httpx.Client) -> tuple[int, str]:
        def worker(i: int) -> httpx.Response:  # no block size: stored as incomplete
            return c.post("/selection/workers", json={"worker_id": 10_000_000 + i, "model_name": f"w{i}",
                                                      "endpoint": f"http://w{i}:8000"})  # fmt: skip

        return fill(worker)

    phase("worker ranks", ranks)
    phase("active requests", requests)
    phase("block hashes", hashes)
    phase("selection workers", workers)
    print(
        "| budget | items at the edge | RSS before | RSS at the edge | bytes per item | /metrics then | refusal |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, items, b, a, why, took, size in rows:
        per = (a - b) / items if items else 0
        print(f"| {name} | {items:,} | {b / MB:.1f} MB | {a / MB:.1f} MB | {per:,.0f} | "
              f"{size / 1024:,.0f} KiB in {took * 1000:,.0f} ms | {why[:70]}... |")  # fmt: skip


@contextlib.contextmanager
def background(work: Callable[[threading.Event], None]) -> Iterator[None]:
    stop = threading.Event()
    t = threading.Thread(target=work, args=(stop,), daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=30)


def live_latency(url: str, seconds: float) -> tuple[float, float, float, int]:
    """The live client's ``/add`` + ``/free`` round trips for ``seconds``: p50, p99, max (ms)
    and how many were not 2xx."""
    times: list[float] = []
    failed = 0
    with httpx.Client(base_url=url, timeout=30) as c:
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            started = time.perf_counter()
            try:
                a = c.post("/add", json={"model_name": "live", "request_id": f"l{i}", "worker_id": 1,
                                         "dp_rank": 0, "sequence_hashes": [i]})  # fmt: skip
                f = c.post("/free", json={"model_name": "live", "request_id": f"l{i}"})
                failed += (a.status_code >= 300) + (f.status_code >= 300)
            except httpx.HTTPError:
                failed += 1
            times.append((time.perf_counter() - started) * 1000)
            i += 1
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99)], times[-1], failed


def trickle(port: int, path: bytes) -> Callable[[threading.Event], None]:
    def work(stop: threading.Event) -> None:
        while not stop.is_set():  # a new connection each time the server cuts one
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: t\r\ncontent-type: "
                          b"application/json\r\ncontent-length: 1000000\r\n\r\n")  # fmt: skip
                while not stop.is_set():
                    s.sendall(b" ")

    return work


def endless_chunks(port: int) -> Callable[[threading.Event], None]:
    def work(stop: threading.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /add HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                          b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                while not stop.is_set():
                    s.sendall(b"1\r\n \r\n" * 1000)

    return work


def idle_connections(port: int, count: int) -> Callable[[threading.Event], None]:
    def work(stop: threading.Event) -> None:
        held: list[socket.socket] = []
        while not stop.is_set():  # keep ``count`` open, reopening those the server closes
            held = [s for s in held if not _closed(s)]
            while len(held) < count and not stop.is_set():
                with contextlib.suppress(OSError):
                    held.append(socket.create_connection(("127.0.0.1", port)))
            stop.wait(0.5)
        for s in held:
            s.close()

    return work


def _closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def connections_part(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 20000), hard))
    server = start_ours()
    try:
        httpx.post(server.url + "/register", json={"model_name": "live", "worker_id": 1,
                                                   "block_size": 16, "dp_start": 0, "dp_size": 1})  # fmt: skip
        print()
        print(
            "| the other client | live p50 | live p99 | live max | live calls failed | server CPU |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        phases: list[tuple[str, Callable[[threading.Event], None] | None]] = [
            ("none", None),
            ("4,200 idle connections (reopened when closed)", idle_connections(server.port, 4200)),
            ("/add body a byte per packet", trickle(server.port, b"/add")),
            ("/register body a byte per packet", trickle(server.port, b"/register")),
            ("endless 1-byte chunks to /add", endless_chunks(server.port)),
        ]
        for name, work in phases:
            if work is None:
                cpu = cpu_seconds(server)
                p50, p99, most, failed = live_latency(server.url, args.seconds)
            else:
                with background(work):
                    time.sleep(1.0)  # under way
                    cpu = cpu_seconds(server)
                    p50, p99, most, failed = live_latency(server.url, args.seconds)
            share = (cpu_seconds(server) - cpu) / args.seconds
            print(f"| {name} | {p50:.2f} ms | {p99:.2f} ms | {most:.1f} ms | {failed} | "
                  f"{share:.0%} of a core |")  # fmt: skip
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per latency phase")
    parser.add_argument("--ranks", type=int, default=65_536)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--hashes", type=int, default=5_000_000)
    parser.add_argument("--workers", type=int, default=20_000)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-connections", action="store_true")
    args = parser.parse_args()
    if not args.skip_memory:
        memory_part(args)
    if not args.skip_connections:
        connections_part(args)


if __name__ == "__main__":
    main()
