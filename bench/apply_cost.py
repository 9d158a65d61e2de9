"""CPU cost of applying a peer's replica records (``ReplicaRecords.apply_remote``), in process.

One ``SlotTrackerService`` (one worker of 4 ranks, blocks of 16 tokens) makes the records of ``--n``
requests, each an add of a prompt of 32 real random 64-bit hashes (as a router sends them,
about half negative; the record carries them unsigned) followed by its free; the records are
kept as the stream carries them (the entries' bytes, in the format of the version measured).
Another service decodes them as the reader does and applies them in batches of 50 (the decoding
timed too: since stream format 2 the service decodes a record's fields itself), adds and frees alternating, and the script reports microseconds
of CPU (``process_time``) per record, the median of ``--rounds`` rounds, each on a fresh
service. ``adds`` and ``frees`` apply the same records grouped instead (a batch of 50 adds,
then the batch of their 50 frees), timed apart: 50 requests are active at once then, against
one in the mixed order, so the two do not average to the mixed figure.

Several ``--repo`` (checkouts of the commits to compare, e.g. ``git archive`` exports) are
measured in one run, each round running every repo in turn in its own process, so a busy
machine weighs on all of them alike. With ``--instructions`` each repo runs under callgrind
instead and the script reports instructions per record (a run that applies minus one that does
everything else), which do not depend on what else the machine is doing.

    .venv/bin/python bench/apply_cost.py [--repo PATH ...] [--n 20000] [--rounds 5]
    PYTHONHASHSEED=0 .venv/bin/python bench/apply_cost.py --instructions [--repo PATH ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KEY = ("m", "default")
WALL = 1_700_000_000_000_000_000
HASHES = 32
BATCH = 50


def _service(replicator: Any, instance_id: int) -> Any:
    from kv_slot_tracker.service import SlotTrackerService
    from kv_slot_tracker.service import commands as c

    s = SlotTrackerService(
        clock=lambda: 1_000_000_000_000,
        wall_clock=lambda: WALL,
        instance_id=instance_id,
        replicator=replicator,
    )
    s.register(
        c.Register(
            model_name=KEY[0],
            routing_group=KEY[1],
            worker_id=1,
            block_size=16,
            dp_start=0,
            dp_size=4,
        )
    )
    return s


class _Sink:
    """Keeps every record as the stream carries it (the entry's bytes), in the format of the
    version measured (``--repo``)."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, record: Any, ts: int = 0) -> int:
        from kv_slot_tracker.replication import records as rr

        seq = len(self.payloads) + 1
        if isinstance(record, bytes):  # stream format 2: the service's bytes in an envelope
            self.payloads.append(rr.encode_entry(1, 1, seq, ts, record))
        else:  # format 1: one map
            self.payloads.append(rr.encode_record({**record, "incarnation": 1, "seq": seq}))
        return seq


def reader_decode() -> Any:
    """What the reader of the version measured decodes a stream entry with."""
    from kv_slot_tracker.replication import records as rr

    return getattr(rr, "decode_entry", None) or rr.decode_record


def records(n: int) -> list[bytes]:
    """The stream entries of the add and free records of ``n`` requests, in their order."""
    from kv_slot_tracker.service import commands as c

    sink = _Sink()
    producer = _service(sink, 1)
    rng = random.Random(1)
    for i in range(n):
        hashes = [rng.randrange(-(2**63), 2**63) for _ in range(HASHES)]
        producer.add(
            c.Add(
                model_name=KEY[0],
                routing_group=KEY[1],
                request_id=f"r{i}",
                worker_id=1,
                dp_rank=i % 4,
                sequence_hashes=hashes,
            )
        )
        producer.free(c.Free(model_name=KEY[0], routing_group=KEY[1], request_id=f"r{i}"))
    payloads = sink.payloads[1:]  # the first is the topology record of the registration
    assert len(payloads) == 2 * n
    return payloads


def consumer_of(recs: list[bytes]) -> tuple[Any, list[list[bytes]]]:
    """A fresh service to apply ``recs`` and the batches of ``BATCH`` records, in their order."""
    consumer = _service(None, 2)
    batches = [recs[i : i + BATCH] for i in range(0, len(recs), BATCH)]
    gc.collect()
    return consumer, batches


def apply_mixed(recs: list[bytes]) -> float:
    """CPU seconds to decode and apply ``recs`` in batches of ``BATCH``, in their order, on a
    fresh service."""
    consumer, batches = consumer_of(recs)
    apply = consumer.replica.apply_remote
    decode = reader_decode()
    start = time.process_time()
    for batch in batches:
        apply([decode(p) for p in batch])
    seconds = time.process_time() - start
    assert consumer.replica.applied == len(recs), "a record was not applied"
    assert consumer.replica.dropped == 0, consumer.replica.rejected
    return seconds


def apply_grouped(recs: list[bytes]) -> tuple[float, float]:
    """CPU seconds to apply the adds and, apart, the frees of ``recs``: a batch of
    ``BATCH`` adds, then the batch of their frees."""
    consumer = _service(None, 2)
    adds, frees = recs[0::2], recs[1::2]
    apply = consumer.replica.apply_remote
    decode = reader_decode()
    clock = time.process_time
    add_s = free_s = 0.0
    gc.collect()
    for i in range(0, len(adds), BATCH):
        t0 = clock()
        apply([decode(p) for p in adds[i : i + BATCH]])
        t1 = clock()
        apply([decode(p) for p in frees[i : i + BATCH]])
        t2 = clock()
        add_s += t1 - t0
        free_s += t2 - t1
    assert consumer.replica.applied == len(recs), "a record was not applied"
    return add_s, free_s


def inner(repo: Path, n: int, what: str) -> None:
    sys.path.insert(0, str(repo))
    recs = records(n)
    if what == "time":
        mixed = apply_mixed(recs)
        add_s, free_s = apply_grouped(recs)
        per = 1e6 / len(recs)
        out = {"mixed": mixed * per, "adds": add_s * 2 * per, "frees": free_s * 2 * per}
        print(json.dumps(out))
    elif what == "apply":
        apply_mixed(recs)
    else:  # "base": everything but applying the records
        consumer_of(recs)


def instructions(repo: Path, n: int) -> float:
    counts = {}
    for what in ("base", "apply"):
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"apply_cost.{os.getpid()}.{what}.cg"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
               __file__, "--inner", what, "--n", str(n), "--repo", str(repo)]  # fmt: skip
        res = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}
        )
        out.unlink(missing_ok=True)
        found = re.search(r"Collected : (\d+)", res.stderr)
        assert found is not None, res.stderr[-2000:]
        counts[what] = int(found.group(1))
    return (counts["apply"] - counts["base"]) / (2 * n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", type=Path, action="append", help="checkouts to compare")
    ap.add_argument("--n", type=int, help="requests (an add and a free record each)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--instructions", action="store_true", help="count instructions (callgrind)")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    args = ap.parse_args()
    repos = args.repo or [HERE.parent]
    if args.inner:
        inner(repos[0], args.n, args.inner)
        return
    if args.instructions:
        n = args.n or 2000
        for repo in repos:
            print(f"{repo}: {instructions(repo, n):,.0f} instructions per record")
        return
    n = args.n or 20000
    results: dict[Path, list[dict[str, float]]] = {repo: [] for repo in repos}
    for _ in range(args.rounds):
        for repo in repos:
            cmd = [sys.executable, __file__, "--inner", "time", "--n", str(n), "--repo", str(repo)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[repo].append(json.loads(res.stdout))
    for repo, rounds in results.items():
        med = {k: statistics.median(r[k] for r in rounds) for k in ("mixed", "adds", "frees")}
        best = min(r["mixed"] for r in rounds)
        print(
            f"{repo}: {med['mixed']:.2f} us CPU per record (adds and frees alternating); "
            f"adds {med['adds']:.2f}, frees {med['frees']:.2f} "
            f"(median of {len(rounds)} rounds of {2 * n} records; best round {best:.2f})"
        )


if __name__ == "__main__":
    main()
