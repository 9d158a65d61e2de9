"""Where a setting's value comes from, and how a problem with one is told.

The settings (``kv_slot_tracker.settings``) are built from sources: the packaged defaults
(``DEFAULT_CONFIG_FILE``, package data read through ``importlib.resources``, so that an
installed wheel has them) and the TOML file of ``--config``, whose values ``TomlFilesSource``
hands to pydantic, then ``SLOT_TRACKER_*`` environment variables (``ENV_PREFIX``) and overrides.
This module holds the reading of those sources and the reporting around it, apart from the
model and its rules: ``read_toml``, where each value came from (``Origins``: the flag, the
variable, the file and line, or the default) and the ``Problem`` and ``ConfigError`` that name
it, with ``did_you_mean`` for a misspelt name. It knows the model only through the fields it is
given, so the settings import it and not the other way round.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

ENV_PREFIX = "SLOT_TRACKER_"
RULES_ERROR = "settings_rules"  # the pydantic error type carrying the broken rules
# Package data, so that a regular (not editable) install and the image find it.
DEFAULT_CONFIG_FILE: Traversable = files("kv_slot_tracker").joinpath("config", "default.toml")
DEFAULT_CONFIG_NAME = "kv_slot_tracker/config/default.toml"


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with the configuration: ``where`` names its source (``--port``,
    ``SLOT_TRACKER_PORT``, ``site.toml:3: port``), ``message`` says what is wrong."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class ConfigError(ValueError):
    """Settings that cannot run: every problem found, one line each."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(map(str, self.problems)))


def read_toml(path: Path | Traversable) -> dict[str, Any]:
    """The TOML file at ``path``; :class:`ConfigError` naming it when it is not valid TOML,
    ``OSError`` when it cannot be read."""
    with path.open("rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([Problem(str(path), f"not valid TOML: {exc}")]) from None


def did_you_mean(word: str, choices: Sequence[str], show: Any = str) -> str:
    """`` (did you mean X?)`` with the closest of ``choices``, or nothing."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {show(close[0])}?)" if close else ""


class TomlFilesSource(PydanticBaseSettingsSource):
    """The values of the TOML files (``values``), else the packaged defaults."""

    def __init__(self, settings_cls: type[BaseSettings], values: Mapping[str, Any] | None) -> None:
        super().__init__(settings_cls)
        self._values = dict(read_toml(DEFAULT_CONFIG_FILE) if values is None else values)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


def key_in_file(path: Path, lines: Sequence[str], key: str) -> str:
    """``path:LINE: key``, the line where ``key`` is set (or its table starts)."""
    pattern = re.compile(rf"""^\s*(\[\s*)?["']?{re.escape(key)}["']?\s*[=.\]]""")
    for number, line in enumerate(lines, 1):
        if pattern.match(line):
            return f"{path}:{number}: {key}"
    return f"{path}: {key}"


class Origins:
    """Where each setting's value came from, to name it in a problem: the override (a flag),
    the environment variable, the config file's line, or the packaged default. ``fields`` are
    the settings' fields (``Settings.model_fields``)."""

    def __init__(self, labels: Mapping[str, str], fields: Mapping[str, FieldInfo]) -> None:
        self.labels = labels
        self.fields = fields
        self.given: set[str] = set()
        self.files: dict[str, str] = {}
        self.environ = {name.upper(): name for name in os.environ}

    def of(self, name: str) -> str:
        if name in self.given:
            return self.labels.get(name, "--" + name.replace("_", "-"))
        variable = ENV_PREFIX + name.upper()
        if variable in self.environ:
            return self.environ[variable]
        if name in self.files:
            return self.files[name]
        return f"{name} (default)"

    def where(self, names: Sequence[str]) -> str:
        return ", ".join(self.of(name) for name in names) or "settings"

    def describe(self, exc: ValidationError) -> list[Problem]:
        """One problem per pydantic error, without its links or secret values."""
        problems = []
        for err in exc.errors(include_url=False):
            loc = err.get("loc", ())
            if not loc and err["type"] == RULES_ERROR:
                for fields, message in err["ctx"]["problems"]:
                    problems.append(Problem(self.where(fields), message))
                continue
            name = str(loc[0]) if loc else ""
            message = err["msg"].removeprefix("Value error, ")
            shown = err.get("input")
            if name not in self.fields:
                where = self.where([]) if not name else self.of(name)
                problems.append(Problem(where, message))
                continue
            hint = ""
            choices = _choices(self.fields[name].annotation)
            if choices and isinstance(shown, str):
                hint = did_you_mean(shown.lower(), choices, repr)
            secret = "key" in name or "password" in name or "url" in name
            given = "" if secret or isinstance(shown, dict) else f" (got {shown!r})"
            problems.append(Problem(self.of(name), f"{message}{given}{hint}"))
        return problems


def _choices(annotation: Any) -> list[str]:
    """The strings a ``Literal`` (possibly in a union) allows."""
    out: list[str] = []
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, str):
            out.append(arg)
        else:
            out.extend(_choices(arg))
    return out
