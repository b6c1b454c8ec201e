#!/usr/bin/env python3
"""A small OpenAI-compatible model server that answers deterministically on CPU: gpumarket's sample service.

It stands in for a real model server (vLLM answers on the same port and paths) where tests and examples need one
that starts in a second and needs nothing but Python's standard library (the test image holds Debian's python3
only). A chat completion answers ``"echo: "`` and the last user message's words; tokens are words.

Routes: ``GET /`` (a page saying what this is), ``GET /health`` (503 until ``READY_DELAY_S`` seconds after start, then 200), ``GET /v1/models``,
``POST /v1/chat/completions`` (``stream`` as OpenAI streams it: server-sent events, chunked), and ``GET /v1/ws``, a
websocket echo (RFC 6455: text, binary, ping, close). Every response names the replica that answered in
``X-Replica`` (the host name). Test hooks, as request headers: ``X-Delay-Ms`` waits before answering and
``X-Chunk-Delay-Ms`` between a stream's chunks (each at most 60000).

Environment: ``PORT`` (8000), ``MODEL`` (``gpumarket-echo``), ``READY_DELAY_S`` (0). One line per request goes to
stderr; SIGTERM stops it at once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import html
import json
import os
import signal
import socket
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_PORT = 8000
DEFAULT_MODEL = "gpumarket-echo"
MAX_BODY = 1 << 20
"""Bytes of a request body, and of a websocket message."""
MAX_DELAY_MS = 60_000
IDLE_TIMEOUT_S = 300.0
"""How long a connection (keep-alive or websocket) may stay silent before it is closed."""
LINGER_S = 2.0
"""How long a closing connection drains what the client still sends (a refused body), so it reads the answer."""
WEBSOCKET_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpumarket demo: {model}</title></head>
<body>
<h1>gpumarket's OpenAI-compatible sample server</h1>
<p>This is replica <code>{replica}</code> serving the model <code>{model}</code>: a chat completion answers
<code>echo:</code> and your last message's words.</p>
<ul>
<li><code>GET /health</code>, <code>GET /v1/models</code></li>
<li><code>POST /v1/chat/completions</code> (<code>"stream": true</code> streams it)</li>
<li><code>GET /v1/ws</code>: a websocket echo</li>
</ul>
<pre>curl -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "hello"}}]}}' URL/v1/chat/completions</pre>
</body></html>
"""


class RequestError(Exception):
    """A request the server refuses: an HTTP status, an OpenAI-style error body and any headers the status needs."""

    def __init__(self, status: int, message: str, *, code: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.kind, self.headers = status, code, kind, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}}


# The answer: pure functions of the request.


def _text(content: Any) -> str:
    """A message's content as text: a string, the text parts of a list of content parts, or none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return " ".join(part["text"] for part in content if part.get("type") == "text" and isinstance(part.get("text"), str))
    raise RequestError(400, "a message's content must be a string or a list of content parts", code="invalid_content")


def parse_chat(body: bytes, *, model: str) -> dict[str, Any]:
    """The chat completion request in ``body``, checked: raises ``RequestError`` saying what is wrong."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(request, dict):
        raise RequestError(400, "the body must be a JSON object", code="invalid_json")
    if request.get("model") != model:
        if not isinstance(request.get("model"), str):
            raise RequestError(400, "model is missing: name the model (GET /v1/models lists it)", code="missing_model")
        raise RequestError(404, f"the model {request['model']!r} does not exist: this server serves {model!r}",
                           code="model_not_found", kind="not_found_error")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(message, dict) for message in messages):
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", code="invalid_messages")
    if not any(message.get("role") == "user" for message in messages):
        raise RequestError(400, "messages holds no message whose role is 'user'", code="invalid_messages")
    limit = request.get("max_tokens", request.get("max_completion_tokens"))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise RequestError(400, "max_tokens must be a positive integer", code="invalid_max_tokens")
    return request


def answer(request: dict[str, Any]) -> tuple[list[str], str, dict[str, int]]:
    """The reply's words, its finish reason (``stop``, or ``length`` when ``max_tokens`` cut it) and its usage."""
    messages = request["messages"]
    last_user = next(message for message in reversed(messages) if message.get("role") == "user")
    words = ["echo:", *_text(last_user.get("content")).split()]
    limit = request.get("max_tokens", request.get("max_completion_tokens")) or len(words)
    finish = "length" if limit < len(words) else "stop"
    words = words[:limit]
    prompt_tokens = sum(len(_text(message.get("content")).split()) for message in messages)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(words), "total_tokens": prompt_tokens + len(words)}
    return words, finish, usage


def completion(request: dict[str, Any]) -> dict[str, Any]:
    """The ``chat.completion`` object answering ``request``."""
    words, finish, usage = answer(request)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": request["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(words)}, "logprobs": None,
                     "finish_reason": finish}],
        "usage": usage,
    }


def completion_chunks(request: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed answer: the role, one word each, the finish reason, and
    the usage when ``stream_options.include_usage`` asks for it."""
    words, finish, usage = answer(request)
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": request["model"]}

    def chunk(delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    yield chunk({"role": "assistant", "content": ""})
    for index, word in enumerate(words):
        yield chunk({"content": word if index == 0 else f" {word}"})
    yield chunk({}, finish)
    if (request.get("stream_options") or {}).get("include_usage"):
        yield {**base, "choices": [], "usage": usage}


# The websocket echo: RFC 6455 frames.


def websocket_accept(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` answering a client's ``Sec-WebSocket-Key``."""
    return base64.b64encode(hashlib.sha1((key + WEBSOCKET_GUID).encode()).digest()).decode()


def encode_frame(opcode: int, payload: bytes) -> bytes:
    """One final, unmasked frame (a server's)."""
    size = len(payload)
    if size < 126:
        header = struct.pack("!BB", 0x80 | opcode, size)
    elif size < 1 << 16:
        header = struct.pack("!BBH", 0x80 | opcode, 126, size)
    else:
        header = struct.pack("!BBQ", 0x80 | opcode, 127, size)
    return header + payload


class WebSocketClosed(Exception):
    """The session ends: the close code to send back (``None``: send nothing, the peer is gone)."""

    def __init__(self, code: int | None, reason: str = "") -> None:
        super().__init__(reason)
        self.code = code


def read_frame(read: Callable[[int], bytes]) -> tuple[bool, int, bytes]:
    """One client frame from ``read`` (which returns exactly the bytes asked, or fewer at the end): fin, opcode and
    the unmasked payload. Raises ``WebSocketClosed`` on a protocol error (1002) or a frame too large (1009)."""

    def exactly(size: int) -> bytes:
        data = read(size)
        if len(data) < size:
            raise WebSocketClosed(None, "the connection ended mid-frame")
        return data

    first, second = exactly(2)
    fin, opcode, size = bool(first & 0x80), first & 0x0F, second & 0x7F
    if first & 0x70 or not second & 0x80:
        raise WebSocketClosed(1002, "reserved bits set or an unmasked client frame")
    if size == 126:
        size = struct.unpack("!H", exactly(2))[0]
    elif size == 127:
        size = struct.unpack("!Q", exactly(8))[0]
    if opcode >= 0x8 and (not fin or size > 125):
        raise WebSocketClosed(1002, "a control frame fragmented or longer than 125 bytes")
    if size > MAX_BODY:
        raise WebSocketClosed(1009, f"a frame of more than {MAX_BODY} bytes")
    mask = exactly(4)
    payload = exactly(size)
    keystream = (mask * (size // 4 + 1))[:size]
    return fin, opcode, (int.from_bytes(payload, "big") ^ int.from_bytes(keystream, "big")).to_bytes(size, "big")


def echo_messages(read: Callable[[int], bytes], write: Callable[[bytes], object]) -> None:
    """Echo each text or binary message back as one frame, answer pings, and return once the session is closed."""
    opcode, parts = 0, bytearray()
    try:
        while True:
            fin, frame_opcode, payload = read_frame(read)
            if frame_opcode == 0x8:  # close: answer with the same code
                if len(payload) == 1:
                    raise WebSocketClosed(1002, "a close frame of one byte")
                write(encode_frame(0x8, payload[:2]))
                return
            if frame_opcode == 0x9:
                write(encode_frame(0xA, payload))
                continue
            if frame_opcode == 0xA:
                continue
            if frame_opcode not in (0x0, 0x1, 0x2) or (frame_opcode == 0x0) != bool(opcode):
                raise WebSocketClosed(1002, f"unexpected opcode {frame_opcode:#x}")
            opcode = opcode or frame_opcode
            parts += payload
            if len(parts) > MAX_BODY:
                raise WebSocketClosed(1009, f"a message of more than {MAX_BODY} bytes")
            if fin:
                if opcode == 0x1:
                    try:
                        bytes(parts).decode()
                    except UnicodeDecodeError:
                        raise WebSocketClosed(1007, "a text message that is not UTF-8") from None
                write(encode_frame(opcode, bytes(parts)))
                opcode, parts = 0, bytearray()
    except WebSocketClosed as closed:
        if closed.code is not None:
            write(encode_frame(0x8, struct.pack("!H", closed.code) + str(closed).encode()[:120]))


# HTTP.


class Handler(BaseHTTPRequestHandler):
    """One connection: requests one after another (keep-alive), or a websocket session."""

    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT_S
    # Headers and body go out in separate writes: with Nagle's algorithm the body waits for the client's delayed
    # ACK of the headers, 40 ms on Linux, on every answer on a kept-alive connection.
    disable_nagle_algorithm = True
    server: Server

    def send_response(self, code: int, message: str | None = None) -> None:
        super().send_response(code, message)
        self.send_header("X-Replica", self.server.replica)

    def handle_expect_100(self) -> bool:
        """Refuse a body too large before the client sends it."""
        if self.headers.get("Content-Length", "").isdigit() and int(self.headers["Content-Length"]) > MAX_BODY:
            self.close_connection = True
            self._send_json(413, RequestError(413, f"the body is larger than {MAX_BODY} bytes", code="body_too_large").body())
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        path = self.path.split("?", 1)[0]
        routes: dict[str, dict[str, Callable[[], None]]] = {
            "/": {"GET": self._page},
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/ws": {"GET": self._websocket},
        }
        try:
            time.sleep(self._delay_s("X-Delay-Ms"))
            if path not in routes:
                raise RequestError(404, f"nothing is served at {path}", code="not_found", kind="not_found_error")
            if self.command not in routes[path]:
                raise RequestError(405, f"{path} answers {', '.join(routes[path])}, not {self.command}",
                                   code="method_not_allowed")
            routes[path][self.command]()
        except RequestError as exc:
            self._send_json(exc.status, exc.body(), exc.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            self.log_message("%s %s: the client went away", self.command, path)

    def _delay_s(self, header: str) -> float:
        """The seconds a test hook's header asks to wait (0 without it)."""
        value = self.headers.get(header, "0")
        if not value.isdigit() or int(value) > MAX_DELAY_MS:
            raise RequestError(400, f"{header} must be an integer from 0 to {MAX_DELAY_MS}", code="invalid_delay")
        return int(value) / 1000

    def _send_json(self, status: int, document: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _page(self) -> None:
        """A page for a browser (or curl) at ``/``: what this is and how to call it."""
        data = PAGE.format(model=html.escape(self.server.model), replica=html.escape(socket.gethostname())).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _health(self) -> None:
        ready = time.monotonic() >= self.server.ready_at
        self._send_json(200 if ready else 503, {"status": "ok" if ready else "starting"})

    def _models(self) -> None:
        model = {"id": self.server.model, "object": "model", "created": int(self.server.started), "owned_by": "gpumarket"}
        self._send_json(200, {"object": "list", "data": [model]})

    def _read_body(self) -> bytes:
        """The request's body (``Content-Length`` or chunked), at most ``MAX_BODY`` bytes. A body refused is left
        unread, so the connection closes after the answer."""
        try:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return self._read_chunks()
            length = int(self.headers.get("Content-Length", "0"))
            if length < 0:
                raise ValueError(length)
        except ValueError:
            self.close_connection = True
            raise RequestError(400, "the body's framing (Content-Length or chunks) is malformed", code="invalid_body") from None
        if length > MAX_BODY:
            self.close_connection = True
            raise RequestError(413, f"the body is larger than {MAX_BODY} bytes", code="body_too_large")
        return self.rfile.read(length)

    def _read_chunks(self) -> bytes:
        """A chunked body (as a proxy may forward one); raises ``ValueError`` on a malformed chunk size."""
        body = bytearray()
        while size := int(self.rfile.readline(64).split(b";", 1)[0], 16):
            if len(body) + size > MAX_BODY:
                self.close_connection = True
                raise RequestError(413, f"the body is larger than {MAX_BODY} bytes", code="body_too_large")
            body += self.rfile.read(size)
            self.rfile.readline(64)  # the chunk's CRLF
        while self.rfile.readline(1024).strip():  # trailers, up to the empty line
            pass
        return bytes(body)

    def _chat(self) -> None:
        request = parse_chat(self._read_body(), model=self.server.model)
        if not request.get("stream"):
            self._send_json(200, completion(request))
            return
        chunk_delay_s = self._delay_s("X-Chunk-Delay-Ms")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [*(f"data: {json.dumps(chunk)}\n\n".encode() for chunk in completion_chunks(request)), b"data: [DONE]\n\n"]
        for index, event in enumerate(events):
            if index:
                time.sleep(chunk_delay_s)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.write(b"0\r\n\r\n")

    def _websocket(self) -> None:
        key = self.headers.get("Sec-WebSocket-Key", "")
        if self.headers.get("Upgrade", "").lower() != "websocket" or not _is_websocket_key(key):
            raise RequestError(400, "GET /v1/ws is a websocket: send Upgrade: websocket and a Sec-WebSocket-Key",
                               code="not_a_websocket")
        if self.headers.get("Sec-WebSocket-Version") != "13":
            raise RequestError(426, "only websocket version 13 is spoken here", code="websocket_version",
                               headers={"Sec-WebSocket-Version": "13"})
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", websocket_accept(key))
        self.end_headers()
        self.close_connection = True
        try:
            echo_messages(self.rfile.read, self.wfile.write)
        except TimeoutError:
            self.log_message("websocket idle for %gs: closed", IDLE_TIMEOUT_S)


def _is_websocket_key(key: str) -> bool:
    """Whether ``key`` is 16 bytes in base64, as a ``Sec-WebSocket-Key`` must be."""
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except binascii.Error:
        return False


class Server(ThreadingHTTPServer):
    """The HTTP server, with what its handlers read: the model's name, when it is ready, the replica's name."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], *, model: str = DEFAULT_MODEL, ready_delay_s: float = 0.0) -> None:
        super().__init__(address, Handler)
        self.model, self.replica = model, socket.gethostname()
        self.started = time.time()
        self.ready_at = time.monotonic() + ready_delay_s

    def shutdown_request(self, request: Any) -> None:
        """Close as HTTP servers do: stop writing, then drain what the client still sends for up to ``LINGER_S``, so
        that a client sending a refused body (or a websocket message too large) reads the answer, not a reset."""
        deadline = time.monotonic() + LINGER_S
        try:
            request.shutdown(socket.SHUT_WR)
            while (left := deadline - time.monotonic()) > 0:
                request.settimeout(left)
                if not request.recv(1 << 16):
                    break
        except OSError:  # the client reset it, or the time is up
            pass
        self.close_request(request)


def main() -> None:
    server = Server(("0.0.0.0", int(os.environ.get("PORT") or DEFAULT_PORT)),
                    model=os.environ.get("MODEL") or DEFAULT_MODEL,
                    ready_delay_s=float(os.environ.get("READY_DELAY_S") or 0))
    for signum in (signal.SIGTERM, signal.SIGINT):  # as PID 1 in a container, SIGTERM would otherwise be ignored
        signal.signal(signum, lambda *_: sys.exit(0))
    print(f"serving {server.model} on port {server.server_address[1]}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
