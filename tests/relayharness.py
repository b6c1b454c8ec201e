"""What the relay's test modules share: the relay's base options for a test, a welcomed websocket
client, and the polling and command-publishing helpers (a real Relay on loopback, an in-process bus)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close

from access.relay import Relay
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import CertificateAuthority
from shared.outbound import OutboundWindow
from tests.factories import MS
from tests.pki import agent_client_context

# Every network step is on loopback; a wait that runs out means a bug, not a slow network.
IO_TIMEOUT = 5.0
# A websocket's opening (TLS, the upgrade, the welcome) only guarded against a hang: on a loaded 2-core machine one
# handshake among dozens in a row was seen to wait over 5 s for its process to be scheduled.
OPEN_TIMEOUT = 60.0
EVENTS_GROUP = "test-master"

ServerFrame = protocol.Welcome | protocol.Ack | protocol.Command | protocol.Move


@contextlib.asynccontextmanager
async def events_bus() -> AsyncIterator[InProcessBus]:
    """An in-process bus with the master's consumer group (EVENTS_GROUP) on the agents' events; closed on exit."""
    bus = InProcessBus()
    await bus.ensure_group(protocol.AGENT_EVENTS_STREAM, EVENTS_GROUP)
    try:
        yield bus
    finally:
        await bus.close()


StartRelay = Callable[..., Awaitable[Relay]]


@contextlib.asynccontextmanager
async def started_relays(*, close_buses: bool = False) -> AsyncIterator[StartRelay]:
    """Start relays from their keyword arguments; every one started is closed on exit (its bus too when
    ``close_buses``)."""
    started: list[Relay] = []

    async def start(**options: Any) -> Relay:
        relay = Relay(**options)
        await relay.start()
        started.append(relay)
        return relay

    try:
        yield start
    finally:
        for relay in started:
            await relay.close()
            if close_buses:
                await relay.bus.close()


def relay_options(relay_id: str, bus: InProcessBus, server_context: ssl.SSLContext) -> dict[str, Any]:
    """A test relay's keyword arguments: 127.0.0.1 port 0, intervals of 50 MS, the test timeouts."""
    return {
        "relay_id": relay_id,
        "bus": bus,
        "ssl_context": server_context,
        "host": "127.0.0.1",
        "port": 0,
        "heartbeat_interval": 50 * MS,
        "telemetry_interval": 50 * MS,
        "open_timeout": IO_TIMEOUT,
        "close_timeout": 500 * MS,
    }


def connect_to_relay(url: str, context: ssl.SSLContext, **kwargs: Any) -> connect:
    """A websocket client for ``url`` presenting ``context``'s certificate, with the test timeouts."""
    return connect(url, ssl=context, open_timeout=OPEN_TIMEOUT, close_timeout=500 * MS, compression=None, **kwargs)


async def read_welcome(ws: ClientConnection) -> protocol.Welcome:
    """The relay's first frame, which must be a welcome."""
    async with asyncio.timeout(OPEN_TIMEOUT):
        welcome = protocol.decode_server_frame(await ws.recv())
    assert isinstance(welcome, protocol.Welcome)
    return welcome


@dataclass
class RelayClient:
    """A websocket client holding a host certificate, already welcomed by the relay."""

    host_id: str
    ws: ClientConnection
    window: OutboundWindow

    async def recv(self) -> ServerFrame:
        async with asyncio.timeout(IO_TIMEOUT):
            return protocol.decode_server_frame(await self.ws.recv())

    def heartbeat(self) -> tuple[int, str]:
        return self.window.heartbeat(protocol.HeartbeatBody(uptime_s=1.0))

    async def send_heartbeat(self) -> int:
        seq, frame = self.heartbeat()
        await self.ws.send(frame)
        return seq

    async def expect_ack(self, seq: int) -> None:
        message = await self.recv()
        assert isinstance(message, protocol.Ack), f"expected an ack, got {message!r}"
        assert message.body.seq == seq

    async def closed(self) -> Close:
        """Wait for the relay to close the connection; return the close frame it sent."""
        try:
            async with asyncio.timeout(IO_TIMEOUT):
                frame = await self.ws.recv()
        except ConnectionClosed as exc:
            assert exc.rcvd is not None, "the relay dropped the connection without a close frame"
            return exc.rcvd
        raise AssertionError(f"expected the connection to close, got a frame: {frame!r}")


async def connect_agent(relay: Relay, ca: CertificateAuthority, folder: Path, stack: contextlib.AsyncExitStack, host_id: str,
                        **kwargs: Any) -> RelayClient:  # fmt: skip
    """A simulated agent ``host_id`` (its certificate from ``ca``, its files under ``folder/agents/``) connected to
    ``relay`` until ``stack`` closes, past the welcome; ``kwargs`` go to the websocket's ``connect``."""
    context = agent_client_context(ca, folder / "agents" / host_id, host_id)
    ws = await stack.enter_async_context(connect_to_relay(relay.url, context, **kwargs))
    await read_welcome(ws)
    return RelayClient(host_id, ws, OutboundWindow(host_id, first_seq=1))


async def wait_for(condition: Callable[[], bool | Awaitable[bool]], *, timeout: float = IO_TIMEOUT) -> None:
    """Poll ``condition`` in steps of a few MS until it holds (bounded by ``timeout``, a hang guard)."""
    async with asyncio.timeout(timeout):
        while True:
            result = condition()
            if await result if inspect.isawaitable(result) else result:
                return
            await asyncio.sleep(5 * MS)


async def publish_command(bus: InProcessBus, relay_id: str, host_id: str, command_id: str, args: dict[str, Any]) -> None:
    """Put a ``start_workload`` command with ``args`` for ``host_id`` on ``relay_id``'s command stream."""
    delivery = protocol.CommandDelivery(
        host_id=host_id,
        command=protocol.Command(body=protocol.CommandBody(command_id=command_id, kind="start_workload", args=args)),
    )
    await bus.publish(protocol.commands_stream(relay_id), delivery.model_dump_json().encode())
