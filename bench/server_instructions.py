"""Instructions the running server spends per request, HTTP included, counted by callgrind.

``bench/edge_cost.py --instructions`` counts the operations in process; this starts the real
server (``python -m kv_slot_tracker``) under ``valgrind --tool=callgrind``, gives it ``http_bench.py``'s
topology and active requests, warms it with one of ``bench/wrk``'s scripts, zeroes the counters,
loads it again with wrk on one connection (one request in flight, so the count of completed
requests is exact up to that one) and reports the instructions of that load per request, and per
operation for ``/batch``. Instructions do not depend on what else the machine does, so the figure
compares commits on a busy machine; it leaves out what instructions cannot show (cache misses).

    .venv/bin/python bench/server_instructions.py [--what batch|lifecycle|potential]
                                                  [--seconds 40] [--repo PATH] [--branch-sim]

``--branch-sim`` adds callgrind's branch predictor simulation: conditional branches and their
mispredictions (Bc, Bcm), indirect jumps and theirs (Bi, Bim), per request or operation, so that
two commits of equal instructions can be compared on what a machine without hardware counters
cannot read. The simulator is simple (2-bit counters, a small target buffer): it ranks commits,
it does not predict a real CPU's mispredictions. ``--module`` runs an older checkout whose
package had another name.
Needs: valgrind (callgrind_control comes with it) and wrk.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.http_bench import WRK, setup_active, setup_topology  # noqa: E402
from bench.reference import REPO, Server, free_port, ours_python  # noqa: E402

SCRIPTS = {"batch": "batch.lua", "lifecycle": "lifecycle.lua", "potential": "potential.lua"}
OPS_PER_REQUEST = {"batch": 100, "lifecycle": 1, "potential": 1}


def wrk_requests(url: str, script: str, seconds: int, tag: str) -> int:
    """Completed requests of one wrk run; ``tag`` keeps each run's request ids its own."""
    out = subprocess.run(
        ["wrk", "-t1", "-c1", f"-d{seconds}s", "-s", str(WRK / script), url],
        capture_output=True, text=True, check=True, env={**os.environ, "WRK_TAG": tag},
    ).stdout  # fmt: skip
    if "Non-2xx" in out:
        raise RuntimeError(f"the server answered errors:\n{out}")
    return int(re.search(r"(\d+) requests in", out).group(1))


def measure(
    repo: Path,
    what: str,
    seconds: int,
    start_timeout: float = 180,
    *,
    branch_sim: bool = False,
    module: str = "kv_slot_tracker",
) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="server-instructions-"))
    out = tmp / "callgrind.out"
    env = {
        **os.environ,
        "SLOT_TRACKER_REDIS_URL": "",
        "SLOT_TRACKER_API_KEY": "",
        "SLOT_TRACKER_HOST": "127.0.0.1",
        "PYTHONHASHSEED": "0",
    }
    port = free_port()
    sim = ["--branch-sim=yes"] if branch_sim else []
    argv = ["valgrind", "--tool=callgrind", *sim, f"--callgrind-out-file={out}", ours_python(),
            "-m", module, "--port", str(port), "--log-level", "warning"]  # fmt: skip
    server = Server("ours", argv, port, cwd=repo, env=env, log_dir=tmp).start()
    try:
        server.wait_healthy(timeout=start_timeout)
        setup_topology(server.url)
        setup_active(server.url)
        # warm: imports, caches, the first batches
        wrk_requests(server.url, SCRIPTS[what], 5, "warm")
        ctl = ["callgrind_control"]
        subprocess.run([*ctl, "-z", str(server.pid)], check=True, capture_output=True)
        requests = wrk_requests(server.url, SCRIPTS[what], seconds, "run")
        time.sleep(1)  # the last response is written before wrk counts it; let the loop settle
        subprocess.run([*ctl, "-d", str(server.pid)], check=True, capture_output=True)
        dumps = sorted(tmp.glob("callgrind.out.*"))
        if not dumps:
            raise RuntimeError("callgrind wrote no dump")
        text = dumps[-1].read_text(errors="replace")
        names = re.search(r"^events: (.+)$", text, re.M).group(1).split()
        values = [int(v) for v in re.search(r"^summary: (.+)$", text, re.M).group(1).split()]
        events = dict(zip(names, values, strict=True))
    finally:
        server.stop()
    ops = requests * OPS_PER_REQUEST[what]
    out_fig: dict[str, float] = {"requests": requests, "instructions": events["Ir"]}
    out_fig["per_op"] = events["Ir"] / ops
    for name in ("Bc", "Bcm", "Bi", "Bim"):
        if name in events:
            out_fig[name] = events[name] / ops
    out_fig["dump"] = str(dumps[-1])
    return out_fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=sorted(SCRIPTS), default="batch")
    ap.add_argument("--seconds", type=int, default=40)
    ap.add_argument("--repo", type=Path, default=REPO, help="checkout to run (its .venv)")
    ap.add_argument(
        "--start-timeout",
        type=float,
        default=180,
        help="seconds the server may take to start under callgrind (more on a busy machine)",
    )
    ap.add_argument("--branch-sim", action="store_true", help="simulate the branch predictor too")
    ap.add_argument("--module", default="kv_slot_tracker", help="the package to run with -m")
    ap.add_argument("--keep", action="store_true", help="keep the callgrind dump (path printed)")
    args = ap.parse_args()
    r = measure(
        args.repo.resolve(),
        args.what,
        args.seconds,
        args.start_timeout,
        branch_sim=args.branch_sim,
        module=args.module,
    )
    unit = "operation" if args.what == "batch" else "request"
    print(f"{args.what}: {r['requests']} requests, {r['instructions']:,} instructions, "
          f"{r['per_op']:,.0f} per {unit}")  # fmt: skip
    if "Bc" in r:
        print(f"  per {unit}: {r['Bc']:,.0f} conditional branches, {r['Bcm']:,.1f} mispredicted; "
              f"{r['Bi']:,.0f} indirect, {r['Bim']:,.1f} mispredicted")  # fmt: skip
    if args.keep:
        print(f"  dump: {r['dump']}")
    else:
        Path(r["dump"]).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
