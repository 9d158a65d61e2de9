"""Settings precedence: config/default.toml < --config file < environment < overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from kv_slot_tracker.settings import (
    DEFAULT_CONFIG_FILE,
    Settings,
    load_settings,
    peer_urls,
    read_toml,
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
    with pytest.raises(ValidationError):
        load_settings(**override)


def test_indexer_peers_are_comma_separated_base_urls() -> None:
    s = load_settings(indexer_peers=" http://a:8091/ ,https://b.example:443,, ")
    assert peer_urls(s.indexer_peers) == ["http://a:8091", "https://b.example:443"]
    assert peer_urls(load_settings().indexer_peers) == []


def test_unknown_key_in_config_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("prot = 1\n")
    with pytest.raises(ValidationError):
        load_settings(path)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "absent.toml")


# -- start-up checks, through the command line ----------------------------------------------


def test_a_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.toml"
    bad.write_text("port = \n")
    result = run_app("--config", str(bad))
    assert result.returncode == 2
    assert f"{bad}: not valid TOML: " in result.stderr
    assert "line 1" in result.stderr


def test_tombstones_shorter_than_the_expiry_are_refused_at_start() -> None:
    with pytest.raises(ValidationError, match="tombstone_ttl_seconds \\(300\\) must be at least"):
        load_settings(expiry_seconds=600)
    assert load_settings(expiry_seconds=600, tombstone_ttl_seconds=600).expiry_seconds == 600
    with pytest.raises(ValidationError, match="expiry_check_seconds \\(20\\) must be at most"):
        load_settings(expiry_seconds=10, tombstone_ttl_seconds=10, expiry_check_seconds=20)
    result = run_app(env={"SLOT_TRACKER_TOMBSTONE_TTL_SECONDS": "10"})
    assert result.returncode == 2
    assert result.stderr.startswith("invalid configuration:\nsettings: tombstone_ttl_seconds (10)")


def test_errors_name_the_setting_without_links_or_secrets() -> None:
    result = run_app(
        env={"SLOT_TRACKER_PORT": "http", "SLOT_TRACKER_REDIS_URL": "http://:s3cret@h"}
    )
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "invalid configuration:"
    assert (
        "port: Input should be a valid integer, unable to parse string as an integer (got 'http')"
        in lines
    )
    assert any(line.startswith("redis_url: must be empty or start with") for line in lines)
    assert "s3cret" not in result.stderr
    assert "errors.pydantic.dev" not in result.stderr


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
