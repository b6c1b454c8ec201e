"""The web console: one static single-page app (``console/static/``) served at ``/``.

The console is a pure client of the REST API: plain HTML, CSS and JavaScript modules, no
build step and nothing fetched from elsewhere at run time. Its files are read once when
the routes are added and served from memory with explicit content types, an ETag and a
strict Content-Security-Policy (no inline script or style, no outside origin).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).resolve().parent / "static"

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    content_type: str
    etag: str


def load_static(folder: Path = STATIC_DIR) -> dict[str, StaticFile]:
    """Every servable file under ``folder`` by its path relative to it (``app.js``, ``img/x.svg``)."""
    files: dict[str, StaticFile] = {}
    for path in sorted(folder.rglob("*")):
        content_type = CONTENT_TYPES.get(path.suffix.lower())
        if not path.is_file() or content_type is None or path.name.startswith("."):
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        files[path.relative_to(folder).as_posix()] = StaticFile(body, content_type, etag)
    return files


STATIC: web.AppKey[dict[str, StaticFile]] = web.AppKey("console_static")


def _respond(request: web.Request, item: StaticFile) -> web.Response:
    headers = {**SECURITY_HEADERS, "ETag": item.etag, "Cache-Control": "no-cache"}
    if item.etag in {tag.strip() for tag in request.headers.get("If-None-Match", "").split(",")}:
        return web.Response(status=304, headers=headers)
    headers["Content-Type"] = item.content_type
    return web.Response(body=item.body, headers=headers)


async def index(request: web.Request) -> web.Response:
    return _respond(request, request.app[STATIC]["index.html"])


async def static(request: web.Request) -> web.Response:
    item = request.app[STATIC].get(request.match_info["path"])
    if item is None:
        raise web.HTTPNotFound()
    return _respond(request, item)


def add_console_routes(app: web.Application) -> None:
    files = load_static()
    if "index.html" not in files:
        raise RuntimeError(f"the console's index.html is missing from {STATIC_DIR}; reinstall gpumarket")
    app[STATIC] = files
    app.router.add_get("/", index)
    app.router.add_get("/static/{path:.+}", static)
