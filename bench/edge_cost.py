"""Cost of one call through the HTTP edge's operations, in process (no server, no sockets).

Runs the lean path's operations directly on request bodies like ``bench/http_bench.py``'s
(16 workers x 4 ranks, 200 active requests; add+free of 32-block prompts sharing a 16-block
prefix; potential loads of a 256-block prompt; ``/batch`` bodies of 100 operations like
``bench/wrk/batch.lua``'s, 50 adds and the 50 frees of an earlier batch's adds, a mix with
prefill completions, and ``batch_signed``: the same with full 64-bit hashes, about half of them
negative, as a real prompt's are on the wire) and reports microseconds of CPU per call (per operation for a batch).
Two workloads of the selection API (same catalog, block size 16), prompts given as the hash
triple with real 64-bit hashes (about half negative): ``sel_reserve``, KV events off,
/select_and_reserve of 32-block prompts sharing a 16-block prefix and DELETE of the reservation
made 64 calls before (the approximate cache written and read); ``sel_kv``, KV events on, /select
against an index fed one 32-block store per rank by engine events (half of them carrying the
u64 form of their hashes, half the signed form).
``direct`` feeds the same /add and /free calls as raw HTTP requests through the direct protocol
(``kv_slot_tracker.http.fast_protocol``) on a fake transport: the HTTP parsing and answering a standalone server
adds, without sockets. With
``--instructions`` it runs itself under callgrind instead and reports instructions per call,
which do not depend on what else the machine is doing: the figure to compare two commits on a
busy machine (``--repo`` points at a checkout of the other commit). With ``--opcodes`` it counts
the Python opcodes each function executes per call instead (a tracing run, exact and
repeatable): where the interpreted part of a call goes. ``--replicated`` runs the operations
of a Redis-mode instance instead (``ReplicatedEdge`` around ``Operations``: the readiness gate
open, the records queued in the outbox, which is never started, so no Redis is needed);
``direct`` is skipped then. ``--repo`` may be a tree from before the edge modules were renamed
and the replicated edge composed (``http/direct.py``, ``ReplicatedOperations``).

    .venv/bin/python bench/edge_cost.py [--instructions | --opcodes] [--replicated] [--repo PATH]
        [--only ...] [--top N]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def steady_memory_watch(app) -> None:
    """Read the process's memory once an hour instead of every 0.5 s. The memory budget's
    watch reads ``/proc`` on a clock: a cost per second, not per call (about 14 us, 25,000
    instructions, per 0.5 s: under one instruction per call at the rates these calls run at).
    Under callgrind, about 50 times slower, that is a read every few hundred calls, and their
    number moves with the machine's load (a batch's count by up to 3 %). Every add still checks
    its reading's age, which is what a call pays; a tree without the watch is left as it is."""
    registry = getattr(app.state.service, "registry", None)
    watch = getattr(registry, "resident", None)
    if watch is not None and hasattr(watch, "interval"):
        watch.interval = 3600.0


def build(repo: Path, replicated: bool = False):
    sys.path.insert(0, str(repo))
    from kv_slot_tracker.http.operations import Operations
    from kv_slot_tracker.main import create_app
    from kv_slot_tracker.settings import load_settings

    if not replicated:
        app = create_app(load_settings(api_key="", redis_url=""))
        steady_memory_watch(app)
        ops = Operations(app.state.service, 1_000_000)
    else:
        from kv_slot_tracker.http import replicated
        from kv_slot_tracker.http.gate import ReadinessGate
        from kv_slot_tracker.service.consistency import Consistency

        # Redis mode, never started: nothing connects, the records stay in the outbox
        settings = load_settings(
            api_key="", redis_url="redis://127.0.0.1:1/0", outbox_capacity=10_000_000
        )
        app = create_app(settings)
        steady_memory_watch(app)
        service, replication = app.state.service, app.state.replication
        gate = ReadinessGate(replication)
        gate.closed = False  # caught up
        # no wait for an unknown id
        consistency = Consistency(service, replication, wait_ms=0)
        if hasattr(replicated, "ReplicatedEdge"):
            ops = replicated.ReplicatedEdge(Operations(service, 1_000_000), gate, consistency)
        else:  # a tree where the replicated operations subclassed the embedded ones
            ops = replicated.ReplicatedOperations(service, 1_000_000, gate, consistency)
    return {name: ops.get(name) for name in ("register", "add", "free", "potential_loads", "batch")}


class _Transport:
    """What the protocol writes to: counts the responses and the failed ones, drops the bytes."""

    def __init__(self) -> None:
        self.writes = 0
        self.failed = 0  # answers that are not 2xx

    def write(self, data: bytes) -> None:
        if data.startswith(b"HTTP/"):  # uvicorn's own path writes the body separately
            self.writes += 1
            if data[9:10] != b"2":  # b"HTTP/1.1 201 ..."
                self.failed += 1

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default=None):
        return {"sockname": ("127.0.0.1", 8091), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...


def build_direct(repo: Path):
    """A direct HTTP protocol connection (``kv_slot_tracker.http.fast_protocol``) on a fake transport: requests
    go in as bytes through ``data_received``, the answers are written at once. None for a
    checkout without the direct path."""

    sys.path.insert(0, str(repo))
    import uvicorn
    from uvicorn.server import ServerState

    from kv_slot_tracker.main import create_app
    from kv_slot_tracker.settings import load_settings

    try:
        from kv_slot_tracker.http.fast_protocol import direct_protocol
    except ImportError:
        try:  # a tree from before the module was named fast_protocol
            from kv_slot_tracker.http.direct import direct_protocol
        except ImportError:
            return None
    app = create_app(load_settings(api_key="", redis_url=""))
    steady_memory_watch(app)
    import uvloop

    loop = uvloop.new_event_loop()  # the server's loop (``python -m kv_slot_tracker``)
    asyncio.set_event_loop(loop)
    protocol = direct_protocol(app.lean)
    config = uvicorn.Config(app, http=protocol, log_level="warning")
    config.load()
    conn = protocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    transport = _Transport()
    conn.connection_made(transport)
    return conn, transport


def http_request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:8091\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


def bodies(n: int) -> dict[str, list[bytes]]:
    rng = random.Random(5)
    prefix = [7000001 * i for i in range(1, 129)]
    out: dict[str, list[bytes]] = {"register": [], "active": [], "add": [], "free": []}
    for w in range(16):
        out["register"].append(
            json.dumps(
                {
                    "worker_id": w,
                    "model_name": "bench",
                    "block_size": 16,
                    "dp_start": 0,
                    "dp_size": 4,
                }
            ).encode()
        )
    for i in range(200):
        rank = rng.randrange(64)
        hashes = prefix[: rng.choice([32, 64, 128])] + [rng.getrandbits(62) for _ in range(32)]
        out["active"].append(json.dumps({"model_name": "bench", "request_id": f"act{i}",
            "worker_id": rank // 4, "dp_rank": rank % 4, "sequence_hashes": hashes,
            "new_isl_tokens": 100}).encode())  # fmt: skip
    for i in range(n):
        hashes = prefix[:16] + [rng.getrandbits(62) for _ in range(16)]
        out["add"].append(json.dumps({"model_name": "bench", "request_id": f"r{i}",
            "worker_id": i % 16, "dp_rank": i % 4, "sequence_hashes": hashes,
            "new_isl_tokens": 512}).encode())  # fmt: skip
        out["free"].append(json.dumps({"model_name": "bench", "request_id": f"r{i}"}).encode())
    out["batch"] = batches(n, mix=False)
    out["batch_mix"] = batches(n, mix=True)
    out["batch_signed"] = batches(n, mix=False, signed=True)
    query = prefix + [rng.getrandbits(62) for _ in range(128)]
    out["potential"] = [
        json.dumps(
            {"model_name": "bench", "sequence_hashes": query, "new_isl_tokens": 4096}
        ).encode()
    ]
    return out


BATCH = 100  # operations per /batch call
LAG = 2  # a batch frees the adds of the batch LAG calls before it


def batches(n: int, *, mix: bool, signed: bool = False) -> list[bytes]:
    """``n`` operations as /batch bodies of 100: half adds, half frees of earlier adds; with
    ``mix``, a third each of adds, prefill completions of the previous batch's adds and frees.
    ``signed``: every hash a full signed 64-bit number, about half of them negative (as a real
    prompt's hashes are on the wire) instead of small positive ones."""
    rng = random.Random(7)
    prefix = [1000003 * i for i in range(1, 17)]
    tail = (lambda: rng.getrandbits(64) - 2**63) if signed else (lambda: rng.getrandbits(62))
    if signed:
        prefix = [rng.getrandbits(64) - 2**63 for _ in range(16)]
    per = BATCH // 3 if mix else BATCH // 2

    def rid(k: int) -> str:  # never negative: a body's only minus signs are its hashes'
        return f"b{k + 2 * LAG * BATCH}"

    out = []
    for b in range(-LAG, max(1, n // BATCH)):  # the first LAG bodies are set-up
        ops: list[dict] = []
        for j in range(per):
            k = b * per + j
            rank = k % 64
            ops.append({"op": "add", "model_name": "bench", "request_id": rid(k),
                "worker_id": rank // 4, "dp_rank": rank % 4,
                "sequence_hashes": prefix + [tail() for _ in range(16)],
                "new_isl_tokens": 512})  # fmt: skip
        if mix:
            for j in range(per):
                k = (b - 1) * per + j
                ops.append({"op": "prefill_complete", "model_name": "bench", "request_id": rid(k)})
        for j in range(BATCH - len(ops)):
            k = (b - LAG) * per + j
            ops.append({"op": "free", "model_name": "bench", "request_id": rid(k)})
        out.append(json.dumps({"operations": ops}).encode())
    return out


Tracer = collections.Counter  # opcodes per (file, function), filled by a tracing run


SEL_WORKERS, SEL_RANKS, SEL_BS, SEL_LAG = 16, 4, 16, 64


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def build_selection(repo: Path, kv_events: bool):
    """The selection API's operations (and its service) of a fresh standalone instance."""
    sys.path.insert(0, str(repo))
    from kv_slot_tracker.http.selection.operations import SelectionOperations
    from kv_slot_tracker.main import create_app
    from kv_slot_tracker.settings import load_settings

    app = create_app(
        load_settings(api_key="", redis_url="", router_use_kv_events=kv_events, selection_seed=1)
    )
    steady_memory_watch(app)
    selection = app.state.selection
    ops = SelectionOperations(selection)
    for w in range(SEL_WORKERS):
        body = {"worker_id": w, "model_name": "bench", "endpoint": f"http://w{w}:8000",
                "block_size": SEL_BS, "data_parallel_size": SEL_RANKS}  # fmt: skip
        if kv_events:
            body["kv_events_endpoints"] = {
                str(r): f"tcp://w{w}:{5557 + r}" for r in range(SEL_RANKS)
            }
        assert ops.get("upsert_worker")(json.dumps(body).encode())[0] == 201
    return ops, selection


def selection_reserve_bodies(n: int) -> list[bytes]:
    """``n + SEL_LAG`` /select_and_reserve bodies: 16 shared blocks, 16 of their own."""
    rng = random.Random(11)
    full = lambda: rng.getrandbits(64) - 2**63  # noqa: E731 - a real hash: half negative
    blocks, seqs = [full() for _ in range(16)], [full() for _ in range(16)]
    return [
        json.dumps(
            {
                "model_name": "bench",
                "selection_id": f"s{i}",
                "block_hashes": blocks + [full() for _ in range(16)],
                "sequence_hashes": seqs + [full() for _ in range(16)],
                "isl_tokens": 512,
            }
        ).encode()  # fmt: skip
        for i in range(n + SEL_LAG)
    ]


def selection_kv_setup(repo: Path, selection) -> list[bytes]:
    """Feed one engine store of 32 blocks to every rank (16 shared with every other rank);
    returns /select bodies of prompts overlapping 0..32 blocks of some rank."""
    from kv_slot_tracker.core.hashing import compute_block_hash_for_seq, compute_seq_hash_for_block
    from kv_slot_tracker.ingest.records import decode_batch, encode_batch

    rng = random.Random(13)
    shared = [rng.getrandbits(31) for _ in range(16 * SEL_BS)]
    # the shared blocks under the same engine hashes on every rank (engines hashing with one
    # seed): a rank storing them under other hashes keeps only them (the reference's rule)
    shared_engine = [rng.getrandbits(64) for _ in range(16)]
    tails = []
    for w in range(SEL_WORKERS):
        for r in range(SEL_RANKS):
            tail = [rng.getrandbits(31) for _ in range(16 * SEL_BS)]
            tails.append(tail)
            engine = shared_engine + [rng.getrandbits(64) for _ in range(16)]  # u64: half >= 2^63
            if (w * SEL_RANKS + r) % 2:
                engine = [_signed(h) for h in engine]
            store = ["BlockStored", engine, None, shared + tail, SEL_BS, None, "GPU", None]
            batch = decode_batch(0, encode_batch(0.0, [store], r))
            selection.kv_events.apply_kv_batch(w, r, batch)
    bodies = []
    for i in range(256):
        keep = i % 33  # blocks this prompt shares with the store of rank i % 64
        tokens = (shared + tails[i % len(tails)])[: keep * SEL_BS]
        tokens += [rng.getrandbits(31) for _ in range((32 - keep) * SEL_BS)]
        local = compute_block_hash_for_seq(tokens, SEL_BS)
        seq = compute_seq_hash_for_block(local)
        bodies.append(json.dumps({"model_name": "bench",
            "block_hashes": [_signed(h) for h in local],
            "sequence_hashes": [_signed(h) for h in seq],
            "isl_tokens": 32 * SEL_BS}).encode())  # fmt: skip
    return bodies


def run_selection(repo: Path, what: str, n: int, base: bool, counts: Tracer | None) -> float:
    """CPU seconds of ``n`` calls of a selection workload (``sel_reserve``: n reserve+delete
    pairs)."""
    if what == "sel_reserve":
        ops, _ = build_selection(repo, kv_events=False)
        bodies = selection_reserve_bodies(n)
        reserve, delete = ops.get("select_and_reserve"), ops.get("delete_reservation")
        for raw in bodies[:SEL_LAG]:
            assert reserve(raw)[0] == 200
        calls = bodies[SEL_LAG:]
    else:
        ops, selection = build_selection(repo, kv_events=True)
        queries = selection_kv_setup(repo, selection)
        select = ops.get("select")
        assert sum(selection.kv_events.kv_indexed_blocks().values()) == 32 * 64
        assert select(queries[32])[0] == 200
    gc.collect()
    if counts is not None:
        sys.settrace(_tracing(counts))
    start = time.process_time()
    if base:
        pass
    elif what == "sel_reserve":
        for i, raw in enumerate(calls):
            assert reserve(raw)[0] == 200
            assert delete(b"", f"s{i}")[0] == 200
    else:
        for i in range(n):
            select(queries[i % len(queries)])
    sys.settrace(None)
    return time.process_time() - start


def _tracing(counts: Tracer):
    """A ``sys.settrace`` function that counts every opcode into ``counts``."""

    def trace(frame, event, arg):  # noqa: ARG001 - the settrace signature
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[(Path(code.co_filename).name, code.co_name)] += 1
        return trace

    return trace


def run(
    repo: Path, what: str, n: int, counts: Tracer | None = None, replicated: bool = False
) -> float:
    """CPU seconds of ``n`` calls of ``what``; ``base:WHAT`` does only the set-up of ``WHAT``."""
    base = what.startswith("base:")
    what = what.removeprefix("base:")
    if what == "direct":
        return run_direct(repo, n, base, counts)
    if what.startswith("sel_"):
        return run_selection(repo, what, n, base, counts)
    ops = build(repo, replicated)
    if replicated:
        # a batch naming an id unknown here (the set-up batches' frees, batch_mix's repeated
        # free) answers an awaitable (``Later``): run at once, no wait (``wait_ms=0``)
        loop = asyncio.new_event_loop()
        waiting = ops["batch"]

        def batch_now(raw: bytes):
            result = waiting(raw)
            return result if type(result) is tuple else loop.run_until_complete(result)

        ops["batch"] = batch_now
    b = bodies(max(n, 1))
    for raw in b["register"]:
        assert ops["register"](raw)[0] == 201
    for raw in b["active"]:
        assert ops["add"](raw)[0] == 201
    for raw in b.get(f"{what}", [])[:LAG] if what.startswith("batch") else ():
        assert ops["batch"](raw)[0] == 200
    gc.collect()
    add, free, potential, batch = ops["add"], ops["free"], ops["potential_loads"], ops["batch"]
    if counts is not None:
        sys.settrace(_tracing(counts))
    start = time.process_time()
    if base:
        pass
    elif what == "lifecycle":
        for a, f in zip(b["add"][:n], b["free"][:n], strict=True):
            add(a)
            free(f)
    elif what == "potential":
        query = b["potential"][0]
        for _ in range(n):
            potential(query)
    elif what in ("batch", "batch_mix", "batch_signed"):
        for raw in b[what][LAG:]:
            assert batch(raw)[0] == 200
    sys.settrace(None)
    return time.process_time() - start


def run_direct(repo: Path, n: int, base: bool, counts: Tracer | None = None) -> float:
    """CPU seconds of ``n`` /add + /free pairs fed through the direct protocol as bytes."""

    made = build_direct(repo)
    if made is None:
        return float("nan")
    conn, transport = made
    b = bodies(max(n, 1))
    feed = conn.data_received
    for raw in b["register"]:
        feed(http_request("/register", raw))  # FastAPI's path: answered by tasks, in turn
    while transport.writes < len(b["register"]):
        conn.loop.run_until_complete(asyncio.sleep(0.01))
    for raw in b["active"]:
        feed(http_request("/add", raw))
    calls = [
        http_request(path, raw)
        for a, f in zip(b["add"][:n], b["free"][:n], strict=True)
        for path, raw in (("/add", a), ("/free", f))
    ]
    gc.collect()
    before = transport.writes
    if counts is not None:
        sys.settrace(_tracing(counts))
    start = time.process_time()
    if not base:
        for raw in calls:
            feed(raw)
        assert transport.writes - before == len(calls), "a request was not answered directly"
    assert transport.failed == 0, f"{transport.failed} answers were not 2xx"
    sys.settrace(None)
    return time.process_time() - start


def instructions(repo: Path, what: str, n: int, replicated: bool = False) -> int:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"edge_cost.{os.getpid()}.{what}.cg"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
           __file__, "--inner", what, "--n", str(n), "--repo", str(repo)]  # fmt: skip
    if replicated:
        cmd.append("--replicated")
    res = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}
    )
    out.unlink(missing_ok=True)
    return int(re.search(r"Collected : (\d+)", res.stderr).group(1))


def unit(what: str) -> str:
    return "operation" if what.startswith("batch") else "call"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", type=Path, default=HERE.parent)
    ap.add_argument("--n", type=int, default=2000, help="calls (add+free pairs, or queries)")
    ap.add_argument("--instructions", action="store_true", help="count instructions (callgrind)")
    ap.add_argument("--opcodes", action="store_true", help="count Python opcodes per function")
    ap.add_argument(
        "--replicated",
        action="store_true",
        help="a Redis-mode instance's operations (not connected; direct is skipped)",
    )
    ap.add_argument(
        "--only",
        default="lifecycle,direct,potential,batch,batch_mix,batch_signed,sel_reserve,sel_kv",
        help="workloads, comma-separated",
    )
    ap.add_argument("--top", type=int, default=12, help="functions listed with --opcodes")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        run(args.repo, args.inner, args.n, replicated=args.replicated)
        return
    work = (
        ("lifecycle", 2),
        ("direct", 2),
        ("potential", 1),
        ("batch", 1),
        ("batch_mix", 1),
        ("batch_signed", 1),
        ("sel_reserve", 2),
        ("sel_kv", 1),
    )
    for what, per in work:
        if what not in args.only.split(",") or (args.replicated and what == "direct"):
            continue
        if args.opcodes:
            counts: Tracer = collections.Counter()
            run(args.repo, what, args.n, counts, args.replicated)
            calls = args.n * per
            print(f"{what}: {sum(counts.values()) / calls:,.1f} opcodes per {unit(what)}")
            for (file, name), c in counts.most_common(args.top):
                print(f"  {c / calls:8.1f}  {file}:{name}")
        elif args.instructions:
            base = instructions(args.repo, f"base:{what}", args.n, args.replicated)
            total = instructions(args.repo, what, args.n, args.replicated)
            print(f"{what}: {(total - base) / (args.n * per):,.0f} instructions per {unit(what)}")
        else:
            seconds = min(
                run(args.repo, what, args.n, replicated=args.replicated) for _ in range(3)
            )
            print(f"{what}: {seconds / (args.n * per) * 1e6:.2f} us CPU per {unit(what)}")


if __name__ == "__main__":
    main()
