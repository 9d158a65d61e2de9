"""Redis over TLS with an ACL user: a ``redis-server`` started here with a TLS port only (no
plain one), client certificates required, the default user off and one user restricted to the
namespace's keys; certificates made here with ``openssl``. Two ``python -m kv_slot_tracker`` processes
replicate through it with the password from a file; the password shows in no log line (at
debug level) and not in ``GET /replication``; a wrong password keeps an instance not ready.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

import httpx
import pytest

from kv_slot_tracker.settings import Settings
from tests.e2e.servers import Fleet
from tests.ha.conftest import redis_binary
from tests.ha.topology import MASTER, RedisProcess, SentinelGroup, make_certificates, wait_for
from tests.replication.apps import register, running_apps, until

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

PASSWORD = "tls-acl-Secr3t-value"


def start_tls_server(root: Path, namespace: str) -> tuple[RedisProcess, dict[str, Path]]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates with")
    certs = make_certificates(root)
    server = RedisProcess(redis_binary(), "redis-tls", root)
    server.port_args = ["--port", "0", "--tls-port", str(server.port)]
    server.conf = (
        f"tls-cert-file {certs['server_cert']}\n"
        f"tls-key-file {certs['server_key']}\n"
        f"tls-ca-cert-file {certs['ca']}\n"
        "tls-auth-clients yes\n"
        "user default off\n"
        f"user app on >{PASSWORD} ~{{{namespace}}}:* +@all -@admin -@dangerous +info\n"
    )
    server.args = []
    server.start()
    # until it answers over TLS as the ACL user, or has exited: a redis-server built without
    # TLS refuses the tls-* directives at start (skip); any other exit fails
    tls = {"ssl": True, "ssl_ca_certs": str(certs["ca"]), "ssl_certfile": str(certs["client_cert"]),
           "ssl_keyfile": str(certs["client_key"]), "username": "app", "password": PASSWORD}  # fmt: skip
    try:
        server.wait_up(timeout=30, **tls)
    except RuntimeError:
        log = server.log_tail()
        if "Bad directive" in log and "tls" in log:
            pytest.skip(f"this redis-server has no TLS support: {log}")
        raise AssertionError(f"redis-server with TLS did not start: {log}") from None
    return server, certs


def test_two_instances_replicate_over_tls_as_an_acl_user(
    tmp_path: Path, fleets: list[Fleet]
) -> None:
    namespace = f"tls-{uuid.uuid4().hex[:10]}"
    server, certs = start_tls_server(tmp_path, namespace)
    try:
        secret = tmp_path / "redis-password"
        secret.write_text(PASSWORD + "\n")
        url = f"rediss://127.0.0.1:{server.port}/0"
        env = {"REDIS_USERNAME": "app", "REDIS_PASSWORD_FILE": str(secret),
               "REDIS_TLS_CA_FILE": str(certs["ca"]),
               "REDIS_TLS_CERT_FILE": str(certs["client_cert"]),
               "REDIS_TLS_KEY_FILE": str(certs["client_key"]),
               "LOG_LEVEL": "debug", "REPLICATION_ACK": "redis"}  # fmt: skip
        fleet = Fleet(url, namespace, tmp_path / "logs", env=env)
        fleets.append(fleet)
        a, b = fleet.spawn(2)
        body = {"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        r = httpx.post(a.url + "/register", json=body)
        assert r.status_code == 201, r.text
        add = {"model_name": "m", "request_id": "r1", "worker_id": 1, "dp_rank": 0,
               "sequence_hashes": [1, 2, 3]}  # fmt: skip
        assert httpx.post(a.url + "/add", json=add).status_code == 201  # in the stream

        def on_b() -> bool:
            rows = httpx.get(b.url + "/loads").json()
            return sum(r["active_requests"] for r in rows) == 1

        wait_for(on_b, 10, "the request on b")
        for s in (a, b):
            raw = httpx.get(s.url + "/replication").text
            assert PASSWORD not in raw
            status = s.status()
            assert status["redis"] == f"rediss://app:***@127.0.0.1:{server.port}/0", status
            assert status["connected"] and status["ready"], status

        # a wrong password: the instance starts, says why it is not ready, never shows it
        wrong = "Wr0ng-pa55word-value"
        (c,) = fleet.spawn(1, wait=False, REDIS_PASSWORD_FILE="", REDIS_PASSWORD=wrong)

        def refused() -> str | None:  # 503, and the reason once the login was refused
            try:
                r = httpx.get(c.url + "/ready")
            except httpx.TransportError:
                return None  # not listening yet
            reason = r.json()["reason"] if r.status_code == 503 else None
            return reason if reason and "Redis unreachable" in reason else None

        wait_for(refused, 30, "c to answer /ready 503: Redis unreachable")
        assert wrong not in httpx.get(c.url + "/replication").text
        for s in (a, b, c):
            log = s.log_path.read_text()
            assert PASSWORD not in log and wrong not in log, s.log_tail()
        # the refused login was logged, and what was logged is the server's refusal alone
        assert "invalid username-password pair" in c.log_path.read_text(), c.log_tail()
    finally:
        server.kill()


async def test_sentinels_and_redis_over_tls_with_a_password(tmp_path: Path) -> None:
    """The Sentinel shape of a managed service: Redis nodes and Sentinels on TLS ports only,
    every one requiring the password; two instances follow a switch-over through them."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates with")
    certs = make_certificates(tmp_path)
    group = SentinelGroup(redis_binary(), password=PASSWORD, certs=certs)
    try:
        group.start()
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in group.sentinels)
        settings = Settings(redis_sentinels=hosts, redis_password=PASSWORD, redis_tls=True,
                            redis_tls_ca_file=str(certs["ca"]),
                            namespace=f"tls-s-{uuid.uuid4().hex[:8]}", replication_ack="redis",
                            snapshot_interval_seconds=3600)  # fmt: skip
        async with running_apps(settings, settings) as (a, b):
            await register(a, [b])
            assert await a.add("before") == 201
            old = group.primary_port()
            with group.sentinels[0].client() as c:
                c.execute_command("SENTINEL FAILOVER", MASTER)
            wait_for(lambda: group.primary_port() != old, 30, "the switch-over")
            for _ in range(200):  # a client retrying 503s while the instances follow
                status = await b.add("after")
                if status in (201, 409):
                    break
                assert status == 503, status
                await asyncio.sleep(0.05)

            async def both() -> bool:
                counts = [sum(r["active_requests"] for r in await x.loads()) for x in (a, b)]
                return counts == [2, 2]

            await until(both, 15, "both requests on both instances")
            for x in (a, b):
                raw = (await x.client.get("/replication")).text
                assert PASSWORD not in raw
                assert f'"redis":"rediss+sentinel://:***@{hosts}/mymaster"' in raw, raw
    finally:
        group.close()
