"""Forwarding one request to a service's replica: headers, body, retries, the streamed answer, websockets.

``{public_url}/svc/{service}/{tail}?{query}`` goes to ``/{tail}?{query}`` on the replica's service port,
its path and query as the client wrote them.

* **Headers.** ``Authorization`` and the master's own console cookie are taken out; hop-by-hop headers
  (``Connection`` and those it names, ``Keep-Alive``, ``TE``, ``Transfer-Encoding``, ``Upgrade``…) are
  the two connections' own. Added: ``X-Forwarded-For`` (the client's address after any the request
  carried), ``X-Forwarded-Proto``, ``X-Forwarded-Host``, and ``X-Request-Id`` (the client's, or a new
  one; it comes back on the answer). From the answer, headers that would act on the master's whole
  origin are dropped: ``Set-Cookie``, ``Strict-Transport-Security``, ``Alt-Svc``, ``Clear-Site-Data``.
* **Body.** At most ``gateway_max_body_mib`` (413 ``request_too_large``). One of up to
  ``gateway_retry_body_max_kib`` is read whole first, so it can be sent again; a larger one is
  streamed to the replica as it arrives, and its request is sent once.
* **Retries.** An attempt that fails before any of the answer reached the client is sent to another
  replica (``Gateway.pick``), twice at most (counted as retries): always when no stream to the replica
  opened (nothing was sent), and when the stream broke after sending only for an idempotent request
  (GET, HEAD, PUT, DELETE, OPTIONS, TRACE, or any with an ``Idempotency-Key``) whose body was kept.
  Otherwise 502 ``upstream_failed``; an answer not started within ``gateway_request_timeout_s`` is
  504 ``upstream_timeout``. (aiohttp itself sends an idempotent request once more, to the same replica,
  when the kept-alive connection it took turns out closed; that one is not counted.)
* **Answer.** Status and headers as soon as the replica sends them, then the body chunk by chunk as it
  arrives (server-sent events arrive token by token), undecoded. An answer that breaks off after its
  head cannot be retried: the client's connection is dropped, so it sees a truncated body, never a
  complete-looking one. A small answer (a ``Content-Length`` up to ``WHOLE_ANSWER_MAX``, 64 KiB, no
  ``Transfer-Encoding``) is read whole first and sent in one write, head and body (one send to the
  client instead of two: most of an API's answers); if it breaks off, its head goes out and the
  connection drops, as for a streamed one. The whole request is bounded by ``gateway_request_timeout_s``.
* **Websockets.** An upgrade request is opened on a replica first (the same retries: the handshake is a
  GET), then accepted with the subprotocol the replica chose; messages pass both ways as they come,
  and a close passes on with its code and reason (1005/1006, which cannot be sent, as 1000/1011).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from aiohttp import WSMsgType, web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from master.services import accounts
from master.services.gateway.core import Gateway
from master.services.gateway.routing import ServiceRoute
from master.services.gateway.stats import ServiceStats
from master.services.gateway.upstream import ReplicaPool, UpstreamUnavailable
from shared.errors import ClientError, GpumarketError
from shared.streams.aio import first_done

log = logging.getLogger(__name__)

MAX_RETRIES = 2
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "content-length", "authorization",
})  # fmt: skip
WEBSOCKET_HANDSHAKE = frozenset({"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                                 "sec-websocket-protocol", "sec-websocket-accept"})  # fmt: skip
ORIGIN_WIDE = frozenset({"set-cookie", "strict-transport-security", "alt-svc", "clear-site-data"})
UPSTREAM = "http://replica"  # the pool's connections are all to one replica: the name only keys aiohttp's pool
CHUNK = 64 * 1024
WHOLE_ANSWER_MAX = 64 * 1024
MAX_WS_MESSAGE = 4 * 1024 * 1024
WS_CLOSE_TIMEOUT = 5.0
T = TypeVar("T")
UNSENDABLE_CLOSES = {1005: 1000, 1006: 1011, 1015: 1011}


class UpstreamFailed(GpumarketError):
    code = "upstream_failed"
    http_status = 502


class UpstreamTimeout(GpumarketError):
    code = "upstream_timeout"
    http_status = 504


class WebsocketRefused(GpumarketError):
    code = "websocket_refused"

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.http_status = status if 400 <= status < 600 else 502


class BodyTooLarge(ClientError):
    code = "request_too_large"
    http_status = 413


@dataclass
class Body:
    """A request body: ``data`` kept whole (it can be sent again), or read from ``source`` as it is sent (once)."""

    data: bytes | None = None
    source: web.Request | None = None
    first: bytes = b""
    max_body: int = 0
    started: bool = False

    @property
    def resendable(self) -> bool:
        """Whether an attempt may send it again: kept whole, or never begun."""
        return self.source is None or not self.started

    def payload(self) -> bytes | AsyncIterator[bytes] | None:
        return self.data if self.source is None else self._stream(self.source)

    async def _stream(self, source: web.Request) -> AsyncIterator[bytes]:
        self.started = True
        sent = len(self.first)
        if self.first:
            yield self.first
        while chunk := await source.content.read(CHUNK):
            sent += len(chunk)
            if sent > self.max_body:
                raise BodyTooLarge(f"the request body passed {self.max_body} bytes, the most a service's endpoint takes")
            yield chunk


def error_response(exc: GpumarketError, *, request_id: str | None = None) -> web.Response:
    """The API's JSON error (``{"code", "message"}``), with ``Retry-After`` where the error names one."""
    response = web.json_response(exc.to_json(), status=exc.http_status)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    if request_id is not None:
        response.headers["X-Request-Id"] = request_id
    return response


def idempotent(request: web.Request) -> bool:
    return request.method in IDEMPOTENT_METHODS or "Idempotency-Key" in request.headers


def is_websocket(request: web.Request) -> bool:
    return request.headers.get("Upgrade", "").lower() == "websocket" and request.method == "GET"


def forwarded_headers(request: web.Request, request_id: str, *, websocket: bool = False) -> CIMultiDict[str]:
    """The request's headers as the replica gets them (see the module's policy)."""
    dropped = set(HOP_BY_HOP)
    for token in request.headers.getall("Connection", ()):
        dropped.update(name.strip().lower() for name in token.split(","))
    if websocket:
        dropped |= WEBSOCKET_HANDSHAKE  # aiohttp's client makes its own handshake
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
        lower = name.lower()
        if lower in dropped or lower == accounts.CSRF_HEADER.lower():
            continue
        if lower == "cookie":
            value = _without_console_cookie(value)
            if not value:
                continue
        headers.add(name, value)
    peer = request.remote or ""
    before = request.headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{before}, {peer}" if before else peer
    headers["X-Forwarded-Proto"] = request.headers.get("X-Forwarded-Proto") or request.scheme
    headers["X-Forwarded-Host"] = request.headers.get("X-Forwarded-Host") or request.host
    headers["X-Request-Id"] = request_id
    return headers


def _without_console_cookie(header: str) -> str:
    parts = [part.strip() for part in header.split(";")]
    return "; ".join(p for p in parts if p and p.split("=", 1)[0].strip() != accounts.COOKIE)


def answer_headers(upstream: CIMultiDictProxy[str], request_id: str) -> CIMultiDict[str]:
    """The replica's answer headers as the client gets them (hop-by-hop and origin-wide ones dropped)."""
    dropped = set(HOP_BY_HOP) - {"content-length"}
    for token in upstream.getall("Connection", ()):
        dropped.update(name.strip().lower() for name in token.split(","))
    dropped |= ORIGIN_WIDE
    headers: CIMultiDict[str] = CIMultiDict((n, v) for n, v in upstream.items() if n.lower() not in dropped)
    if "transfer-encoding" in {n.lower() for n in upstream}:
        headers.popall("Content-Length", None)  # chunked wins over a length (RFC 9112 6.3)
    headers.setdefault("X-Request-Id", request_id)
    return headers


def upstream_url(request: web.Request, prefix_len: int) -> URL:
    """``/{tail}?{query}`` on the replica, exactly as the client encoded it."""
    tail = request.raw_path[prefix_len:]
    if not tail.startswith("/"):
        tail = "/" + tail
    return URL(UPSTREAM + tail, encoded=True)


async def read_body(request: web.Request, *, keep_max: int, max_body: int) -> Body:
    """The body kept whole when it is at most ``keep_max`` bytes, else streamed; ``BodyTooLarge`` past ``max_body``."""
    length = request.content_length
    if length is not None and length > max_body:
        raise BodyTooLarge(f"the request body is {length} bytes; a service's endpoint takes at most {max_body}")
    if not request.body_exists:
        return Body()
    if length is not None and length > keep_max:
        return Body(source=request, max_body=max_body)
    kept = bytearray()
    while len(kept) <= keep_max:
        chunk = await request.content.read(min(CHUNK, keep_max + 1 - len(kept)))
        if not chunk:
            return Body(data=bytes(kept))
        kept += chunk
    return Body(source=request, first=bytes(kept), max_body=max_body)


class Attempt:
    """One request's way through replicas: which were tried, the retries spent, the time left."""

    def __init__(self, gateway: Gateway, route: ServiceRoute, stats: ServiceStats, *, deadline: float) -> None:
        self.gateway, self.route, self.stats, self.deadline = gateway, route, stats, deadline
        self.tried: set[str] = set()
        self.retries = 0

    def next(self, failure: str | None) -> tuple[str, ReplicaPool]:
        """The next replica (its rental id and pool); ``UpstreamFailed`` when none is left or retries are spent."""
        if failure is not None:
            if self.retries >= MAX_RETRIES:
                raise UpstreamFailed(f"no replica of service {self.route.service_id} answered ({failure}); retry later")
            self.retries += 1
            self.stats.retried()
        picked = self.gateway.pick(self.route, self.tried)
        if picked is None:
            raise UpstreamFailed(f"no replica of service {self.route.service_id} answered ({failure or 'none ready'}); "
                                 "retry later")  # fmt: skip
        replica, pool = picked
        self.tried.add(replica.rental_id)
        return replica.rental_id, pool

    def remaining(self) -> float:
        return max(0.001, self.deadline - self.gateway.clock())

    async def open(self, open_one: Callable[[ReplicaPool], Awaitable[T]], *, may_resend: Callable[[bool], bool]) -> tuple[ReplicaPool, T]:
        """``open_one`` on replica after replica until one answers: that replica's pool (its ``inflight`` counts this
        request; the caller gives it back) and the answer. ``may_resend(sent)`` says whether another attempt may
        follow a failure, ``sent`` whether the request may have reached the replica. A replica that answered is not
        a failure, whatever its answer (``WSServerHandshakeError`` goes to the caller)."""
        failure: str | None = None
        while True:
            rental_id, pool = self.next(failure)
            pool.inflight += 1
            try:
                return pool, await open_one(pool)
            except UpstreamUnavailable as exc:
                pool.inflight -= 1
                if exc.status == 404:  # the host left that relay: read where it is now
                    self.gateway.routes.forget(self.route.service_id)
                failure = exc.message
                log.info("service %s: %s", self.route.service_id, failure)
                if not may_resend(False):
                    raise UpstreamFailed(f"replica {rental_id} of service {self.route.service_id}: {failure}") from None
            except TimeoutError:
                pool.inflight -= 1
                raise UpstreamTimeout(f"no replica of service {self.route.service_id} answered within "
                                      f"{self.gateway.settings.gateway_request_timeout_s:g} s") from None  # fmt: skip
            except aiohttp.WSServerHandshakeError:
                pool.inflight -= 1
                raise
            except aiohttp.ClientError as exc:
                pool.inflight -= 1
                failure = f"replica {rental_id}: {type(exc).__name__}: {exc}"
                log.info("service %s: %s", self.route.service_id, failure)
                if not may_resend(True):
                    raise UpstreamFailed(f"replica {rental_id} of service {self.route.service_id} broke off before "
                                         "answering; the request was not sent again (not idempotent)") from None  # fmt: skip
            except BaseException:
                pool.inflight -= 1
                raise


async def forward(gateway: Gateway, request: web.Request, route: ServiceRoute, *, prefix_len: int) -> web.StreamResponse:
    """Forward ``request`` to a ready replica of ``route``'s service and stream its answer back (the module's policy).

    Counted in the service's figures. Errors before the answer's head are JSON answers; after it, the
    client's connection is dropped. Cancelling (the client left: aiohttp cancels the handler) is safe: the
    replica's connection closes, which stops its work on the answer; it is not counted as an error."""
    stats = gateway.stats.of(route.service_id)
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    started = time.monotonic()
    stats.started()
    error = True
    answered = False
    try:
        try:
            if is_websocket(request):
                response, error = await _websocket(gateway, request, route, stats, request_id, prefix_len, started)
                answered = True
                return response
            body = await read_body(request, keep_max=gateway.settings.gateway_retry_body_max_kib * 1024,
                                   max_body=gateway.settings.gateway_max_body_mib * 1024 * 1024)  # fmt: skip
            route = await gateway.ready_route(route)
            attempt = Attempt(gateway, route, stats, deadline=gateway.clock() + gateway.settings.gateway_request_timeout_s)
            response, error = await _http(request, attempt, body, request_id, prefix_len, started)
            answered = True
            return response
        except GpumarketError as exc:
            error = exc.http_status >= 500
            return error_response(exc, request_id=request_id)
    except asyncio.CancelledError:  # the client left (aiohttp cancels its handler): not the service's failure
        error = False
        raise
    finally:
        if not answered:
            stats.answered((time.monotonic() - started) * 1000)
        stats.finished(error=error)


async def _http(
    request: web.Request, attempt: Attempt, body: Body, request_id: str, prefix_len: int, started: float
) -> tuple[web.StreamResponse, bool]:
    """Send until a replica answers (or the policy gives up), then stream the answer. Returns it, and whether
    it counts as an error."""
    url = upstream_url(request, prefix_len)
    headers = forwarded_headers(request, request_id)
    if body.source is not None and request.content_length is not None:
        headers["Content-Length"] = str(request.content_length)
    pool, upstream = await attempt.open(
        lambda pool: pool.session.request(
            request.method, url, headers=headers, data=body.payload(), allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=attempt.remaining()),
        ),
        may_resend=lambda sent: body.resendable and (not sent or idempotent(request)),
    )  # fmt: skip
    try:
        async with upstream:
            return await _stream_answer(request, upstream, attempt, request_id, started)
    finally:
        pool.inflight -= 1


async def _stream_answer(
    request: web.Request, upstream: aiohttp.ClientResponse, attempt: Attempt, request_id: str, started: float
) -> tuple[web.StreamResponse, bool]:
    error = upstream.status >= 500
    broken: BaseException | None = None
    if _small(request, upstream):
        try:
            body = await upstream.read()  # the request's timeout (aiohttp's total) bounds it
        except (aiohttp.ClientError, TimeoutError) as exc:
            broken = exc  # as a streamed answer that breaks off: the head goes out, then the connection drops
        else:
            whole = web.Response(status=upstream.status, reason=upstream.reason, headers=answer_headers(upstream.headers, request_id))
            whole.body = body
            attempt.stats.answered((time.monotonic() - started) * 1000)
            return whole, error
    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    response.headers.extend(answer_headers(upstream.headers, request_id))
    attempt.stats.answered((time.monotonic() - started) * 1000)
    try:
        await response.prepare(request)
    except (ConnectionError, RuntimeError):
        return response, error  # the client left before the head went out
    chunks = upstream.content.iter_any().__aiter__()
    while True:
        try:
            if broken is not None:
                raise broken
            chunk = await anext(chunks)  # the request's timeout (aiohttp's total) bounds the whole answer
        except StopAsyncIteration:
            break
        except (aiohttp.ClientError, TimeoutError) as exc:
            # The answer broke off (or ran past the request's time): drop the client's connection so that its body
            # reads as truncated, never as complete.
            log.info("service %s: the answer to %s broke off: %s", attempt.route.service_id, request_id,
                     exc or type(exc).__name__)  # fmt: skip
            _drop(request)
            return response, True
        try:
            await response.write(chunk)
        except ConnectionError:  # the client left: the replica's connection goes too
            upstream.close()
            return response, error
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response, error


def _small(request: web.Request, upstream: aiohttp.ClientResponse) -> bool:
    """Whether the answer is read whole before its head goes out: a body of a known length up to ``WHOLE_ANSWER_MAX``."""
    length = upstream.content_length
    return (length is not None and length <= WHOLE_ANSWER_MAX and request.method != "HEAD"
            and upstream.status not in (204, 304) and "Transfer-Encoding" not in upstream.headers)  # fmt: skip


def _drop(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


# ---- websockets ------------------------------------------------------------------------------------


async def _websocket(
    gateway: Gateway, request: web.Request, route: ServiceRoute, stats: ServiceStats, request_id: str, prefix_len: int,
    started: float,
) -> tuple[web.StreamResponse, bool]:  # fmt: skip
    route = await gateway.ready_route(route)
    attempt = Attempt(gateway, route, stats, deadline=gateway.clock() + gateway.settings.gateway_request_timeout_s)
    url = upstream_url(request, prefix_len)
    headers = forwarded_headers(request, request_id, websocket=True)
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    try:
        pool, upstream = await attempt.open(
            lambda pool: pool.session.ws_connect(
                url, headers=headers, protocols=protocols, autoclose=False, autoping=True, max_msg_size=MAX_WS_MESSAGE,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=WS_CLOSE_TIMEOUT),
            ),
            may_resend=lambda sent: True,  # the handshake is a GET
        )  # fmt: skip
    except aiohttp.WSServerHandshakeError as exc:  # the replica answered, but not with an upgrade
        stats.answered((time.monotonic() - started) * 1000)
        answer = WebsocketRefused(f"the replica did not accept the websocket (HTTP {exc.status}); check the path",
                                  status=exc.status)  # fmt: skip
        return error_response(answer, request_id=request_id), answer.http_status >= 500
    try:
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(upstream.close)
            client = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (), autoclose=False,
                                           autoping=True, max_msg_size=MAX_WS_MESSAGE)  # fmt: skip
            client.headers["X-Request-Id"] = request_id
            await client.prepare(request)
            stats.answered((time.monotonic() - started) * 1000)
            # The pump that gets a close passes it on and completes both handshakes; the other one sees its side
            # closing and ends: both are given the time of a close handshake.
            await first_done(_pump(client, upstream), _pump(upstream, client), grace=WS_CLOSE_TIMEOUT)
            for ws in (client, upstream):
                if not ws.closed:
                    with contextlib.suppress(Exception):
                        await ws.close(code=1001, message=b"the other side went away")
            return client, False
    finally:
        pool.inflight -= 1


WebSocket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse
async def _pump(source: WebSocket, sink: WebSocket) -> None:
    while True:
        message = await source.receive()
        if message.type is WSMsgType.TEXT:
            await sink.send_str(message.data)
        elif message.type is WSMsgType.BINARY:
            await sink.send_bytes(message.data)
        elif message.type is WSMsgType.CLOSE:
            code = int(message.data) if message.data is not None else 1005
            code = UNSENDABLE_CLOSES.get(code, code)
            reason = (message.extra or "").encode()[:123]
            await sink.close(code=code, message=reason)
            await source.close(code=code)
            return
        elif message.type is WSMsgType.CLOSING:  # the other pump is closing this side: it closes the sink too
            return
        else:  # CLOSED, ERROR: this side went without a close (the connection dropped)
            await sink.close(code=1011, message=b"the other side went away")
            return
