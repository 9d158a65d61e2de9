"""Router knobs: defaults, environment variables with their alias, overrides and range messages."""

from __future__ import annotations

import pytest

from kv_slot_tracker.core.selection import RouterConfig, RouterConfigOverride
from kv_slot_tracker.core.selection.errors import InvalidRouterConfig, InvalidRouterConfigOverride
from tests.support.router_config import with_override


def test_defaults_are_the_reference_defaults() -> None:
    c = RouterConfig()
    assert (
        c.overlap_score_credit,
        c.overlap_score_credit_decay,
        c.prefill_load_scale,
        c.decode_active_request_weight,
        c.router_temperature,
        c.track_prefill_tokens,
        c.track_output_blocks,
        c.assume_kv_reuse,
        c.shared_cache_multiplier,
        c.router_ttl_secs,
    ) == (1.0, 0.0, 1.0, 0.0, 0.0, True, False, True, 0.0, 120.0)
    assert c.router_ttl_ns == 120_000_000_000
    assert RouterConfig().with_env({}) == c


def test_every_knob_reads_its_environment_variable() -> None:
    c = RouterConfig().with_env(
        {
            "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "0.5",
            "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY": "1",
            "DYN_ROUTER_PREFILL_LOAD_SCALE": "2",
            "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT": "3",
            "DYN_ROUTER_TEMPERATURE": "1e0",
            "DYN_ROUTER_TRACK_PREFILL_TOKENS": "false",
            "DYN_ROUTER_TRACK_OUTPUT_BLOCKS": "ON",
            "DYN_ROUTER_ASSUME_KV_REUSE": "0",
            "DYN_ROUTER_TTL_SECS": "2",
            "UNRELATED": "x",
        }
    )
    assert c == RouterConfig(
        overlap_score_credit=0.5,
        overlap_score_credit_decay=1.0,
        prefill_load_scale=2.0,
        decode_active_request_weight=3.0,
        router_temperature=1.0,
        track_prefill_tokens=False,
        track_output_blocks=True,
        assume_kv_reuse=False,
        router_ttl_secs=2.0,
    )
    assert c.router_ttl_ns == 2_000_000_000


@pytest.mark.parametrize("var", ["DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT"])
def test_overlap_score_weight_is_an_alias_of_prefill_load_scale(var: str) -> None:
    c = RouterConfig().with_env({var: "2", "DYN_ROUTER_PREFILL_LOAD_SCALE": "5"})
    assert (c.prefill_load_scale, c.overlap_score_credit) == (2.0, 1.0)
    zero = RouterConfig().with_env({var: "0", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "0.7"})
    assert (zero.prefill_load_scale, zero.overlap_score_credit) == (0.0, 0.0)


def test_first_alias_wins() -> None:
    c = RouterConfig().with_env(
        {"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "3", "DYN_OVERLAP_SCORE_WEIGHT": "4"}
    )
    assert c.prefill_load_scale == 3.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DYN_ROUTER_TEMPERATURE": "hot"}, "DYN_ROUTER_TEMPERATURE must be a number, got 'hot'"),
        ({"DYN_ROUTER_TEMPERATURE": " 1"}, "DYN_ROUTER_TEMPERATURE must be a number, got ' 1'"),
        ({"DYN_ROUTER_TTL_SECS": "1_0"}, "DYN_ROUTER_TTL_SECS must be a number, got '1_0'"),
        (
            {"DYN_ROUTER_TRACK_PREFILL_TOKENS": "maybe"},
            "DYN_ROUTER_TRACK_PREFILL_TOKENS must be one of true/false/1/0/yes/no/on/off, "
            "got 'maybe'",
        ),
        (
            {"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "-1"},
            "overlap_score_credit must be a finite, non-negative number",
        ),
        (
            {"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "inf"},
            "overlap_score_credit must be a finite, non-negative number",
        ),
        (
            {"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY": "-0.5"},
            "overlap_score_credit_decay must be greater than or equal to 0",
        ),
        (
            {"DYN_ROUTER_PREFILL_LOAD_SCALE": "NaN"},
            "prefill_load_scale must be greater than or equal to 0",
        ),
        ({"DYN_ROUTER_TEMPERATURE": "-1"}, "router_temperature must be greater than or equal to 0"),
        ({"DYN_ROUTER_TTL_SECS": "-2"}, "router_ttl_secs must be greater than or equal to 0"),
    ],
)
def test_bad_environment_values(env: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidRouterConfig) as e:
        RouterConfig().with_env(env)
    assert str(e.value) == message


def test_active_request_weight_range_message_prints_f64_max_like_rust() -> None:
    with pytest.raises(InvalidRouterConfig) as e:
        RouterConfig(decode_active_request_weight=-1.0)
    assert str(e.value) == (
        "decode_active_request_weight must be between 0 and 17976931348623157" + "0" * 292
    )
    with pytest.raises(InvalidRouterConfig) as e:
        RouterConfig(shared_cache_multiplier=1.5)
    assert str(e.value) == "shared_cache_multiplier must be between 0 and 1"


# -- per-request override ---------------------------------------------------------------------


def test_override_replaces_only_what_it_names() -> None:
    base = RouterConfig(overlap_score_credit_decay=1.0, decode_active_request_weight=2.0)
    override = RouterConfigOverride.from_json(
        {
            "overlap_score_credit": 0.25,
            "router_temperature": 1,
            "track_prefill_tokens": False,
            "prefill_load_scale": None,
            "unknown_field": "ignored",
        }
    )
    c = with_override(base, override)
    assert c == RouterConfig(
        overlap_score_credit=0.25,
        overlap_score_credit_decay=1.0,
        decode_active_request_weight=2.0,
        router_temperature=1.0,
        track_prefill_tokens=False,
    )
    assert with_override(base, None) is base
    assert with_override(base, RouterConfigOverride.from_json({})) is base
    assert RouterConfigOverride.from_json(None) is None


def test_override_weight_alias() -> None:
    o = RouterConfigOverride.from_json({"overlap_score_weight": 2, "prefill_load_scale": 7})
    assert (o.prefill_load_scale, o.overlap_score_credit) == (2.0, None)
    o = RouterConfigOverride.from_json({"overlap_score_weight": 0, "overlap_score_credit": 0.9})
    assert (o.prefill_load_scale, o.overlap_score_credit) == (0.0, 0.0)
    c = with_override(RouterConfig(), RouterConfigOverride.from_json({"assume_kv_reuse": False}))
    assert c.assume_kv_reuse is False


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"overlap_score_credit": -0.1},
            "overlap_score_credit must be a finite, non-negative number",
        ),
        ({"prefill_load_scale": -1}, "prefill_load_scale must be finite and non-negative"),
        ({"overlap_score_weight": -1}, "prefill_load_scale must be finite and non-negative"),
        ({"router_temperature": -0.5}, "router_temperature must be finite and non-negative"),
        ({"shared_cache_multiplier": 2}, "shared_cache_multiplier must be between 0 and 1"),
        ({"router_temperature": "1"}, 'invalid type: string "1", expected f64'),
        ({"prefill_load_scale": True}, "invalid type: boolean `true`, expected f64"),
        ({"overlap_score_credit": [1]}, "invalid type: sequence, expected f64"),
        ({"overlap_score_credit": {}}, "invalid type: map, expected f64"),
        ({"track_prefill_tokens": 1}, "invalid type: integer `1`, expected a boolean"),
        ({"assume_kv_reuse": 0.5}, "invalid type: floating point `0.5`, expected a boolean"),
        ({"prefill_load_scale": 10**400}, "number out of range"),
        ([1], "invalid type: sequence, expected struct RouterConfigOverrideSerde"),
        ("x", 'invalid type: string "x", expected struct RouterConfigOverrideSerde'),
        (3, "invalid type: integer `3`, expected struct RouterConfigOverrideSerde"),
    ],
)
def test_bad_overrides(value: object, message: str) -> None:
    with pytest.raises(InvalidRouterConfigOverride) as e:
        RouterConfigOverride.from_json(value)
    assert str(e.value) == message
    assert e.value.detail == message


def test_with_env_applies_only_the_variables_present() -> None:
    base = RouterConfig(overlap_score_credit=0.5, router_temperature=0.25)
    assert base.with_env({}) is base
    got = base.with_env({"DYN_ROUTER_TEMPERATURE": "1", "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "0"})
    assert (got.router_temperature, got.prefill_load_scale, got.overlap_score_credit) == (
        1.0,
        0.0,
        0.0,
    )
    assert base.with_env({"OTHER": "1"}).overlap_score_credit == 0.5
