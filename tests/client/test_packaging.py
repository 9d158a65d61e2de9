"""The client is a distribution of its own (clients/python): what it declares, what importing it
loads, what its wheel holds, and that the service does not depend on it."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "clients" / "python"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable
SERVER_ONLY = {"kv_slot_tracker", "fastapi", "starlette", "uvicorn", "redis", "prometheus_client"}


def client_project() -> dict:
    return tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]


def test_declares_only_httpx_and_pydantic() -> None:
    project = client_project()
    assert project["name"] == "kv-slot-tracker-client"
    assert project["requires-python"] == ">=3.11"
    requirements = [Requirement(r) for r in project["dependencies"]]
    assert sorted(r.name for r in requirements) == ["httpx", "pydantic"]
    assert all(not r.extras and r.marker is None for r in requirements)
    assert "optional-dependencies" not in project


def test_version_is_the_package_version() -> None:
    """The distribution's version is read from the package, which says it once."""
    done = subprocess.run(
        [PYTHON, "-c", "import importlib.metadata as m, kv_slot_tracker_client as k;"
         "print(m.version('kv-slot-tracker-client'), k.__version__)"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    installed, package = done.stdout.split()
    assert installed == package == "0.1.0"


def test_import_loads_no_server_module(tmp_path: Path) -> None:
    """Importing the client (in a fresh interpreter, outside the repository) loads none of the
    service's dependencies, only its own."""
    code = (
        "import json, sys\n"
        "import kv_slot_tracker_client\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    done = subprocess.run(
        [PYTHON, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert {"kv_slot_tracker_client", "httpx", "pydantic"} <= loaded
    assert loaded & SERVER_ONLY == set()


def test_service_does_not_import_the_client() -> None:
    imported: dict[str, set[str]] = {}
    for path in sorted((REPO / "kv_slot_tracker").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                imported.setdefault(name.split(".")[0], set()).add(str(path.relative_to(REPO)))
    assert "kv_slot_tracker" in imported  # the walk did see the service's own imports
    assert "kv_slot_tracker_client" not in imported
    assert "httpx" not in imported  # the client was the service's only HTTP client
    assert not (REPO / "kv_slot_tracker" / "client.py").exists()
    server = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {Requirement(r).name for r in server["dependencies"]}
    assert "kv-slot-tracker-client" not in names and "httpx" not in names


def test_wheel_holds_the_package_and_py_typed(tmp_path: Path) -> None:
    """The wheel builds offline with the virtualenv's setuptools (a copy of the sources, so the
    build leaves nothing in the tree) and holds the typed package, and no ``kv_slot_tracker``."""
    pytest.importorskip("setuptools", minversion="70.1")
    source = tmp_path / "src"
    shutil.copytree(
        CLIENT, source, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__")
    )
    out = tmp_path / "wheels"
    done = subprocess.run(
        [PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("*.whl")
    assert wheel.name == "kv_slot_tracker_client-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read("kv_slot_tracker_client-0.1.0.dist-info/METADATA").decode()
    top = {n.split("/")[0] for n in names}
    assert top == {"kv_slot_tracker_client", "kv_slot_tracker_client-0.1.0.dist-info"}
    assert "kv_slot_tracker_client/py.typed" in names
    assert "kv_slot_tracker_client/client.py" in names
    requires = sorted(
        line.split(":", 1)[1].strip()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:")
    )
    assert requires == ["httpx>=0.27", "pydantic>=2.7"]
