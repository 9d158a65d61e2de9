"""The package type-checks: mypy with the configuration in pyproject.toml (``[tool.mypy]``: the
whole package under ``strict``, no module of it relaxed). ``make lint`` runs the same."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)  # a first run, without mypy's cache, on a busy machine
def test_mypy_accepts_the_package() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_module_of_the_package_is_typed_less_strictly() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True and config["files"] == ["kv_slot_tracker"]
    for override in config.get("overrides", []):
        modules = override["module"]
        modules = [modules] if isinstance(modules, str) else modules
        assert not any(m.startswith("kv_slot_tracker") for m in modules), override
