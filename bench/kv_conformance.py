"""Differential check of the KV-events mode against Dynamo's selection service (1.6.1).

Both servers run with KV events on (the reference's default): the reference
(``python -m dynamo.select_service``, ``bench/reference.py``) and kv-slot-tracker
(``/selection``, ``DYN_ROUTER_USE_KV_EVENTS=true``). For every run a publisher process
(``bench/kv_publisher.py``, vLLM's wire format, one PUB + replay ROUTER per rank) stands in for the
engines; random workers (dp 1-2, some with a replay endpoint) are registered on both servers with
the same publisher addresses, so both subscribe to the same sockets. Then random operations:

* event batches: stores (from block 0 or continuing a chain the rank holds; GPU, sometimes CPU,
  CPU_PINNED, DISK, STORAGE, EXTERNAL or a medium the reference does not know), removals of held
  blocks (middle ones included), unknown removals, stores under an unknown parent, clears,
  batches with several events; each event as the engines encode it now (a msgspec map) or in
  the older positional form, some with ``locality``, ``ownership``, a cache salt (``cache_salt``,
  or vLLM's tagged ``extra_keys``), KV cache group fields, EAGLE bigram tokens; each rank's
  engine hashes content-addressed with a seed of its own or shared (so ranks store the same
  tokens under the same or other hashes); on ranks with a replay endpoint, dropped batches (a
  gap the next batch reveals and both servers replay);
* after each batch both ``/dump`` answers are polled until they hold the same facts
  ``(worker, dp_rank, tier, block_hash, tokens_hash, parent)`` (up to ``--settle`` seconds); a
  difference left then is counted;
* ``/overlap_scores`` on a random prompt, sometimes salted (every column compared, rows sorted);
* ``/select`` on a random prompt: equal picks compare the whole body; different picks count as
  agreeing when the reference, asked again (``--requery`` times), can choose ours (random
  tie-breaks), and then our body is compared with its body for that pick.

Prompts share prefixes (a few base prompts cut at random depths), so ranks overlap partially.
Gaps without a replay endpoint are left out here; they, and the other gap and hostile-input
scenarios, are compared one by one in ``bench/kv_gap_conformance.py``.

    .venv/bin/python bench/kv_conformance.py --seed 1 --runs 10 --ops 60

The last line is ``N checks, M differences, agreement P %``; exit code 1 when M > 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kv_publisher import CLEARED, PublisherProcess  # noqa: E402
from bench.reference import start_ours, start_reference  # noqa: E402

BS = 4
BLOCKS = 8
MEDIA = ["GPU"] * 8 + ["CPU", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL", "NVME_XYZ"]
SALTS = ["s1", "s2"]


def dump_facts(body: dict, model: str) -> set[tuple]:
    facts = set()
    for ev in body.get(f"{model}:default", {}).get("events", []):
        stored_ = ev["event"]["data"].get("stored")
        if stored_ is None:
            continue
        parent = stored_["parent_hash"]
        for b in stored_["blocks"]:
            facts.add(
                (ev["worker_id"], ev["event"]["dp_rank"], ev["storage_tier"], b["block_hash"],
                 b["tokens_hash"], parent)
            )  # fmt: skip
            parent = b["block_hash"]
    return facts


def overlap_rows(body: dict) -> list[tuple]:
    return sorted(
        tuple(w[k] for k in (
            "worker_id", "dp_rank", "device_blocks", "host_pinned_blocks", "disk_blocks",
            "host_pinned_extension_blocks", "disk_extension_blocks"))
        for w in body["workers"]
    )  # fmt: skip


class Run:
    def __init__(self, rng: random.Random, ref: httpx.Client, ours: httpx.Client, tag: str,
                 first_worker: int, args: argparse.Namespace) -> None:  # fmt: skip
        self.rng, self.ref, self.ours, self.args = rng, ref, ours, args
        self.ours_metrics = httpx.Client(
            base_url=str(ours.base_url).removesuffix("/selection/"), timeout=10
        )
        self.model = f"kv{tag}"
        self.diffs: Counter[str] = Counter()
        self.checks: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}
        # base prompts: each block's tokens, and the engine hash of each (prompt, depth)
        # (one token more than the blocks: an EAGLE block's hash covers the token after it)
        self.bases = [[rng.randrange(1, 50_000) for _ in range(BS * BLOCKS + 1)] for _ in range(3)]
        # base 1 shares base 0's first blocks
        cut = rng.randrange(1, BLOCKS) * BS
        self.bases[1][:cut] = self.bases[0][:cut]
        self.workers: list[tuple[int, int, bool]] = []  # (worker_id, dp_size, replay)
        self.log: list[str] = []  # the operations so far (printed with -v on a difference)
        sizes = [rng.choice([1, 1, 2]) for _ in range(rng.randrange(1, 4))]
        self.pub = PublisherProcess(ranks=sum(sizes))
        self.rank_of: dict[tuple[int, int], int] = {}  # (worker, dp rank) -> publisher rank
        self.held: dict[
            int, dict[int, tuple[int, int, str]]
        ] = {}  # pub rank -> hash -> (base, depth, medium)
        self.seeds: dict[int, int] = {}  # pub rank -> the seed of its engine hashes
        pr = 0
        for i, size in enumerate(sizes):
            wid = first_worker + i
            replay = size == 1 and rng.random() < 0.5
            body: dict[str, Any] = {
                "worker_id": wid, "model_name": self.model, "endpoint": f"http://w{wid}",
                "block_size": BS, "data_parallel_size": size,
                "kv_events_endpoints": {str(r): self.pub.endpoints[pr + r] for r in range(size)},
            }  # fmt: skip
            if replay:
                body["replay_endpoint"] = self.pub.replay_endpoints[pr]
            for side in (self.ref, self.ours):
                r = side.post("/workers", json=body)
                assert r.status_code == 201 and r.json()["lifecycle"] == "schedulable", r.text
            for r in range(size):
                self.rank_of[wid, r] = pr + r
                self.held[pr + r] = {}
                self.seeds[pr + r] = rng.choice([0, 0, pr + r + 1])
            self.workers.append((wid, size, replay))
            pr += size
        for rank in range(pr):
            self.pub.wait_subscribers(rank, 2)

    def ext_hash(self, base: int, depth: int, seed: int = 0) -> int:
        """The engine's hash of a block: content-addressed like vLLM's (same prefix, same hash,
        for one ``seed``), signed or unsigned 64-bit at random."""
        prefix = self.bases[base][: (depth + 1) * BS]
        h = xxhash.xxh64_intdigest(b"".join(t.to_bytes(4, "little") for t in prefix), seed)
        return h - (1 << 64) if h >= (1 << 63) and depth % 2 else h

    def note(self, family: str, ok: bool, detail: str) -> None:
        self.checks[family] += 1
        if not ok:
            if self.args.verbose and not self.diffs:
                print("\n".join(self.log[-12:]), "\n  ->", family, detail[:600])
            if self.args.log and not self.diffs:
                with open(self.args.log, "a") as f:
                    f.write(json.dumps({"model": self.model, "ops": self.log, "family": family,
                                        "detail": detail[:2000]}) + "\n")  # fmt: skip
            self.diffs[family] += 1
            self.examples.setdefault(family, [])
            if len(self.examples[family]) < self.args.show:
                self.examples[family].append(detail)

    # -- events -----------------------------------------------------------------------------

    def random_event(self, rank: int) -> list | dict:
        rng = self.rng
        held = self.held[rank]
        seed = self.seeds[rank]
        roll = rng.random()
        if roll < 0.55 or not held:
            base = rng.randrange(3)
            medium = rng.choice(MEDIA)
            chains = [(b, d) for h, (b, d, m) in held.items() if b == base and m == medium]
            start = 0
            if chains and rng.random() < 0.6:
                start = max(d for _, d in chains) + 1
                if start >= BLOCKS:
                    start = 0
            n = rng.randrange(1, min(4, BLOCKS - start) + 1)
            if start and rng.random() < 0.2:  # parent unknown to the rank
                parent = rng.randrange(1, 1 << 62)
            else:
                parent = self.ext_hash(base, start - 1, seed) if start else None
            hashes = [self.ext_hash(base, start + i, seed) for i in range(n)]
            tokens: list = self.bases[base][start * BS : (start + n) * BS]
            if rng.random() < 0.08:  # EAGLE: bigrams, each block hashed with the next token
                window = self.bases[base][start * BS : (start + n) * BS + 1]
                tokens = [[window[i], window[i + 1]] for i in range(len(window) - 1)]
            if parent is None or parent in held or parent in [h for h in hashes]:
                for i, h in enumerate(hashes):
                    held[h] = (base, start + i, medium)
            extra = self.extras(stored_=True)
            salt = rng.choice(SALTS) if rng.random() < 0.15 else None
            if rng.random() < 0.5:  # the engines' encoding: a msgspec map
                ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                      "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": medium,
                      **extra}  # fmt: skip
                if salt is not None:
                    ev["cache_salt"] = salt
                return ev
            keys = [[f"dynamo-cache-salt:{salt}"]] if salt is not None else None
            trailing = [extra.get(k) for k in ("group_idx", "kv_cache_spec_kind",
                        "kv_cache_spec_sliding_window", "locality", "ownership")]  # fmt: skip
            while trailing and trailing[-1] is None:
                trailing.pop()
            if trailing:
                trailing += [None] * (4 - len(trailing))
            return ["BlockStored", hashes, parent, tokens, BS, None, medium, None, keys, *trailing]
        if roll < 0.85:
            victims = rng.sample(sorted(held), rng.randrange(1, min(3, len(held)) + 1))
            by_medium: dict[str, list[int]] = {}
            for h in victims:
                by_medium.setdefault(held[h][2], []).append(h)
            medium, hashes = rng.choice(sorted(by_medium.items()))
            for h in hashes:
                held.pop(h, None)
            if rng.random() < 0.2:
                hashes = [*hashes, rng.randrange(1, 1 << 62)]
            extra = self.extras(stored_=False)
            if rng.random() < 0.5:
                return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **extra}
            return ["BlockRemoved", hashes, medium]
        held.clear()
        return CLEARED if rng.random() < 0.5 else {"type": "AllBlocksCleared"}

    def extras(self, *, stored_: bool) -> dict:
        """Optional fields of an event: KV cache groups, locality, ownership (each now and then)."""
        rng = self.rng
        out: dict = {}
        roll = rng.random()
        if roll < 0.06:
            out.update(group_idx=1, kv_cache_spec_kind="sliding_window")
        elif roll < 0.12:
            out.update(group_idx=0, kv_cache_spec_kind="full_attention")
        elif roll < 0.16:
            out.update(group_idx=1)
        elif roll < 0.18 and stored_:
            out.update(group_idx=1, kv_cache_spec_kind="full_attention")
        roll = rng.random()
        if roll < 0.05:
            out["locality"] = "REMOTE"
        elif roll < 0.1:
            out["locality"] = "LOCAL"
        elif roll < 0.13:
            out["ownership"] = "kvcr"
        return out

    def publish(self) -> None:
        wid, size, replay = self.rng.choice(self.workers)
        dp = self.rng.randrange(size)
        rank = self.rank_of[wid, dp]
        events = [self.random_event(rank) for _ in range(self.rng.choice([1, 1, 2, 3]))]
        drop = replay and self.rng.random() < 0.25
        self.log.append(f"publish w{wid} dp{dp} drop={drop} {json.dumps(events)}")
        self.pub.publish(rank, events, dp_rank=dp, drop=drop)
        self.args.published += 1
        if drop:  # the gap shows with the next batch, which both servers then replay
            follow = [self.random_event(rank)]
            self.log.append(f"publish w{wid} dp{dp} {follow}")
            self.pub.publish(rank, follow, dp_rank=dp)
            self.args.published += 1
        self.settle()

    def ours_batches(self) -> float:
        for line in self.ours_metrics.get("/metrics").text.splitlines():
            if line.startswith("kv_slot_tracker_kv_events_batches_total "):
                return float(line.split()[-1])
        return 0.0

    def settle(self) -> None:
        """Wait until this service has applied every batch published so far (its counter), then
        until both dumps agree (the reference has no counter to read)."""
        deadline = time.monotonic() + self.args.settle
        while self.ours_batches() < self.args.published and time.monotonic() < deadline:
            time.sleep(0.01)
        while True:
            a = dump_facts(self.ref.get("/dump").json(), self.model)
            b = dump_facts(self.ours.get("/dump").json(), self.model)
            if a == b or time.monotonic() > deadline:
                break
            time.sleep(0.03)
        self.note("dump", a == b, f"ref-ours {sorted(a - b)[:3]} ours-ref {sorted(b - a)[:3]}")

    # -- queries ----------------------------------------------------------------------------

    def prompt(self) -> list[int]:
        base = self.rng.randrange(3)
        n = self.rng.randrange(1, BLOCKS + 1)
        tokens = self.bases[base][: n * BS]
        if self.rng.random() < 0.3:
            tokens = tokens + [
                self.rng.randrange(1, 50_000) for _ in range(self.rng.randrange(1, 6))
            ]
        return tokens

    def overlap(self) -> None:
        body: dict[str, Any] = {"model_name": self.model, "token_ids": self.prompt()}
        if self.rng.random() < 0.2:
            body["cache_salt"] = self.rng.choice(SALTS)
        self.log.append(f"overlap {len(body['token_ids'])} tokens")
        a = self.ref.post("/overlap_scores", json=body)
        b = self.ours.post("/overlap_scores", json=body)
        ok = a.status_code == b.status_code and (
            a.status_code != 200 or (
                overlap_rows(a.json()) == overlap_rows(b.json())
                and a.json()["num_blocks"] == b.json()["num_blocks"]
            )
        )  # fmt: skip
        self.note("overlap_scores", ok, f"{a.text[:300]} vs {b.text[:300]}")

    def select(self) -> None:
        body: dict[str, Any] = {"model_name": self.model, "token_ids": self.prompt()}
        if self.rng.random() < 0.2:
            body["cache_salt"] = self.rng.choice(SALTS)
        b = self.ours.post("/select", json=body)
        a = self.ref.post("/select", json=body)
        if a.status_code != 200 or b.status_code != 200:
            self.note("select", a.status_code == b.status_code, f"{a.text} vs {b.text}")
            return
        ours = b.json()
        pick = (ours["worker_id"], ours["dp_rank"])
        ref = a.json()
        tries = 0
        while (ref["worker_id"], ref["dp_rank"]) != pick and tries < self.args.requery:
            ref = self.ref.post("/select", json=body).json()
            tries += 1
        self.note("select", ref == ours, f"{json.dumps(ref)[:300]} vs {json.dumps(ours)[:300]}")

    def go(self, ops: int) -> None:
        try:
            for _ in range(ops):
                roll = self.rng.random()
                if roll < 0.5:
                    self.publish()
                elif roll < 0.8:
                    self.overlap()
                else:
                    self.select()
        finally:
            self.pub.close()
            self.ours_metrics.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ops", type=int, default=60)
    ap.add_argument("--requery", type=int, default=32)
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--show", type=int, default=2)
    ap.add_argument("--log", help="append each run's operations up to its first difference")
    ap.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print the batches before the first difference of a run",
    )
    args = ap.parse_args(argv)
    args.published = 0  # batches published in all runs (this service counts the ones it applied)
    env = {k: v for k, v in os.environ.items() if k != "DYN_ROUTER_USE_KV_EVENTS"}
    ref_srv = start_reference(module="dynamo.select_service", env=env)
    ours_srv = start_ours(env={**env, "DYN_ROUTER_USE_KV_EVENTS": "true"})
    checks: Counter[str] = Counter()
    diffs: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    started = time.monotonic()
    try:
        with (
            httpx.Client(base_url=ref_srv.url, timeout=10) as ref,
            httpx.Client(base_url=ours_srv.url + "/selection", timeout=10) as ours,
        ):
            for run in range(args.runs):
                rng = random.Random(args.seed * 100_003 + run)
                r = Run(rng, ref, ours, f"{args.seed}r{run}", 1 + args.seed * 10_000 + run * 10,
                        args)  # fmt: skip
                r.go(args.ops)
                checks += r.checks
                diffs += r.diffs
                for k, v in r.examples.items():
                    examples.setdefault(k, []).extend(v)
    finally:
        ref_srv.stop()
        ours_srv.stop()
    print(f"elapsed {time.monotonic() - started:.1f} s")
    for family in sorted(checks):
        print(f"  {family}: {checks[family]} checks, {diffs[family]} differences")
        for ex in examples.get(family, [])[: args.show]:
            print(f"    e.g. {ex}")
    n, m = sum(checks.values()), sum(diffs.values())
    print(f"{n} checks, {m} differences, agreement {100 * (n - m) / max(n, 1):.2f} %")
    return 1 if m else 0


if __name__ == "__main__":
    sys.exit(main())
