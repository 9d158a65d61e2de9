"""``compose.sentinel.yaml``, checked without a Docker engine: the same service on a Redis
primary with two replicas and three Sentinels, every one of them requiring the password.

* valid against the Compose Specification JSON schema;
* three instances of the local image on distinct host ports whose settings (real names,
  accepted values) name exactly the three Sentinels and the master they monitor, wait for one
  replica (fewer than the replicas there are, so writes go on through a failover) and take the
  API key and the Redis password from the environment (refusing to start without either);
* the Redis nodes and Sentinels require the same password, replicas authenticate to the
  primary with it, the Sentinels to Redis and to each other; their start scripts are valid
  ``sh`` once Compose has turned ``$$`` into ``$``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from kv_slot_tracker.replication.redis.endpoint import RedisEndpoint
from tests.deploy.support import ROOT, settings_from_env
from tests.deploy.test_compose import (
    API_KEY_VAR,
    PASSWORD_VAR,
    SHELL_ENV,
    interpolate,
    schema_errors,
    service_env,
)

FILE = ROOT / "compose.sentinel.yaml"
PASSWORD = SHELL_ENV[PASSWORD_VAR]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(FILE.read_text())


def services(compose: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if n.startswith(prefix)}


def script(service: dict[str, Any]) -> str:
    entry = service["entrypoint"]
    assert entry[:2] == ["sh", "-c"], entry
    return interpolate(entry[2], SHELL_ENV)


def test_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []


def test_instances_know_the_sentinels_and_wait_for_a_replica(compose: dict[str, Any]) -> None:
    sentinels = services(compose, "sentinel-")
    nodes = services(compose, "redis-")
    trackers = {n: s for n, s in compose["services"].items() if "build" in s}
    assert len(sentinels) == 3 and len(nodes) == 3 and len(trackers) == 3
    monitor = re.search(
        r"sentinel monitor (\S+) (\S+) (\d+) (\d+)", script(sentinels["sentinel-1"])
    )
    assert monitor, script(sentinels["sentinel-1"])
    master, first_primary, port, quorum = monitor.groups()
    assert first_primary in nodes and int(port) == 6379 and int(quorum) == 2
    host_ports = set()
    for name, svc in trackers.items():
        settings = settings_from_env(service_env(svc, SHELL_ENV))
        endpoint = RedisEndpoint.of(settings)
        assert endpoint.kind == "sentinel" and endpoint.master == master, name
        assert {h for h, _ in endpoint.sentinels} == set(sentinels), name
        assert {p for _, p in endpoint.sentinels} == {26379}, name
        assert endpoint.password == PASSWORD, name
        assert settings.replication_ack == "redis"
        # fewer than the replicas there are: after a failover, one still confirms
        assert 1 <= settings.replication_ack_replicas < len(nodes) - 1
        assert settings.api_key.get_secret_value() == SHELL_ENV[API_KEY_VAR]
        assert set(svc["depends_on"]) == set(sentinels), name
        (mapping,) = svc["ports"]
        host_ports.add(int(str(mapping).split(":")[0]))
        for var in (API_KEY_VAR, PASSWORD_VAR):
            with pytest.raises(LookupError, match=var):
                service_env(svc, {k: v for k, v in SHELL_ENV.items() if k != var})
    assert host_ports == {8091, 8092, 8093}


def test_every_redis_process_requires_the_password(compose: dict[str, Any]) -> None:
    for name, svc in {**services(compose, "redis-"), **services(compose, "sentinel-")}.items():
        env = service_env(svc, SHELL_ENV)
        assert env["REDISCLI_AUTH"] == PASSWORD, name  # the health check authenticates
        assert env["NODE"] == name == svc["hostname"], name
        with pytest.raises(LookupError, match=PASSWORD_VAR):
            service_env(svc, {})
        text = script(svc)
        # written from REDISCLI_AUTH into the files Redis and the Sentinels load, never on a
        # command line (test_deploy_invariants.py runs these scripts)
        assert "pw=$(printf '%s' \"$REDISCLI_AUTH\" | sed" in text, name
        if name.startswith("redis-"):
            # replicas, and a demoted primary, authenticate to the primary with it
            assert 'printf \'requirepass "%s"\\nmasterauth "%s"\\n\' "$pw" "$pw"' in text
        else:
            for line in ('requirepass \\"$pw\\"', 'sentinel sentinel-pass \\"$pw\\"',
                         'sentinel auth-pass mymaster \\"$pw\\"'):  # fmt: skip
                assert line in text, (name, line)


def test_start_scripts_are_valid_sh(compose: dict[str, Any]) -> None:
    sh = shutil.which("sh")
    assert sh is not None
    for name, svc in {**services(compose, "redis-"), **services(compose, "sentinel-")}.items():
        done = subprocess.run([sh, "-n", "-c", script(svc)], capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stderr)
