"""Print the service's OpenAPI document as YAML: ``python -m kv_slot_tracker.openapi_export > openapi.yaml``.

The document is built from a fresh ``create_app`` with the environment-independent settings of
:func:`export_settings` (no API key, embedded replication), and dumped with sorted keys, so the
output is byte-for-byte stable across runs and machines. ``make openapi`` writes ``openapi.yaml``;
a test fails when that file drifts from the application.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import Settings, load_settings


def export_settings() -> Settings:
    """Defaults with the two settings that change the document pinned to their defaults."""
    return load_settings(api_key="", redis_url="")


def openapi_document(settings: Settings | None = None) -> dict[str, Any]:
    return create_app(settings if settings is not None else export_settings()).openapi()


def to_yaml(document: dict[str, Any]) -> str:
    return yaml.safe_dump(
        document,
        sort_keys=True,
        allow_unicode=True,
        default_flow_style=False,
        width=100,
    )


def render() -> str:
    """The YAML text ``openapi.yaml`` must contain."""
    return to_yaml(openapi_document())


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
