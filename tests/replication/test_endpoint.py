"""Where Redis is, from the settings: one server, Sentinels or a Cluster, with credentials that
come from the URL, a setting or a file, and a description that never shows the password."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kv_slot_tracker.replication.redis.endpoint import RedisEndpoint
from kv_slot_tracker.settings import Settings

SECRET = "s3cr3t-Pa55"


def endpoint(**values) -> RedisEndpoint:
    return RedisEndpoint.of(Settings(**values))


def test_one_server_with_the_password_in_the_url() -> None:
    e = endpoint(redis_url=f"redis://app:{SECRET}@cache:6380/2")
    assert (e.kind, e.url, e.username, e.password) == ("server", "redis://cache:6380/2", "app",
                                                       SECRET)  # fmt: skip
    assert e.describe() == "redis://app:***@cache:6380/2"
    assert SECRET not in repr(e) and SECRET not in repr(Settings(redis_url=e.url))
    assert not e.tls and e.tls_kwargs() == {}


def test_password_setting_and_file_win_over_the_url(tmp_path: Path) -> None:
    e = endpoint(redis_url="redis://:old@cache:6379/0", redis_password=SECRET)
    assert e.password == SECRET and e.username is None
    assert e.describe() == "redis://:***@cache:6379/0"
    secret_file = tmp_path / "password"
    secret_file.write_text("from-file\n")
    e = endpoint(redis_url="redis://cache", redis_password=SECRET,
                 redis_password_file=str(secret_file), redis_username="svc")  # fmt: skip
    assert (e.username, e.password) == ("svc", "from-file")


def test_tls_from_the_scheme_or_the_setting() -> None:
    e = endpoint(redis_url="rediss://cache:6380/0", redis_tls_ca_file="/ca.pem",
                 redis_tls_cert_file="/c.pem", redis_tls_key_file="/k.pem")  # fmt: skip
    assert e.tls_kwargs() == {"ssl_check_hostname": True, "ssl_ca_certs": "/ca.pem",
                              "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem"}  # fmt: skip
    e = endpoint(redis_url="redis://cache:6380/0", redis_tls=True)
    assert e.url == "rediss://cache:6380/0" and e.tls


def test_sentinels_from_settings_or_url() -> None:
    e = endpoint(redis_sentinels="s1:26379, s2:26380", redis_sentinel_master="main",
                 redis_password=SECRET)  # fmt: skip
    assert (e.kind, e.sentinels, e.master) == ("sentinel", (("s1", 26379), ("s2", 26380)), "main")
    assert e.describe() == "redis+sentinel://:***@s1:26379,s2:26380/main"
    # the Sentinels use the same credentials unless they have their own password
    assert e.sentinel_kwargs(1, 1)["password"] == SECRET
    e = endpoint(redis_url=f"rediss+sentinel://u:{SECRET}@s1:1,s2:2/other",
                 redis_sentinel_password="sentinel-pw")  # fmt: skip
    assert (e.sentinels, e.master, e.username, e.password, e.tls) == (
        (("s1", 1), ("s2", 2)), "other", "u", SECRET, True)  # fmt: skip
    assert e.sentinel_kwargs(1, 1)["password"] == "sentinel-pw"
    assert e.sentinel_kwargs(1, 1)["ssl"] is True
    assert SECRET not in e.describe()
    assert not Settings(redis_sentinels="s1:26379").embedded


def test_cluster_and_bad_values() -> None:
    e = endpoint(redis_url="redis://node1:7000", redis_cluster=True)
    assert e.kind == "cluster" and e.describe() == "cluster redis://node1:7000"
    with pytest.raises(ValidationError):
        Settings(redis_sentinels="no-port")
    with pytest.raises(ValueError, match="not both"):
        endpoint(redis_url="redis://x", redis_sentinels="s:1")
