"""What the deployment tests share: paths, the service's real setting names, YAML loading and
the service's HTTP surface as an in-process application."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from kv_slot_tracker.config_sources import ENV_PREFIX
from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
KUBE_DIR = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "kv-slot-tracker.json"
# the page that shows how to run the image, Compose and Kubernetes
DEPLOY_DOC = ROOT / "docs" / "kubernetes.md"
DOCKERFILE = ROOT / "Dockerfile"

# Every environment variable the service reads: SLOT_TRACKER_ + a settings field in upper case.
SETTING_ENV_NAMES = frozenset(ENV_PREFIX + name.upper() for name in Settings.model_fields)


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def image_user() -> tuple[int, int]:
    """``(uid, gid)`` of the final ``USER`` instruction of the Dockerfile."""
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", DOCKERFILE.read_text(), flags=re.M)
    assert users, "the Dockerfile has no numeric USER uid:gid"
    uid, gid = users[-1]
    return int(uid), int(gid)


def settings_from_env(env: dict[str, str]) -> Settings:
    """The settings an instance started with exactly ``env`` would run with (validated)."""
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in SETTING_ENV_NAMES)
    assert not unknown, f"not settings of the service: {unknown}"
    return load_settings(**{k[len(ENV_PREFIX) :].lower(): v for k, v in env.items()})


@contextlib.asynccontextmanager
async def app_client(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An application built like ``python -m kv_slot_tracker`` builds it, inside its lifespan."""
    app = create_app(load_settings(**overrides))
    async with app.router.lifespan_context(app):
        await app.state.replication.settled(10)  # what a probe of /ready would wait for
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://deploy") as client:
            yield client
