"""Speed tests: an agent measures its network against its relay, one websocket connection per test.

The relay routes ``/v1/speedtest`` here (``access.relay``), on the same TLS server and
behind the same client certificate as the agent channel; ``agent.netmeasure`` is the
client. This module owns the server half and the protocol; it imports ``shared`` and
``websockets`` only.

Protocol. A text frame carries one JSON object with an ``op``; a binary frame carries
payload bytes and nothing else. Commands are served one at a time, in order::

    server → client, once, on connect:
        {"op": "hello", "max_frame": F, "max_bytes_per_request": B,
         "max_requests": R, "max_seconds": S}
            F bounds every binary frame the client sends (the relay's frame limit);
            B bounds "bytes" below; R and S are the other bounds listed under close codes.
    client → server:
        {"op": "ping", "id": N, "t": T}   → {"op": "pong", "id": N, "t": T} at once.
            N is an integer ≥ 0; T (any finite number, usually the client's clock)
            is optional and echoed unchanged.
        {"op": "download", "bytes": N}    → N bytes in binary frames of at most
            ``chunk_size`` bytes, then {"op": "download_done", "bytes": N}.
        {"op": "upload", "bytes": N}      → the client then sends exactly N bytes in
            binary frames (each ≤ F); the server answers
            {"op": "upload_done", "bytes": N, "seconds": S}, S being the server's time
            from the command to the last byte (a monotonic clock).
        N in "bytes" is an integer, 1 ≤ N ≤ B. A command with any other key is malformed.

Close codes (the reason says which bound and what to do):

    4000 (CLOSE_BAD_FRAME)     a malformed command, a binary frame outside an upload, a
                               text frame inside one, or more upload bytes than announced
    1008 (CLOSE_POLICY)        a transfer over max_bytes_per_request, or the connection
                               outlived max_connection_seconds
    4004 (CLOSE_RATE_LIMITED)  more than max_requests_per_connection commands (pings count),
                               or the host already runs its allowed number of tests here,
                               or the relay runs its allowed total
    1001                       the relay is shutting down (sent by ``Relay.close``)

Logging: one info line when a test starts and ends, a warning when a bound closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from websockets.exceptions import ConnectionClosed

from shared.errors import ConfigError, ProtocolError
from shared.protocol import CLOSE_BAD_FRAME, CLOSE_RATE_LIMITED, DEFAULT_MAX_FRAME

log = logging.getLogger(__name__)

CLOSE_POLICY = 1008  # RFC 6455 policy violation: a size or time bound of the speed test
_MAX_PROBE_ID = (1 << 63) - 1


class SpeedtestConnection(Protocol):
    """What ``handle`` needs of a websocket connection (``ServerConnection`` has it)."""

    async def recv(self, decode: bool | None = None) -> str | bytes: ...

    async def send(self, message: str | bytes) -> None: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...


# ---- commands (Sans-I/O) ---------------------------------------------------------------


@dataclass(frozen=True)
class Ping:
    id: int
    t: float | None = None


@dataclass(frozen=True)
class Download:
    size: int


@dataclass(frozen=True)
class Upload:
    size: int


Command = Ping | Download | Upload

_KEYS: dict[str, frozenset[str]] = {
    "ping": frozenset({"op", "id", "t"}),
    "download": frozenset({"op", "bytes"}),
    "upload": frozenset({"op", "bytes"}),
}


def _malformed(message: str) -> ProtocolError:
    return ProtocolError(message, code="bad_frame", close_code=CLOSE_BAD_FRAME)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _integer(obj: dict[str, Any], key: str, *, minimum: int, maximum: int) -> int:
    value = obj.get(key)
    # bool is an int subclass; true is not a byte count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _malformed(f"{obj['op']}: {key!r} must be an integer, got {value!r}")
    if not minimum <= value <= maximum:
        raise _malformed(f"{obj['op']}: {key!r} must be between {minimum} and {maximum}, got {value}")
    return value


def parse_command(data: str | bytes) -> Command:
    """Decode one client frame into a command; a malformed one raises ``ProtocolError`` (close 4000)."""
    if isinstance(data, bytes):
        raise _malformed("a binary frame arrived outside an upload; send a JSON command first")
    try:
        obj = json.loads(data, parse_constant=_reject_constant)
    except ValueError as exc:
        raise _malformed(f"command is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _malformed("command must be a JSON object")
    op = obj.get("op")
    if not isinstance(op, str) or op not in _KEYS:
        raise _malformed(f"unknown op {op!r}; expected ping, download or upload")
    unknown = sorted(set(obj) - _KEYS[op])
    if unknown:
        raise _malformed(f"{op}: unknown keys {', '.join(unknown)}")
    if op == "ping":
        probe_id = _integer(obj, "id", minimum=0, maximum=_MAX_PROBE_ID)
        t = obj.get("t")
        if t is not None and (not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t)):
            raise _malformed(f"ping: 't' must be a finite number, got {t!r}")
        return Ping(id=probe_id, t=None if t is None else float(t))
    size = _integer(obj, "bytes", minimum=1, maximum=1 << 62)
    return Download(size) if op == "download" else Upload(size)


def _encode(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _reason(text: str) -> str:
    """Websocket close reasons are limited to 123 bytes."""
    return text.encode()[:120].decode(errors="ignore")


# ---- who is testing now ----------------------------------------------------------------


class SpeedtestRegistry:
    """The speed tests running on one relay: bounded per host and in total, listed for shutdown."""

    def __init__(self, *, max_per_host: int = 1, max_total: int = 64) -> None:
        if max_per_host < 1 or max_total < 1:
            raise ConfigError("speed test limits max_per_host and max_total must be at least 1")
        self.max_per_host = max_per_host
        self.max_total = max_total
        self._running: dict[str, list[SpeedtestConnection]] = {}

    def __len__(self) -> int:
        return sum(len(connections) for connections in self._running.values())

    def running(self, host_id: str) -> int:
        return len(self._running.get(host_id, ()))

    def connections(self) -> list[SpeedtestConnection]:
        """Every connection running a test now (the relay closes them when it shuts down)."""
        return [c for connections in self._running.values() for c in connections]

    @contextlib.contextmanager
    def admit(self, host_id: str, connection: SpeedtestConnection) -> Iterator[None]:
        """Hold a slot for ``connection`` while the block runs; refuse (close 4004) over a bound."""
        if self.running(host_id) >= self.max_per_host:
            raise ProtocolError(
                f"host {host_id} already runs a speed test on this relay; retry when it has finished",
                code="rate_limited",
                close_code=CLOSE_RATE_LIMITED,
            )
        if len(self) >= self.max_total:
            raise ProtocolError(
                f"this relay already runs {self.max_total} speed tests; retry later",
                code="rate_limited",
                close_code=CLOSE_RATE_LIMITED,
            )
        slots = self._running.setdefault(host_id, [])
        slots.append(connection)
        try:
            yield
        finally:
            slots.remove(connection)
            if not slots:
                del self._running[host_id]


# ---- one test --------------------------------------------------------------------------


async def handle(
    connection: SpeedtestConnection,
    *,
    host_id: str,
    registry: SpeedtestRegistry,
    # Limits
    max_frame: int = DEFAULT_MAX_FRAME,
    chunk_size: int = 64 << 10,
    max_bytes_per_request: int = 64 << 20,
    max_requests_per_connection: int = 128,
    # Timeouts
    max_connection_seconds: float = 60.0,
) -> None:
    """Serve one speed-test connection of ``host_id`` until the client leaves or breaks a bound.

    ``max_frame`` is the largest binary frame the client may send, announced in the hello
    (the relay passes its own websocket frame limit); ``chunk_size`` is the size of the
    download frames this side sends. Every bound is listed in the module docstring.

    Cancelling is safe: the host's slot in ``registry`` is released and nothing else is held.
    """
    if (
        min(max_frame, chunk_size, max_bytes_per_request, max_requests_per_connection) < 1
        or max_connection_seconds <= 0
    ):
        raise ConfigError("speed test limits must be positive")
    try:
        with registry.admit(host_id, connection):
            log.info("host %s started a speed test", host_id)
            await _serve(
                connection,
                host_id=host_id,
                max_frame=max_frame,
                chunk_size=chunk_size,
                max_bytes_per_request=max_bytes_per_request,
                max_requests_per_connection=max_requests_per_connection,
                max_connection_seconds=max_connection_seconds,
            )
    except ProtocolError as exc:
        log.warning("closing the speed test of host %s: %s (%s)", host_id, exc.message, exc.code)
        await connection.close(exc.close_code, _reason(exc.message))
    except ConnectionClosed as exc:
        log.info("host %s ended its speed test (%s)", host_id, exc)


@dataclass
class _Totals:
    requests: int = 0
    downloaded: int = 0
    uploaded: int = 0


async def _serve(
    connection: SpeedtestConnection,
    *,
    host_id: str,
    max_frame: int,
    chunk_size: int,
    max_bytes_per_request: int,
    max_requests_per_connection: int,
    max_connection_seconds: float,
) -> None:
    totals = _Totals()
    try:
        # The connection's time budget bounds every await of the session, a stalled
        # reader or an idle client alike, so the deadline wraps the whole exchange.
        async with asyncio.timeout(max_connection_seconds):
            await connection.send(
                _encode(
                    {
                        "op": "hello",
                        "max_frame": max_frame,
                        "max_bytes_per_request": max_bytes_per_request,
                        "max_requests": max_requests_per_connection,
                        "max_seconds": max_connection_seconds,
                    }
                )
            )
            payload = os.urandom(chunk_size)  # incompressible, in case anything on the path compresses
            while True:
                command = parse_command(await connection.recv())
                totals.requests += 1
                if totals.requests > max_requests_per_connection:
                    raise ProtocolError(
                        f"more than {max_requests_per_connection} commands on one speed test; reconnect for another",
                        code="rate_limited",
                        close_code=CLOSE_RATE_LIMITED,
                    )
                if isinstance(command, Ping):
                    pong: dict[str, Any] = {"op": "pong", "id": command.id}
                    if command.t is not None:
                        pong["t"] = command.t
                    await connection.send(_encode(pong))
                    continue
                if command.size > max_bytes_per_request:
                    op = "download" if isinstance(command, Download) else "upload"
                    raise ProtocolError(
                        f"{op} of {command.size} bytes exceeds the {max_bytes_per_request}-byte limit per request",
                        code="policy",
                        close_code=CLOSE_POLICY,
                    )
                if isinstance(command, Download):
                    await _send_download(connection, command.size, payload)
                    totals.downloaded += command.size
                else:
                    await _receive_upload(connection, command.size)
                    totals.uploaded += command.size
    except TimeoutError:
        raise ProtocolError(
            f"speed test connection exceeded its {max_connection_seconds:g} s limit; reconnect for another",
            code="policy",
            close_code=CLOSE_POLICY,
        ) from None
    finally:
        log.info(
            "speed test of host %s: %d commands, %d bytes down, %d bytes up",
            host_id,
            totals.requests,
            totals.downloaded,
            totals.uploaded,
        )


async def _send_download(connection: SpeedtestConnection, size: int, payload: bytes) -> None:
    remaining = size
    while remaining > 0:
        frame = payload if remaining >= len(payload) else payload[:remaining]
        await connection.send(frame)
        remaining -= len(frame)
    await connection.send(_encode({"op": "download_done", "bytes": size}))


async def _receive_upload(connection: SpeedtestConnection, size: int) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    received = 0
    while received < size:
        data = await connection.recv()
        if isinstance(data, str):
            raise _malformed(f"upload: a text frame arrived with {size - received} of {size} bytes still due")
        received += len(data)
        if received > size:
            raise _malformed(f"upload: received more than the {size} bytes announced")
    seconds = loop.time() - started
    await connection.send(_encode({"op": "upload_done", "bytes": received, "seconds": seconds}))
