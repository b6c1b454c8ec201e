"""One browser connection of a web port, relayed request by request to a stream on the host's agent link.

The relay reads HTTP/1.1 both ways for the life of the connection, with h11 (Sans-I/O) as the parser and
writer on each side: ``browser`` (the relay as the server) and ``app`` (the relay as the rental app's
client). Framing (``Content-Length``, chunked, bodiless answers to ``HEAD``, 1xx, 204 and 304, answers
that end at the app's EOF) is h11's; what the relay adds, on every message of the connection:

* **Requests** lose the relay's session cookie (``gm_port``) from their ``Cookie`` headers; the rest
  of the renter's cookies pass. Each request's ``Host`` must name the connection's port (421 else).
* **Answers** lose ``Domain=`` from every ``Set-Cookie`` (any case, any place among the attributes),
  so a rental sets host-only cookies on its own host name and nothing on its neighbours'; an app's
  ``Set-Cookie`` for ``gm_port`` itself is dropped (it would sign the renter out).

Pipelined requests are answered one after the other: the relay hands the app the next request once the
answer to the one before is complete (the browser gets its answers in order, as HTTP/1.1 wants). Until
then it reads nothing more from the browser beyond ``read_size`` bytes (TCP holds the rest back). After
``101 Switching Protocols`` (a websocket: Jupyter's kernels) both directions are spliced raw.

Malformed HTTP from the browser is answered 400 (when no answer is under way) and the connection
closed; malformed HTTP from the app closes the connection. This module must not import the relay's
listener (``access.webports``); that one imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import h11

from shared.streams import TUNNEL_REASONS
from shared.streams.aio import Channel, ChannelReset

log = logging.getLogger(__name__)

SESSION_COOKIE = b"gm_port"
STATUS_TEXT = {302: "Found", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 421: "Misdirected Request",
               502: "Bad Gateway", 503: "Service Unavailable"}  # fmt: skip
_NO_ANSWER_YET = (h11.IDLE, h11.SEND_RESPONSE)
_FINISHED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)



class _Pending:
    """Bytes queued for one side, written together (a head and a small body: one write, one frame)."""

    def __init__(self) -> None:
        self._parts: list[bytes | bytearray] = []
        self._size = 0

    def add(self, data: bytes | bytearray | None) -> int:
        """Queue ``data``; how many bytes are queued now."""
        if data:
            self._parts.append(data)
            self._size += len(data)
        return self._size

    def take(self) -> bytes:
        """Everything queued, joined (``b""`` when nothing is), and the queue emptied."""
        data = b"".join(self._parts)
        self._parts, self._size = [], 0
        return data

class Refused(Exception):
    """A request the relay answers itself (``status``, one line of ``text``) before closing the connection."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


def answer_bytes(status: int, text: str, *, headers: Iterable[tuple[str, str]] = ()) -> bytes:
    """A whole one-line ``text/plain`` answer that closes the connection."""
    body = (text + "\n").encode()
    head = [f"HTTP/1.1 {status} {STATUS_TEXT.get(status, 'Error')}", "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(body)}", "Connection: close", "Cache-Control: no-store"]  # fmt: skip
    head += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def without_session_cookie(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` with ``gm_port`` taken out of every ``Cookie`` header (one left empty goes)."""
    kept: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name.lower() == b"cookie":
            items = [item.strip() for item in value.split(b";")]
            items = [item for item in items if item and item.partition(b"=")[0].strip() != SESSION_COOKIE]
            if not items:
                continue
            value = b"; ".join(items)
        kept.append((name, value))
    return kept


def host_only_cookies(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` with every ``Domain`` attribute taken out of every ``Set-Cookie``, and any ``Set-Cookie`` of
    ``gm_port`` dropped. Attributes are split on ``;``, which a cookie's value never holds (RFC 6265)."""
    kept: list[tuple[bytes, bytes]] = []
    for name, value in headers:
        if name.lower() == b"set-cookie":
            pair, *attributes = value.split(b";")
            if pair.partition(b"=")[0].strip() == SESSION_COOKIE:
                continue
            value = b";".join([pair, *(a for a in attributes if a.partition(b"=")[0].strip().lower() != b"domain")])
        kept.append((name, value))
    return kept


def head_size(event: h11.Request | h11.Response | h11.InformationalResponse) -> int:
    """The bytes of a message's head as parsed (h11 bounds only heads that arrive in pieces)."""
    first = len(event.method) + len(event.target) if isinstance(event, h11.Request) else len(event.reason) + 3
    return first + 12 + sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items()) + 2


def too_big(event: h11.Request | h11.Response | h11.InformationalResponse, *, max_head: int, max_headers: int) -> str | None:
    """Why the head is over the relay's bounds, or ``None``."""
    if len(event.headers) > max_headers:
        return f"more than {max_headers} header lines"
    if head_size(event) > max_head:
        return f"a head over {max_head} bytes"
    return None


def _ends_at_eof(request_method: bytes, response: h11.Response) -> bool:
    """An answer framed by neither ``Content-Length`` nor ``Transfer-Encoding``: its body ends where the app closes."""
    if request_method == b"HEAD" or response.status_code in (204, 304):
        return False
    return not any(name in (b"content-length", b"transfer-encoding") for name, _ in response.headers)


class HttpRelay:
    """Relays one browser connection, whose first request (already read by ``browser``) is ``first``.

    ``same_port`` says whether a later request's ``Host`` names the connection's port. Every limit is a
    keyword argument: ``max_head`` bytes of a request's or an answer's head, ``max_headers`` header
    lines in one, ``read_size`` bytes read from either side at once (pipelined requests wait there).
    """

    def __init__(
        self,
        channel: Channel,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        browser: h11.Connection,
        first: h11.Request,
        *,
        same_port: Callable[[h11.Request], bool],
        max_head: int = 16 * 1024,
        max_headers: int = 100,
        read_size: int = 64 * 1024,
    ) -> None:
        self.channel = channel
        self.reader = reader
        self.writer = writer
        self.browser = browser
        self.app = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_head)
        self.first: h11.Request | None = first
        self.same_port = same_port
        self.max_head = max_head
        self.max_headers = max_headers
        self.read_size = read_size
        self.switched = False
        self.answered = False  # the app sent something: a reset is no longer a 502
        self.method = first.method  # of the request in flight (the app gets one at a time): HEAD answers have no body
        self._advanced = asyncio.Event()
        self._app_out = _Pending()
        self._browser_out = _Pending()

    async def run(self) -> None:
        """Relay until either side ends the connection. Cancelling is safe: the caller closes both ends."""
        requests = asyncio.ensure_future(self._requests())
        answers = asyncio.ensure_future(self._answers())
        try:
            pending: set[asyncio.Future[bool]] = {requests, answers}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # A loop returns True when the connection is over; False (the browser's half-close, a stream
                # reset seen while writing to it) lets the other finish what is under way.
                try:
                    if any(task.result() for task in done):
                        break
                except h11.ProtocolError as exc:  # what h11 would not write: nothing more can go out in order
                    log.info("web port: %s; connection closed", exc)
                    break
        finally:
            for task in (requests, answers):
                task.cancel()
            await asyncio.gather(requests, answers, return_exceptions=True)

    # ---- browser → app -------------------------------------------------------------------------

    async def _requests(self) -> bool:
        try:
            return await self._relay_requests()
        except ChannelReset:
            return False  # the answers' side sees the reset too, and says 502 if nothing was answered yet

    async def _relay_requests(self) -> bool:
        browser = self.browser
        while True:
            if self.first is not None:
                event: h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA] = self.first
                self.first = None
            else:
                try:
                    event = browser.next_event()
                except h11.RemoteProtocolError as exc:
                    return await self._bad_request(f"malformed request: {exc}")
            if event is h11.NEED_DATA:
                await self._flush_app()  # what the app has of a body so far goes before waiting for more
                browser.receive_data(await self.reader.read(self.read_size))
            elif event is h11.PAUSED:
                if self.switched:
                    return await self._splice_requests()
                await self._next_cycle()
            elif isinstance(event, h11.Request):
                if (why := too_big(event, max_head=self.max_head, max_headers=self.max_headers)) is not None:
                    return await self._bad_request(why)
                if event.method == b"CONNECT":
                    return await self._bad_request("CONNECT is not served by web ports")
                if not self.same_port(event):
                    return await self._refuse(Refused(421, "this connection is for another rental port; open a new one"))
                request = h11.Request(method=event.method, target=event.target,
                                      headers=without_session_cookie(event.headers.raw_items()))  # fmt: skip
                self.method = event.method
                await self._to_app(self.app.send(request))
            elif isinstance(event, h11.Data):
                for piece in self.app.send_with_data_passthrough(h11.Data(data=event.data)) or ():
                    await self._to_app(piece)
            elif isinstance(event, h11.EndOfMessage):
                await self._to_app(self.app.send(h11.EndOfMessage(headers=event.headers)))
                await self._flush_app()
                if self._advance():
                    return True
            elif isinstance(event, h11.ConnectionClosed):
                # The browser closed its half: the app hears the same; an answer under way still goes out.
                await self._flush_app()
                self.channel.close()
                return self.browser.our_state in (h11.IDLE, h11.DONE)

    async def _to_app(self, data: bytes | bytearray | None) -> None:
        """Queue bytes for the app; they go in one write per ``read_size`` (a head and a small body: one frame)."""
        if self._app_out.add(data) >= self.read_size:
            await self._flush_app()

    async def _flush_app(self) -> None:
        if data := self._app_out.take():
            await self.channel.write(data)

    async def _bad_request(self, text: str) -> bool:
        return await self._refuse(Refused(400, text))

    async def _refuse(self, refusal: Refused) -> bool:
        if self.browser.our_state in _NO_ANSWER_YET:
            self.writer.write(answer_bytes(refusal.status, refusal.text))
            with contextlib.suppress(ConnectionError, OSError):
                await self.writer.drain()
        return True

    async def _splice_requests(self) -> bool:
        data, _ = self.browser.trailing_data
        if data:
            await self.channel.write(data)
        while data := await self.reader.read(self.read_size):
            await self.channel.write(data)
        self.channel.close()
        return False

    # ---- app → browser -------------------------------------------------------------------------

    async def _answers(self) -> bool:
        app = self.app
        while True:
            try:
                event = app.next_event()
            except h11.RemoteProtocolError as exc:
                log.info("web port: malformed answer from rental port (%s); connection closed", exc)
                return True
            if event is h11.NEED_DATA:
                await self._flush_browser()  # a streamed answer (server-sent events) goes out as it comes
                try:
                    data = await self.channel.read()
                except ChannelReset as exc:
                    if not self.answered:
                        reason = TUNNEL_REASONS.get(exc.code, str(exc)) if exc.by_peer else str(exc)  # type: ignore[call-overload]
                        await self._refuse(Refused(502, f"the rental did not answer: {reason}"))
                    return True
                self.answered = self.answered or bool(data)
                app.receive_data(data)
            elif event is h11.PAUSED:
                await self._next_cycle()
            elif isinstance(event, (h11.InformationalResponse, h11.Response)) and (
                why := too_big(event, max_head=self.max_head, max_headers=self.max_headers)
            ):
                log.info("web port: an answer with %s; connection closed", why)
                return True
            elif isinstance(event, h11.InformationalResponse):
                await self._to_browser(self.browser.send(h11.InformationalResponse(
                    status_code=event.status_code, headers=host_only_cookies(event.headers.raw_items()), reason=event.reason)))  # fmt: skip
                if event.status_code == 101:
                    return await self._splice_answers()
            elif isinstance(event, h11.Response):
                headers = host_only_cookies(event.headers.raw_items())
                if _ends_at_eof(self.method, event):
                    headers.append((b"Connection", b"close"))  # no keep-alive after it: the app's side is gone
                await self._to_browser(self.browser.send(
                    h11.Response(status_code=event.status_code, headers=headers, reason=event.reason)))  # fmt: skip
            elif isinstance(event, h11.Data):
                for piece in self.browser.send_with_data_passthrough(h11.Data(data=event.data)) or ():
                    await self._to_browser(piece)
            elif isinstance(event, h11.EndOfMessage):
                await self._to_browser(self.browser.send(h11.EndOfMessage(headers=event.headers)))
                await self._flush_browser()
                if self._advance():
                    return True
            elif isinstance(event, h11.ConnectionClosed):
                return True

    async def _to_browser(self, data: bytes | bytearray | None) -> None:
        """Queue bytes for the browser; they go in one TLS write per ``read_size`` at most."""
        if self._browser_out.add(data) >= self.read_size:
            await self._flush_browser()

    async def _flush_browser(self) -> None:
        if data := self._browser_out.take():
            if self.writer.is_closing():  # asyncio drops the write, uvloop raises RuntimeError: both a closed socket
                raise ConnectionResetError("the browser's connection closed")
            self.writer.write(data)
            await self.writer.drain()

    async def _splice_answers(self) -> bool:
        self.switched = True
        self._wake()
        data, _ = self.app.trailing_data
        await self._to_browser(data)
        await self._flush_browser()
        while data := await self.channel.read():
            if self.writer.is_closing():
                raise ConnectionResetError("the browser's connection closed")
            self.writer.write(data)
            await self.writer.drain()
        return True

    # ---- the request/answer cycle --------------------------------------------------------------

    def _advance(self) -> bool:
        """After a request or an answer ended: start the next cycle when both ended on both sides (True: the
        connection is over, one side must close)."""
        states = (self.browser.their_state, self.browser.our_state, self.app.our_state, self.app.their_state)
        if all(state is h11.DONE for state in states):
            self.browser.start_next_cycle()
            self.app.start_next_cycle()
            self._wake()
            return False
        return all(state in _FINISHED for state in states)

    async def _next_cycle(self) -> None:
        """Wait until the cycle moves on (or the protocol switched). Cancelling is safe."""
        await self._advanced.wait()

    def _wake(self) -> None:
        woken, self._advanced = self._advanced, asyncio.Event()
        woken.set()
