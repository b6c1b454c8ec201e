"""A local HTTP stand-in for Stripe's ``POST /v1/checkout/sessions``, and webhook payloads signed as Stripe signs them.

The ``stripe`` package is pointed at it with its ``api_base`` (``GPUMARKET_STRIPE_API_BASE``): the request is
the real package's real HTTP call, recorded here as Stripe would receive it (form-encoded, bracketed keys).
The fake honours ``Idempotency-Key`` like Stripe (the same key answers the same session) and can be told to
refuse (``refuse``: a 400 ``invalid_request_error``, which the package does not retry).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer


@dataclass
class SentSession:
    """One create request as Stripe received it, and the session answered."""

    form: dict[str, str]
    headers: dict[str, str]
    session: dict[str, Any]


@dataclass
class StripeFake:
    url: str = ""
    sent: list[SentSession] = field(default_factory=list)
    refuse: str | None = None  # answer 400 with this message
    by_key: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def create_session(self, request: web.Request) -> web.Response:
        form = {k: str(v) for k, v in (await request.post()).items()}
        headers = dict(request.headers)
        if self.refuse is not None:
            return web.json_response({"error": {"type": "invalid_request_error", "message": self.refuse}}, status=400)
        key = request.headers.get("Idempotency-Key", "")
        session = self.by_key.get(key)
        if session is None:
            session_id = f"cs_test_{secrets.token_hex(12)}"
            session = {
                "id": session_id, "object": "checkout.session", "url": f"https://checkout.stripe.test/c/pay/{session_id}",
                "amount_total": int(form["line_items[0][price_data][unit_amount]"]), "currency": form["line_items[0][price_data][currency]"],
                "client_reference_id": form["client_reference_id"], "payment_status": "unpaid", "status": "open",
                "metadata": {k[len("metadata["):-1]: v for k, v in form.items() if k.startswith("metadata[")},
            }  # fmt: skip
            if key:
                self.by_key[key] = session
        self.sent.append(SentSession(form, headers, session))
        return web.json_response(session)


@asynccontextmanager
async def stripe_fake() -> AsyncIterator[StripeFake]:
    fake = StripeFake()
    app = web.Application()
    app.router.add_post("/v1/checkout/sessions", fake.create_session)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    fake.url = str(server.make_url("")).rstrip("/")
    try:
        yield fake
    finally:
        await server.close()


def completed_event(session: dict[str, Any], *, event_id: str | None = None, kind: str = "checkout.session.completed",
                    payment_status: str = "paid") -> bytes:  # fmt: skip
    """The JSON body of a Stripe event about ``session``, paid as ``payment_status`` says."""
    obj = {**session, "payment_status": payment_status, "status": "complete"}
    event = {"id": event_id or f"evt_{secrets.token_hex(12)}", "object": "event", "type": kind, "api_version": "2024-06-20",
             "created": int(time.time()), "livemode": False, "data": {"object": obj}}  # fmt: skip
    return json.dumps(event).encode()


def sign(payload: bytes, secret: str, *, at: int | None = None) -> str:
    """A ``Stripe-Signature`` header as Stripe documents it: ``t=<unix time>,v1=<HMAC-SHA256(secret, "t.payload")>``."""
    timestamp = int(time.time()) if at is None else at
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"
