"""``ssh -L`` into a container rental (``agent.reach.sshd``): the one destination a forward may open — a port on the
rental container's own address, or its ``localhost`` — and the bytes pumped both ways between it and the channel."""

from __future__ import annotations

import asyncio
from typing import Final

import asyncssh

from agent.runtimes.container import ContainerRuntime
from shared.errors import BadRequest

EXITED: Final = "the workload has exited; only SFTP (scp, sftp) reaches /workspace until the rental is released"
CHUNK: Final = 32 << 10


async def open_container_port(
    containers: ContainerRuntime, rental_id: str, dest_host: str, dest_port: int, *, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to ``dest_port`` of the rental's container; ``asyncssh.ChannelOpenError`` saying why not (another
    address, the workload gone, the port not answering)."""
    try:
        address = await containers.container_address(rental_id)
    except BadRequest as exc:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, exc.message) from None
    if address is None:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, EXITED)
    if dest_host not in (address, "localhost", "127.0.0.1"):
        raise asyncssh.ChannelOpenError(
            asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
            f"only the rental's container ({address}, or localhost) can be reached, not {dest_host[:100]}",
        )
    try:
        opened = await containers.open_port(rental_id, dest_port, timeout=timeout)
    except BadRequest as exc:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, exc.message) from None
    except (OSError, TimeoutError) as exc:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, f"port {dest_port} of the rental's container does not answer ({exc})") from None
    if opened is None:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, EXITED)
    return opened


async def pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
    chan_reader: asyncssh.SSHReader[bytes], chan_writer: asyncssh.SSHWriter[bytes],
) -> None:
    """Copy both ways until both sides have ended (an end of file passed on as one); raises the first error."""

    async def inbound() -> None:
        while data := await chan_reader.read(CHUNK):
            if writer.is_closing():  # asyncio drops the write, uvloop raises RuntimeError: both a closed socket
                raise ConnectionResetError("the forwarded connection closed")
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    async def outbound() -> None:
        while data := await reader.read(CHUNK):
            chan_writer.write(data)
            await chan_writer.drain()
        chan_writer.write_eof()

    await asyncio.gather(inbound(), outbound())
