"""Catalog rules: reasons, dp ranks, and what a PATCH may change."""

from __future__ import annotations

from kv_slot_tracker.core.selection.catalog import (
    WorkerSpec,
    block_size_mismatch,
    intrinsic_reasons,
    patched,
)
from kv_slot_tracker.core.types import WorkerDpRange


def test_reasons_in_the_reference_order() -> None:
    assert intrinsic_reasons(WorkerSpec(worker_id=1)) == [
        "endpoint is required",
        "block_size must be greater than 0",
    ]
    spec = WorkerSpec(worker_id=1, endpoint="", block_size=0, data_parallel_size=0)
    assert intrinsic_reasons(spec) == [
        "endpoint is required",
        "block_size must be greater than 0",
        "data_parallel_size must be greater than 0",
    ]
    assert intrinsic_reasons(WorkerSpec(worker_id=1, endpoint="e", block_size=4)) == []
    big = WorkerSpec(worker_id=1, endpoint="e", block_size=4, data_parallel_size=5000)
    assert intrinsic_reasons(big) == ["data_parallel_size must be at most 4096"]
    top = WorkerSpec(
        worker_id=1, endpoint="e", block_size=4, data_parallel_start_rank=2**32 - 1,
        data_parallel_size=2,
    )  # fmt: skip
    assert intrinsic_reasons(top) == [
        "data_parallel_start_rank + data_parallel_size must not exceed 4294967296"
    ]
    assert block_size_mismatch(("m", "g"), 4, 8) == (
        "reconciliation failed: block_size mismatch for model=m routing_group=g: "
        "existing=4 requested=8"
    )


def test_ranks_default_to_one_from_zero() -> None:
    spec = WorkerSpec(worker_id=3, data_parallel_start_rank=4, data_parallel_size=2)
    assert spec.dp_range == WorkerDpRange(3, 4, 2)
    assert [spec.has_rank(r) for r in (3, 4, 5, 6)] == [False, True, True, False]
    assert WorkerSpec(worker_id=3).dp_range == WorkerDpRange(3, 0, 1)


def test_patch_applies_non_null_fields_but_not_the_partition() -> None:
    spec = WorkerSpec(worker_id=1, model_name="m", endpoint="e", block_size=4)
    changed = patched(
        spec,
        {
            "endpoint": None,
            "block_size": 8,
            "model_name": "x",
            "routing_group": "y",
            "worker_id": 9,
        },
    )
    assert changed == WorkerSpec(worker_id=1, model_name="m", endpoint="e", block_size=8)
    assert patched(spec, {}) is spec
