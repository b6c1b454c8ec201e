"""A stand-in master and relay for the renter's ssh/cp/tunnel commands, on loopback, per the contract:

* the master's ``POST /api/v1/rentals/{id}/connect`` and ``GET /api/v1/rentals`` (aiohttp);
* a relay: a real TLS websocket server (certificate from a test CA) that takes ``Authorization:
  Bearer <ticket token>`` once, and splices the websocket's binary messages to a TCP target;
* the targets: a real SSH + SFTP server (asyncssh, chrooted to a workspace folder), a TCP echo
  server, a "speaker" that sends bytes and hangs up, and a relay-side close with a 4xxx code.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import asyncssh
from aiohttp import web
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from shared.crypto import CertificateAuthority, server_ssl_context

API_KEY = "key-renter-1"
SSH_RENTAL = "r-0123456789abcdef"
WRONG_KEY_RENTAL = "r-fedcba9876543210"
NO_SSH_RENTAL = "r-00000000000000aa"
STOPPED_RENTAL = "r-00000000000000bb"
ECHO_PORT, SPEAKER_PORT, CLOSING_PORT, UNKNOWN_TICKET_PORT = 8888, 7000, 7001, 7002
SPOKEN = bytes(range(256)) * 4096  # what the speaker sends before it hangs up (1 MiB)
RELAY_CLOSE = (4009, "rental stopped by its renter")


@dataclass
class Target:
    """Where the relay takes a ticket: a TCP port on loopback, or a close code of its own."""

    port: int | None = None
    close: tuple[int, str] | None = None


@dataclass
class Market:
    api_url: str = ""
    relay_url: str = ""
    ca_pem: str = ""
    host_key_line: str = ""  # the SSH server's real public key, "ssh-ed25519 AAAA..."
    wrong_key_line: str = ""
    workspace: Path = Path()
    ssh_port: int = 0
    tickets: dict[str, Target] = field(default_factory=dict)  # token → target, taken once by the relay
    targets: dict[tuple[str, str | int], Target] = field(default_factory=dict)  # (rental, port) → target
    relay_closes: list[int | None] = field(default_factory=list)  # the close code each tunnel's client sent
    ssh_users: list[str] = field(default_factory=list)
    connects: int = 0


def alias(rental_id: str) -> str:
    return f"{rental_id}.gpumarket"


# ---- the master's two endpoints ------------------------------------------------------------------

MARKET = web.AppKey("market", Market)
RENTALS = {
    SSH_RENTAL: "running", WRONG_KEY_RENTAL: "running", NO_SSH_RENTAL: "running", STOPPED_RENTAL: "stopped",
}  # fmt: skip


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


async def connect_handler(request: web.Request) -> web.Response:
    market = request.app[MARKET]
    if request.headers.get("Authorization") != f"Bearer {API_KEY}":
        return web.json_response({"code": "invalid_api_key", "message": "That API key is not valid."}, status=401)
    rental_id = request.match_info["rental_id"]
    port = (await request.json()).get("port")
    if rental_id not in RENTALS:
        return _error(404, "rental_not_found", f"No rental {rental_id}.")
    if RENTALS[rental_id] != "running":
        return _error(409, "rental_not_running", f"Rental {rental_id} is {RENTALS[rental_id]}.")
    if port == "ssh" and rental_id == NO_SSH_RENTAL:
        return _error(409, "no_ssh_host_key", "This rental's host has not reported an SSH host key.")
    target = market.targets.get((rental_id, port))
    if target is None:
        return _error(422, "port_not_declared", f"Rental {rental_id} declared no port {port}.")
    market.connects += 1
    token = secrets.token_urlsafe(24)
    if port != UNKNOWN_TICKET_PORT:
        market.tickets[token] = target
    body: dict[str, Any] = {
        "rental_id": rental_id, "kind": "ssh" if port == "ssh" else "tcp", "port": 22 if port == "ssh" else port,
        "relay_url": market.relay_url, "token": token, "expires_at": "2026-11-26T05:40:00Z", "ca_pem": market.ca_pem,
        "ssh": None, "web_url": None,
    }  # fmt: skip
    if port == "ssh":
        key = market.wrong_key_line if rental_id == WRONG_KEY_RENTAL else market.host_key_line
        body["ssh"] = {"host_key": f"{key} agent@h-1", "host_alias": alias(rental_id), "user": "gpumarket"}
    else:
        body["web_url"] = f"https://{rental_id}-{port}.ports.example:7444/?gm_token=x"
    return web.json_response(body)


async def rentals_handler(request: web.Request) -> web.Response:
    items = [{"id": rid, "state": state} for rid, state in RENTALS.items()]
    return web.json_response({"items": items, "total": len(items)})


# ---- the relay ------------------------------------------------------------------------------------


def _refuse(connection: ServerConnection, request: Request, market: Market) -> Response | None:
    token = (request.headers.get("Authorization") or "").removeprefix("Bearer ")
    if token not in market.tickets:
        response = connection.respond(HTTPStatus.FORBIDDEN, "ticket unknown or expired: ask the API for a new one\n")
        response.headers = Headers({"Content-Type": "text/plain", "Content-Length": str(len(response.body))})
        return response
    return None


async def _relay_handler(ws: ServerConnection, market: Market) -> None:
    token = (ws.request.headers.get("Authorization") if ws.request else "") or ""
    target = market.tickets.pop(token.removeprefix("Bearer "))
    if target.close is not None:
        await ws.close(*target.close)
        return
    assert target.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", target.port)

    async def to_target() -> None:
        async for message in ws:
            assert isinstance(message, bytes), "the client sends binary messages only"
            if not message:  # the end of the client's input: half-close, as the relay does
                writer.write_eof()
                continue
            writer.write(message)
            await writer.drain()

    async def to_client() -> None:
        while data := await reader.read(64 * 1024):
            await ws.send(data)
        await ws.close()  # the far end finished: 1000

    tasks = [asyncio.create_task(to_target()), asyncio.create_task(to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        await ws.wait_closed()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        writer.close()
        market.relay_closes.append(ws.protocol.close_rcvd.code if ws.protocol.close_rcvd else None)


# ---- the targets ----------------------------------------------------------------------------------


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(64 * 1024):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _speak(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(SPOKEN)
    await writer.drain()
    writer.close()


def _ssh_process(market: Market) -> Any:
    async def handle(process: asyncssh.SSHServerProcess[str]) -> None:
        user = str(process.get_extra_info("username"))
        market.ssh_users.append(user)
        process.stdout.write(f"hello {user}, you ran: {process.command}\n")
        process.exit(0)

    return handle


class WorkspaceSFTP(asyncssh.SFTPServer):
    """SFTP rooted at the workspace that, like OpenSSH's sshd, ends its session with exit-status 0.

    asyncssh's own SFTP session closes the channel without an exit status, which OpenSSH's scp
    (SFTP mode, its default since 9.0) counts as a failure (exit 1) even after a whole copy.
    """

    def exit(self) -> None:
        super().exit()
        self.channel.exit(0)


def _key_line(key: asyncssh.SSHKey) -> str:
    """"ssh-ed25519 AAAA..." without the comment."""
    kind, blob = key.export_public_key().decode().split()[:2]
    return f"{kind} {blob}"


def _ssh_keys_handler(public_key: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /account/ssh-keys``: the one key the stand-in's SSH server accepts (``gpumarket ssh`` asks first)."""
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"ssh_keys": [{"id": "sshk-0000000000000001", "name": "test", "public_key": public_key}]})

    return handler


@contextlib.asynccontextmanager
async def running_market(tmp: Path, ca: CertificateAuthority, client_public_key: str) -> AsyncIterator[Market]:
    """The whole stand-in, up on loopback until the block ends."""
    market = Market(ca_pem=ca.cert_pem.decode(), workspace=tmp / "workspace")
    market.workspace.mkdir()
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    market.host_key_line = _key_line(host_key)
    market.wrong_key_line = _key_line(asyncssh.generate_private_key("ssh-ed25519"))

    workspace = str(market.workspace).encode()
    ssh_server = await asyncssh.listen(
        "127.0.0.1", 0, server_host_keys=[host_key],
        authorized_client_keys=asyncssh.import_authorized_keys(client_public_key),
        process_factory=_ssh_process(market), sftp_factory=lambda chan: WorkspaceSFTP(chan, chroot=workspace),
    )  # fmt: skip
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    speaker = await asyncio.start_server(_speak, "127.0.0.1", 0)
    market.ssh_port = ssh_server.sockets[0].getsockname()[1]
    for rental in (SSH_RENTAL, WRONG_KEY_RENTAL):
        market.targets[(rental, "ssh")] = Target(port=market.ssh_port)
    market.targets[(SSH_RENTAL, ECHO_PORT)] = Target(port=echo.sockets[0].getsockname()[1])
    market.targets[(SSH_RENTAL, SPEAKER_PORT)] = Target(port=speaker.sockets[0].getsockname()[1])
    market.targets[(SSH_RENTAL, CLOSING_PORT)] = Target(close=RELAY_CLOSE)
    market.targets[(SSH_RENTAL, UNKNOWN_TICKET_PORT)] = Target(port=1)

    key_file, cert_file = ca.write_server_certificate(tmp, ["127.0.0.1", "localhost"], basename="relay")
    context: ssl.SSLContext = server_ssl_context(cert_file, key_file, ca.cert_path, require_client_cert=False)
    relay: Server = await serve(
        lambda ws: _relay_handler(ws, market), "127.0.0.1", 0, ssl=context, compression=None,
        process_request=lambda connection, request: _refuse(connection, request, market),
    )  # fmt: skip
    market.relay_url = f"wss://127.0.0.1:{relay.sockets[0].getsockname()[1]}/v1/connect"

    app = web.Application()
    app[MARKET] = market
    app.router.add_post("/api/v1/rentals/{rental_id}/connect", connect_handler)
    app.router.add_get("/api/v1/rentals", rentals_handler)
    app.router.add_get("/api/v1/account/ssh-keys", _ssh_keys_handler(client_public_key))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert runner.addresses
    market.api_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield market
    finally:
        await runner.cleanup()
        relay.close()
        await relay.wait_closed()
        for server in (echo, speaker):
            server.close()
        ssh_server.close()
        await ssh_server.wait_closed()
