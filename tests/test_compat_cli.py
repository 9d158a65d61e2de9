"""A Dynamo user's command line: every flag of ``python -m dynamo.slot_tracker`` and
``python -m dynamo.select_service`` (1.6.1, and the presets of Dynamo's newer router) is
accepted with its meaning here, or refused with one line saying what to use, exit code 2."""

from __future__ import annotations

import pytest

from kv_slot_tracker import cli
from kv_slot_tracker.core.selection import RouterConfig
from kv_slot_tracker.main import router_config
from kv_slot_tracker.settings import load_settings
from tests.servers import run_app

# The options each reference command's --help lists (1.6.1), with a value for each.
SLOT_TRACKER_FLAGS = {"--port": "8091", "--replica-sync-port": "9091", "--replica-sync-peers": "tcp://b:9091"}  # fmt: skip
SELECT_SERVICE_FLAGS = {
    "--port": "8092",
    "--threads": "4",
    "--indexer-peers": "http://selector-b:8092",
    "--replica-sync-port": "9092",
    "--replica-sync-peers": "tcp://selector-b:9092",
    "--session-affinity-ttl-secs": "30",
    "--selection-cache-ttl-secs": "60",
    "--selection-cache-max-entries": "4096",
    "--selection-cache-max-bytes": "1048576",
    "--router-assume-kv-reuse": None,
    "--no-router-assume-kv-reuse": None,
    "--router-tracking-hash": "public-xxh3-v1",
    "--router-tracking-key-file": "/etc/key",
    "--router-tracking-key-id": "epoch-1",
}
REFUSED = {
    "--threads": "--workers",
    "--replica-sync-port": "--redis-url",
    "--replica-sync-peers": "--redis-url",
    "--router-tracking-key-file": "public xxh3",
    "--router-tracking-key-id": "public xxh3",
}


def settings_of(*argv: str):
    args = cli.parse_args(list(argv))
    return load_settings(args.config, **cli.overrides(args))


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(list(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no usage text, no traceback
    return err


def test_every_reference_flag_is_known(capsys: pytest.CaptureFixture[str]) -> None:
    """None of them is an "unrecognized argument": accepted, or refused by name."""
    for flag, value in {**SLOT_TRACKER_FLAGS, **SELECT_SERVICE_FLAGS}.items():
        argv = [flag] if value is None else [flag, value]
        if flag in REFUSED:
            err = refusal(capsys, *argv)
            assert err.startswith(f"kv-slot-tracker: error: {flag}: "), err
            assert REFUSED[flag] in err
            assert "unrecognized" not in err
        else:
            settings_of(*argv)
    assert "--agentic" in cli.build_parser().format_help()


def test_accepted_flags_take_their_meaning() -> None:
    s = settings_of(
        "--port", "8092", "--indexer-peers", "http://selector-b:8092",
        "--session-affinity-ttl-secs", "30", "--selection-cache-ttl-secs", "60",
        "--selection-cache-max-entries", "4096", "--selection-cache-max-bytes", "1048576",
        "--router-tracking-hash", "public-xxh3-v1",
    )  # fmt: skip
    assert (s.port, s.indexer_peers) == (8092, "http://selector-b:8092")
    assert s.session_affinity_ttl_seconds == 30.0
    assert (s.selection_cache_ttl_seconds, s.selection_cache_max_entries) == (60, 4096)
    assert s.selection_cache_max_bytes == 1_048_576
    assert (s.router_assume_kv_reuse, s.router_preset) == (True, "")  # the defaults


def test_kv_reuse_switches() -> None:
    assert settings_of("--no-router-assume-kv-reuse").router_assume_kv_reuse is False
    assert settings_of("--router-assume-kv-reuse").router_assume_kv_reuse is True
    # the bare switch before another flag, and this service's own spelling with a value
    s = settings_of("--no-router-assume-kv-reuse", "--router-assume-kv-reuse", "--port", "1")
    assert (s.router_assume_kv_reuse, s.port) == (True, 1)
    assert settings_of("--router-assume-kv-reuse", "false").router_assume_kv_reuse is False
    assert settings_of("--router-assume-kv-reuse=off").router_assume_kv_reuse is False
    off = router_config(settings_of("--no-router-assume-kv-reuse"), {})
    assert off.assume_kv_reuse is False


def test_keyed_tracking_hash_and_bad_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(capsys, "--router-tracking-hash", "keyed-xxh3-v1")
    assert "keyed tracking hashes are not supported here" in err
    assert "unknown tracking hash 'sha1'" in refusal(capsys, "--router-tracking-hash", "sha1")
    assert "expected true or false" in refusal(capsys, "--router-assume-kv-reuse", "maybe")
    assert "give one" in refusal(capsys, "--agentic", "--load-aware")
    assert "give one" in refusal(capsys, "--router-preset", "load_aware", "--agentic")


def test_presets_set_the_router_knobs_over_settings_and_environment() -> None:
    env = {"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "0.5", "DYN_ROUTER_PREFILL_LOAD_SCALE": "9"}
    agentic = router_config(settings_of("--agentic", "--router-prefill-load-scale", "7"), env)
    assert (agentic.overlap_score_credit, agentic.prefill_load_scale) == (2.0, 4.0)
    assert agentic.decode_active_request_weight == 64.0
    base = router_config(settings_of("--router-prefill-load-scale", "7"), env)
    assert (base.overlap_score_credit, base.prefill_load_scale) == (0.5, 9.0)
    assert agentic.use_kv_events == base.use_kv_events  # the rest keeps its value
    load = router_config(settings_of("--load-aware", "--router-prefill-load-scale", "3"), {})
    assert (load.overlap_score_credit, load.use_kv_events, load.assume_kv_reuse) == (
        0.0, False, False,
    )  # fmt: skip
    assert (load.track_prefill_tokens, load.prefill_load_scale) == (True, 3.0)  # kept
    # Dynamo's variables for the presets
    by_env = router_config(settings_of(), {"DYN_ROUTER_AGENTIC": "true"})
    assert by_env.prefill_load_scale == 4.0
    assert router_config(settings_of(), {"DYN_ROUTER_LOAD_AWARE": "1"}).use_kv_events is False
    assert router_config(settings_of(), {}).prefill_load_scale == RouterConfig().prefill_load_scale


def test_a_refusal_from_the_command_is_one_line_and_exit_2() -> None:
    """The real command: no traceback, no usage block, and nothing started."""
    done = run_app("--port", "8092", "--replica-sync-port", "9092", "--threads", "4")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "kv-slot-tracker: error: --replica-sync-port: instances share their state through "
        "Redis here, not a ZMQ mesh: give every instance the same --redis-url "
        "redis://HOST:6379 (and --namespace)"
    ]
    assert done.stdout == ""


def test_a_dynamo_select_service_command_line_is_accepted() -> None:
    done = run_app(
        "--port", "8092", "--indexer-peers", "http://selector-b:8092",
        "--session-affinity-ttl-secs", "30", "--selection-cache-ttl-secs", "60",
        "--no-router-assume-kv-reuse", "--router-tracking-hash", "public-xxh3-v1",
        "--agentic", "--check-config",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = set(done.stdout.splitlines())
    assert {"port = 8092", 'router_preset = "agentic"', "router_assume_kv_reuse = false"} <= lines
