"""What ``docker compose config`` would check of ``compose.yaml`` and ``compose.sentinel.yaml``,
done here without the CLI (which most machines running the suite lack; where it is installed,
``test_compose.py`` and this module's last test run it too):

* interpolated as Compose does (with the shell's key and password), each file is still valid
  against the Compose Specification schema, and without either variable it refuses to load;
* every ``depends_on`` names a service of the file, without a cycle, and a ``service_healthy``
  condition names a service that has a health check; every service has one;
* host ports are distinct within a file;
* every file a service refers to exists (build context and Dockerfile, bind mounts, env files,
  configs and secrets), and every named volume is declared;
* every ``SLOT_TRACKER_*`` variable is a setting the service has, with a value it accepts.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import ROOT, settings_from_env
from tests.deploy.test_compose import (
    API_KEY_VAR,
    PASSWORD_VAR,
    SHELL_ENV,
    compose_cli,
    interpolate,
    schema_errors,
)

FILES = [ROOT / "compose.yaml", ROOT / "compose.sentinel.yaml"]


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def interpolated(node: Any, env: dict[str, str]) -> Any:
    """The document with every string interpolated (keys are not, as in Compose)."""
    if isinstance(node, dict):
        return {k: interpolated(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolated(v, env) for v in node]
    return interpolate(node, env) if isinstance(node, str) else node


@pytest.fixture(params=FILES, ids=lambda p: p.name)
def path(request: pytest.FixtureRequest) -> Path:
    return request.param


def test_valid_once_interpolated_and_refused_without_a_secret(path: Path) -> None:
    doc = load(path)
    assert schema_errors(interpolated(doc, SHELL_ENV)) == []
    for missing in (API_KEY_VAR, PASSWORD_VAR):
        env = {k: v for k, v in SHELL_ENV.items() if k != missing}
        with pytest.raises(LookupError, match=missing):
            interpolated(doc, env)


def depends(service: dict[str, Any]) -> dict[str, str]:
    """``depends_on`` in its long form: service name -> condition."""
    given = service.get("depends_on") or {}
    if isinstance(given, list):
        return dict.fromkeys(given, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in given.items()}


def test_dependencies_and_health_checks(path: Path) -> None:
    services = load(path)["services"]
    for name, service in services.items():
        assert "healthcheck" in service and service["healthcheck"]["test"], name
        for dep, condition in depends(service).items():
            assert dep in services and dep != name, (name, dep)
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], (name, dep)
    # no cycle: every service can be started after the ones it depends on
    started: set[str] = set()
    while len(started) < len(services):
        ready = {n for n, s in services.items() if n not in started and set(depends(s)) <= started}
        assert ready, f"a dependency cycle among {sorted(set(services) - started)}"
        started |= ready


def test_host_ports_are_distinct(path: Path) -> None:
    host_ports = [
        str(mapping).rsplit(":", 1)[0]
        for service in load(path)["services"].values()
        for mapping in service.get("ports", [])
    ]
    assert host_ports and len(host_ports) == len(set(host_ports)), host_ports


def volume_source(volume: str | dict[str, Any]) -> str | None:
    """What a service's volume mounts: a host path, a named volume, or None (anonymous)."""
    if isinstance(volume, dict):
        return volume.get("source")
    return volume.split(":", 1)[0] if ":" in volume else None


def is_host_path(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def referenced_files(doc: dict[str, Any]) -> list[Path]:
    """Every host path the file refers to, relative to its directory (the project's root)."""
    paths = []
    for service in doc["services"].values():
        build = service.get("build")
        if build is not None:
            spec = {"context": build} if isinstance(build, str) else build
            context = ROOT / spec.get("context", ".")
            paths += [context, context / spec.get("dockerfile", "Dockerfile")]
        for volume in service.get("volumes", []):
            source = volume_source(volume)
            if source is not None and is_host_path(source):
                paths.append(ROOT / source)
        env_files = service.get("env_file", [])
        paths += [ROOT / f for f in ([env_files] if isinstance(env_files, str) else env_files)]
    for section in ("configs", "secrets"):
        paths += [
            ROOT / spec["file"] for spec in (doc.get(section) or {}).values() if "file" in spec
        ]
    return paths


def named_volumes(doc: dict[str, Any]) -> set[str]:
    return {
        source
        for service in doc["services"].values()
        for volume in service.get("volumes", [])
        if (source := volume_source(volume)) is not None and not is_host_path(source)
    }


def test_every_referenced_file_exists_and_named_volumes_are_declared(path: Path) -> None:
    doc = load(path)
    files = referenced_files(doc)
    assert ROOT / "Dockerfile" in files, "the instances are built from this repository"
    assert [str(p.relative_to(ROOT)) for p in files if not p.exists()] == []
    assert named_volumes(doc) <= set(doc.get("volumes") or {})


def test_the_checks_see_a_missing_file_and_an_undeclared_volume() -> None:
    doc = {
        "services": {
            "a": {"build": {"context": ".", "dockerfile": "Nope.Dockerfile"},
                  "volumes": ["./missing-dir:/data", "cache:/cache"], "env_file": "gone.env"},
        },
        "configs": {"c": {"file": "./no-such.conf"}},
    }  # fmt: skip
    missing = [str(p.relative_to(ROOT)) for p in referenced_files(doc) if not p.exists()]
    assert missing == ["Nope.Dockerfile", "missing-dir", "gone.env", "no-such.conf"]
    assert named_volumes(doc) == {"cache"}


def test_service_settings_are_real(path: Path) -> None:
    doc = interpolated(load(path), SHELL_ENV)
    trackers = {n: s for n, s in doc["services"].items() if "build" in s}
    assert len(trackers) == 3
    for name, service in trackers.items():
        environment = service["environment"]
        settings = settings_from_env({k: str(v) for k, v in environment.items()})
        assert settings.api_key.get_secret_value() == SHELL_ENV[API_KEY_VAR], name


def test_the_compose_cli_accepts_the_file(path: Path) -> None:
    """The engine's own check, where it is installed (the checks above stand in elsewhere)."""
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    result = subprocess.run(
        [*cli, "-f", str(path), "config", "-q"],
        cwd=ROOT,
        env={**os.environ, **SHELL_ENV},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
