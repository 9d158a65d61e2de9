"""Dynamo's command-line flags, so that a Dynamo user's command line starts this service.

``python -m dynamo.slot_tracker`` (1.6.1) takes ``--port``, ``--replica-sync-port`` and
``--replica-sync-peers``; ``python -m dynamo.select_service`` takes those and ``--threads``,
``--indexer-peers``, ``--session-affinity-ttl-secs``, the ``--selection-cache-*`` flags,
``--router-assume-kv-reuse`` / ``--no-router-assume-kv-reuse`` and ``--router-tracking-*``;
Dynamo's router after 1.6.1 adds the ``--agentic`` and ``--load-aware`` presets. Each is
accepted here with its meaning where this service has one, and otherwise refused with one line
saying what to use instead, exit code 2 (a usage error, as argparse's own), no traceback:

==============================  ==========================================================
``--port``, ``--indexer-peers``  the settings of those names (generic flags of ``cli``)
``--session-affinity-ttl-secs``  ``session_affinity_ttl_seconds`` (generic ``-secs`` alias)
``--selection-cache-*``          the ``selection_cache_*`` settings (generic flags)
``--router-assume-kv-reuse``     ``router_assume_kv_reuse = true`` (also ``... true|false``)
``--no-router-assume-kv-reuse``  ``router_assume_kv_reuse = false``
``--agentic``, ``--load-aware``  ``router_preset = "agentic"`` / ``"load_aware"``
``--router-tracking-hash``       ``public-xxh3-v1`` accepted (what is computed here);
                                 ``keyed-xxh3-v1`` refused
``--router-tracking-key-*``      refused (no keyed tracking hashes here)
``--threads``                    refused: ``--workers``
``--replica-sync-port|peers``    refused: ``--redis-url`` (replication goes through Redis)
==============================  ==========================================================

:func:`add_dynamo_flags` puts them on the parser ``kv_slot_tracker.cli`` builds (they show in
``--help`` under their own heading); :func:`with_preset` applies a preset to the router knobs.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NoReturn

from kv_slot_tracker.core.selection import RouterConfig

# What to use here instead of a Dynamo flag this service has no meaning for.
REFUSED: dict[str, str] = {
    "--threads": "the KV index is kept by the server process here; for more cores use "
    "--workers N (server processes sharing one state), or run more instances with --redis-url",
    "--replica-sync-port": "instances share their state through Redis here, not a ZMQ mesh: "
    "give every instance the same --redis-url redis://HOST:6379 (and --namespace)",
    "--replica-sync-peers": "instances share their state through Redis here, not a ZMQ mesh: "
    "give every instance the same --redis-url redis://HOST:6379 (and --namespace)",
    "--router-tracking-key-file": "keyed tracking hashes are not supported here: "
    "request identities use public xxh3 (--router-tracking-hash public-xxh3-v1)",
    "--router-tracking-key-id": "keyed tracking hashes are not supported here: "
    "request identities use public xxh3 (--router-tracking-hash public-xxh3-v1)",
}
PUBLIC_TRACKING_HASH = "public-xxh3-v1"
KEYED_TRACKING_HASH = "keyed-xxh3-v1"
TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")

# Dynamo's presets (its router's --agentic and --load-aware): the knobs each one sets. A preset
# wins over the individual settings and their DYN_ROUTER_* variables, as in Dynamo.
PRESETS: dict[str, dict[str, Any]] = {
    "agentic": {
        "overlap_score_credit": 2.0,
        "prefill_load_scale": 4.0,
        "decode_active_request_weight": 64.0,
    },
    "load_aware": {
        "overlap_score_credit": 0.0,
        "use_kv_events": False,
        "assume_kv_reuse": False,
        "track_prefill_tokens": True,
    },
}
PRESET_ENV = (("DYN_ROUTER_AGENTIC", "agentic"), ("DYN_ROUTER_LOAD_AWARE", "load_aware"))


def _refuse(parser: argparse.ArgumentParser, flag: str, why: str) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {flag}: {why}\n")


class _Refused(argparse.Action):
    """A Dynamo flag without a meaning here: one line saying what to use, exit 2."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: Any, values: Any, opt: Any = None
    ) -> None:
        _refuse(parser, str(opt), REFUSED[str(opt)])


class _TrackingHash(argparse.Action):
    def __call__(
        self, parser: argparse.ArgumentParser, ns: Any, values: Any, opt: Any = None
    ) -> None:
        if values != PUBLIC_TRACKING_HASH:
            why = (
                "keyed tracking hashes are not supported here"
                if values == KEYED_TRACKING_HASH
                else f"unknown tracking hash {values!r}"
            )
            _refuse(parser, str(opt), f"{why}; request identities use {PUBLIC_TRACKING_HASH}")


class _Preset(argparse.Action):
    """``--agentic``, ``--load-aware``, ``--router-preset NAME``: at most one preset."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: Any, values: Any, opt: Any = None
    ) -> None:
        preset = self.const if self.const is not None else values
        given = getattr(ns, self.dest, None)
        if given is not None and given != preset:
            _refuse(parser, str(opt), "--agentic and --load-aware are two presets: give one")
        setattr(ns, self.dest, preset)


class _Bool(argparse.Action):
    """Dynamo's bare switch (``--router-assume-kv-reuse``), or this service's
    ``--router-assume-kv-reuse true|false``."""

    def __call__(
        self, parser: argparse.ArgumentParser, ns: Any, values: Any, opt: Any = None
    ) -> None:
        text = self.const if values is None or values == [] else str(values).lower()
        if text not in TRUE_WORDS + FALSE_WORDS:
            _refuse(parser, str(opt), f"expected true or false, got {values!r}")
        setattr(ns, self.dest, text in TRUE_WORDS)


def add_dynamo_flags(parser: argparse.ArgumentParser, helps: Mapping[str, str]) -> None:
    """Dynamo's flags on ``parser``, after the settings' flags: ``--router-assume-kv-reuse``
    and ``--router-preset`` are made again here (their generic form goes), last of the flags
    of their setting, with the setting's help (``helps``)."""
    parser.conflict_handler = "resolve"
    group = parser.add_argument_group(
        "Dynamo's flags (python -m dynamo.slot_tracker / dynamo.select_service)",
        "Accepted with their meaning here; those without one are refused with what to use.",
    )
    group.add_argument(
        "--no-router-assume-kv-reuse",
        dest="router_assume_kv_reuse",
        nargs=0,
        const="false",
        action=_Bool,
        help="router_assume_kv_reuse = false",
    )
    group.add_argument(
        "--router-assume-kv-reuse",
        dest="router_assume_kv_reuse",
        nargs="?",
        const="true",
        metavar="true|false",
        action=_Bool,
        help=f"{helps.get('router_assume_kv_reuse', '')} Alone: true. (default: true)".strip(),
    )
    group.add_argument(
        "--agentic",
        dest="router_preset",
        nargs=0,
        const="agentic",
        action=_Preset,
        help='router_preset = "agentic": overlap credit 2, prefill scale 4, 64 blocks per request',
    )
    group.add_argument(
        "--load-aware",
        dest="router_preset",
        nargs=0,
        const="load_aware",
        action=_Preset,
        help='router_preset = "load_aware": load only (no cache credit, no KV events)',
    )
    group.add_argument(
        "--router-preset",
        dest="router_preset",
        metavar="agentic|load_aware",
        action=_Preset,
        help=f'{helps.get("router_preset", "")} (default: "")'.strip(),
    )
    group.add_argument(
        "--router-tracking-hash",
        metavar="HASH",
        action=_TrackingHash,
        dest=argparse.SUPPRESS,
        default=argparse.SUPPRESS,
        help=f"only {PUBLIC_TRACKING_HASH} (what is computed here)",
    )
    for flag, why in REFUSED.items():
        group.add_argument(
            flag,
            metavar="VALUE",
            action=_Refused,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            help=f"refused: {why}",
        )


def with_preset(config: RouterConfig, preset: str, env: Mapping[str, str]) -> RouterConfig:
    """``config`` with ``preset`` applied (``""``: the one ``DYN_ROUTER_AGENTIC`` or
    ``DYN_ROUTER_LOAD_AWARE`` asks for, if any)."""
    if not preset:
        on = [name for var, name in PRESET_ENV if env.get(var, "").lower() in TRUE_WORDS]
        preset = on[0] if len(on) == 1 else ""
    values = PRESETS.get(preset)
    return replace(config, **values) if values else config
