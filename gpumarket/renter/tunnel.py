"""``gpumarket tunnel RENTAL [--port ssh|N]``: stdin ↔ the relay's websocket ↔ stdout.

It is the ProxyCommand that ``gpumarket ssh``, ``cp`` and ``ssh-config`` give ssh: ask the API
for a ticket (``connect.py``), open a websocket to the ticket's relay with the ticket as bearer
token, TLS verified against the CA the ticket names (only that CA, never none), then copy bytes
both ways, one binary message per chunk read. Local EOF sends an empty message (the end of our
input; the relay half-closes the stream and keeps sending what the far end has);
the relay closing it ends the tunnel: 1000 is the far end's EOF, a 4xxx code carries the
relay's reason (refused, a limit, the rental stopped). Errors are one line on stderr and exit
status 255, as ssh's own.

Cancellation: SIGHUP (what ssh sends its ProxyCommand at exit), SIGTERM and SIGINT close the
websocket normally and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import ssl
import sys
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from gpumarket import __version__
from gpumarket.renter.api import Client, CliError, load_login
from gpumarket.renter.connect import SSH, Ticket, request_ticket
from gpumarket.renter.stdio import Sink, Source, Stdio, loop_kind
from shared import eventloop

EXIT_ERROR = 255  # what ssh exits with on its own errors
CHUNK = 64 * 1024  # the most one binary message carries this way (the stream layer's MAX_DATA)


class TunnelError(CliError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status=EXIT_ERROR)


def relay_ssl_context(ca_pem: str) -> ssl.SSLContext:
    """Verify the relay against the ticket's CA only (and its name), TLS 1.2 at least."""
    try:
        context = ssl.create_default_context(cadata=ca_pem)
    except (ssl.SSLError, ValueError) as exc:
        raise TunnelError(f"the API's CA certificate for the relay does not load ({exc}); is the master up to date?") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


async def open_relay(
    ticket: Ticket, *,
    # Timeouts
    open_timeout: float = 10, close_timeout: float = 5, ping_interval: float | None = 20, ping_timeout: float = 20,
    # Limits
    max_message: int = 2**20, max_queue: int = 16, write_limit: int = 2 * CHUNK,
) -> ClientConnection:  # fmt: skip
    """The websocket to the ticket's relay, open; a ``TunnelError`` saying why not."""
    where = urlsplit(ticket.relay_url).netloc or ticket.relay_url
    try:
        return await connect(
            ticket.relay_url, additional_headers={"Authorization": f"Bearer {ticket.token}"},
            ssl=relay_ssl_context(ticket.ca_pem), proxy=None, compression=None,
            user_agent_header=f"gpumarket/{__version__}", open_timeout=open_timeout, close_timeout=close_timeout,
            ping_interval=ping_interval, ping_timeout=ping_timeout, max_size=max_message, max_queue=max_queue,
            write_limit=write_limit,
        )  # fmt: skip
    except InvalidStatus as exc:
        status = exc.response.status_code
        text = " ".join(exc.response.body.decode(errors="replace").split())[:300] if exc.response.body else ""
        again = "; run the command again for a fresh ticket" if status == 401 else ""
        raise TunnelError(f"the relay refused the tunnel: {text or exc.response.reason_phrase} (HTTP {status}){again}") from None
    except ssl.SSLCertVerificationError as exc:
        raise TunnelError(
            f"the relay at {where} has a certificate the API's CA does not vouch for ({exc.verify_message}); not connecting"
        ) from None
    except (InvalidURI, InvalidHandshake) as exc:
        raise TunnelError(f"the relay at {where} did not open a websocket ({exc}); is the master up to date?") from None
    except (OSError, TimeoutError) as exc:
        why = f"no answer in {open_timeout:g} s" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise TunnelError(f"cannot reach the relay at {where} ({why}); check your network, or try again") from None


async def splice(ws: ClientConnection, source: Source, sink: Sink, *, stop: asyncio.Event | None = None) -> None:
    """Copy ``source`` to the websocket and the websocket to ``sink`` until either side ends.

    Returns when the relay closed the websocket (after writing all it sent), or when ``source``
    reached EOF or ``stop`` was set and the close handshake that starts is over. Then
    ``check_close`` says whether the relay ended it with an error. Cancelling it is safe: the
    websocket is left to its owner to close.
    """

    async def upstream() -> None:
        with contextlib.suppress(ConnectionClosed):  # the relay ended it: downstream reports how
            while data := await source.read():
                await ws.send(data)
            # An empty message ends our input but keeps reading (a half-close): the relay closes
            # with 1000 once the far end has sent all it had.
            await ws.send(b"")

    async def downstream() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in ws:
                if isinstance(message, str):
                    await ws.close(1003, "binary messages only")
                    raise TunnelError("the relay sent a text message on a byte tunnel; is the relay up to date?")
                await sink.write(message)

    up, down = asyncio.create_task(upstream()), asyncio.create_task(downstream())
    stopping = asyncio.create_task((stop or asyncio.Event()).wait())
    try:
        done, _ = await asyncio.wait({up, down, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if down in done:
            down.result()
        elif up in done:
            up.result()
            await asyncio.wait({down, stopping}, return_when=asyncio.FIRST_COMPLETED)  # the far end's rest, then its close
            if not down.done():
                await ws.close()
            await down
        else:
            await ws.close()
            await down
    finally:
        for task in (up, down, stopping):
            task.cancel()
        await asyncio.gather(up, down, stopping, return_exceptions=True)


def check_close(ws: ClientConnection) -> None:
    """``TunnelError`` unless the tunnel ended well: the relay closed it with 1000 (or no code),
    or we closed it and the relay answered without a 4xxx reason of its own (when both close at
    once, the relay's reason wins: "rental stopped" is worth saying)."""
    protocol = ws.protocol
    rcvd, sent = protocol.close_rcvd, protocol.close_sent
    we_closed_first = sent is not None and not protocol.close_rcvd_then_sent
    if rcvd is not None and rcvd.code in (1000, 1005):
        return
    if we_closed_first and (rcvd is None or rcvd.code < 4000):
        return
    if rcvd is None:
        raise TunnelError("the connection to the relay broke; run the command again")
    if rcvd.code == 1001:
        raise TunnelError("the relay is shutting down (1001); run the command again to reach another")
    raise TunnelError(f"the relay closed the tunnel: {rcvd.reason or 'no reason given'} ({rcvd.code})")


async def tunnel(ticket: Ticket, source: Source, sink: Sink, *, stop: asyncio.Event | None = None) -> None:
    """Open the ticket's relay and splice until the tunnel ends; ``TunnelError`` if it ended badly."""
    ws = await open_relay(ticket)
    try:
        await splice(ws, source, sink, stop=stop)
    except BrokenPipeError:
        pass  # stdout's reader (ssh) has gone: close the websocket normally
    finally:
        await ws.close()
    check_close(ws)


# ---- the command --------------------------------------------------------------------------------


def run_tunnel(args: argparse.Namespace) -> None:
    """``gpumarket tunnel``: errors are one line on stderr and exit status 255."""
    try:
        login = load_login(args.config, os.environ)
        # uvloop when ssh gave us pipes or sockets (issue 42); asyncio's loop for a regular file or a terminal.
        kind = "asyncio" if os.environ.get(eventloop.LOOP_ENV) == "asyncio" else loop_kind()
        eventloop.run(_main(args, Client(login, timeout=args.timeout)), kind=kind)
    except CliError as exc:
        print(f"gpumarket: {exc.message}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


async def _main(args: argparse.Namespace, client: Client) -> None:
    async with client:
        ticket = await request_ticket(client, args.rental, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stdio = Stdio(chunk=CHUNK)
    try:
        source, sink = await stdio.open()
        await tunnel(ticket, source, sink, stop=stop)
    finally:
        await stdio.aclose()


def port_arg(text: str) -> str | int:
    """``ssh`` or a TCP port."""
    if text == SSH:
        return SSH
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'ssh' or a TCP port, not {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 'ssh' or 1 to 65535, not {value}")
    return value
