"""The interactive API reference at ``/api/docs``: Swagger UI over ``/api/v1/openapi.json``.

Swagger UI's files come from a Python package (``openapi-ui-bundles``), never a CDN; the page and
its start-up script are ours (``master/data/apidocs/``): the script is a file, because the page's
Content-Security-Policy, like the console's, allows no inline script or style and no other origin.
Every file is read once, on the first app that mounts the routes, and served from memory with an
ETag. Public and never rate-limited, like the console's files; "Try it out" calls the API with the
key typed into Authorize, so the reference shows nothing an anonymous caller could not fetch.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from openapi_ui_bundles import swagger_ui

from master.api.base import RateClass, Route
from shared.errors import NotFound

DOCS = "/api/docs"
OWN_FILES = Path(__file__).resolve().parents[1] / "data" / "apidocs"
# The package's files the page uses; nothing else of it is served.
SWAGGER_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon-32x32.png", "favicon-16x16.png")

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'"
)
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
}


@dataclass(frozen=True)
class DocFile:
    body: bytes
    content_type: str
    etag: str


def _load(path: Path) -> DocFile:
    body = path.read_bytes()
    return DocFile(body, _TYPES[path.suffix], '"' + hashlib.sha256(body).hexdigest()[:32] + '"')


@functools.cache
def doc_files() -> dict[str, DocFile]:
    """Every file of the reference by its name under ``/api/docs/`` (``""``: the page)."""
    files = {name: _load(Path(swagger_ui.static_path) / name) for name in SWAGGER_FILES}
    files.update({path.name: _load(path) for path in OWN_FILES.iterdir() if path.suffix in (".js", ".css")})
    files[""] = _load(OWN_FILES / "index.html")
    return files


def _respond(request: web.Request, item: DocFile) -> web.Response:
    headers = {
        "Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "ETag": item.etag, "Cache-Control": "no-cache",
    }  # fmt: skip
    if item.etag in {tag.strip() for tag in request.headers.get("If-None-Match", "").split(",")}:
        return web.Response(status=304, headers=headers)
    return web.Response(body=item.body, headers={**headers, "Content-Type": item.content_type})


async def docs_page(request: web.Request) -> web.Response:
    return _respond(request, doc_files()[""])


async def docs_file(request: web.Request) -> web.Response:
    item = doc_files().get(request.match_info["name"])
    if item is None:
        raise NotFound(f"no such file of the API reference: {request.path}; the reference is at {DOCS}")
    return _respond(request, item)


UNVERSIONED: tuple[Route, ...] = (
    Route("GET", DOCS, docs_page, "The interactive API reference (Swagger UI).", public=True, limit=RateClass.NONE,
          media_types=("text/html",)),
    Route("GET", DOCS + "/{name:[^/]*}", docs_file, "A file of the API reference (the page itself for an empty name).",
          public=True, limit=RateClass.NONE, media_types=("text/html",)),
)  # fmt: skip
