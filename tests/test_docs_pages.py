"""The README and the pages of ``docs/`` hold together.

* every relative link (and image) of ``README.md``, ``docs/*.md`` and the client's README names a
  file that exists and, for a Markdown page, a heading anchor that page has (GitHub's slugs);
* every page of ``docs/`` is listed in ``docs/README.md``, and the README links the index;
* every operation of the application is listed in the API reference's tables and named in the
  README's "API at a glance"; every setting is in the configuration page's table.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

from kv_slot_tracker.config_sources import ENV_PREFIX
from kv_slot_tracker.main import create_app
from kv_slot_tracker.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "clients/python/README.md"]
HTTP_METHODS = ("get", "put", "post", "delete", "patch")


def parse(text: str) -> list[Token]:
    return MarkdownIt("commonmark").enable("table").parse(text)


def inline_tokens(tokens: list[Token]) -> list[Token]:
    return [child for t in tokens if t.type == "inline" for child in t.children or []]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: lower case, only letters, digits, ``-`` and ``_``
    kept, each space a hyphen."""
    kept = "".join(
        c for c in heading.lower() if c in " -_" or unicodedata.category(c)[0] in ("L", "N", "M")
    )
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page, a repeated heading numbered as GitHub numbers it."""
    tokens = parse(text)
    seen: dict[str, int] = {}
    found = set()
    for i, token in enumerate(tokens):
        if token.type != "heading_open":
            continue
        children = tokens[i + 1].children or []
        base = slug("".join(c.content for c in children if c.type in ("text", "code_inline")))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> list[str]:
    out = []
    for token in inline_tokens(parse(text)):
        if token.type == "link_open":
            out.append(str(token.attrs["href"]))
        elif token.type == "image":
            out.append(str(token.attrs["src"]))
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that name no file, or no heading of the page they name."""
    broken = []
    for href in links(page.read_text()):
        parts = urlsplit(href)
        if parts.scheme or parts.netloc:
            continue  # absolute: not checked (the machine has no internet)
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not target.exists():
            broken.append(f"{href}: no such file")
        elif (
            parts.fragment
            and target.suffix == ".md"
            and unquote(parts.fragment) not in anchors(target.read_text())
        ):
            broken.append(f"{href}: no heading #{parts.fragment} in {target.name}")
    return broken


def test_slugs_are_githubs() -> None:
    text = (
        "# Selection API (`/selection`)\n\n## Several processes on one host (`workers`)\n\n"
        "## Deploy: container, Compose and Kubernetes\n\n## What it does\n\n## What it does\n"
    )
    assert anchors(text) == {
        "selection-api-selection",
        "several-processes-on-one-host-workers",
        "deploy-container-compose-and-kubernetes",
        "what-it-does",
        "what-it-does-1",
    }


def test_the_check_finds_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [self](#page) [web](https://example.com/x)\n\n"
        "[gone](missing.md) [anchor](other.md#nope) | `[code](nope.md)`\n\n"
        "```sh\n[fenced](nope.md)\n```\n\n![img](pic.png)\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nope: no heading #nope in other.md",
        "pic.png: no such file",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert links(page.read_text()), f"{page.name} links nothing"
    assert broken_links(page) == []


def test_the_index_lists_every_page() -> None:
    listed = {urlsplit(h).path for h in links((DOCS / "README.md").read_text())}
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages - listed == set()
    assert "docs/README.md" in links((ROOT / "README.md").read_text())


def operations() -> set[tuple[str, str]]:
    doc = create_app(load_settings(redis_url="")).openapi()
    return {(m.upper(), p) for p, item in doc["paths"].items() for m in HTTP_METHODS if m in item}


def normal(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)


def test_the_api_reference_lists_every_operation() -> None:
    """Each operation is a ``METHOD /path`` cell of a table of docs/api.md (path parameters
    named as the reader likes), and nothing listed there is not an operation."""
    tokens = parse((DOCS / "api.md").read_text())
    listed = set()
    for i, token in enumerate(tokens):
        if token.type == "td_open" and tokens[i - 1].type == "tr_open":  # the first cell
            cell = tokens[i + 1].content
            listed |= set(re.findall(r"`(GET|POST|PATCH|DELETE|PUT) (/[^`\s]*)`", cell))
    expected = {(m, normal(p)) for m, p in operations()}
    listed = {(m, normal(p)) for m, p in listed}
    # the docs pages are not in the schema but are in the table
    assert expected - listed == set()
    assert listed - expected <= {("GET", "/dashboard"), ("GET", "/docs"), ("GET", "/openapi.json")}


def test_the_readme_names_every_route() -> None:
    text = (ROOT / "README.md").read_text()
    glance = text[text.index("\n## API at a glance\n") :]
    glance = glance[: glance.index("\n## ", 1)]
    named = set(re.findall(r"(/[a-z_/{}]+)", glance))
    assert {p for _, p in operations()} - named == set()
    assert len(text.splitlines()) < 150, "the README is the first read: keep the rest in docs/"


def test_the_configuration_page_lists_every_setting() -> None:
    """Each setting is in the first column of docs/configuration.md's table, with its variable
    in the second, and the table names no setting the service does not have."""
    tokens = parse((DOCS / "configuration.md").read_text())
    names, variables = set(), set()
    for i, token in enumerate(tokens):
        if token.type == "td_open" and tokens[i - 1].type == "tr_open":
            names |= set(re.findall(r"`([a-z0-9_]+)`", tokens[i + 1].content))
            variables |= set(re.findall(r"`(SLOT_TRACKER_[A-Z0-9_]+)`", tokens[i + 4].content))
    fields = set(Settings.model_fields)
    assert (fields - names, names - fields) == (set(), set())
    assert variables <= {ENV_PREFIX + f.upper() for f in fields}
