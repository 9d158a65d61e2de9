"""Positional shorthands for the service's commands, so tests read like the calls they make.

``register(service, KEY, 1, 4, 0, 2)`` is ``service.register(Register(model_name=..., ...))``.
"""

from __future__ import annotations

from typing import Any

from kv_slot_tracker.core.types import WorkerDpRange
from kv_slot_tracker.service import commands as c
from kv_slot_tracker.service.commands import Key


def AddCall(  # noqa: N802 - reads like the command it builds
    model_name: str,
    routing_group: str,
    request_id: str,
    worker_id: int,
    dp_rank: int,
    sequence_hashes: list[int] | None = None,
    token_ids: list[int] | None = None,
    new_isl_tokens: int = 0,
    expected_prefill_ms: float | None = None,
    track_prefill_tokens: bool | None = None,
    expected_output_tokens: int | None = None,
    lora_name: str | None = None,
) -> c.Add:
    return c.Add(
        model_name=model_name,
        routing_group=routing_group,
        request_id=request_id,
        worker_id=worker_id,
        dp_rank=dp_rank,
        sequence_hashes=sequence_hashes,
        token_ids=token_ids,
        new_isl_tokens=new_isl_tokens,
        expected_prefill_ms=expected_prefill_ms,
        track_prefill_tokens=track_prefill_tokens,
        expected_output_tokens=expected_output_tokens,
        lora_name=lora_name,
    )


def _k(key: Key) -> dict[str, str]:
    return {"model_name": key[0], "routing_group": key[1]}


def register(svc: Any, key: Key, worker_id: int, block_size: int, start: int, size: int) -> None:
    svc.register(
        c.Register(
            **_k(key), worker_id=worker_id, block_size=block_size, dp_start=start, dp_size=size
        )
    )


def upsert(svc: Any, key: Key, worker_id: int, block_size: int, start: int, size: int) -> bool:
    return svc.upsert(
        c.Upsert(
            **_k(key), worker_id=worker_id, block_size=block_size, dp_start=start, dp_size=size
        )
    )


def unregister(svc: Any, key: Key, worker_id: int) -> None:
    svc.unregister(c.Unregister(**_k(key), worker_id=worker_id))


def reconcile(svc: Any, key: Key, block_size: int, workers: list[tuple[int, int, int]]) -> Any:
    ranges = [WorkerDpRange(*w) for w in workers]
    return svc.reconcile(c.Reconcile(**_k(key), block_size=block_size, workers=ranges))


def free(svc: Any, key: Key, request_id: str) -> None:
    svc.free(c.Free(**_k(key), request_id=request_id))


def prefill_complete(svc: Any, key: Key, request_id: str) -> None:
    svc.prefill_complete(c.PrefillComplete(**_k(key), request_id=request_id))


def potential_loads(
    svc: Any,
    key: Key,
    sequence_hashes: list[int] | None,
    token_ids: list[int] | None,
    lora_name: str | None,
    new_isl_tokens: int,
) -> Any:
    return svc.potential_loads(
        c.PotentialLoads(
            **_k(key),
            sequence_hashes=sequence_hashes,
            token_ids=token_ids,
            lora_name=lora_name,
            new_isl_tokens=new_isl_tokens,
        )
    )


def import_tracker(data: dict[str, Any], from_wall: Any, **tracker_kwargs: Any) -> Any:
    """A new tracker built with ``tracker_kwargs`` (``clock`` is required) holding ``data``."""
    from kv_slot_tracker.core.tracker import ActiveSequencesMultiWorker

    tracker_kwargs.setdefault("publisher", None)
    tracker_kwargs.setdefault("worker_type", "test")
    tracker = ActiveSequencesMultiWorker(block_size=data["block_size"], **tracker_kwargs)
    tracker.restore(data, from_wall)
    return tracker
