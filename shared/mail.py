"""Sending mail through SMTP: the master's verification and password-reset links (``smtp_url``).

``smtp://[user:password@]host[:port]`` (port 25 by default) speaks plain SMTP, upgraded with STARTTLS when the
server offers it only for ``smtp+starttls://`` (where it is then required); ``smtps://`` (port 465) is TLS from
the first byte. The standard library's ``smtplib`` does the talking, in a worker thread, bounded by ``timeout``.
A message that cannot be sent raises ``MailUnavailable`` (503 ``mail_unavailable``): the caller says so and the
user asks again, nothing is queued.
"""

from __future__ import annotations

import asyncio
import smtplib
import ssl
from dataclasses import dataclass
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from urllib.parse import unquote, urlsplit

from shared.errors import ConfigError, ServiceUnavailable

SCHEMES = {"smtp": 25, "smtp+starttls": 587, "smtps": 465}


class MailUnavailable(ServiceUnavailable):
    code = "mail_unavailable"


@dataclass(frozen=True)
class Mail:
    """One message: plain text, to one recipient."""

    to: str
    subject: str
    body: str


@dataclass(frozen=True)
class SmtpServer:
    scheme: str
    host: str
    port: int
    username: str | None
    password: str | None

    @classmethod
    def parse(cls, url: str) -> SmtpServer:
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise ConfigError(f"smtp_url must be smtp://, smtp+starttls:// or smtps:// and name a host; got scheme {parts.scheme!r}")
        try:
            port = parts.port or SCHEMES[parts.scheme]
        except ValueError as exc:
            raise ConfigError(f"smtp_url: {exc}") from None
        return cls(
            parts.scheme, parts.hostname, port,
            unquote(parts.username) if parts.username else None, unquote(parts.password) if parts.password else None,
        )  # fmt: skip

    def __repr__(self) -> str:  # never the password, in a log or a traceback
        return f"SmtpServer({self.scheme}://{self.host}:{self.port})"


def build(mail: Mail, sender: str) -> EmailMessage:
    message = EmailMessage()
    message["From"] = sender
    message["To"] = mail.to
    message["Subject"] = mail.subject
    message["Date"] = formatdate(usegmt=True)
    message["Message-ID"] = make_msgid(domain="gpumarket.local")
    message.set_content(mail.body)
    return message


def _send(server: SmtpServer, message: EmailMessage, timeout: float) -> None:
    context = ssl.create_default_context()
    client: smtplib.SMTP
    if server.scheme == "smtps":
        client = smtplib.SMTP_SSL(server.host, server.port, timeout=timeout, context=context)
    else:
        client = smtplib.SMTP(server.host, server.port, timeout=timeout)
    with client:
        if server.scheme == "smtp+starttls":
            client.starttls(context=context)
        if server.username is not None:
            client.login(server.username, server.password or "")
        client.send_message(message)


async def send(url: str, sender: str, mail: Mail, *, timeout: float = 10.0) -> None:
    """Send ``mail``; ``MailUnavailable`` (the cause, never the credentials) when the server cannot take it."""
    server = SmtpServer.parse(url)
    try:
        await asyncio.to_thread(_send, server, build(mail, sender), timeout)
    except (OSError, smtplib.SMTPException) as exc:
        raise MailUnavailable(
            f"the mail server at {server.host}:{server.port} did not take the message ({type(exc).__name__}); try again in a minute"
        ) from None
