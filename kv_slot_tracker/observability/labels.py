"""Label names and values every collector shares: a name cut to a bound keeps its series apart
from the others (``short_label``)."""

from __future__ import annotations

import hashlib

RANK_LABELS = ["model_name", "routing_group", "worker_id", "dp_rank"]
KEY_LABELS = ["model_name", "routing_group"]


def short_label(value: str, limit: int) -> str:
    """``value`` as a label value of at most ``limit`` characters: a longer one is cut and ends
    with ``~`` and 12 hex digits of its hash, so that distinct names stay distinct series."""
    if len(value) <= limit:
        return value
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
    return value[: limit - 13] + "~" + digest


OTHER = "other"  # worker_id and dp_rank of a tracker's ranks beyond the per-rank series bound
