"""The optional access log: one JSON line per request, on every path (direct, lean, FastAPI)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.servers import live_server

REGISTER = {"model_name": "m", "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
ADD = {"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1]}


def json_lines(log: Path) -> list[dict]:
    lines = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def test_every_request_is_one_json_line(tmp_path: Path) -> None:
    with live_server(tmp_path, SLOT_TRACKER_ACCESS_LOG="true") as url:
        with httpx.Client(base_url=url) as c:
            assert c.post("/register", json=REGISTER).status_code == 201  # FastAPI route
            assert c.post("/add", json=ADD).status_code == 201  # direct path
            assert c.get("/loads").status_code == 200
            assert c.post("/free", json={"model_name": "m"}).status_code == 422
        logs = list(tmp_path.glob("server-*.log"))
    lines = json_lines(logs[0])
    seen = [(x["method"], x["route"], x["status"]) for x in lines]
    assert seen[0] == ("GET", "/health", 200)  # the start-up probe of the test's server
    assert [s for s in seen if s[1] != "/health"] == [
        ("POST", "/register", 201),
        ("POST", "/add", 201),
        ("GET", "/loads", 200),
        ("POST", "/free", 422),
    ]
    assert all(
        set(x) == {"ts", "method", "route", "status", "duration_ms", "request_id"} for x in lines
    )
    assert len({x["request_id"] for x in lines}) == len(lines)
    assert all(x["duration_ms"] >= 0 and x["ts"].endswith("+00:00") for x in lines)


def test_off_by_default(tmp_path: Path) -> None:
    with live_server(tmp_path) as url:
        with httpx.Client(base_url=url) as c:
            assert c.post("/register", json=REGISTER).status_code == 201
            assert c.post("/add", json=ADD).status_code == 201
        logs = list(tmp_path.glob("server-*.log"))
    assert json_lines(logs[0]) == []
