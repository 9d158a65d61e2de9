"""Router knobs of the selection service and the per-request ``router_config_override``.

Why a module of its own: the same knobs come from three places (defaults, ``DYN_ROUTER_*``
environment variables at start-up, and a per-request override) and each place must apply the same
aliases and range checks before the cost function sees a value. Defaults and the environment
variable names are those of SELECTION.md §4; the override's fields, the deprecated
``overlap_score_weight`` alias (it sets ``prefill_load_scale``, and a value of 0 also zeroes the
credit) and the range messages follow the reference's ``RouterConfigOverride`` and
``KvRouterConfig::validate``.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from kv_slot_tracker.core.serde.values import unexpected

from .errors import InvalidRouterConfig, InvalidRouterConfigOverride


def _rust_display(x: float) -> str:
    """``format!("{x}")`` of a Rust f64: shortest round-trip digits, never an exponent."""
    s = format(Decimal(repr(x)), "f")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


def _check_min(name: str, value: float, minimum: float) -> str | None:
    if value >= minimum:  # False for NaN, as in Rust
        return None
    return f"{name} must be greater than or equal to {_rust_display(minimum)}"


def _check_range(name: str, value: float, lo: float, hi: float) -> str | None:
    if lo <= value <= hi:
        return None
    return f"{name} must be between {_rust_display(lo)} and {_rust_display(hi)}"


def _check_finite_non_negative(name: str, value: float) -> str | None:
    """The per-request override's wording (observed on the reference for SCALE and T)."""
    if math.isfinite(value) and value >= 0.0:
        return None
    return f"{name} must be finite and non-negative"


def _check_credit(value: float) -> str | None:
    if math.isfinite(value) and value >= 0.0:
        return None
    return "overlap_score_credit must be a finite, non-negative number"


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The knobs the cost function, the bookings and the approximate cache read.

    Construction validates every value and raises ``InvalidRouterConfig`` with the reference's
    message for the first bad one.
    """

    overlap_score_credit: float = 1.0
    """CREDIT: device-overlap blocks subtracted from the prompt's prefill blocks, per block."""
    overlap_score_credit_decay: float = 0.0
    """DECAY: shrinks the credit on ranks whose prefill backlog exceeds the least-loaded one's."""
    prefill_load_scale: float = 1.0
    """SCALE: multiplies the (credited) prefill term."""
    decode_active_request_weight: float = 0.0
    """W: blocks charged per active request."""
    router_temperature: float = 0.0
    """T: 0 picks the minimum cost; T > 0 samples a softmax over normalised costs."""
    track_prefill_tokens: bool = True
    """Bookings add prefill tokens; off also disables the credit decay."""
    track_output_blocks: bool = False
    """Accepted for parity; output blocks are counted either way (SELECTION.md §4)."""
    assume_kv_reuse: bool = True
    """Off: the caller books random sequence hashes, so no block is shared with other requests."""
    shared_cache_multiplier: float = 0.0
    """Accepted for parity; there is no shared cache tier here, so it never changes a cost."""
    router_ttl_secs: float = 120.0
    """Lifetime of an approximate-cache block after its last write."""
    use_kv_events: bool = True
    """On (the reference's default): overlap comes from the engines' KV events (``kv_index``)
    and a worker needs a ``kv_events_endpoint`` per dp rank; off: the approximate cache."""
    host_cache_hit_weight: float = 0.75
    """Prefill blocks each host-memory extension block saves (KV events on)."""
    disk_cache_hit_weight: float = 0.25
    """Prefill blocks each disk extension block saves (KV events on)."""

    def __post_init__(self) -> None:
        checks = (
            _check_credit(self.overlap_score_credit),
            _check_min("overlap_score_credit_decay", self.overlap_score_credit_decay, 0.0),
            _check_min("prefill_load_scale", self.prefill_load_scale, 0.0),
            _check_range(
                "decode_active_request_weight",
                self.decode_active_request_weight,
                0.0,
                sys.float_info.max,
            ),
            _check_min("router_temperature", self.router_temperature, 0.0),
            _check_min("router_ttl_secs", self.router_ttl_secs, 0.0),
            _check_range("shared_cache_multiplier", self.shared_cache_multiplier, 0.0, 1.0),
        )
        for message in checks:
            if message is not None:
                raise InvalidRouterConfig(message)

    @property
    def router_ttl_ns(self) -> int:
        return round(self.router_ttl_secs * 1_000_000_000)

    def with_env(self, env: Mapping[str, str]) -> RouterConfig:
        """This config with the ``DYN_ROUTER_*`` variables present in ``env`` applied on top.

        ``DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT`` (or ``DYN_OVERLAP_SCORE_WEIGHT``) is the deprecated
        alias of ``DYN_ROUTER_PREFILL_LOAD_SCALE`` and wins over it; a value of 0 also sets the
        credit to 0. Unlike the reference, which silently keeps the default when a value does not
        parse, an unparsable value raises ``InvalidRouterConfig`` naming the variable.
        """
        values: dict[str, Any] = {}  # field name -> value, each parsed for its field
        for var, name in _FLOAT_ENV:
            if var in env:
                values[name] = _env_float(var, env[var])
        for var in _WEIGHT_ALIAS_ENV:
            if var in env:
                weight = _env_float(var, env[var])
                values["prefill_load_scale"] = weight
                if weight == 0.0:
                    values["overlap_score_credit"] = 0.0
                break
        for var, name in _BOOL_ENV:
            if var in env:
                values[name] = _env_bool(var, env[var])
        return replace(self, **values) if values else self


_FLOAT_ENV = (
    ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", "overlap_score_credit"),
    ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY", "overlap_score_credit_decay"),
    ("DYN_ROUTER_PREFILL_LOAD_SCALE", "prefill_load_scale"),
    ("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT", "decode_active_request_weight"),
    ("DYN_ROUTER_TEMPERATURE", "router_temperature"),
    ("DYN_ROUTER_TTL_SECS", "router_ttl_secs"),
)
_WEIGHT_ALIAS_ENV = ("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT")
_BOOL_ENV = (
    ("DYN_ROUTER_TRACK_PREFILL_TOKENS", "track_prefill_tokens"),
    ("DYN_ROUTER_TRACK_OUTPUT_BLOCKS", "track_output_blocks"),
    ("DYN_ROUTER_ASSUME_KV_REUSE", "assume_kv_reuse"),
    ("DYN_ROUTER_USE_KV_EVENTS", "use_kv_events"),
)
# Rust's f64 grammar (no whitespace, no digit separators, inf/infinity/nan in any case).
_RUST_F64 = re.compile(
    r"[+-]?(?:inf|infinity|nan|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)", re.IGNORECASE
)
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _env_float(var: str, raw: str) -> float:
    if not _RUST_F64.fullmatch(raw):
        raise InvalidRouterConfig(f"{var} must be a number, got {raw!r}")
    return float(raw)


def _env_bool(var: str, raw: str) -> bool:
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise InvalidRouterConfig(f"{var} must be one of true/false/1/0/yes/no/on/off, got {raw!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfigOverride:
    """A request's ``router_config_override``: every field optional, ``None`` = keep the config.

    Construction validates the values (after the ``overlap_score_weight`` alias was applied by
    ``from_json``) and raises ``InvalidRouterConfigOverride`` with the reference's message.
    """

    overlap_score_credit: float | None = None
    prefill_load_scale: float | None = None
    router_temperature: float | None = None
    assume_kv_reuse: bool | None = None
    track_prefill_tokens: bool | None = None
    shared_cache_multiplier: float | None = None

    def __post_init__(self) -> None:
        checks = (
            None if self.overlap_score_credit is None else _check_credit(self.overlap_score_credit),
            None
            if self.prefill_load_scale is None
            else _check_finite_non_negative("prefill_load_scale", self.prefill_load_scale),
            None
            if self.router_temperature is None
            else _check_finite_non_negative("router_temperature", self.router_temperature),
            None
            if self.shared_cache_multiplier is None
            else _check_range("shared_cache_multiplier", self.shared_cache_multiplier, 0.0, 1.0),
        )
        for message in checks:
            if message is not None:
                raise InvalidRouterConfigOverride(message)

    @classmethod
    def from_json(cls, value: object) -> RouterConfigOverride | None:
        """Parse the decoded JSON value of ``router_config_override`` (``None`` when null/absent).

        Type errors use serde's wording (``invalid type: string "x", expected f64``); unknown
        keys are ignored, as the reference's struct does.
        """
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidRouterConfigOverride(
                f"invalid type: {unexpected(value)}, expected struct RouterConfigOverrideSerde"
            )
        floats: dict[str, Any] = {
            name: _json_f64(value.get(name))
            for name in (
                "overlap_score_credit",
                "prefill_load_scale",
                "overlap_score_weight",
                "router_temperature",
                "shared_cache_multiplier",
            )
        }
        bools = {name: _json_bool(value.get(name)) for name in _OVERRIDE_BOOLS}
        weight = floats.pop("overlap_score_weight")
        if weight is not None:
            floats["prefill_load_scale"] = weight
            if weight == 0.0:
                floats["overlap_score_credit"] = 0.0
        return cls(**floats, **bools)


_OVERRIDE_BOOLS = ("assume_kv_reuse", "track_prefill_tokens")


def _json_f64(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, float):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise InvalidRouterConfigOverride("number out of range") from None
    raise InvalidRouterConfigOverride(f"invalid type: {unexpected(value)}, expected f64")


def _json_bool(value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise InvalidRouterConfigOverride(f"invalid type: {unexpected(value)}, expected a boolean")
