"""How many processes ``workers`` means: the cores this process may use.

Kept apart from the supervisor (``kv_slot_tracker.supervisor``) so that the settings can check a
``workers`` value without importing the process machinery and replication.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (v2
    ``cpu.max``, or v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``) rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _cgroup_quota(root: Path) -> float | None:
    """CPUs allowed by the cgroup quota (None: no quota)."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    return None


def process_count(setting: int | str) -> int:
    """The ``workers`` setting as a number of processes."""
    return usable_cores() if setting == "auto" else int(setting)
