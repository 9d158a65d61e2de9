"""The Python examples of the client's README run against a live instance of their own."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from kv_slot_tracker_client import SlotTrackerClient

from tests.servers import live_server

README = Path(__file__).resolve().parents[2] / "clients" / "python" / "README.md"
DOC_URL = "http://127.0.0.1:8091"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory.mktemp("readme")) as url:
        yield url


def test_readme_has_the_examples() -> None:
    blocks = python_blocks()
    assert len(blocks) == 5
    assert "AsyncSlotTrackerClient" in blocks[2] and "BatchBuilder" in blocks[3]
    assert "tracker.selection" in blocks[4]


def test_readme_examples_run(server: str) -> None:
    """Each block runs on its own, in order; the fragments find ``tracker`` and ``prompt``, as
    the text around them says, already defined."""
    printed = []
    with SlotTrackerClient(server) as tracker:
        for block in python_blocks():
            scope = {"tracker": tracker, "prompt": [0x9E3779B97F4A7C15, 0xFFFF_FFFF_FFFF_FFFF]}
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block.replace(DOC_URL, server), str(README), "exec"), scope)
            printed.append(out.getvalue())
        # the quick example routed and freed req-1; the error example added it again
        assert printed[0] == "1 0 32 2\n1 1 0 0\n"
        assert printed[1] == ""
        assert printed[2].startswith("worker_id=1 dp_rank=")
        # the batch freed the unknown req-0 (fine) and found req-1 already active
        assert printed[3].startswith("409 Request req-1 already exists")
        # the selection example booked and freed 40 prompt tokens on the only rank
        assert printed[4] == "1 0 http://10.0.0.1:8000 40\n"
        (qwen,) = tracker.selection.loads("qwen")
        assert [(r.worker_id, r.active_requests) for r in qwen.loads] == [(1, 0)]
        loads = [(r.dp_rank, r.active_requests) for r in tracker.loads("llama")]
        assert loads == [(0, 1), (1, 0)]


def test_client_page_shows_the_tested_example() -> None:
    """docs/python-client.md shows docs/client_example.py (which test_client runs) verbatim."""
    root = README.parents[2]
    example = (root / "docs" / "client_example.py").read_text()
    code = example.split('"""', 2)[2].lstrip("\n")  # without the module docstring
    assert "from kv_slot_tracker_client import SlotTrackerClient" in code
    assert f"```python\n{code}```" in (root / "docs" / "python-client.md").read_text()
