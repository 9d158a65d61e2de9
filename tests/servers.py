"""A real ``python -m kv_slot_tracker`` process for tests that need one over the network.

The instance is embedded (no Redis) and configured only by the given ``SLOT_TRACKER_*``
variables: those of the test environment are dropped. Used by the client, browser, Locust and
container tests; the end-to-end tests have their own fleet of replicated instances.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[1]
_VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = str(_VENV_PYTHON) if _VENV_PYTHON.exists() else sys.executable


def run_app(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m kv_slot_tracker ARGS`` to completion, with only ``env`` of the SLOT_TRACKER_* variables
    (for a command that exits: ``--check-config``, ``--help``, a refused configuration)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLOT_TRACKER_")}
    return subprocess.run(
        [PYTHON, "-m", "kv_slot_tracker", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def _healthy(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


KV_EVENTS_ENV = "SLOT_TRACKER_ROUTER_USE_KV_EVENTS"


def suite_mode() -> dict[str, str]:
    """The suite's selection mode (set in tests/conftest.py), for a child process that gets no
    other ``SLOT_TRACKER_*`` variable of the test environment."""
    return {KV_EVENTS_ENV: os.environ[KV_EVENTS_ENV]} if KV_EVENTS_ENV in os.environ else {}


@contextlib.contextmanager
def live_server(log_dir: Path, **env: str) -> Iterator[str]:
    """Run an instance on a free port until the block ends; yields its base URL."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLOT_TRACKER_")}
    clean.update(suite_mode())
    for _ in range(3):  # the free port may be taken before the child binds it
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = log_dir / f"server-{port}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [PYTHON, "-m", "kv_slot_tracker", "--port", str(port), "--log-level", "warning"],
                cwd=REPO,
                env={**clean, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if _healthy(proc, url, 30):
            break
        _stop(proc)
    else:
        pytest.fail(f"the instance did not start:\n{log_path.read_text()}", pytrace=False)
    try:
        yield url
    finally:
        _stop(proc)
