"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), served entirely by the instance itself.

FastAPI's default pages load their JavaScript and CSS from a CDN, so they stay blank where the
service usually runs: without internet. Here the pages point at copies served under
``/docs/assets/``, taken from the ``fastapi-offline`` package (``swagger-ui-bundle.js``,
``swagger-ui.css``, ``redoc.standalone.js`` and a favicon). Nothing else is loaded: no Google
fonts, no favicon from elsewhere, no online validator, not ReDoc's CDN logo (see ``REWRITES``),
and a content security policy makes that a guarantee.

The routes are left out of the OpenAPI document. The pages and assets carry no data, so they
stay open when an API key is set (``DOCS_ASSETS`` is the open prefix); "Try it out" sends the
key the user enters in Swagger UI's "Authorize" dialog.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from importlib.resources import files

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from starlette.exceptions import HTTPException

DOCS_URL = "/docs"
REDOC_URL = "/redoc"
OAUTH2_REDIRECT_URL = "/docs/oauth2-redirect"
DOCS_ASSETS = "/docs/assets/"

SWAGGER_JS = "swagger-ui-bundle.js"
SWAGGER_CSS = "swagger-ui.css"
REDOC_JS = "redoc.standalone.js"
FAVICON = "favicon.png"
ASSET_TYPES = {
    SWAGGER_JS: "text/javascript; charset=utf-8",
    SWAGGER_CSS: "text/css; charset=utf-8",
    REDOC_JS: "text/javascript; charset=utf-8",
    FAVICON: "image/png",
}

# ReDoc's menu footer ("API docs by Redocly") loads Redocly's logo from their CDN. With an empty
# source the image hides itself (its error handler) and no request leaves the page; the text
# link stays. tests/api/test_docs.py fails if a new version of the asset moves this URL.
REDOC_CDN_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"
REWRITES: dict[str, tuple[tuple[bytes, bytes], ...]] = {REDOC_JS: ((REDOC_CDN_LOGO, b""),)}

# Everything comes from this origin. Swagger UI's page starts it with an inline script and both
# UIs inject inline styles; ReDoc runs its search index in a worker made from a blob.
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; "
        "worker-src 'self' blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


@lru_cache(maxsize=len(ASSET_TYPES))
def load_asset(name: str) -> Asset:
    """One of the files shipped in ``fastapi_offline/static``, read once."""
    body = files("fastapi_offline").joinpath("static", name).read_bytes()
    for old, new in REWRITES.get(name, ()):
        body = body.replace(old, new)
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    return Asset(body, ASSET_TYPES[name], etag)


def build_docs_router(title: str, openapi_url: str) -> APIRouter:
    """The docs pages, the OAuth2 redirect page of Swagger UI and the assets both pages load.

    Build the application with ``docs_url=None, redoc_url=None`` so that FastAPI's own CDN
    pages are not registered as well.
    """
    router = APIRouter()

    def prefix(request: Request) -> str:
        root: str = request.scope.get("root_path", "")
        return root.rstrip("/")

    @router.get(DOCS_URL, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = prefix(request)
        page = get_swagger_ui_html(
            openapi_url=root + openapi_url,
            title=f"{title} - Swagger UI",
            swagger_js_url=root + DOCS_ASSETS + SWAGGER_JS,
            swagger_css_url=root + DOCS_ASSETS + SWAGGER_CSS,
            swagger_favicon_url=root + DOCS_ASSETS + FAVICON,
            oauth2_redirect_url=root + OAUTH2_REDIRECT_URL,
            swagger_ui_parameters={"validatorUrl": None},  # no badge from validator.swagger.io
        )
        page.headers.update(PAGE_HEADERS)
        return page

    @router.get(OAUTH2_REDIRECT_URL, include_in_schema=False)
    async def swagger_ui_oauth2_redirect() -> HTMLResponse:
        page = get_swagger_ui_oauth2_redirect_html()
        page.headers.update(PAGE_HEADERS)
        return page

    @router.get(REDOC_URL, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = prefix(request)
        page = get_redoc_html(
            openapi_url=root + openapi_url,
            title=f"{title} - ReDoc",
            redoc_js_url=root + DOCS_ASSETS + REDOC_JS,
            redoc_favicon_url=root + DOCS_ASSETS + FAVICON,
            with_google_fonts=False,
        )
        page.headers.update(PAGE_HEADERS)
        return page

    @router.get(DOCS_ASSETS + "{name}", include_in_schema=False)
    async def asset(name: str, request: Request) -> Response:
        if name not in ASSET_TYPES:  # a fixed list: no path from the client reaches the disk
            raise HTTPException(404)
        found = load_asset(name)
        headers = {
            "etag": found.etag,
            # the names carry no version: revalidate, which costs a 304 once cached
            "cache-control": "no-cache",
            "x-content-type-options": "nosniff",
        }
        if request.headers.get("if-none-match") == found.etag:
            return Response(status_code=304, headers=headers)
        return Response(found.body, media_type=found.media_type, headers=headers)

    return router
