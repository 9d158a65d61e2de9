"""Settings precedence: config/default.toml < --config file < environment < overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from app.settings import DEFAULT_CONFIG_FILE, Settings, load_settings, read_toml


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(f"SLOT_TRACKER_{name.upper()}", raising=False)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "site.toml"
    path.write_text('port = 9001\nexpiry_seconds = 600\nnamespace = "from-file"\n')
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
    [{"port": 70000}, {"port": -1}, {"expiry_seconds": 0}, {"redis_url": "http://x"}],
)
def test_invalid_values_are_rejected(override: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        load_settings(**override)


def test_unknown_key_in_config_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("prot = 1\n")
    with pytest.raises(ValidationError):
        load_settings(path)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "absent.toml")
