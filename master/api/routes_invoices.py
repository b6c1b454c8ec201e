"""Invoices (renters) and statements (providers), computed from the ledger (``billing/invoices.py``).

``GET /invoices`` lists the caller's months; ``GET /invoices/{id}`` is JSON, ``?format=html``
a printable page. Another account's document is 404, exactly as one that does not exist.
"""

from __future__ import annotations

from aiohttp import web

from billing import invoices
from master.api.base import QueryParam, Route, str_query
from master.api.keys import MASTER
from master.api.middleware import principal
from shared.errors import BadRequest


async def list_invoices(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        items = await invoices.list_documents(session, principal(request), account_id=str_query(request, "account_id"))
    return web.json_response({"items": items, "total": len(items)})


async def get_invoice(request: web.Request) -> web.Response:
    wanted = str_query(request, "format") or "json"
    if wanted not in ("json", "html"):
        raise BadRequest(f"format must be json or html, not {wanted[:20]!r}", code="invalid_query")
    async with request.app[MASTER].db.session() as session:
        doc = await invoices.document(session, principal(request), request.match_info["invoice_id"])
    if wanted == "html":
        return web.Response(text=invoices.render_html(doc), content_type="text/html", charset="utf-8")
    return web.json_response(doc)


ROUTES: tuple[Route, ...] = (
    Route("GET", "/invoices", list_invoices, "Your monthly invoices (renters) or statements (providers), newest first.",
          query=(QueryParam("account_id", "string", "Admins: another account's."),)),
    Route("GET", "/invoices/{invoice_id}", get_invoice, "One invoice or statement with its lines; ?format=html for a printable page.",
          query=(QueryParam("format", "string", "json (default) or html."),), errors=(400, 404)),
)  # fmt: skip
