"""Open-loop latency at several rates on one server, with the server's CPU time per request.

``http_bench.py``'s p99 figure loads a server at half of its closed-loop peak. Under an open loop
each request arrives alone, so the server pays a wake-up and its own socket calls for every
request instead of sharing them with the others waiting in a closed loop: its capacity is lower
than that peak. This sweep shows where latency turns (one fresh server, the topology of
``http_bench.py``, ``bench/openloop.py`` pinned to CPU 0 and the server to CPU 1):

  rate   achieved req/s, p50 and p99 from the scheduled send time, and server CPU per request

Run:  .venv/bin/python bench/openloop_sweep.py [--kind ours|ref] [--rates 6000,9000,12000]
      [--seconds 6]
Needs: taskset, and for the reference its venv (python bench/reference.py ensure).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.http_bench import cpu_seconds, setup_topology, started  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("ours", "ref"), default="ours")
    ap.add_argument("--rates", default="6000,9000,11000,13000")
    ap.add_argument("--seconds", type=float, default=6)
    args = ap.parse_args()
    with started(args.kind) as s:
        setup_topology(s.url)
        for rate in (int(r) for r in args.rates.split(",")):
            cmd = [sys.executable, str(HERE / "openloop.py"), s.url, "--rate", str(rate),
                   "--seconds", str(args.seconds), "--tag", f"s{rate}_"]  # fmt: skip
            if shutil.which("taskset"):
                cmd = ["taskset", "-c", "0", *cmd]
            before, t0 = cpu_seconds(s.pid), time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            used, wall = cpu_seconds(s.pid) - before, time.perf_counter() - t0
            res = json.loads(out.strip().splitlines()[-1])
            sent = res["sent"]
            print(
                f"{args.kind} rate {rate}: achieved {res['achieved_rps']:.0f} req/s, p50 "
                f"{res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms, server CPU "
                f"{used / wall:.2f} of a core, {used / sent * 1e6:.0f} us per request",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
