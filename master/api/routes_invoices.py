"""Invoices (renters) and statements (providers), computed from the ledger by ``billing/invoices.py``.

``GET /invoices`` lists the caller's months (admins: ``?account_id=``); ``GET /invoices/{id}``
is the JSON document, ``GET /invoices/{id}?format=html`` the same as a printable page.
Another account's document is 404, exactly as one that does not exist.
"""

from __future__ import annotations

from aiohttp import web

from billing import invoice_html, invoices
from master.api.base import API, QueryParam, Route, str_query
from master.api.keys import MASTER
from master.api.middleware import principal
from shared.errors import BadRequest

FORMATS = ("json", "html")
# The page is the API's origin showing text that came from users (GPU model names, account
# names): escaped, and besides that allowed no script, frame or outside resource at all.
HTML_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "private, no-store",
}


async def list_invoices(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        items = await invoices.list_invoices(session, principal(request), account_id=str_query(request, "account_id"))
    for item in items:
        item["url"] = f"{API}/invoices/{item['id']}"
        item["html_url"] = f"{API}/invoices/{item['id']}?format=html"
    return web.json_response({"items": items, "total": len(items)})


async def get_invoice(request: web.Request) -> web.Response:
    wanted = str_query(request, "format") or "json"
    if wanted not in FORMATS:
        raise BadRequest(f"query parameter 'format' must be json or html, got {wanted[:20]!r}", code="invalid_query")
    async with request.app[MASTER].db.session() as session:
        doc = await invoices.document(session, principal(request), request.match_info["invoice_id"])
    if wanted == "html":
        return web.Response(text=invoice_html.render_html(doc), content_type="text/html", charset="utf-8", headers=HTML_HEADERS)
    return web.json_response(doc, headers={"Cache-Control": "private, no-store"})


ROUTES: tuple[Route, ...] = (
    Route("GET", "/invoices", list_invoices, "Your monthly invoices (renters) or statements (providers), newest first.",
          query=(QueryParam("account_id", "string", "Admins (required): whose documents to list."),), errors=(404,), scope="billing"),
    Route("GET", "/invoices/{invoice_id}", get_invoice,
          "One invoice (inv-YYYY-MM-<account>) or statement (stm-YYYY-MM-<account>); ?format=html for a printable page.",
          query=(QueryParam("format", "string", "json (default) or html.", choices=FORMATS),), errors=(404,),
          media_types=("application/json", "text/html"), scope="billing"),
)  # fmt: skip
