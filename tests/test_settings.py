"""Settings precedence: the packaged defaults < --config file < environment < overrides; one
validation for ``--check-config`` and start-up, each problem on one line naming its source."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
from pathlib import Path
from unittest import mock

import certifi
import pytest
from pydantic import SecretStr, ValidationError

from kv_slot_tracker import __main__ as command
from kv_slot_tracker.config_sources import DEFAULT_CONFIG_FILE, ConfigError, read_toml
from kv_slot_tracker.settings import (
    WORKERS_TRANSPORT_REDIS_REMOVED,
    Settings,
    load_settings,
    peer_urls,
    unknown_environment,
)
from tests.servers import run_app


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(f"SLOT_TRACKER_{name.upper()}", raising=False)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "site.toml"
    path.write_text(
        'port = 9001\nexpiry_seconds = 600\ntombstone_ttl_seconds = 600\nnamespace = "from-file"\n'
    )
    return path


def test_defaults_come_from_default_toml() -> None:
    settings = load_settings()
    assert settings.host == "127.0.0.1"
    assert settings.port == 8091
    assert settings.expiry_seconds == 300
    assert settings.api_key.get_secret_value() == ""
    assert settings.embedded


def test_class_defaults_mirror_default_toml() -> None:
    from_file = read_toml(DEFAULT_CONFIG_FILE)
    class_defaults = {
        name: field.default.get_secret_value()
        if isinstance(field.default, SecretStr)
        else field.default
        for name, field in Settings.model_fields.items()
    }
    assert from_file == class_defaults


def test_config_file_overrides_defaults(config_file: Path) -> None:
    settings = load_settings(config_file)
    assert settings.port == 9001
    assert settings.expiry_seconds == 600
    assert settings.namespace == "from-file"
    assert settings.host == "127.0.0.1"  # untouched keys keep the default


def test_env_overrides_config_file(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOT_TRACKER_PORT", "9002")
    monkeypatch.setenv("SLOT_TRACKER_NAMESPACE", "from-env")
    settings = load_settings(config_file)
    assert settings.port == 9002
    assert settings.namespace == "from-env"
    assert settings.expiry_seconds == 600  # not in the environment: the file still wins


def test_overrides_beat_env(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOT_TRACKER_PORT", "9002")
    settings = load_settings(config_file, port=9003, host=None)
    assert settings.port == 9003
    assert settings.host == "127.0.0.1"  # a None override means "not given"


def test_api_key_is_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOT_TRACKER_API_KEY", "s3cret")
    settings = load_settings()
    assert settings.api_key.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)
    assert "s3cret" not in str(settings)


@pytest.mark.parametrize(
    "override",
    [{"port": 70000}, {"port": -1}, {"expiry_seconds": 0}, {"redis_url": "http://x"},
     {"indexer_peers": "ftp://a:1"}, {"indexer_peers": "http://"},
     {"indexer_peers": "http://user:pw@a:1"}, {"indexer_peers": "a:8091"},
     {"indexer_peers": ",".join(f"http://h{i}:1" for i in range(17))},
     {"indexer_peers_timeout_seconds": 0}, {"kv_events_silent_seconds": 0}],
)  # fmt: skip
def test_invalid_values_are_rejected(override: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        load_settings(**override)


def test_indexer_peers_are_comma_separated_base_urls() -> None:
    s = load_settings(indexer_peers=" http://a:8091/ ,https://b.example:443,, ")
    assert peer_urls(s.indexer_peers) == ["http://a:8091", "https://b.example:443"]
    assert peer_urls(load_settings().indexer_peers) == []


def test_unknown_key_in_config_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("prot = 1\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert str(caught.value) == f"{path}:1: prot: no such setting (did you mean port?)"
    with pytest.raises(ValidationError):  # built directly, a key that names nothing is refused
        Settings(prot=1)  # type: ignore[call-arg]


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(tmp_path / "absent.toml")
    assert str(caught.value) == (
        f"--config: cannot read {tmp_path / 'absent.toml'}: No such file or directory"
    )


def test_the_defaults_are_package_data() -> None:
    """Read through importlib.resources from inside the package: what a wheel ships."""
    assert DEFAULT_CONFIG_FILE.name == "default.toml"
    path = Path(str(DEFAULT_CONFIG_FILE))
    assert path.parent.parent == Path(__file__).resolve().parents[1] / "kv_slot_tracker"


# -- start-up checks, through the command line ----------------------------------------------


def test_a_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.toml"
    bad.write_text("port = \n")
    result = run_app("--config", str(bad))
    assert result.returncode == 2
    assert f"{bad}: not valid TOML: " in result.stderr
    assert "line 1" in result.stderr


def test_tombstones_shorter_than_the_expiry_are_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="tombstone_ttl_seconds \\(300\\) must be at least"):
        load_settings(expiry_seconds=600)
    assert load_settings(expiry_seconds=600, tombstone_ttl_seconds=600).expiry_seconds == 600
    with pytest.raises(ConfigError, match="expiry_check_seconds \\(20\\) must be at most"):
        load_settings(expiry_seconds=10, tombstone_ttl_seconds=10, expiry_check_seconds=20)
    result = run_app(env={"SLOT_TRACKER_TOMBSTONE_TTL_SECONDS": "10"})
    assert result.returncode == 2
    assert result.stderr.startswith(
        "invalid configuration:\nSLOT_TRACKER_TOMBSTONE_TTL_SECONDS, expiry_seconds (default): "
        "tombstone_ttl_seconds (10) must be at least expiry_seconds (300)"
    )


def test_errors_name_the_variable_without_links_or_secrets() -> None:
    result = run_app(
        env={"SLOT_TRACKER_PORT": "http", "SLOT_TRACKER_REDIS_URL": "http://:s3cret@h"}
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "invalid configuration:"
    assert (
        "SLOT_TRACKER_PORT: Input should be a valid integer, unable to parse string as an integer "
        "(got 'http')" in lines
    )
    assert any(
        line.startswith("SLOT_TRACKER_REDIS_URL: must be empty or start with") for line in lines
    )
    assert len(lines) == 3
    assert "s3cret" not in result.stderr
    assert "errors.pydantic.dev" not in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_slot_tracker_variable_is_named_with_the_closest_setting() -> None:
    assert unknown_environment(
        {"SLOT_TRACKER_PROT": "1", "SLOT_TRACKER_PORT": "2", "PATH": "/"}
    ) == [
        "SLOT_TRACKER_PROT is set but names no setting; it is ignored "
        "(did you mean SLOT_TRACKER_PORT?)"
    ]
    assert unknown_environment({"SLOT_TRACKER_ZZZ_QQQ": "1"}) == [
        "SLOT_TRACKER_ZZZ_QQQ is set but names no setting; it is ignored"
    ]
    result = run_app("--version", env={"SLOT_TRACKER_PROT": "1"})
    assert result.returncode == 0  # --version exits before the settings are read


# -- one validation: what --check-config passes, start-up runs --------------------------------


def problem_lines(checked: tuple[int, str], started: tuple[int, str]) -> str:
    """Both refused the same way (exit 2, the same lines, no traceback): the problem lines."""
    assert (checked[0], started[0]) == (2, 2), (checked[1], started[1])
    assert checked[1] == started[1]
    assert "Traceback" not in checked[1]
    head, _, problems = checked[1].partition("\n")
    assert head == "invalid configuration:"
    return problems.rstrip("\n")


def run_main(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The command's ``main(args)`` in this process, with ``env`` as the only SLOT_TRACKER_*
    variables: its exit code and standard error. A start that gets past the validation fails
    at once (the app is never made, no process started) instead of serving."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("SLOT_TRACKER_")}
    for name in saved:
        del os.environ[name]
    os.environ.update(env or {})
    err = io.StringIO()
    started = AssertionError("the configuration was accepted: the service would start")
    try:
        with (
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            mock.patch.object(command, "create_app", side_effect=started),
            mock.patch.object(command, "supervise", side_effect=started),
        ):
            try:
                code = command.main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        for name in [k for k in os.environ if k.startswith("SLOT_TRACKER_")]:
            del os.environ[name]
        os.environ.update(saved)
    return code, err.getvalue()


def check_and_start(*args: str, env: dict[str, str] | None = None) -> str:
    """Run ``--check-config`` and a start with the same settings, through the command's
    ``main`` in this process; both must refuse them the same way (exit 2, the same lines, no
    traceback). Returns the problem lines. (``test_the_command_line_refuses_as_its_check_does``
    runs the real command line, twice, for one case.)"""
    return problem_lines(run_main(*args, "--check-config", env=env), run_main(*args, env=env))


def check_and_start_command(*args: str, env: dict[str, str] | None = None) -> str:
    """``check_and_start`` through ``python -m kv_slot_tracker`` itself (two processes)."""
    checked = run_app(*args, "--check-config", env=env)
    started = run_app(*args, env=env)  # refused before it listens (else: the timeout fails it)
    return problem_lines((checked.returncode, checked.stderr), (started.returncode, started.stderr))


def test_the_command_line_refuses_as_its_check_does() -> None:
    args = ("--redis-url", "redis://127.0.0.1:7000", "--redis-cluster", "true",
            "--replication-ack", "redis", "--replication-ack-replicas", "1")  # fmt: skip
    problems = check_and_start_command(*args)
    assert problems == check_and_start(*args)
    assert problems.startswith("--replication-ack-replicas, --redis-cluster: ")


def test_replicas_with_a_cluster_are_refused_by_the_check_too() -> None:
    problems = check_and_start(
        "--redis-url", "redis://127.0.0.1:7000", "--redis-cluster", "true",
        "--replication-ack", "redis", "--replication-ack-replicas", "1",
    )  # fmt: skip
    assert problems == (
        "--replication-ack-replicas, --redis-cluster: replication_ack_replicas needs one server "
        "or Sentinel, not Cluster"
    )


def test_a_redis_url_and_sentinels_together_are_refused() -> None:
    problems = check_and_start(
        "--redis-url", "redis://127.0.0.1:6379", env={"SLOT_TRACKER_REDIS_SENTINELS": "s:26379"}
    )
    assert problems == (
        "--redis-url, SLOT_TRACKER_REDIS_SENTINELS: set either redis_url or redis_sentinels, "
        "not both"
    )


def test_a_missing_ca_file_is_named_before_start(tmp_path: Path) -> None:
    missing = tmp_path / "ca.pem"
    problems = check_and_start(
        "--redis-url", "rediss://127.0.0.1:6391", "--redis-tls-ca-file", str(missing)
    )
    assert problems == f"--redis-tls-ca-file: cannot read {missing}: No such file or directory"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    problems = check_and_start(
        "--redis-url", "rediss://127.0.0.1:6391", "--redis-tls-ca-file", str(not_pem)
    )
    assert problems.startswith(f"--redis-tls-ca-file: cannot load {not_pem}: ")
    # TLS material given while TLS is off would be ignored without a word
    problems = check_and_start(
        "--redis-url", "redis://127.0.0.1:6391", "--redis-tls-ca-file", certifi.where()
    )
    assert problems == (
        "--redis-tls-ca-file, redis_tls (default): redis_tls_ca_file is set but TLS is off: "
        "set redis_tls = true or use a rediss:// URL"
    )
    settings = load_settings(redis_url="rediss://127.0.0.1:6391", redis_tls_ca_file=certifi.where())
    assert settings.redis_tls_ca_file == certifi.where()


def test_a_client_certificate_must_load_with_its_key(tmp_path: Path) -> None:
    from tests.ha.topology import make_certificates

    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed to make test certificates", pytrace=False)
    certs = make_certificates(tmp_path)
    ok = load_settings(redis_url="rediss://h:1", redis_tls_cert_file=str(certs["client_cert"]),
                       redis_tls_key_file=str(certs["client_key"]))  # fmt: skip
    assert ok.redis_tls_key_file == str(certs["client_key"])
    with pytest.raises(ConfigError) as caught:  # the key of another certificate
        load_settings(redis_url="rediss://h:1", redis_tls_cert_file=str(certs["client_cert"]),
                      redis_tls_key_file=str(certs["server_key"]))  # fmt: skip
    (problem,) = caught.value.problems
    assert problem.where == "--redis-tls-cert-file, --redis-tls-key-file"
    assert problem.message.startswith(f"cannot load {certs['client_cert']} and ")
    with pytest.raises(ConfigError, match="redis_tls_key_file needs redis_tls_cert_file"):
        load_settings(redis_url="rediss://h:1", redis_tls_key_file=str(certs["client_key"]))


def test_a_password_file_must_be_readable_and_not_empty(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    problems = check_and_start(
        "--redis-url",
        "redis://127.0.0.1:6379",
        env={"SLOT_TRACKER_REDIS_PASSWORD_FILE": str(empty)},
    )
    assert problems == f"SLOT_TRACKER_REDIS_PASSWORD_FILE: {empty}: the first line is empty"
    with pytest.raises(ConfigError, match="cannot read /nonexistent/pw: No such file"):
        load_settings(redis_url="redis://h", redis_password_file="/nonexistent/pw")


def test_a_toml_typo_names_the_file_and_line_and_the_closest_key(tmp_path: Path) -> None:
    path = tmp_path / "site.toml"
    path.write_text('port = 9000\n\nredis_ulr = "redis://x"\nport_ = 1\n')
    problems = check_and_start("--config", str(path))
    assert problems.splitlines() == [
        f"{path}:3: redis_ulr: no such setting (did you mean redis_url?)",
        f"{path}:4: port_: no such setting (did you mean port?)",
    ]
    path.write_text('port = "x"\n')
    problems = check_and_start("--config", str(path))
    assert problems == (
        f"{path}:1: port: Input should be a valid integer, unable to parse string as an integer "
        "(got 'x')"
    )


def test_a_bad_variable_is_named_by_its_name() -> None:
    problems = check_and_start(env={"SLOT_TRACKER_PORT": "abc"})
    assert problems == (
        "SLOT_TRACKER_PORT: Input should be a valid integer, unable to parse string as an integer "
        "(got 'abc')"
    )


def test_an_unknown_flag_gets_the_closest_flag_and_every_problem_is_listed() -> None:
    problems = check_and_start("--prot", "9000", "--log-level", "inf")
    assert problems.splitlines() == [
        "--prot: no such flag (did you mean --port?)",
        "--log-level: Input should be 'critical', 'error', 'warning', 'info', 'debug' or 'trace' "
        "(got 'inf') (did you mean 'info'?)",
    ]


def test_a_cluster_needs_a_node_url_and_replicas_need_durable_acks() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(redis_cluster=True, replication_ack_replicas=1)
    assert [str(p) for p in caught.value.problems] == [
        "--redis-cluster: redis_cluster needs redis_url naming a Cluster node",
        "--replication-ack-replicas, --redis-cluster: replication_ack_replicas needs one server "
        "or Sentinel, not Cluster",
        "--replication-ack-replicas, replication_ack (default): replication_ack_replicas needs "
        'replication_ack = "redis"',
    ]
    with pytest.raises(ConfigError, match="not Sentinels"):
        load_settings(redis_cluster=True, redis_url="redis+sentinel://s:1/m")
    with pytest.raises(ConfigError, match="expected Sentinels as host:port, got 's:x'"):
        load_settings(redis_url="redis+sentinel://s:x/m")
    with pytest.raises(ConfigError, match="names no Sentinel"):
        load_settings(redis_url="redis+sentinel:///m")
    with pytest.raises(ConfigError, match="redis_url: not a valid URL"):
        load_settings(redis_url="redis://h:port/0", labels={"redis_url": "redis_url"})


def test_too_many_workers_for_the_instance_id_are_refused_by_the_check() -> None:
    problems = check_and_start("--instance-id", str(2**64 - 1), "--workers", "2")
    assert problems == (
        "--instance-id, --workers: instance_id + 1 (the workers after the first) exceeds a u64"
    )


def test_the_removed_private_redis_transport_is_refused_with_what_to_use_instead() -> None:
    problems = check_and_start("--workers", "2", "--workers-transport", "redis")
    assert problems == f"--workers-transport: {WORKERS_TRANSPORT_REDIS_REMOVED} (got 'redis')"
    assert 'use workers_transport = "local" (the default)' in problems


def test_the_removed_transport_in_a_file_or_variable_is_named_where_it_was_set(
    tmp_path: Path,
) -> None:
    path = tmp_path / "site.toml"
    path.write_text('workers = 2\nworkers_transport = "redis"\n')
    problems = check_and_start("--config", str(path))
    assert (
        problems == f"{path}:2: workers_transport: {WORKERS_TRANSPORT_REDIS_REMOVED} (got 'redis')"
    )
    problems = check_and_start(env={"SLOT_TRACKER_WORKERS_TRANSPORT": "redis"})
    assert problems == (
        f"SLOT_TRACKER_WORKERS_TRANSPORT: {WORKERS_TRANSPORT_REDIS_REMOVED} (got 'redis')"
    )


def test_discovery_without_the_kubernetes_client_is_refused_by_the_check(tmp_path: Path) -> None:
    """The check runs what start-up runs: a missing optional client is found by both."""
    blocker = tmp_path / "kubernetes_asyncio"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('not installed here')\n")
    problems = check_and_start_command(  # a process of its own: the client blocked there
        "--discovery-kubernetes-service", "vllm", env={"PYTHONPATH": str(tmp_path)}
    )
    assert problems.startswith("--discovery-kubernetes-service: ")
    assert "kv-slot-tracker[kubernetes]" in problems


def test_no_traceback_for_a_port_in_use() -> None:
    """A setting that is valid but cannot be served (a port taken) ends with a message."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_app("--port", str(port))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "address already in use" in result.stderr.lower()
