"""``tune_gc``: the start-up heap is frozen and young collections become rarer."""

from __future__ import annotations

import gc

from kv_slot_tracker.gc_tuning import GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD, tune_gc


def test_tune_gc_freezes_the_start_up_heap_and_raises_the_thresholds() -> None:
    before = gc.get_threshold()
    survivor = [object()]  # alive before the call, so it must end up frozen
    try:
        tune_gc()
        assert gc.get_threshold() == (GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
        assert (GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD) == (50_000, 20, 100)
        assert gc.get_freeze_count() > 0
        assert not any(o is survivor for o in gc.get_objects())  # frozen objects are not listed
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
