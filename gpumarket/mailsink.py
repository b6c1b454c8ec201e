"""A local SMTP sink: a real SMTP server (aiosmtpd) that keeps every message instead of delivering it.

``gpumarket up`` runs one on loopback and points the master's ``smtp_url`` at it, so sign-up, verification and
password resets work offline; each message is also written to ``<folder>/<n>.eml`` and the ready box says where.
The tests read the messages from ``MailSink.messages`` (or ``wait_for``) as a user reads an inbox.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from email import message_from_bytes, policy
from email.message import EmailMessage
from pathlib import Path

from aiosmtpd.smtp import SMTP, Envelope, Session

LINK = re.compile(r"https?://\S+")


@dataclass
class Received:
    to: list[str]
    message: EmailMessage

    @property
    def subject(self) -> str:
        return str(self.message["Subject"])

    @property
    def body(self) -> str:
        part = self.message.get_body(preferencelist=("plain",))
        return part.get_content() if part is not None else ""

    def links(self) -> list[str]:
        return LINK.findall(self.body)


@dataclass
class MailSink:
    """Start with ``start()`` (port 0 picks one), stop with ``close()``; ``url`` is the ``smtp_url`` to use."""

    host: str = "127.0.0.1"
    port: int = 0
    folder: Path | None = None
    messages: list[Received] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    @property
    def url(self) -> str:
        return f"smtp://{self.host}:{self.port}"

    async def start(self) -> MailSink:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: SMTP(self, hostname="gpumarket-mail-sink"), self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        content = envelope.original_content or envelope.content or b""
        raw = content if isinstance(content, bytes) else content.encode()
        message = message_from_bytes(raw, policy=policy.default)
        assert isinstance(message, EmailMessage)
        received = Received([str(to) for to in envelope.rcpt_tos], message)
        async with self._arrived:
            self.messages.append(received)
            if self.folder is not None:
                (self.folder / f"{len(self.messages):04d}.eml").write_bytes(raw)
            self._arrived.notify_all()
        return "250 OK: kept by the gpumarket mail sink"

    async def wait_for(self, to: str, *, after: int = 0, timeout: float = 30.0) -> Received:
        """The first message to ``to`` among those after the first ``after`` ones, waiting for it to arrive."""
        async with asyncio.timeout(timeout), self._arrived:
            while True:
                for received in self.messages[after:]:
                    if to.lower() in (address.lower() for address in received.to):
                        return received
                await self._arrived.wait()
