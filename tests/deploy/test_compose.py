"""``compose.yaml``, checked without a Docker engine.

* it is valid against the Compose Specification JSON schema (the copy ``check-jsonschema``
  bundles), and the validator does refuse a broken file;
* three instances of the image built from the Dockerfile, one distinct host port each, all on
  the same Redis and namespace, an API key taken from the environment, settings the service
  really has with values it accepts;
* health checks: the instances' command, run as it is, passes against a live instance and fails
  against a closed port; Redis is pinged and the instances wait for it to be healthy;
* only variable syntax docker-compose 1.x understands too;
* ``docker compose config -q`` (or ``docker-compose config -q``) accepts it when the CLI is
  installed (that needs no daemon); skipped otherwise, where ``test_compose_offline.py`` checks
  what it would (interpolation, dependencies, ports, referenced files).
"""

from __future__ import annotations

import copy
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml

from kv_slot_tracker.settings import Settings
from tests.deploy.support import COMPOSE, ROOT, settings_from_env
from tests.ports import free_port
from tests.servers import live_server

APP_PORT = Settings.model_fields["port"].default  # what the image listens on (EXPOSE 8091)
API_KEY_VAR = "SLOT_TRACKER_API_KEY"
PASSWORD_VAR = "SLOT_TRACKER_REDIS_PASSWORD"
SHELL_ENV = {API_KEY_VAR: "a-key-from-the-shell", PASSWORD_VAR: "a-password-from-the-shell"}


def compose_schema() -> dict[str, Any]:
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads((vendor / "compose-spec.json").read_text())


def schema_errors(document: Any) -> list[str]:
    schema = compose_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    validator = validator_cls(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(document)
    ]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def tracker_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if "build" in svc}


# --- Interpolation, as Compose does it for the forms this file may use -------------------------

VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:[-?])(?P<arg>[^}]*))?\}"
)


def interpolate(value: str, env: dict[str, str]) -> str:
    def replace(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group("name", "op", "arg")
        if env.get(name):
            return env[name]
        if op == ":-":
            return arg
        if op == ":?":
            raise LookupError(f"{name}: {arg}")
        return ""

    return VARIABLE.sub(replace, value)


def service_env(service: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    environment = service["environment"]
    assert isinstance(environment, dict), "environment as a mapping, one variable a line"
    return {k: interpolate(str(v), env) for k, v in environment.items()}


# --- Schema ---------------------------------------------------------------------------------


def test_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []


@pytest.mark.parametrize(
    "breakage",
    [
        lambda c: c["services"]["redis"].update(healthcheck={"tset": ["CMD", "redis-cli", "ping"]}),
        lambda c: c["services"]["slot-tracker-1"].update(ports="8091:8091"),
        lambda c: c["services"]["slot-tracker-2"]["depends_on"]["redis"].update(condition="up"),
        lambda c: c.update(servies={}),
    ],
    ids=["misspelt-key", "ports-not-a-list", "unknown-condition", "unknown-top-level-key"],
)
def test_the_schema_check_refuses_a_broken_file(compose: dict[str, Any], breakage) -> None:
    broken = copy.deepcopy(compose)
    breakage(broken)
    assert schema_errors(broken), "the validator accepted a broken file"


def test_no_keys_older_compose_versions_refuse(compose: dict[str, Any]) -> None:
    # `name` needs Compose v2.3.3+; `version` is obsolete (v2 warns about it).
    assert set(compose) - {k for k in compose if k.startswith("x-")} == {"services"}


def test_only_portable_variable_syntax() -> None:
    text = COMPOSE.read_text()
    uses = [m.group(0) for m in re.finditer(r"\$\{[^}]*\}", text)]
    assert uses, "the file takes nothing from the environment"
    for use in uses:
        m = VARIABLE.fullmatch(use)
        assert m, f"{use}: only ${{VAR}}, ${{VAR:-default}} and ${{VAR:?message}}"
        assert "$" not in (m.group("arg") or ""), use


# --- Instances ------------------------------------------------------------------------------


def test_three_instances_of_the_local_image_on_distinct_host_ports(
    compose: dict[str, Any],
) -> None:
    services = tracker_services(compose)
    assert len(services) == 3, sorted(services)
    host_ports = []
    for name, svc in services.items():
        assert svc["build"] in (".", {"context": "."}), (name, svc["build"])
        assert (ROOT / "Dockerfile").is_file()
        (mapping,) = svc["ports"]
        host, container = str(mapping).split(":")
        assert int(container) == APP_PORT, (name, mapping)
        host_ports.append(int(host))
    assert sorted(host_ports) == [8091, 8092, 8093]
    assert len({svc["image"] for svc in services.values()}) == 1, "one image for all three"


def test_instances_share_redis_and_namespace_with_valid_settings(
    compose: dict[str, Any],
) -> None:
    seen = set()
    for name, svc in tracker_services(compose).items():
        variables = service_env(svc, SHELL_ENV)
        settings = settings_from_env(variables)  # real setting names, accepted values
        assert settings.api_key.get_secret_value() == "a-key-from-the-shell", name
        assert settings.redis_password.get_secret_value() == "a-password-from-the-shell", name
        assert settings.redis_url == "redis://redis:6379/0", name
        seen.add((settings.redis_url, settings.namespace, settings.instance_id))
    (shared,) = seen  # same Redis, same namespace; instance ids left random (0)
    assert shared[2] == 0
    assert "redis" in compose["services"]


def test_api_key_and_redis_password_must_come_from_the_environment(
    compose: dict[str, Any],
) -> None:
    for name, svc in tracker_services(compose).items():
        for var in (API_KEY_VAR, PASSWORD_VAR):
            raw = str(svc["environment"][var])
            assert re.fullmatch(r"\$\{" + var + r":\?[^}]+\}", raw), (name, raw)
            with pytest.raises(LookupError, match=var):
                service_env(svc, {k: v for k, v in SHELL_ENV.items() if k != var})


def redis_start(compose: dict[str, Any]) -> str:
    """The script the Redis container starts with (run for real in test_deploy_invariants.py)."""
    entrypoint = compose["services"]["redis"]["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"], entrypoint
    return interpolate(entrypoint[2], SHELL_ENV)


def test_redis_requires_the_same_password(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    # written from REDISCLI_AUTH into the file redis-server loads, never on its command line
    assert 'printf \'requirepass "%s"' in redis_start(compose)
    assert '"$REDISCLI_AUTH"' in redis_start(compose)
    # the health check's redis-cli authenticates through REDISCLI_AUTH
    assert service_env(redis, SHELL_ENV)["REDISCLI_AUTH"] == SHELL_ENV[PASSWORD_VAR]


def test_instances_wait_for_a_healthy_redis(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    assert redis["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -qx PONG"]
    # no persistence: `--save ""` and `--appendonly no`
    assert '--save "" --appendonly no' in redis_start(compose)
    for name, svc in tracker_services(compose).items():
        assert svc["depends_on"] == {"redis": {"condition": "service_healthy"}}, name


def test_instances_are_locked_down(compose: dict[str, Any]) -> None:
    for name, svc in tracker_services(compose).items():
        assert svc["read_only"] is True, name
        assert svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name


# --- Health check ---------------------------------------------------------------------------


def healthcheck_argv(compose: dict[str, Any]) -> list[str]:
    tests = {json.dumps(svc["healthcheck"]["test"]) for svc in tracker_services(compose).values()}
    assert len(tests) == 1, "the three instances check their health the same way"
    argv = json.loads(tests.pop())
    assert argv[0] == "CMD", "exec form: the image has no shell tools to rely on"
    assert argv[1] == "python", "the image has python and no curl"
    assert f"http://127.0.0.1:{APP_PORT}/health" in argv[-1]
    return argv[1:]


def run_healthcheck(argv: list[str], port: int) -> subprocess.CompletedProcess:
    code = argv[-1].replace(f":{APP_PORT}/", f":{port}/")
    return subprocess.run(
        [sys.executable, *argv[1:-1], code], capture_output=True, text=True, timeout=10
    )


@pytest.fixture(scope="module")
def live_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    # /health must stay open although the instances run with an API key
    with live_server(tmp_path_factory.mktemp("server"), SLOT_TRACKER_API_KEY="k") as url:
        yield int(url.rsplit(":", 1)[1])


def test_healthcheck_passes_on_a_live_instance(compose: dict[str, Any], live_port: int) -> None:
    result = run_healthcheck(healthcheck_argv(compose), live_port)
    assert result.returncode == 0, result.stderr


def test_healthcheck_fails_without_a_server(compose: dict[str, Any]) -> None:
    assert run_healthcheck(healthcheck_argv(compose), free_port()).returncode != 0


# --- The real CLI, when installed ------------------------------------------------------------


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_compose_cli_accepts_the_file() -> None:
    cli = compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    env = {**os.environ, API_KEY_VAR: "k", PASSWORD_VAR: "p"}
    result = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # and without the key it refuses to start
    env.pop(API_KEY_VAR)
    result = subprocess.run(
        [*cli, "-f", str(COMPOSE), "config", "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert API_KEY_VAR in result.stderr


def test_redis_is_bounded_and_never_evicts_the_stream(compose: dict[str, Any]) -> None:
    assert "--maxmemory 768mb --maxmemory-policy noeviction" in redis_start(compose)
    sentinel = (ROOT / "compose.sentinel.yaml").read_text()
    assert "--maxmemory 768mb" in sentinel and "--maxmemory-policy noeviction" in sentinel
