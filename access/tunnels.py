"""Renters' connections through the relay: a websocket at ``/v1/connect`` spliced to a stream on the
rental's host's agent link.

A renter (``gpumarket tunnel``, the console's terminal) opens ``wss://<relay>/v1/connect`` with a
connect token (``shared.crypto.tokens``) in ``Authorization: Bearer`` or, for browsers, in the
``token`` query parameter. The token is checked in the HTTP upgrade, before any websocket exists,
so a refusal is a plain HTTP answer with one line saying what to do:

=====  ==========================================================================================
401    no token, a forged one, an expired one
404    the rental's host is not connected to this relay (ask ``connect`` again: it names the relay
       the host is on now)
429    the rental has ``max_streams_per_rental`` connections open here already
=====  ==========================================================================================

Once upgraded, each binary message carries bytes of the stream, both ways, and an empty one from
the renter ends its input while it still reads (a half-close: ``printf req | gpumarket tunnel``
gets its answer); the relay opens a
stream on the agent link with the token's rental, port and kind as its OPEN header. The agent
decides the rest (the rental runs here, the port is the rental's): it resets the stream otherwise,
and the relay closes the websocket with ``4404`` and the reason. A renter's websocket that ends
(any close) closes the stream's half; the stream's end (the agent's side finished) closes the
websocket with 1000; a reset (the rental stopped, the agent's link went) closes it with ``4410``.

Bytes are counted per connection here (logged at its end); the agent counts them per rental for
the master (``tunnel_usage``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

from cryptography.hazmat.primitives.asymmetric import ec
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from shared.clock import Clock
from shared.crypto.tokens import (
    SERVICE_KIND,
    ConnectClaims,
    TokenError,
    names_service_kind,
    verify_connect_token,
)
from shared.streams import MAX_DATA, TUNNEL_REASONS, StreamLimitError, TunnelCode, encode_open_header
from shared.streams.aio import Channel, ChannelReset, StreamLink

log = logging.getLogger(__name__)

CLOSE_STREAM_REFUSED = 4404  # the agent refused the stream (no such rental or port here)
CLOSE_STREAM_RESET = 4410  # the stream was reset: the rental stopped, or the host's link went
CLOSE_RELAY_LIMIT = 4429  # the relay's limits (streams on the agent's link)


@dataclass(frozen=True, slots=True)
class Refusal:
    status: HTTPStatus
    text: str


def token_of(request: Request) -> str | None:
    header = request.headers.get("Authorization")
    if header:
        scheme, _, value = header.partition(" ")
        return value.strip() if scheme.lower() == "bearer" and value.strip() else None
    query = parse_qs(urlsplit(request.path).query, max_num_fields=4)
    values = query.get("token")
    return values[0] if values else None


class RenterGate:
    """Checks renters' upgrade requests and splices their websockets to agent streams.

    ``links`` finds the agent link of a host connected here (``None`` when it is not)."""

    def __init__(
        self,
        *,
        token_key: ec.EllipticCurvePublicKey,
        clock: Clock,
        # Limits
        max_streams_per_rental: int = 16,
        max_message: int = 64 * 1024,
    ) -> None:
        if max_streams_per_rental < 1 or max_message < 1:
            raise ValueError("renter limits must be positive")
        self.token_key = token_key
        self.clock = clock
        self.max_streams_per_rental = max_streams_per_rental
        self.max_message = max_message
        self.open_per_rental: collections.Counter[str] = collections.Counter()
        self.connections = 0
        self.bytes_to_renters = 0
        self.bytes_from_renters = 0
        self._claims: dict[ServerConnection, ConnectClaims] = {}

    def admit(self, connection: ServerConnection, request: Request, *, host_connected: Callable[[str], bool]) -> Refusal | None:
        """Check the token of a request for ``CONNECT_PATH``; remember its claims for ``serve``."""
        token = token_of(request)
        if token is None:
            return Refusal(HTTPStatus.UNAUTHORIZED, "no connect token: run `gpumarket ssh RENTAL` or use Connect in the console")
        try:
            claims = verify_connect_token(self.token_key, token, now=self.clock.now().timestamp())
        except TokenError as exc:
            return Refusal(HTTPStatus.UNAUTHORIZED, exc.message)
        if not host_connected(claims.host_id):
            return Refusal(HTTPStatus.NOT_FOUND, f"the host of rental {claims.rental_id} is not connected to this relay; connect again")
        if self.open_per_rental[claims.rental_id] >= self.max_streams_per_rental:
            return Refusal(HTTPStatus.TOO_MANY_REQUESTS,
                           f"rental {claims.rental_id} has {self.max_streams_per_rental} connections open here; close one first")
        self._claims[connection] = claims
        return None

    def from_gateway(self, request: Request) -> bool:
        """Whether the request carries a valid service gateway's token (kind ``svc``): a master's connection, which the
        relay does not hold to the per-source limit on renters' connections. Only a token whose claims say ``svc``
        has its signature checked here (the rest wait for ``admit``), and a bad one is simply not a gateway's."""
        token = token_of(request)
        if token is None or not names_service_kind(token):
            return False
        try:
            return verify_connect_token(self.token_key, token, now=self.clock.now().timestamp()).kind == SERVICE_KIND
        except TokenError:
            return False

    def claims_of(self, connection: ServerConnection) -> ConnectClaims | None:
        return self._claims.get(connection)

    def forget(self, connection: ServerConnection) -> None:
        self._claims.pop(connection, None)

    async def serve(self, connection: ServerConnection, claims: ConnectClaims, link: StreamLink | None) -> None:
        """Splice an admitted renter's websocket to a new stream on ``link``. Cancelling is safe:
        the stream is reset and the websocket closed."""
        if link is None:
            await connection.close(CLOSE_STREAM_RESET, "the rental's host just left this relay; connect again")
            return
        try:
            channel = link.open(encode_open_header(claims.rental_id, claims.port, claims.stream_kind))
        except (StreamLimitError, ConnectionError) as exc:
            await connection.close(CLOSE_RELAY_LIMIT, f"the host's link is full ({exc}); try again shortly"[:120])
            return
        self.open_per_rental[claims.rental_id] += 1
        self.connections += 1
        try:
            await _splice_websocket(connection, channel)
        finally:
            self.open_per_rental[claims.rental_id] -= 1
            if self.open_per_rental[claims.rental_id] <= 0:
                del self.open_per_rental[claims.rental_id]
            self.bytes_to_renters += channel.bytes_in
            self.bytes_from_renters += channel.bytes_out
            log.info("renter %s: %s closed (%d bytes in, %d out)", claims.account_id, claims.target, channel.bytes_out, channel.bytes_in)


async def _splice_websocket(connection: ServerConnection, channel: Channel) -> None:
    async def to_renter() -> None:
        # Renters' clients bound their messages (the service gateway's at 2 × MAX_DATA): whatever the agent
        # link agreed, a renter gets protocol v1's message size.
        while data := await channel.read(MAX_DATA):
            await connection.send(data)

    async def to_agent() -> None:
        finished = False
        async for message in connection:
            if isinstance(message, str):
                message = message.encode()
            if finished:
                continue  # nothing may follow the end of the renter's input; dropped
            if message:
                await channel.write(message)
            else:  # an empty message: the renter's input ended, it still reads (a half-close)
                channel.close()
                finished = True
        channel.close()  # the renter finished

    outward = asyncio.ensure_future(to_renter())
    inward = asyncio.ensure_future(to_agent())
    code, reason = 1000, ""
    try:
        done, _ = await asyncio.wait({outward, inward}, return_when=asyncio.FIRST_COMPLETED)
        if outward in done:
            exc = outward.exception()
            if isinstance(exc, ChannelReset):
                code, reason = _reset_close(exc)
            elif exc is not None and not isinstance(exc, ConnectionClosed):
                raise exc
        else:
            exc = inward.exception()
            if exc is None:
                # The renter's side ended; let the agent's side finish (bounded by the websocket closing).
                await asyncio.wait({outward})
                if isinstance(rest := outward.exception(), ChannelReset):
                    code, reason = _reset_close(rest)
            elif isinstance(exc, ChannelReset):
                code, reason = _reset_close(exc)
            else:
                channel.reset()
    finally:
        for task in (outward, inward):
            task.cancel()
        await asyncio.gather(outward, inward, return_exceptions=True)
        if channel.reset_error is None and code != 1000:
            channel.reset()
        with contextlib.suppress(Exception):
            await connection.close(code, reason)


def _reset_close(exc: BaseException) -> tuple[int, str]:
    assert isinstance(exc, ChannelReset)
    reason = TUNNEL_REASONS.get(exc.code) if exc.by_peer else None  # type: ignore[call-overload]
    if reason is None:
        return CLOSE_STREAM_RESET, str(exc)[:120]
    return (CLOSE_STREAM_RESET if exc.code == TunnelCode.RENTAL_STOPPED else CLOSE_STREAM_REFUSED), reason[:120]


def refusal_response(connection: ServerConnection, refusal: Refusal) -> Response:
    return connection.respond(refusal.status, refusal.text + "\n")
