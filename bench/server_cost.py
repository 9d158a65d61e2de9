"""Which HTTP server: server CPU per call of each candidate, next to the reference, in one run.

Servers (each started afresh per round; the rounds alternate A B C ... A B C ...):
  ref           Dynamo's ``dynamo.slot_tracker`` (and ``dynamo.select_service`` for select,
                KV events off), from the reference venv (``bench/reference.py``)
  direct        ``python -m kv_slot_tracker`` as shipped: the direct path (``http/fast_protocol.py``)
  asgi          the same app on uvicorn's public API only (``bench/servers/asgi_uvicorn.py``)
  granian       the app on granian's ASGI interface (``bench/servers/granian_app.py:app``)
  granian_rsgi  granian's RSGI interface through a thin adapter (``...granian_app.py:rsgi``)
  NAME          with ``--checkout NAME=PATH``: another checkout of this service run the way
                ``direct`` is (its own ``PATH/.venv``, ``python -m kv_slot_tracker``, or
                ``python -m app`` for a checkout from before the package was renamed): two
                commits compared in one run

Workloads (wrk, 1 thread, 32 connections, the scripts of ``bench/wrk``; wrk on CPU 0, the
server on CPU 1, as ``bench/http_bench.py``): lifecycle (/add + /free), potential
(/potential_loads, 256-block prompt, 200 active requests), batch (/batch of 100 operations:
CPU per call is per batch), select (/selection/select, the reference's /select; 200
reservations active). The figure is the server's CPU time (user + system from /proc, its
children included: granian's worker) over the calls wrk counted; req/s beside it.

    .venv/bin/python bench/server_cost.py [--duration 5] [--rounds 3] [--only ...] [--servers ...]
        [--checkout NAME=PATH ...]
Needs wrk, taskset, the reference venv, and granian installed in the venv for the granian rows
(``.venv/bin/pip install granian``; not a project dependency).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.http_bench import (  # noqa: E402
    children,
    cpu_seconds,
    pin,
    setup_active,
    setup_topology,
    wrk,
)
from bench.reference import (  # noqa: E402
    REPO,
    Server,
    _start_checked,
    ours_python,
    start_ours,
    start_reference,
)
from bench.selection_bench import setup_active as setup_reservations  # noqa: E402
from bench.selection_bench import setup_catalog  # noqa: E402

SCRIPTS = {
    "lifecycle": "lifecycle.lua",
    "potential": "potential.lua",
    "batch": "batch.lua",
    "select": "select.lua",
}
SERVERS = ("ref", "direct", "asgi", "granian", "granian_rsgi")
CHECKOUTS: dict[str, Path] = {}  # --checkout NAME=PATH: server kinds of other checkouts


def _ours_env() -> dict[str, str]:
    return {
        **os.environ,
        "SLOT_TRACKER_REDIS_URL": "",
        "SLOT_TRACKER_API_KEY": "",
        "SLOT_TRACKER_HOST": "127.0.0.1",
        "SLOT_TRACKER_LOG_LEVEL": "warning",
        # the selection API's catalog without KV event endpoints, as the reference is run
        "SLOT_TRACKER_ROUTER_USE_KV_EVENTS": "false",
    }


def _granian(interface: str, target: str) -> Server:
    granian = str(Path(ours_python()).parent / "granian")

    def make(port: int) -> Server:
        return Server(
            f"granian-{interface}",
            [
                granian,
                "--interface",
                interface,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--loop",
                "uvloop",
                "--log-level",
                "warning",
                target,
            ],
            port,
            cwd=HERE / "servers",
            env={**_ours_env(), "PYTHONPATH": str(REPO)},
        )

    return _start_checked(make)


def start(kind: str, workload: str) -> Server:
    if kind == "ref":
        if workload == "select":
            env = {**os.environ, "DYN_ROUTER_USE_KV_EVENTS": "false"}
            return start_reference(module="dynamo.select_service", env=env)
        return start_reference()
    if kind == "direct":
        return start_ours(env=_ours_env())
    if kind in CHECKOUTS:
        repo = CHECKOUTS[kind]
        module = "kv_slot_tracker" if (repo / "kv_slot_tracker").is_dir() else "app"

        def make_checkout(port: int) -> Server:
            argv = [str(repo / ".venv" / "bin" / "python"), "-m", module, "--port", str(port),
                    "--log-level", "warning"]  # fmt: skip
            return Server(kind, argv, port, cwd=repo, env=_ours_env())

        return _start_checked(make_checkout)
    if kind == "asgi":

        def make(port: int) -> Server:
            return Server(
                "asgi",
                [ours_python(), str(HERE / "servers" / "asgi_uvicorn.py"), str(port)],
                port,
                cwd=REPO,
                env=_ours_env(),
            )

        return _start_checked(make)
    if kind == "granian":
        return _granian("asgi", "granian_app:app")
    if kind == "granian_rsgi":
        return _granian("rsgi", "granian_app:rsgi")
    raise ValueError(kind)


def measure(kind: str, workload: str, duration: int, round_no: int) -> dict:
    with start(kind, workload) as s:
        for p in [s.pid, *children(s.pid)]:
            pin(p, 1)
        prefix = "" if kind == "ref" else "/selection"
        if workload == "select":
            setup_catalog(s.url + prefix)
            setup_reservations(s.url + prefix)
        else:
            setup_topology(s.url)
            if workload == "potential":
                setup_active(s.url)
        env = {"WRK_PREFIX": prefix} if workload == "select" else {}
        wrk(s.url, SCRIPTS[workload], 2, {**env, "WRK_TAG": f"warm{round_no}"})
        before = cpu_seconds(s.pid)
        res = wrk(s.url, SCRIPTS[workload], duration, {**env, "WRK_TAG": f"r{round_no}"})
        used = cpu_seconds(s.pid) - before
        calls = res["rps"] * duration
        return {"rps": res["rps"], "cpu_us": used / calls * 1e6, "non2xx": res["non2xx"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="lifecycle,potential,batch,select")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="another checkout (with its .venv) as server NAME; name it in --servers",
    )
    args = ap.parse_args()
    for spec in args.checkout:
        name, _, path = spec.partition("=")
        CHECKOUTS[name] = Path(path).resolve()
    servers = args.servers.split(",")
    workloads = args.only.split(",")
    rows: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for workload in workloads:
            order = servers if r % 2 == 0 else list(reversed(servers))
            for kind in order:
                if kind == "ref" and workload == "batch":
                    continue  # the reference has no /batch
                try:
                    res = measure(kind, workload, args.duration, r)
                except Exception as e:  # a candidate that cannot serve a workload: say so
                    print(f"{workload:9s} round {r} {kind:12s} FAILED: {e}", flush=True)
                    continue
                rows.setdefault((workload, kind), []).append(res)
                print(
                    f"{workload:9s} round {r} {kind:12s} {res['rps']:9.0f} req/s "
                    f"server CPU {res['cpu_us']:7.1f} us/call non-2xx {res['non2xx']}",
                    flush=True,
                )
    print(f"\nload average at the end: {os.getloadavg()}")
    print(
        "| workload | server | CPU us/call median (min-max) | req/s median (min-max) | vs direct |"
    )
    print("|---|---|---|---|---|")
    for workload in workloads:
        direct = rows.get((workload, "direct"))
        base = statistics.median(x["cpu_us"] for x in direct) if direct else None
        for kind in servers:
            got = rows.get((workload, kind))
            if not got:
                continue
            cpu = [x["cpu_us"] for x in got]
            rps = [x["rps"] for x in got]
            vs = f"{statistics.median(cpu) / base:.2f}x" if base else "-"
            print(
                f"| {workload} | {kind} | {statistics.median(cpu):.1f} ({min(cpu):.1f}-"
                f"{max(cpu):.1f}) | {statistics.median(rps):.0f} ({min(rps):.0f}-{max(rps):.0f})"
                f" | {vs} |"
            )
    print(json.dumps({f"{w}/{k}": v for (w, k), v in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
