"""HTTP benchmarks of kv-slot-tracker next to Dynamo's Rust slot tracker, in the same run.

Both servers are started here (the reference from its own virtualenv, see bench/reference.py),
given the same topology (16 workers x 4 ranks, block size 16), and loaded in turn (A B A B ...)
with wrk: 1 thread, 32 connections, wrk pinned to CPU 0 and the server to CPU 1. wrk is used
because it is a fast C load generator whose Lua scripts can build distinct request ids; a Python
generator would measure itself.

Figures:
  lifecycle   /add + /free alternating, 32-block prompts sharing a 16-block prefix
  potential   /potential_loads, 64 ranks, 256-block prompt, 200 active requests
  batch       /batch with 100 lifecycle operations per call (ops/s), each run paired with a
              reference lifecycle run just before it (the ratio is the median of the pairs')
  batch_signed  the same with every hash negative on both sides (most real 64-bit hashes are,
              as signed JSON numbers), so the sign conversion is measured too (not by default)
  p99         latency at half of our measured lifecycle maximum, open loop (bench/openloop.py)
  memory      resident size with 100,000 active requests of 32 blocks

With ``--workers N`` (N > 1) ours also runs as ``python -m kv_slot_tracker --workers N`` (N processes on
one port sharing one state, kv_slot_tracker/supervisor.py): the throughput figures then compare the reference,
one process ("ours1") and N processes ("ours"), and nothing is pinned: every server may use
every core (the reference's threads, our processes and the private Redis), wrk included.

Run:  .venv/bin/python bench/http_bench.py [--duration 10] [--rounds 2] [--only lifecycle,...]
                                           [--workers N]
Needs: wrk (apt-get install wrk), taskset, the reference venv (python bench/reference.py ensure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.reference import Server, start_ours, start_reference  # noqa: E402

WRK = HERE / "wrk"
WORKERS, RANKS_PER_WORKER = 16, 4
# ``python -m kv_slot_tracker --workers N`` for "ours" (1: a single process); set by --workers
OURS_WORKERS = 1


def post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def pin(pid: int, cpu: int) -> None:
    if shutil.which("taskset"):
        subprocess.run(
            ["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=False, capture_output=True
        )


def setup_topology(url: str) -> None:
    for w in range(WORKERS):
        status, body = post(
            url,
            "/register",
            {
                "worker_id": w,
                "model_name": "bench",
                "block_size": 16,
                "dp_start": 0,
                "dp_size": RANKS_PER_WORKER,
            },
        )
        assert status in (201, 409), body


def setup_active(url: str, n: int = 200) -> None:
    rng = random.Random(5)
    prefix = [7000001 * i for i in range(1, 129)]
    for i in range(n):
        rank = rng.randrange(WORKERS * RANKS_PER_WORKER)
        hashes = prefix[: rng.choice([32, 64, 128])] + [rng.getrandbits(62) for _ in range(32)]
        status, body = post(
            url,
            "/add",
            {
                "model_name": "bench",
                "request_id": f"act{i}",
                "worker_id": rank // 4,
                "dp_rank": rank % 4,
                "sequence_hashes": hashes,
                "new_isl_tokens": 100,
            },
        )
        assert status == 201, body


def wrk(
    url: str, script: str, duration: int, env: dict | None = None, connections: int = 32
) -> dict:
    cmd = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{duration}s",
        "--latency",
        "-s",
        str(WRK / script),
        url,
    ]
    if shutil.which("taskset") and OURS_WORKERS == 1:
        cmd = ["taskset", "-c", "0", *cmd]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=True
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    p99_ms = None
    if p99:
        value, unit = float(p99.group(1)), p99.group(2)
        p99_ms = value / 1000 if unit == "us" else value * 1000 if unit == "s" else value
    return {
        "rps": rps,
        "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "p99_ms": p99_ms,
        "raw": out,
    }


def rss_mb(pid: int) -> float:
    total = 0
    for p in [pid, *children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total / 1024


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process and its children (a supervisor's server processes
    and private Redis) have used so far."""
    total = 0
    for p in [pid, *children(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(x) for x in out.split()]


def started(kind: str) -> Server:
    """``kind``: "ref", "ours" (``OURS_WORKERS`` processes) or "ours1" (one process)."""
    if kind == "ref":
        server = start_reference()
    else:
        workers = OURS_WORKERS if kind == "ours" else 1
        server = start_ours(extra_args=["--workers", str(workers)])
        if workers > 1:
            wait_all_ready(server.url, workers)
    if OURS_WORKERS == 1:  # one core for the server, the other for wrk
        pin(server.pid, 1)
        for c in children(server.pid):
            pin(c, 1)
    return server


def wait_all_ready(url: str, workers: int, timeout: float = 60.0) -> None:
    """Until every process of a ``--workers`` instance answers and is ready."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/replication", timeout=5) as r:
                status = json.loads(r.read())
            if status.get("ready") and len(status.get("processes", [])) == workers:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{workers} processes at {url} not ready after {timeout} s")


def settle(url: str) -> None:
    """With several processes: until the setup calls reached every process (no outbox left,
    every process at the same stream position)."""
    if OURS_WORKERS == 1:
        return
    for _ in range(100):
        try:
            with urllib.request.urlopen(url + "/replication", timeout=5) as r:
                status = json.loads(r.read())
        except urllib.error.HTTPError:
            return  # the reference: one process
        if status.get("mode") == "embedded":
            return
        views = status.get("processes") or [status]
        if status["outbox_depth"] == 0 and len({v.get("stream_position") for v in views}) == 1:
            return
        time.sleep(0.05)


def bench_throughput(
    kind: str, workload: str, duration: int, round_no: int, signed: bool = False
) -> dict:
    """``signed``: the lifecycle and batch scripts send negative hashes (``WRK_SIGNED``)."""
    env = {"WRK_SIGNED": "1"} if signed else {}
    with started(kind) as s:
        setup_topology(s.url)
        script = {"lifecycle": "lifecycle.lua", "potential": "potential.lua", "batch": "batch.lua"}[
            workload
        ]
        if workload == "potential":
            setup_active(s.url)
        if kind == "ours":
            settle(s.url)
        wrk(s.url, script, 2, {"WRK_TAG": f"warm{round_no}", **env})  # warm-up
        before = cpu_seconds(s.pid)
        res = wrk(s.url, script, duration, {"WRK_TAG": f"r{round_no}", **env})
        # the server's CPU time per call answered (wrk's rate over the run's duration)
        res["cpu_us"] = (cpu_seconds(s.pid) - before) / (res["rps"] * duration) * 1e6
        return res


def bench_p99(kind: str, duration: int) -> dict:
    """Closed-loop maximum first, then an open-loop run at half of it on the same server."""
    with started(kind) as s:
        setup_topology(s.url)
        peak = wrk(s.url, "lifecycle.lua", duration, {"WRK_TAG": "peak"})["rps"]
        cmd = [
            sys.executable,
            str(HERE / "openloop.py"),
            s.url,
            "--rate",
            str(peak / 2),
            "--seconds",
            str(duration),
            "--tag",
            "half",
        ]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", "0", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        res = json.loads(out.strip().splitlines()[-1])
        return {"peak_rps": peak, **res}


def bench_memory(kind: str, count: int) -> dict:
    with started(kind) as s:
        setup_topology(s.url)
        before = rss_mb(s.pid)
        expected_secs = max(10, count // 2000)
        wrk(s.url, "fill.lua", expected_secs, {"FILL_COUNT": str(count)}, connections=16)
        loads = json.loads(urllib.request.urlopen(s.url + "/loads?model_name=bench").read())
        blocks = sum(r["active_decode_blocks"] for r in loads)
        time.sleep(1)
        return {"rss_before_mb": before, "rss_after_mb": rss_mb(s.pid), "blocks": blocks}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="lifecycle,potential,batch,p99,memory")
    ap.add_argument("--fill", type=int, default=100_000)
    ap.add_argument(
        "--workers", type=int, default=1, help="ours as python -m kv_slot_tracker --workers N"
    )
    args = ap.parse_args()
    global OURS_WORKERS
    OURS_WORKERS = args.workers
    kinds = ("ref", "ours1", "ours") if args.workers > 1 else ("ref", "ours")
    only = set(args.only.split(","))
    results: dict[str, dict[str, list[float]]] = {}
    for workload in ("lifecycle", "potential"):
        if workload not in only:
            continue
        for r in range(args.rounds):
            for kind in kinds:
                res = bench_throughput(kind, workload, args.duration, r)
                results.setdefault(workload, {}).setdefault(kind, []).append(res["rps"])
                print(
                    f"{workload:10s} round {r} {kind:5s} {res['rps']:10.0f} req/s "
                    f"p99 {res['p99_ms']} ms non-2xx {res['non2xx']} "
                    f"server CPU {res['cpu_us']:.1f} us/call",
                    flush=True,
                )
    for workload, by_kind in results.items():
        ref, ours = statistics.median(by_kind["ref"]), statistics.median(by_kind["ours"])
        rounds = zip(by_kind["ref"], by_kind["ours"], strict=True)
        pairs = ", ".join(f"{o / r:.3f}" for r, o in rounds)
        print(
            f"SUMMARY {workload}: ref {ref:.0f} req/s, ours {ours:.0f} req/s, "
            f"ratio {ours / ref:.3f} (each round's: {pairs})"
        )
        if "ours1" in by_kind:
            one = statistics.median(by_kind["ours1"])
            print(
                f"SUMMARY {workload}: {args.workers} processes {ours:.0f} req/s, one process "
                f"{one:.0f} req/s, ratio {ours / one:.3f}"
            )
    for name in ("batch", "batch_signed"):
        if name not in only:
            continue
        # interleaved with reference lifecycle runs: the ratio compares the same minutes
        signed = name == "batch_signed"
        pairs = []
        for r in range(args.rounds):
            ref = bench_throughput("ref", "lifecycle", args.duration, r, signed)["rps"]
            ours = bench_throughput("ours", "batch", args.duration, r, signed)
            ops = ours["rps"] * 100
            pairs.append((ref, ops))
            print(
                f"{name:12s} round {r} ref single calls {ref:10.0f} req/s, ours "
                f"{ops:10.0f} ops/s, ratio {ops / ref:.2f}, server CPU "
                f"{ours['cpu_us'] / 100:.1f} us per operation",
                flush=True,
            )
        ops = statistics.median(o for _, o in pairs)
        ref = statistics.median(r for r, _ in pairs)
        ratio = statistics.median(o / r for r, o in pairs)
        print(
            f"SUMMARY {name}: ours {ops / 100:.0f} calls/s = {ops:.0f} ops/s, reference single "
            f"calls {ref:.0f} req/s, ratio (median of pairs) {ratio:.2f}"
        )
    if "p99" in only:
        for kind in ("ref", "ours"):
            r = bench_p99(kind, args.duration)
            print(
                f"SUMMARY p99 {kind}: peak {r['peak_rps']:.0f} req/s; at {r['achieved_rps']:.0f} "
                f"req/s open loop: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
                f"max {r['max_ms']:.2f} ms, errors {r['errors']}"
            )
    if "memory" in only:
        for kind in kinds:
            m = bench_memory(kind, args.fill)
            print(
                f"SUMMARY memory {kind}: {m['rss_after_mb']:.0f} MB with {args.fill} requests "
                f"({m['blocks']} active blocks; {m['rss_before_mb']:.0f} MB before)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
