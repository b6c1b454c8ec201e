"""What the web console needs beyond the rest of the API: signing in and out, and live telemetry.

``POST /sessions`` exchanges an API key for a session cookie (``master/services/accounts/sessions.py``);
every other route then accepts that cookie in place of the ``Authorization`` header
(``master/api/middleware.py``), with the session's CSRF token on every change.
``GET /hosts/{id}/metrics/stream`` pushes a host's raw telemetry as Server-Sent Events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from master.api.base import QueryParam, RateClass, Route, int_query, parse_body
from master.api.keys import MASTER
from master.api.middleware import SESSION, principal
from master.api.ratelimits import limit_email, request_address
from master.api.responses import ConsoleSession, SignedOut
from master.context import Master
from master.services import accounts
from master.telemetry import series
from shared.errors import ClientError, NotFound

# Samples one read of the live stream sends at most; a host sends one per telemetry interval.
STREAM_PAGE = 100
KEEPALIVE_S = 15.0
STREAMS_CLOSING = web.AppKey("streams_closing", asyncio.Event)


class SessionCreate(BaseModel):
    """Either an email and a password, or an API key."""

    model_config = ConfigDict(extra="forbid")

    email: str | None = Field(None, min_length=1, max_length=254, description="Your account's email address (with password).")
    password: str | None = Field(None, min_length=1, max_length=1024, description="Your password (with email).")
    totp_code: str | None = Field(None, min_length=1, max_length=32, description="With a second factor: the code of your "
                                  "authenticator app, or a recovery code.")  # fmt: skip
    # Any length is a key to check: a short one is refused as a wrong key (401), not as malformed input.
    api_key: str | None = Field(None, min_length=1, max_length=256, description="Or your API key; the console keeps a session cookie instead.")

    @model_validator(mode="after")
    def one_way_in(self) -> SessionCreate:
        by_password = self.email is not None or self.password is not None
        if by_password == (self.api_key is not None) or (by_password and (self.email is None or self.password is None)):
            raise ValueError("send either email and password (and totp_code), or api_key")
        if self.totp_code is not None and not by_password:
            raise ValueError("totp_code goes with email and password")
        return self


class UnsupportedMediaType(ClientError):
    code = "unsupported_media_type"
    http_status = 415


def _secure_cookie(request: web.Request) -> bool:
    chosen = request.app[MASTER].settings.console_secure_cookie
    if chosen is not None:
        return chosen
    public = request.app[MASTER].settings.public_url or ""
    return request.secure or public.startswith("https://")


async def create_session(request: web.Request) -> web.Response:
    # A JSON body only: a cross-site HTML form cannot send one, so nobody signs a browser in behind its back.
    if request.content_type != "application/json":
        raise UnsupportedMediaType("send a JSON body: {\"email\": \"...\", \"password\": \"...\"} or {\"api_key\": \"...\"}")
    body = await parse_body(request, SessionCreate)
    master = request.app[MASTER]
    address, now = request_address(request), master.clock.now()
    if body.email is not None and body.password is not None:
        await limit_email(request, body.email)
        async with master.db.session() as session:  # a failure's audit record commits before the 401
            opened = await accounts.sign_in_password(session, body.email, body.password, settings=master.settings, now=now,
                                                     address=address, totp_code=body.totp_code)  # fmt: skip
        if isinstance(opened, Exception):
            raise opened
        token, signed_in = opened
    else:
        assert body.api_key is not None
        async with master.db.session() as session:
            token, signed_in = await accounts.sign_in(session, body.api_key.strip(), settings=master.settings, now=now, address=address)
    return session_opened(request, token, signed_in)


def session_opened(request: web.Request, token: str, signed_in: accounts.SignedIn) -> web.Response:
    """The 201 of a sign-in (by password, key or passkey): the session's view, its token in the HttpOnly cookie."""
    response = web.json_response(signed_in.view(), status=201, headers={"Cache-Control": "no-store"})
    response.set_cookie(
        accounts.COOKIE, token, httponly=True, samesite="Strict", secure=_secure_cookie(request), path="/",
        max_age=int(request.app[MASTER].settings.console_session_max_s),
    )  # fmt: skip
    return response


def _signed_in(request: web.Request) -> accounts.SignedIn:
    if SESSION not in request:
        raise NotFound("this call was made with an API key, not a console session", code="no_session")
    return request[SESSION]


async def get_session(request: web.Request) -> web.Response:
    return web.json_response(_signed_in(request).view(), headers={"Cache-Control": "no-store"})


async def delete_session(request: web.Request) -> web.Response:
    signed_in = _signed_in(request)
    master = request.app[MASTER]
    async with master.db.session() as session:
        await accounts.sign_out(session, signed_in.session_id, now=master.clock.now())
    response = web.json_response({"signed_out": True})
    response.del_cookie(accounts.COOKIE, path="/")
    return response


def _event(item: dict[str, Any]) -> bytes:
    return f"id: {item['seq']}\nevent: sample\ndata: {json.dumps(item, separators=(',', ':'))}\n\n".encode()


def _resume_from(request: web.Request) -> int | None:
    """The sequence number the browser saw last (EventSource's ``Last-Event-ID``, or ``?after_seq=``)."""
    raw = request.headers.get("Last-Event-ID") or request.query.get("after_seq")
    if not raw:
        return None
    try:
        return max(-1, int(raw))
    except ValueError:
        return None  # a stale or foreign id: start again from the recent samples


async def stream_host_metrics(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events: the host's recent raw samples, then each new one as it is stored.

    The stream closes after ``stream_max_s`` (the browser reconnects with ``Last-Event-ID`` and is
    authorized again), at once when the master shuts down, and at its next poll once the console
    session it was opened with is over (signed out, expired, its key revoked: the reconnect is then
    refused with 401 and the console asks to sign in). A client that goes away ends it at the next
    write; no transaction is open while it waits.
    """
    master = request.app[MASTER]
    backlog = int_query(request, "backlog", 60, minimum=0, maximum=1000)
    resume = _resume_from(request)
    host_id, first, last_seq = await series.stream_start(
        master, principal(request), request.match_info["host_id"], resume=resume, backlog=backlog, limit=STREAM_PAGE
    )
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    closing = request.app[STREAMS_CLOSING]
    signed_in = request.get(SESSION)  # None: opened with an API key, authorized again when it reconnects
    clock, settings = master.clock, master.settings
    deadline = clock.monotonic() + settings.stream_max_s
    last_write = clock.monotonic()
    with contextlib.suppress(ConnectionResetError):
        await response.write(b"retry: 2000\n\n" + b"".join(_event(item) for item in first))
        while clock.monotonic() < deadline and not closing.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(settings.stream_poll_interval):  # not wait_for (shared/cancelling.py)
                    await closing.wait()
            items = await series.samples_after(master, host_id, last_seq, limit=STREAM_PAGE)
            # Checked after the read: a session that ended before it (and so before anything stored after its end)
            # gets none of it. Checked before, a sign-out and a sample stored between the two went out (fresh run 40).
            if signed_in is not None and not await _still_signed_in(master, signed_in.session_id):
                break  # nothing more for a session that is over, not even what was stored before it ended
            if items:
                last_seq = items[-1]["seq"]
                await response.write(b"".join(_event(item) for item in items))
                last_write = clock.monotonic()
            elif clock.monotonic() - last_write >= KEEPALIVE_S:
                await response.write(b": keep-alive\n\n")
                last_write = clock.monotonic()
    return response


async def _still_signed_in(master: Master, session_id: str) -> bool:
    async with master.db.session() as session:
        return await accounts.is_live(session, session_id, settings=master.settings, now=master.clock.now())


async def streams_ctx(app: web.Application) -> AsyncIterator[None]:
    """The event that ends live streams; ``close_streams`` sets it when the app starts shutting down."""
    app[STREAMS_CLOSING] = asyncio.Event()
    yield


async def close_streams(app: web.Application) -> None:
    """An ``on_shutdown`` hook: streams end when the app shuts down, rather than holding it up until they time out
    (shutdown waits for open requests before the cleanup contexts run)."""
    app[STREAMS_CLOSING].set()


ROUTES: tuple[Route, ...] = (
    Route("POST", "/sessions", create_session, "Sign in to the web console: an email and password, or an API key, for a "
          "session cookie (HttpOnly, SameSite=Strict) and the CSRF token every change must send in X-CSRF-Token.",
          public=True, limit=RateClass.SIGN_IN, body=SessionCreate, response=ConsoleSession, success=201, errors=(401, 415, 422)),
    Route("GET", "/sessions/current", get_session, "The console session of the cookie: account, CSRF token, end.",
          response=ConsoleSession, errors=(401, 404)),
    Route("DELETE", "/sessions/current", delete_session, "Sign out: end the console session and clear its cookie.",
          response=SignedOut, errors=(401, 403, 404), scope="read"),
    Route("GET", "/hosts/{host_id}/metrics/stream", stream_host_metrics,
          "Live raw telemetry of a host as Server-Sent Events ('sample' events, id = sequence number): the recent "
          "samples, then each new one. Resumes after Last-Event-ID.",
          query=(QueryParam("backlog", "integer", "Recent samples sent first (default 60).", 0, 1000),
                 QueryParam("after_seq", "string", "Send only samples after this sequence number (any value that is not "
                            "an integer starts from the recent samples, as a stale Last-Event-ID does)."),
                 QueryParam("team", "string", "Act for this team (its id), as the Gpumarket-Team header says elsewhere: "
                            "a browser's EventSource cannot send headers.")),
          errors=(404,), media_types=("text/event-stream",)),
)  # fmt: skip
