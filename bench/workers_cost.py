"""``--workers 2`` through each transport next to one process, in one run: what each costs.

Configurations (``--only``): ``one-process``; ``2-local`` (``workers_transport = "local"``, the
supervisor's hub); ``2-local-durable`` (the same with ``replication_ack = "redis"``, not run by
default); ``2-redis`` (``workers_transport = "redis"``, a private ``redis-server``). Rounds
interleave the configurations so they share the same minutes. Nothing is pinned (wrk, the
server processes, the hub and the private Redis share the cores).

Figures (``--measure``), each on a fresh server given the benchmark topology (16 workers x 4
ranks):

  writes   CPU time per lifecycle call (``lifecycle.lua``, ``/add`` + ``/free``): every
           process of the server (the supervisor with its hub thread, the server processes,
           the private redis-server) from ``/proc`` before and after a wrk run, over the calls
           answered; at each of ``--connections``. A call with two processes is a replicated
           write: its record is applied by the sibling too.
  lag      visibility lag: a lifecycle call answered by process 0 (through its own Unix
           socket) until process 1 shows it in ``/loads`` (polled on its own socket); a
           dedicated one-rank tracker, adds and frees alternating; p50 / p99 / max of up to
           ``--lag-samples`` calls: idle ("lag_idle"), while ``--lag-rate`` lifecycle calls
           per second reach the port from 4 paced connections, the same offered load for every
           configuration ("lag_paced"), and while wrk's 32 connections load it, each
           configuration at its own maximum ("lag_saturated").
  reads    ``/potential_loads`` (``potential.lua``, 64 ranks, 256-block prompt, 200 active
           requests) req/s and CPU time per call, every process counted.
  memory   RSS of the whole group (supervisor, processes, private Redis) idle, and after
           ``--fill`` active requests of 32 blocks (``fill.lua``) reached every process.

On a shared, loaded machine requests per second move with the neighbours; the CPU time per call
moves much less, so that is the figure. ``consistency_wait_ms = 0``: the lifecycle script's
first frees are of ids never added, which would each wait the consistency bound otherwise.

Run:  .venv/bin/python bench/workers_cost.py [--duration 5] [--rounds 3] [--connections 1,32]
          [--measure writes,lag,reads,memory] [--only one-process,2-local,2-redis]
Needs: wrk (apt-get install wrk), redis-server on PATH (the "redis" transport).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench import http_bench as hb  # noqa: E402
from bench.reference import start_ours  # noqa: E402
from bench.transport_bench import PrivateRedis  # noqa: E402

CONFIGS = {  # name: (workers, a private redis-server as redis_url, replication_ack)
    "one-process": (1, False, "local"),
    "2-local": (2, False, "local"),
    "2-local-durable": (2, False, "redis"),
    "2-redis": (2, True, "local"),
}
DEFAULT_ONLY = "one-process,2-local,2-redis"
LAG_MODEL = "lag"


def seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(pid: int, redis_pid: int | None = None) -> dict[str, float]:
    """CPU seconds so far of the supervisor (with its hub thread), its server processes and
    the private redis-server (a single process: all of it is "servers")."""
    kids = hb.children(pid) + ([redis_pid] if redis_pid else [])
    if not kids:
        return {"servers": seconds(pid), "supervisor": 0.0, "redis": 0.0}
    roles = {"servers": 0.0, "supervisor": seconds(pid), "redis": 0.0}
    for child in kids:
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except FileNotFoundError:
            continue
        roles["redis" if name.startswith("redis") else "servers"] += seconds(child)
    return roles


def rss_by_role(pid: int, redis_pid: int | None = None) -> dict[str, float]:
    """Resident MB of the supervisor, its server processes and its private Redis."""

    def rss(p: int) -> float:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except FileNotFoundError:
            pass
        return 0.0

    kids = hb.children(pid) + ([redis_pid] if redis_pid else [])
    roles = {"supervisor": rss(pid) if kids else 0.0, "servers": 0.0 if kids else rss(pid),
             "redis": 0.0}  # fmt: skip
    for child in kids:
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except FileNotFoundError:
            continue
        roles["redis" if name.startswith("redis") else "servers"] += rss(child)
    roles["total"] = sum(roles.values())
    return roles


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 keep-alive to one server process's own Unix socket."""

    def __init__(self, path: str) -> None:
        super().__init__("worker", timeout=10)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def call(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    headers = {"content-type": "application/json"} if data else {}
    conn.request(method, path, data, headers)
    r = conn.getresponse()
    return r.status, r.read()


def control_sockets(pid: int) -> dict[int, str]:
    """The server processes' own Unix sockets (``--control-socket``), by process index."""
    found = {}
    for child in hb.children(pid):
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"--control-socket" in args:
            path = args[args.index(b"--control-socket") + 1].decode()
            found[int(Path(path).stem.rsplit("-", 1)[1])] = path
    return found


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def lag_samples(pid: int, samples: int, until: float = float("inf")) -> list[float]:
    """Milliseconds from a lifecycle call answered by process 0 until process 1 shows it; at
    most ``samples`` of them, none started after ``until`` (``time.monotonic()``)."""
    sockets = control_sockets(pid)
    writer, reader = UnixHTTPConnection(sockets[0]), UnixHTTPConnection(sockets[1])
    register = {"worker_id": 1, "model_name": LAG_MODEL, "block_size": 16, "dp_start": 0,
                "dp_size": 1}  # fmt: skip
    status, body = call(writer, "POST", "/register", register)
    assert status in (201, 409), body
    query = f"/loads?model_name={LAG_MODEL}"
    deadline = time.monotonic() + 10
    while not json.loads(call(reader, "GET", query)[1]):
        assert time.monotonic() < deadline, "the registration never reached process 1"
    tag = f"{time.monotonic_ns()}"
    lags = []
    for i in range(samples):
        if time.monotonic() > until:
            break
        rid = f"lag{tag}-{i // 2}"
        if i % 2 == 0:
            op, want = "/add", 1
            body_ = {"model_name": LAG_MODEL, "request_id": rid, "worker_id": 1, "dp_rank": 0,
                     "sequence_hashes": [i, i + 1], "new_isl_tokens": 32}  # fmt: skip
        else:
            op, want = "/free", 0
            body_ = {"model_name": LAG_MODEL, "request_id": rid}
        status, body = call(writer, "POST", op, body_)
        assert status in (200, 201), body
        t0 = time.perf_counter()
        while True:
            rows = json.loads(call(reader, "GET", query)[1])
            if rows[0]["active_requests"] == want:
                break
            if time.perf_counter() - t0 > 10:
                raise TimeoutError(f"{op} {rid} not visible on process 1 after 10 s")
        lags.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.002)
    writer.close()
    reader.close()
    return lags


def lag_figures(lags: list[float], **extra: float) -> dict[str, float]:
    return {"p50": statistics.median(lags), "p99": percentile(lags, 0.99), "max": max(lags),
            "samples": float(len(lags)), **extra}  # fmt: skip


def paced_load(url: str, rate: float, seconds: float, tag: str, sent: Any) -> None:
    """``/add`` + ``/free`` alternating at ``rate`` calls per second in all (4 threads, each
    on its own keep-alive connection, each call sent at its scheduled time or as soon as the
    previous one is answered); ``sent.value``: the calls answered."""
    host, port = url.removeprefix("http://").split(":")
    threads = 4
    hashes = ",".join(str(1000003 * i) for i in range(1, 33))

    def run(t: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        interval = threads / rate
        due = time.perf_counter()
        end = due + seconds
        k = 0
        while due < end:
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            rid = f"{tag}-{t}-{k // 2}"
            if k % 2 == 0:
                body = (f'{{"model_name":"bench","request_id":"{rid}","worker_id":{k % 16},'
                        f'"dp_rank":0,"sequence_hashes":[{hashes}],"new_isl_tokens":512}}')  # fmt: skip
                conn.request("POST", "/add", body, {"content-type": "application/json"})
            else:
                body = f'{{"model_name":"bench","request_id":"{rid}"}}'
                conn.request("POST", "/free", body, {"content-type": "application/json"})
            conn.getresponse().read()
            with sent.get_lock():
                sent.value += 1
            k += 1
            due += interval

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def env_for(name: str) -> dict[str, str]:
    ack = CONFIGS[name][2]
    return {**os.environ, "SLOT_TRACKER_REPLICATION_ACK": ack,
            "SLOT_TRACKER_CONSISTENCY_WAIT_MS": "0"}  # fmt: skip


class Started:
    """A fresh server of configuration ``name`` (with its private redis-server if it has one),
    topology set, every process ready. ``s.redis_pid``: that redis-server's, counted with the
    server's CPU time and memory."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.workers, self.with_redis, _ = CONFIGS[name]
        self.redis: PrivateRedis | None = None

    def __enter__(self):
        args = ["--workers", str(self.workers)]
        if self.with_redis:
            self.redis = PrivateRedis()
            args += ["--redis-url", f"unix://{self.redis.path}"]
        self.server = start_ours(extra_args=args, env=env_for(self.name))
        s = self.server.__enter__()
        s.redis_pid = self.redis.proc.pid if self.redis is not None else None
        if self.workers > 1:
            hb.wait_all_ready(s.url, self.workers)
        hb.setup_topology(s.url)
        hb.settle(s.url)
        return s

    def __exit__(self, *exc):
        try:
            return self.server.__exit__(*exc)
        finally:
            if self.redis is not None:
                self.redis.close()


def per_call(before: dict[str, float], after: dict[str, float], calls: float) -> dict[str, float]:
    out = {role: (after[role] - before[role]) / calls * 1e6 for role in after}
    out["total"] = sum(out.values())
    return out


def loaded_wrk(s, script: str, duration: int, tag: str, connections: int = 32) -> dict:
    hb.wrk(s.url, script, 2, {"WRK_TAG": f"warm{tag}"}, connections)
    before = cpu_by_role(s.pid, s.redis_pid)
    res = hb.wrk(s.url, script, duration, {"WRK_TAG": tag}, connections)
    after = cpu_by_role(s.pid, s.redis_pid)
    out = per_call(before, after, res["rps"] * duration)
    out["rps"] = res["rps"]
    out["non2xx"] = res["non2xx"]
    return out


def run_writes_lag(name: str, args, round_no: int) -> dict[str, dict[str, float]]:
    """One server: idle lag, writes at each connection count, lag under load, reads."""
    out: dict[str, dict[str, float]] = {}
    measure = args.measure
    with Started(name) as s:
        two = CONFIGS[name][0] > 1
        if "lag" in measure and two:
            out["lag_idle"] = lag_figures(lag_samples(s.pid, args.lag_samples))
        if "writes" in measure:
            for c in args.connections:
                out[f"writes_c{c}"] = loaded_wrk(s, "lifecycle.lua", args.duration,
                                                 f"w{round_no}c{c}", c)  # fmt: skip
        if "lag" in measure and two:
            # at a fixed rate of lifecycle calls through the port (the same for every
            # configuration), then under wrk's 32 connections (each at its own maximum)
            seconds = args.duration + 5
            sent = multiprocessing.Value("q", 0)
            load = multiprocessing.Process(
                target=paced_load, args=(s.url, args.lag_rate, seconds, f"pl{round_no}", sent)
            )
            load.start()
            time.sleep(1)
            lags = lag_samples(s.pid, args.lag_samples, time.monotonic() + seconds - 2)
            load.join()
            out["lag_paced"] = lag_figures(lags, rate=sent.value / seconds)
            wrk_cmd = ["wrk", "-t1", "-c32", f"-d{seconds}s", "-s",
                       str(hb.WRK / "lifecycle.lua"), s.url]  # fmt: skip
            env = {**os.environ, "WRK_TAG": f"lagload{round_no}"}
            with subprocess.Popen(wrk_cmd, stdout=subprocess.DEVNULL, env=env) as wrk:
                time.sleep(1)
                lags = lag_samples(s.pid, args.lag_samples, time.monotonic() + seconds - 2)
                wrk.wait()
            out["lag_saturated"] = lag_figures(lags)
        if "reads" in measure:
            hb.setup_active(s.url)
            hb.settle(s.url)
            out["reads"] = loaded_wrk(s, "potential.lua", args.duration, f"p{round_no}")
    return out


def active_requests(url: str) -> int:
    rows = json.loads(urllib.request.urlopen(url + "/loads?model_name=bench").read())
    return sum(r["active_requests"] for r in rows)


def run_memory(name: str, fill: int) -> dict[str, float]:
    with Started(name) as s:
        idle = rss_by_role(s.pid, s.redis_pid)
        active = 0
        for _ in range(10):  # until ``fill`` requests are active (a slow server takes longer)
            env = {"FILL_COUNT": str(fill - active), "FILL_START": str(active + 1)}
            hb.wrk(s.url, "fill.lua", max(5, (fill - active) // 2500), env, 16)
            hb.settle(s.url)
            active = active_requests(s.url)
            if active >= fill:
                break
        time.sleep(1)
        filled = rss_by_role(s.pid, s.redis_pid)
    return {"idle": idle["total"], "filled": filled["total"], "active": active,
            "servers": filled["servers"], "supervisor": filled["supervisor"],
            "redis": filled["redis"],
            "per_1k": (filled["total"] - idle["total"]) / active * 1000}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", default="32,1")
    ap.add_argument("--measure", default="writes,lag,reads,memory")
    ap.add_argument("--lag-samples", type=int, default=400)
    ap.add_argument("--lag-rate", type=float, default=1000, help="lifecycle calls/s meanwhile")
    ap.add_argument("--fill", type=int, default=50_000)
    ap.add_argument("--only", default=DEFAULT_ONLY)
    args = ap.parse_args()
    args.connections = [int(c) for c in args.connections.split(",")]
    args.measure = set(args.measure.split(","))
    hb.OURS_WORKERS = 2  # nothing pinned, whatever the configuration
    names = [n for n in CONFIGS if n in args.only.split(",")]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for name in names:  # interleaved: the same minutes for every configuration
            got = run_writes_lag(name, args, r)
            if "memory" in args.measure:
                got["memory"] = run_memory(name, args.fill)
            for figure, values in got.items():
                results.setdefault((name, figure), []).append(values)
                shown = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                  for k, v in values.items())  # fmt: skip
                print(f"{name:15s} round {r} {figure:10s}: {shown}", flush=True)
    print(f"\nSUMMARY (median of {args.rounds} rounds; CPU in us per call, lag in ms, RSS in MB)")
    for (name, figure), runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        if figure.startswith(("writes", "reads")):
            totals = ", ".join(f"{x['total']:.0f}" for x in runs)
            line = (f"{med['rps']:.0f} req/s, CPU per call servers {med['servers']:.0f} + "
                    f"supervisor {med['supervisor']:.0f} + redis {med['redis']:.0f} = "
                    f"{med['total']:.0f} us (rounds: {totals})")  # fmt: skip
        elif figure.startswith("lag"):
            rounds = ", ".join(f"{x['p50']:.2f}/{x['p99']:.2f}" for x in runs)
            line = (f"p50 {med['p50']:.2f} ms, p99 {med['p99']:.2f} ms, max {med['max']:.2f} "
                    f"ms, {med['samples']:.0f} samples (rounds p50/p99: {rounds})")  # fmt: skip
            if "rate" in med:
                line += f", load {med['rate']:.0f} calls/s"
        else:
            line = (
                f"idle {med['idle']:.0f} MB, with {med['active']:.0f} active {med['filled']:.0f}"
                f" MB (servers {med['servers']:.0f}, supervisor {med['supervisor']:.0f}, "
                f"redis {med['redis']:.0f}); above idle {med['filled'] - med['idle']:.0f} MB"
            )
        print(f"SUMMARY {name} {figure}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
