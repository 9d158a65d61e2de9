"""Which rank holds each active request, and with which LoRA adapter (the seeds'
``request_maps.rs``).

The index is what turns a request id into a rank for ``free``, ``mark_prefill_completed`` and
``add_output_block``, and what keeps the active-request count per LoRA name. It is separate from
the ranks' own request tables because the two can disagree for a moment, exactly as in the seeds:
a replicated add of an id that another rank still holds re-points the index (``set``) while the
older copy stays active on its rank until it is freed or expires.
"""

from __future__ import annotations

from collections.abc import Container

from .limits import Usage
from .types import WorkerWithDpRank


class RequestIndex:
    __slots__ = ("workers", "loras", "lora_counts", "usage")

    def __init__(self, usage: Usage | None = None) -> None:
        self.usage = Usage() if usage is None else usage  # counts the indexed ids in all
        self.workers: dict[str, WorkerWithDpRank] = {}
        self.loras: dict[str, str] = {}
        self.lora_counts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.workers

    def worker(self, request_id: str) -> WorkerWithDpRank | None:
        return self.workers.get(request_id)

    def lora(self, request_id: str) -> str | None:
        return self.loras.get(request_id)

    def set(self, request_id: str, worker: WorkerWithDpRank, lora: str | None) -> None:
        """``set_request``: map the id to the rank, replacing any earlier mapping and LoRA."""
        old = self.loras.pop(request_id, None)
        if old is not None:
            self._lora_dec(old)
        if request_id in self.workers:
            self.usage.requests -= 1  # re-pointed: ``add`` counts it once more
        self.add(request_id, worker, lora)

    def add(self, request_id: str, worker: WorkerWithDpRank, lora: str | None) -> None:
        """``set`` for an id that is not mapped (the lifecycle hot path)."""
        self.workers[request_id] = worker
        self.usage.requests += 1
        if lora is not None:
            self.loras[request_id] = lora
            self.lora_counts[lora] = self.lora_counts.get(lora, 0) + 1

    def remove(self, request_id: str) -> WorkerWithDpRank | None:
        """Forget the id; returns the rank it mapped to (None when unknown)."""
        worker = self.workers.pop(request_id, None)
        if worker is not None:
            self.usage.requests -= 1
        lora = self.loras.pop(request_id, None)
        if lora is not None:
            self._lora_dec(lora)
        return worker

    def remove_on(self, ranks: Container[WorkerWithDpRank]) -> None:
        """Forget every id mapped to one of ``ranks`` (a topology change removed them)."""
        for rid in [rid for rid, w in self.workers.items() if w in ranks]:
            self.remove(rid)

    def _lora_dec(self, lora: str) -> None:
        n = self.lora_counts[lora] - 1
        if n:
            self.lora_counts[lora] = n
        else:
            del self.lora_counts[lora]

    def assert_consistent(self) -> None:
        counts: dict[str, int] = {}
        for lora in self.loras.values():
            counts[lora] = counts.get(lora, 0) + 1
        assert counts == self.lora_counts, "LoRA counts out of sync with the index"
        assert set(self.loras) <= set(self.workers), "LoRA names of unindexed requests"
