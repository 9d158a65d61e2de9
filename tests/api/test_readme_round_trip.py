"""The README's curl round trip, run as written: every ``curl`` of its Quick start, sent to the
application, is answered exactly the JSON the comment under it shows."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import httpx

README = Path(__file__).resolve().parents[2] / "README.md"


def round_trip() -> list[tuple[str, str, str | None, object]]:
    """(method, path with query, body or None, the answer shown) for each curl of the block."""
    text = README.read_text()
    quick = text[text.index("\n## Quick start\n") :]
    block = next(b for b in re.findall(r"```sh\n(.*?)```", quick, re.S) if "curl " in b)
    lines = block.replace("\\\n", " ").splitlines()  # continuation lines joined
    calls: list[tuple[str, str, str | None, object]] = []
    i = 0
    while i < len(lines):
        words = shlex.split(lines[i])
        assert words[:2] == ["curl", "-s"], lines[i]
        method, url, body = "GET", "", None
        args = iter(words[2:])
        for word in args:
            if word.startswith("-X"):
                method = word[2:]
            elif word == "-H":
                assert next(args) == "content-type: application/json"
            elif word == "-d":
                body = next(args)
            else:
                url = word
        answer = []
        i += 1
        while i < len(lines) and lines[i].startswith("#"):
            answer.append(lines[i][1:].strip())
            i += 1
        parts = urlsplit("http://" + url)
        assert parts.netloc == "localhost:8091", url
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        calls.append((method, path, body, json.loads("".join(answer))))
    return calls


def test_the_readme_shows_a_whole_round_trip() -> None:
    assert [(m, p.split("?")[0]) for m, p, _, _ in round_trip()] == [
        ("POST", "/register"),
        ("POST", "/add"),
        ("GET", "/loads"),
        ("POST", "/potential_loads"),
        ("POST", "/free"),
    ]


async def test_each_call_gets_the_answer_shown(client: httpx.AsyncClient) -> None:
    for method, path, body, shown in round_trip():
        headers = {"content-type": "application/json"} if body is not None else {}
        resp = await client.request(method, path, content=body, headers=headers)
        assert resp.status_code in (200, 201), (path, resp.text)
        assert resp.json() == shown, path
