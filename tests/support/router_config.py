"""A router config with every field of a per-request override applied: the cost scenarios
vary the knobs this way. The service applies only ``track_prefill_tokens`` of an override,
as the reference does (``SelectionService._config_for``)."""

from __future__ import annotations

from dataclasses import fields, replace

from kv_slot_tracker.core.selection import RouterConfig, RouterConfigOverride


def with_override(config: RouterConfig, override: RouterConfigOverride | None) -> RouterConfig:
    """``config`` with the fields ``override`` sets (CREDIT, SCALE, T, tracking...); DECAY, W and
    the TTL cannot be overridden per request (as in the reference)."""
    if override is None:
        return config
    changes = {
        f.name: getattr(override, f.name)
        for f in fields(override)
        if getattr(override, f.name) is not None
    }
    return replace(config, **changes) if changes else config
