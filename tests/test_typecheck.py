"""The package type-checks: mypy with the configuration in pyproject.toml (``[tool.mypy]``: the
package gradually typed, ``kv_slot_tracker.core`` strictly). ``make lint`` runs the same."""

from __future__ import annotations

import subprocess
import sys
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
