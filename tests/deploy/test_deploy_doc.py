"""The "Container" section of docs/kubernetes.md shows the three ways to run the image and the
dashboard, and every file it names exists."""

from __future__ import annotations

import re

from tests.deploy.support import DEPLOY_DOC, ROOT


def container_section() -> str:
    text = DEPLOY_DOC.read_text()
    start = text.index("\n## Container\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_shows_docker_run_compose_and_kubernetes() -> None:
    section = container_section()
    for command in (
        "docker build -t kv-slot-tracker",
        "docker run --rm -p 8091:8091 kv-slot-tracker",
        "export SLOT_TRACKER_API_KEY=",
        "docker compose up --build -d",
        "kubectl create secret generic",
        "kubectl apply -k deploy/kubernetes",
        "deploy/grafana/kv-slot-tracker.json",
    ):
        assert command in section, command


def test_named_files_exist() -> None:
    named = set(re.findall(r"`((?:deploy/|compose\.yaml)[^`\s]*)`", container_section()))
    # bare manifest names (`redis.yaml`) are those of deploy/kubernetes
    bare = set(re.findall(r"`(\w+\.yaml)`", container_section())) - {"compose.yaml"}
    named |= {f"deploy/kubernetes/{n}" for n in bare}
    assert "compose.yaml" in named and "deploy/grafana/kv-slot-tracker.json" in named
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert missing == []
