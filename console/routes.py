"""Console pages (placeholder until the console issue lands)."""

from __future__ import annotations

from html import escape

from aiohttp import web

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>gpumarket console</title>
<style>body{{font-family:system-ui,sans-serif;max-width:46rem;margin:3rem auto;padding:0 1rem;line-height:1.5}}
code{{background:#f3f3f3;padding:.1rem .3rem;border-radius:3px}}</style></head>
<body><main>
<h1>gpumarket</h1>
<p>The web console is coming. Meanwhile, everything is available through the REST API:</p>
<ul>
<li>API: <a href="{api}/openapi.json"><code>{api}</code></a> (OpenAPI document)</li>
<li>Health: <a href="{api}/health"><code>{api}/health</code></a></li>
</ul>
<p>Authenticate with <code>Authorization: Bearer &lt;api key&gt;</code>. In the demo started by
<code>gpumarket up</code>, the keys are in <code>credentials.json</code> in the data directory.</p>
</main></body></html>
"""


async def index(request: web.Request) -> web.Response:
    return web.Response(text=PAGE.format(api=escape("/api/v1")), content_type="text/html")


def add_console_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
