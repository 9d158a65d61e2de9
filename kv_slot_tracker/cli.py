"""The command line: every setting as a flag, the reference's names as aliases, a config check.

Each setting ``name`` is ``--name-with-dashes VALUE``, its help the comment above it in
``kv_slot_tracker/config/default.toml`` (one text for both). A flag overrides the environment,
which overrides the config files (``kv_slot_tracker.settings``); values are checked by the settings, so a flag takes exactly
what the TOML key and the ``SLOT_TRACKER_*`` variable take. A setting in seconds answers to the
reference's ``-secs`` spelling too (``--selection-cache-ttl-secs``). Secrets are not flags (they
would show in the process list): ``--api-key-file`` reads the key from a file instead.

``--check-config`` runs :func:`load`, the validation start-up runs, prints the effective values
(secrets masked) and the warnings, and exits: 0 when they are valid, 2 otherwise. A flag that
does not exist is a problem like any other, with the closest flag suggested.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from kv_slot_tracker import __version__
from kv_slot_tracker.config_sources import DEFAULT_CONFIG_FILE, ConfigError, Problem, did_you_mean
from kv_slot_tracker.dynamo_flags import add_dynamo_flags
from kv_slot_tracker.settings import Settings, load_settings

PROG = "kv-slot-tracker"  # the console script; ``python -m kv_slot_tracker`` is the same
# Settings that are secrets: never flags, masked by --check-config.
SECRETS = frozenset(name for name, f in Settings.model_fields.items() if f.annotation is SecretStr)
MASK = '"***"'


def setting_help(path: Path | Traversable = DEFAULT_CONFIG_FILE) -> dict[str, str]:
    """The comment above each key of the packaged defaults, joined into one line."""
    helps: dict[str, str] = {}
    comment: list[str] = []
    shared = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("# ---"):
            comment, shared = [], ""
        elif stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
        elif m := re.match(r"([a-z_][a-z0-9_]*)\s*=", stripped):
            # keys written right below each other share the comment above the first
            helps[m.group(1)] = " ".join(comment) if comment else shared
            shared, comment = helps[m.group(1)], []
        else:
            comment, shared = [], ""
    return helps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--config FILE] [--api-key-file FILE] [--SETTING VALUE ...] [--check-config]",
        description="kv-slot-tracker HTTP service. Flags override SLOT_TRACKER_* environment "
        "variables, which override the config file, which overrides the packaged defaults "
        "(kv_slot_tracker/config/default.toml).",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file with settings")
    parser.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="read api_key from this file (its first line), keeping it out of the process list",
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="print the effective settings (secrets masked) and exit: 0 if valid, 2 if not",
    )
    parser.add_argument("--version", action="version", version=f"kv-slot-tracker {__version__}")
    # set by a --workers supervisor for the processes it starts: the listening socket to accept
    # from, and a Unix socket where that process alone serves too (its siblings reach it there)
    parser.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--control-socket", help=argparse.SUPPRESS)
    # ... and the Unix socket of its hub (no Redis configured)
    parser.add_argument("--hub-socket", help=argparse.SUPPRESS)
    helps = setting_help()
    group = parser.add_argument_group("settings (see kv_slot_tracker/config/default.toml)")
    for name, field in Settings.model_fields.items():
        if name in SECRETS:
            continue
        flags = ["--" + name.replace("_", "-")]
        if name.endswith("_seconds"):
            flags.append("--" + name.removesuffix("_seconds").replace("_", "-") + "-secs")
        default = field.default
        group.add_argument(
            *flags,
            dest=name,
            metavar=_metavar(field.annotation),
            help=f"{helps.get(name, '')} (default: {_toml(default)})".strip(),
        )
    add_dynamo_flags(parser, helps)  # Dynamo's own flags: accepted with their meaning, or refused
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags; :class:`ConfigError` naming each flag that does not exist, with the closest
    one (``--prot`` -> ``--port``). A flag missing its value is argparse's error (exit 2)."""
    args, problems = _parse(argv)
    if problems:
        raise ConfigError(problems)
    return args


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[Problem]]:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    return args, unknown_flags(parser, unknown)


def unknown_flags(parser: argparse.ArgumentParser, unknown: Sequence[str]) -> list[Problem]:
    flags = [
        flag
        for action in parser._actions  # noqa: SLF001 - argparse lists its actions nowhere else
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--")
    ]
    problems = []
    after_flag = False
    for word in unknown:
        if word.startswith("-"):
            flag = word.split("=", 1)[0]
            problems.append(Problem(flag, "no such flag" + did_you_mean(flag, flags)))
            after_flag = "=" not in word
        elif not after_flag:
            problems.append(Problem(repr(word), "unexpected argument (settings are --name VALUE)"))
        else:
            after_flag = False  # the value of the unknown flag before it
    return problems


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the flags give (``None``: not given, left to the other sources)."""
    return {name: getattr(args, name) for name in Settings.model_fields if name not in SECRETS}


def load_argv(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    """The flags of ``argv`` and their settings, checked: what ``--check-config`` and start-up
    both run. :class:`ConfigError` lists every problem, unknown flags included."""
    args, problems = _parse(argv)
    return args, load(args, problems)


def load(args: argparse.Namespace, problems: Sequence[Problem] = ()) -> Settings:
    """The settings of ``args``, checked; :class:`ConfigError` lists every problem (after
    ``problems`` found before), each naming its flag, variable or file."""
    given = overrides(args)
    problems = list(problems)
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            problems.append(Problem("--api-key-file", f"cannot read {args.api_key_file}: {why}"))
        else:
            key = lines[0].strip() if lines else ""
            if key:
                given["api_key"] = key
            else:  # an empty key would leave the service open
                problems.append(
                    Problem("--api-key-file", f"{args.api_key_file}: the first line is empty")
                )
    try:
        settings = load_settings(args.config, labels={"api_key": "--api-key-file"}, **given)
    except ConfigError as exc:
        raise ConfigError([*problems, *exc.problems]) from None
    if problems:
        raise ConfigError(problems)
    return settings


def describe(settings: Settings) -> str:
    """The effective settings as TOML lines, secrets (and a URL's password) masked."""
    lines = []
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            text = MASK if value.get_secret_value() else '""'
        else:
            text = _toml(value)
            if isinstance(value, str):
                text = re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1***@", text)
        lines.append(f"{name} = {text}")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def _metavar(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    if text == "bool":
        return "true|false"
    if text in ("int", "float"):
        return "N"
    return "VALUE"
