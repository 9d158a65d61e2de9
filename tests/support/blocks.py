"""Changes to a block tracker that the service does not make."""

from __future__ import annotations

import math

from kv_slot_tracker.core.blocks import BlockTracker, _scaled


def set_fraction(bt: BlockTracker, h: int, fraction: float) -> None:
    """Give block ``h`` a fraction of its own (the service sets fractions through groups)."""
    bt.drop_fraction(h)
    bt._fraction[h] = fraction
    if math.isfinite(fraction):
        bt._frac_sum += _scaled(fraction)
    else:
        bt._nonfinite += 1
