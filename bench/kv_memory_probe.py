"""Where this service's memory sits after a burst of KV events, read inside the serving process.

The server runs as ``python -m kv_slot_tracker`` (KV events on) with a ``sitecustomize`` that,
on ``SIGUSR1``, writes a report to a file: resident memory, the interpreter's allocated blocks,
the garbage collector's counts, live objects by type, pymalloc's arena statistics
(``sys._debugmallocstats``), glibc's ``malloc_info`` and, with ``--tracemalloc``, the largest
allocation sites of the live heap. The driver registers ``--ranks`` workers, publishes
``--blocks`` blocks as ``bench/kv_ingest_bench.py`` does (``--chunk`` batches at a time), waits
until the server holds them all, and asks for a report after start-up, after ``--settle`` seconds
of quiet, and (``--trim``) once more after the report's own ``gc.collect`` and ``malloc_trim``.

    .venv/bin/python bench/kv_memory_probe.py --chunk 6250 [--tracemalloc 1]

Reports go to ``--out`` (a directory; one file per report). Tracing inflates the heap: read the
resident figures from a run without it.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kv_publisher import PublisherProcess, stored  # noqa: E402
from bench.reference import start_ours  # noqa: E402

BS = 16

SITECUSTOMIZE = r"""
import collections, ctypes, ctypes.util, gc, os, signal, sys, tracemalloc

_DEPTH = int(os.environ.get("KV_PROBE_TRACEMALLOC", "0"))
if _DEPTH:
    tracemalloc.start(_DEPTH)
_OUT = os.environ["KV_PROBE_OUT"]
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_LIBC.fopen.restype = ctypes.c_void_p
_LIBC.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
_LIBC.fclose.argtypes = [ctypes.c_void_p]
_LIBC.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
_n = [0]


def _status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _report(signum, frame):
    _n[0] += 1
    path = os.path.join(_OUT, "report-%d.txt" % _n[0])
    tag = open(os.path.join(_OUT, "tag")).read().strip()
    collect = tag.endswith("+trim")
    if collect:
        gc.collect()
        _LIBC.malloc_trim(0)
    with open(path, "w") as f:
        f.write("tag %s\nrss_kib %d\npeak_rss_kib %d\nallocated_blocks %d\ngc_count %r\n"
                "frozen %d\n" % (tag, _status("VmRSS"), _status("VmHWM"),
                                  sys.getallocatedblocks(), gc.get_count(), gc.get_freeze_count()))
        objs = gc.get_objects()
        f.write("gc_tracked %d\n" % len(objs))
        by_type = collections.Counter(type(o).__name__ for o in objs)
        for name, n in by_type.most_common(15):
            f.write("  type %s %d\n" % (name, n))
        big = sorted(((sys.getsizeof(o), type(o).__name__, len(o)) for o in objs
                      if isinstance(o, (dict, list, set, collections.deque))),
                     reverse=True)[:15]
        for size, name, length in big:
            f.write("  big %s size=%d len=%d\n" % (name, size, length))
        del objs
        if _DEPTH:
            snap = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(False, tracemalloc.__file__)])
            total = sum(s.size for s in snap.statistics("filename"))
            f.write("traced_total %d\n" % total)
            for s in snap.statistics("lineno")[:25]:
                f.write("  site %s\n" % s)
            for s in snap.statistics("traceback")[:6]:
                f.write("  trace %d B in %d blocks\n" % (s.size, s.count))
                for line in s.traceback.format()[-2 * _DEPTH:]:
                    f.write("      %s\n" % line)
        f.flush()
    # pymalloc and glibc write to stderr / a FILE: point fd 2 at the report meanwhile
    with open(path, "a") as f:
        f.write("\n== sys._debugmallocstats\n")
        f.flush()
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    with open(path, "a") as f:
        f.write("\n== malloc_info\n")
    fp = _LIBC.fopen(path.encode(), b"a")
    _LIBC.malloc_info(0, fp)
    _LIBC.fclose(fp)
    with open(path, "a") as f:
        f.write("\ndone\n")


signal.signal(signal.SIGUSR1, _report)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=6250)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--tracemalloc", type=int, default=0, help="frames per traceback; 0 = off")
    ap.add_argument("--trim", action="store_true", help="a last report after gc + malloc_trim")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="kv-memory-probe-"))
    out.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="kv-probe-site-"))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "DYN_ROUTER_USE_KV_EVENTS"}
    env.update(
        DYN_ROUTER_USE_KV_EVENTS="true",
        PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        KV_PROBE_OUT=str(out),
        KV_PROBE_TRACEMALLOC=str(args.tracemalloc),
    )
    rng = random.Random(args.seed)
    server = start_ours(env=env)
    pub = PublisherProcess(ranks=args.ranks)
    assert server.pid is not None

    def report(tag: str) -> str:
        (out / "tag").write_text(tag)
        n = len(list(out.glob("report-*.txt"))) + 1
        os.kill(server.pid, signal.SIGUSR1)
        path = out / f"report-{n}.txt"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().rstrip().endswith("done"):
                break
            time.sleep(0.2)
        head = path.read_text().split("\n== sys._debugmallocstats")[0]
        print(f"--- {tag} ({path})\n{head}")
        return str(path)

    try:
        c = httpx.Client(base_url=server.url + "/selection", timeout=60)
        for wid in range(args.ranks):
            r = c.post("/workers", json={"worker_id": wid + 1, "endpoint": f"http://w{wid}",
                                         "block_size": BS,
                                         "kv_events_endpoint": pub.endpoints[wid]})  # fmt: skip
            assert r.json()["lifecycle"] == "schedulable", r.text
        for wid in range(args.ranks):
            pub.wait_subscribers(wid, 1)
        time.sleep(0.5)
        report("start")
        batches = args.blocks // args.chain
        prompts, work = [], []
        for i in range(batches):
            tokens = [rng.randrange(1, 100_000) for _ in range(BS * args.chain)]
            prompts.append(tokens)
            hashes = [rng.randrange(1, 1 << 63) for _ in range(args.chain)]
            work.append([i % args.ranks, [stored(hashes, tokens, BS)]])
        for lo in range(0, batches, args.chunk):
            hi = min(batches, lo + args.chunk)
            pending = {i % args.ranks: i for i in range(lo, hi)}
            pub.call(op="bulk", batches=work[lo:hi])
            while pending:
                for rank, i in list(pending.items()):
                    r = c.post("/overlap_scores", json={"token_ids": prompts[i]}).json()
                    full = {w["worker_id"]: w["device_blocks"] for w in r["workers"]}
                    if full.get(rank + 1) != args.chain:
                        break
                    del pending[rank]
                else:
                    continue
                time.sleep(0.01)
        time.sleep(args.settle)
        report("settled")
        if args.trim:
            report("settled+trim")
    finally:
        pub.close()
        server.stop()
    print(f"reports in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
