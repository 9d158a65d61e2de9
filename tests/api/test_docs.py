"""``/docs`` and ``/redoc`` need no internet: the pages load their assets from the instance.

The pages are checked here over HTTP (what they reference, headers, HEAD, caching, the key);
``tests/browser/test_docs.py`` renders them in a real Chromium without network access.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kv_slot_tracker.http.docs import ASSET_TYPES, DOCS_ASSETS, REDOC_CDN_LOGO, load_asset

KEY = "docs-key"
PAGES = ["/docs", "/redoc", "/docs/oauth2-redirect"]
ABSOLUTE_URL = re.compile(r"""(?:https?:)?//[^\s"'<>)]+""")
SRC_OR_HREF = re.compile(r"""(?:src|href)=["']([^"']+)["']""")


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"api_key": KEY}


async def test_pages_reference_only_assets_of_the_instance(client: httpx.AsyncClient) -> None:
    swagger = (await client.get("/docs")).text
    assert SRC_OR_HREF.findall(swagger) == [
        "/docs/assets/swagger-ui.css",
        "/docs/assets/favicon.png",
        "/docs/assets/swagger-ui-bundle.js",
    ]
    assert "url: '/openapi.json'" in swagger
    assert "window.location.origin + '/docs/oauth2-redirect'" in swagger
    assert '"validatorUrl": null' in swagger
    redoc = (await client.get("/redoc")).text
    assert SRC_OR_HREF.findall(redoc) == [
        "/docs/assets/favicon.png",
        "/docs/assets/redoc.standalone.js",
    ]
    assert '<redoc spec-url="/openapi.json">' in redoc
    for page in (swagger, redoc, (await client.get("/docs/oauth2-redirect")).text):
        assert ABSOLUTE_URL.findall(page) == []


async def test_pages_forbid_loading_from_elsewhere(client: httpx.AsyncClient) -> None:
    for path in PAGES:
        resp = await client.get(path)
        assert resp.status_code == 200, path
        assert resp.headers["content-type"] == "text/html; charset=utf-8"
        csp = dict(
            part.strip().split(" ", 1)
            for part in resp.headers["content-security-policy"].split(";")
        )
        assert csp["default-src"] == "'none'"
        assert csp["script-src"] == "'self' 'unsafe-inline'"
        assert csp["connect-src"] == "'self'"
        assert csp["img-src"] == "'self' data:"
        assert resp.headers["referrer-policy"] == "no-referrer"


@pytest.mark.parametrize(
    ("name", "media_type", "starts_with"),
    [
        ("swagger-ui-bundle.js", "text/javascript; charset=utf-8", b"/*! For license"),
        ("swagger-ui.css", "text/css; charset=utf-8", b".swagger-ui"),
        ("redoc.standalone.js", "text/javascript; charset=utf-8", b"/*! For license"),
        ("favicon.png", "image/png", b"\x89PNG\r\n"),
    ],
)
async def test_assets_are_served_with_their_type_and_a_validator(
    client: httpx.AsyncClient, name: str, media_type: str, starts_with: bytes
) -> None:
    resp = await client.get(DOCS_ASSETS + name)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == media_type
    assert resp.content.startswith(starts_with)
    assert resp.content == load_asset(name).body
    assert int(resp.headers["content-length"]) == len(resp.content) > 1000
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-content-type-options"] == "nosniff"
    etag = resp.headers["etag"]
    assert re.fullmatch(r'"[0-9a-f]{32}"', etag)

    again = await client.get(DOCS_ASSETS + name, headers={"if-none-match": etag})
    assert (again.status_code, again.content, again.headers["etag"]) == (304, b"", etag)
    other = await client.get(DOCS_ASSETS + name, headers={"if-none-match": '"stale"'})
    assert (other.status_code, other.content) == (200, resp.content)

    head = await client.head(DOCS_ASSETS + name)
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-length"] == resp.headers["content-length"]
    assert head.headers["content-type"] == media_type


async def test_assets_and_pages_are_open_with_a_key_set(client: httpx.AsyncClient) -> None:
    for path in [*PAGES, *(DOCS_ASSETS + name for name in ASSET_TYPES)]:
        for headers in ({}, {"authorization": "Bearer wrong"}):
            resp = await client.get(path, headers=headers)
            assert resp.status_code == 200, (path, headers)
        assert (await client.head(path)).status_code == 200, path
    # only the asset prefix is open, not what merely starts like it
    for path in ["/docs/assetsx", "/docs/asset/swagger-ui.css", "/docs/swagger-ui.css"]:
        resp = await client.get(path)
        assert (resp.status_code, resp.json()) == (401, {"error": "missing or invalid bearer key"})


async def test_unknown_assets_are_404_and_read_nothing_from_disk(client: httpx.AsyncClient) -> None:
    for name in ["nope.js", "__init__.py", "core.py", "..%2Fcore.py", "static", ""]:
        resp = await client.get(DOCS_ASSETS + name)
        assert (resp.status_code, resp.json()) == (404, {"error": "route not found"}), name
    assert (await client.get("/docs/assets/swagger-ui.css/x")).status_code == 404
    assert (await client.post(DOCS_ASSETS + "swagger-ui.css")).status_code == 405


def test_redoc_asset_no_longer_loads_the_cdn_logo() -> None:
    """The rewrite still applies: the shipped file has the URL, the served one does not."""
    from importlib.resources import files

    shipped = files("fastapi_offline").joinpath("static", "redoc.standalone.js").read_bytes()
    assert shipped.count(REDOC_CDN_LOGO) == 1
    served = load_asset("redoc.standalone.js").body
    assert REDOC_CDN_LOGO not in served
    assert b"https://cdn." not in served
    assert len(served) == len(shipped) - len(REDOC_CDN_LOGO)


async def test_docs_routes_are_not_in_the_schema(app: FastAPI, client: httpx.AsyncClient) -> None:
    for doc in (app.openapi(), (await client.get("/openapi.json")).json()):
        assert [p for p in doc["paths"] if p.startswith(("/docs", "/redoc"))] == []


async def test_pages_follow_the_root_path(make_client: Any) -> None:
    """Behind a proxy that strips a prefix, the pages ask for the prefixed URLs."""
    async with make_client() as (app, _):
        transport = httpx.ASGITransport(app=app, root_path="/tracker")
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            swagger = (await client.get("/docs")).text
            redoc = (await client.get("/redoc")).text
    assert "/tracker/docs/assets/swagger-ui-bundle.js" in swagger
    assert "url: '/tracker/openapi.json'" in swagger
    assert "'/tracker/docs/oauth2-redirect'" in swagger
    assert '<redoc spec-url="/tracker/openapi.json">' in redoc
    assert "/tracker/docs/assets/redoc.standalone.js" in redoc


async def test_with_a_key_the_document_asks_for_it_except_on_open_paths(
    app: FastAPI, client: httpx.AsyncClient
) -> None:
    """Swagger UI sends the key it was given only to operations that require it."""
    doc = (await client.get("/openapi.json")).json()
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    assert doc["security"] == [{"bearer": []}]
    open_ops = {
        (path, method)
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if op.get("security") == []
    }
    assert open_ops == {
        ("/health", "get"),
        ("/ready", "get"),
        ("/metrics", "get"),
        ("/selection/health", "get"),
        ("/selection/ready", "get"),
    }
    assert all(
        "security" not in op
        for path, item in doc["paths"].items()
        for op in item.values()
        if path not in {"/health", "/ready", "/metrics", "/selection/health", "/selection/ready"}
    )
    assert KEY not in (await client.get("/openapi.json")).text


async def test_without_a_key_the_document_asks_for_none(make_client: Any) -> None:
    async with make_client() as (app, _):
        doc = app.openapi()
    assert "security" not in doc
    assert "securitySchemes" not in doc["components"]
    assert all("security" not in op for item in doc["paths"].values() for op in item.values())
