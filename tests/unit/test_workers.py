"""How many processes ``workers`` means (``app.workers``), and the setting's forms."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import load_settings
from app.workers import usable_cores, worker_count

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_no_cgroup_files_means_the_cpu_affinity(tmp_path: Path) -> None:
    assert usable_cores(tmp_path) == AFFINITY


def test_cgroup_v2_without_quota_means_the_cpu_affinity(tmp_path: Path) -> None:
    assert usable_cores(cgroup(tmp_path, {"cpu.max": "max 100000\n"})) == AFFINITY


@pytest.mark.parametrize(("quota", "cores"), [("50000", 1), ("100000", 1), ("150000", 2)])
def test_cgroup_v2_quota_rounds_up_and_caps(tmp_path: Path, quota: str, cores: int) -> None:
    root = cgroup(tmp_path, {"cpu.max": f"{quota} 100000\n"})
    assert usable_cores(root) == min(cores, AFFINITY)


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root = cgroup(tmp_path, {"cpu/cpu.cfs_quota_us": "100000", "cpu/cpu.cfs_period_us": "100000"})
    assert usable_cores(root) == 1
    unlimited = cgroup(tmp_path / "u", {"cpu/cpu.cfs_quota_us": "-1",
                                        "cpu/cpu.cfs_period_us": "100000"})  # fmt: skip
    assert usable_cores(unlimited) == AFFINITY


def test_worker_count() -> None:
    assert worker_count(1) == 1
    assert worker_count(3) == 3
    assert 1 <= worker_count("auto") <= AFFINITY


@pytest.mark.parametrize(("given", "value"), [("auto", "auto"), ("AUTO", "auto"), ("2", 2), (4, 4)])
def test_workers_setting_forms(given: object, value: object) -> None:
    assert load_settings(workers=given).workers == value


@pytest.mark.parametrize("given", [0, "0", "-1", "many", 1.5])
def test_workers_setting_refuses_the_rest(given: object) -> None:
    with pytest.raises(ValidationError):
        load_settings(workers=given)
