"""The command line: every setting is a flag, documented from the packaged defaults; secrets come
from files; ``--check-config`` shows what the service would run with; ``--version``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kv_slot_tracker import __version__ as app_version
from kv_slot_tracker import cli
from kv_slot_tracker.config_sources import ConfigError
from kv_slot_tracker.settings import Settings, load_settings
from tests.servers import run_app

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_but_the_secrets_is_a_documented_flag() -> None:
    parser = cli.build_parser()
    flags = {a.dest: a for a in parser._actions}  # noqa: SLF001 - reading what argparse built
    helps = cli.setting_help()
    assert {"api_key"} <= cli.SECRETS
    for name in Settings.model_fields:
        if name in cli.SECRETS:
            assert name not in flags
            continue
        action = flags[name]
        assert "--" + name.replace("_", "-") in action.option_strings
        assert helps[name] and action.help.startswith(helps[name]), name
    assert "--selection-cache-ttl-secs" in flags["selection_cache_ttl_seconds"].option_strings


def test_flags_override_the_environment_and_take_the_settings_checks(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k-from-file\n")
    args = cli.parse_args(
        ["--port", "9005", "--http-direct", "false", "--router-ttl-secs", "30.5",
         "--api-key-file", str(key)]
    )  # fmt: skip
    settings = cli.load(args)
    assert settings.port == 9005 and settings.http_direct is False
    assert settings.router_ttl_seconds == 30.5
    assert settings.api_key.get_secret_value() == "k-from-file"
    assert load_settings(None, **cli.overrides(cli.parse_args([]))).port == 8091
    with pytest.raises(ConfigError) as caught:
        cli.parse_args(["--prot", "1"])
    assert str(caught.value) == "--prot: no such flag (did you mean --port?)"


def test_check_config_prints_the_effective_settings_with_secrets_masked(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    result = run_app(
        "--check-config", "--api-key-file", str(key), "--port", "9100",
        env={"SLOT_TRACKER_REDIS_URL": "redis://user:pw@redis:6379/0",
             "SLOT_TRACKER_EXPIRY_SECONDS": "600", "SLOT_TRACKER_TOMBSTONE_TTL_SECONDS": "600"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ['host = "127.0.0.1"', "port = 9100"]
    assert 'api_key = "***"' in lines
    assert 'redis_url = "redis://user:***@redis:6379/0"' in lines
    assert "expiry_seconds = 600" in lines
    assert len(lines) == len(Settings.model_fields)
    assert "s3cret" not in result.stdout + result.stderr and ":pw@" not in result.stdout


def test_check_config_fails_on_an_invalid_setting(tmp_path: Path) -> None:
    result = run_app("--check-config", "--port", "70000")
    assert result.returncode == 2
    assert result.stderr == (
        "invalid configuration:\n"
        "--port: Input should be less than or equal to 65535 (got '70000')\n"
    )
    missing = run_app("--check-config", "--api-key-file", "/nonexistent/key")
    assert missing.returncode == 2
    assert missing.stderr == (
        "invalid configuration:\n"
        "--api-key-file: cannot read /nonexistent/key: No such file or directory\n"
    )
    empty = tmp_path / "key"
    empty.write_text("\n")  # a key file without a key would leave the service open
    started = run_app("--api-key-file", str(empty))
    assert started.returncode == 2
    assert f"--api-key-file: {empty}: the first line is empty" in started.stderr


def test_version_is_the_package_version() -> None:
    result = run_app("--version", env={"SLOT_TRACKER_PORT": "not read"})
    assert (result.returncode, result.stdout) == (0, f"kv-slot-tracker {app_version}\n")


def test_start_up_says_what_the_instance_is(tmp_path: Path) -> None:
    """One INFO line: version, address, docs, mode and whether a key is needed."""
    from tests.ports import free_port

    port = free_port()
    key = tmp_path / "key"
    key.write_text("k\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLOT_TRACKER_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kv_slot_tracker", "--port", str(port), "--api-key-file", str(key)],
        env=clean,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        seen = []
        for line in proc.stderr:  # type: ignore[union-attr]
            seen.append(line)
            if "Application startup complete" in line or len(seen) > 50:
                break
    finally:
        proc.terminate()
        proc.wait(10)
    summary = [line for line in seen if "kv-slot-tracker" in line and " on http://" in line]
    # each line starts with its time, ISO 8601 UTC with milliseconds (tests/test_log_format.py)
    stamps = [line.split(" ", 1)[0] for line in summary]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", t) for t in stamps), seen
    summary = [line.split(" ", 1)[1] for line in summary]
    assert summary == [
        f"INFO:     kv-slot-tracker {app_version} on http://127.0.0.1:{port} "
        f"(docs http://127.0.0.1:{port}/docs): embedded mode (one instance, state in this "
        "process, no Redis); an API key is required\n"
    ], seen


def test_the_console_script_is_the_same_command(tmp_path: Path) -> None:
    """``kv-slot-tracker`` (installed with the package) runs what ``python -m kv_slot_tracker``
    runs: the same parser, the same settings checks."""
    script = Path(sys.executable).with_name("kv-slot-tracker")
    assert script.exists(), "the package declares the console script in [project.scripts]"
    done = subprocess.run(
        [str(script), "--check-config", "--port", "9101"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == "port = 9101"
    usage = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.stdout.startswith("usage: kv-slot-tracker [--config FILE]")
    bad = subprocess.run(
        [str(script), "--check-config", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        bad.returncode == 2 and "--port: Input should be less than or equal to 65535" in bad.stderr
    )
