"""Route one request through kv-slot-tracker (SLOT_TRACKER_URL=http://host:port python FILE)."""

import os

from kv_slot_tracker_client import SlotTrackerClient

with SlotTrackerClient(os.environ.get("SLOT_TRACKER_URL", "http://127.0.0.1:8091")) as tracker:
    tracker.upsert(worker_id=1, model_name="llama", block_size=16, dp_start=0, dp_size=2)
    prompt = [0x9E3779B97F4A7C15, 0xFFFF_FFFF_FFFF_FFFF]  # block hashes, u64 or i64
    ranks = tracker.potential_loads("llama", prompt, new_isl_tokens=32)
    best = min(ranks, key=lambda r: (r.potential_decode_blocks, r.dp_rank))
    tracker.add("llama", "req-1", best.worker_id, best.dp_rank, prompt, new_isl_tokens=32)
    for row in tracker.loads("llama"):
        print(row.worker_id, row.dp_rank, row.active_prefill_tokens, row.active_decode_blocks)
    tracker.free("llama", "req-1")  # when the request has finished
