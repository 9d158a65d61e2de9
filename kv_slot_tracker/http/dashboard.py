"""``GET /dashboard``: a live, self-contained load page for people.

The page is one static HTML file (``kv_slot_tracker/static/dashboard.html``: inline CSS and vanilla
JavaScript, no build step, no external resources) that polls ``/loads``, ``/workers``,
``/ready``, ``/replication``, ``/selection/loads``, ``/selection/workers`` and ``/selection/ready``
once a second with relative URLs. The selection table shows, per partition, each schedulable
rank's KV-event publisher as live, silent or disconnected (``/selection/ready``'s ``kv_events``),
never as ready when it is not. The HTML itself needs no key; when the
instance has an API key, the page asks for it (or takes ``?key=...``), keeps it in
``sessionStorage`` and sends it as ``Authorization: Bearer``.
"""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = "dashboard.html"

# The page loads nothing from elsewhere; the policy makes that a guarantee. The key may sit in
# the page's address for a moment, so no referrer is ever sent.
HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
}


@lru_cache(maxsize=1)
def page_html() -> str:
    """The dashboard's HTML, read once from the package data."""
    return files("kv_slot_tracker").joinpath("static", PAGE).read_text(encoding="utf-8")


def build_dashboard_router() -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard", include_in_schema=False, response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page_html(), headers=HEADERS)

    return router
