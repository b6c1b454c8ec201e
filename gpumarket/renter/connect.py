"""``POST /api/v1/rentals/{id}/connect``: a short-lived relay ticket to one port of a rental.

The answer names the relay's websocket URL, a bearer token for it (about 2 minutes, bound to
this renter, rental and port), the CA the relay's certificate chains to and, for the rental's
SSH server, its pinned host key, the alias to check it under and the login user. Everything
here ends up in an ``ssh`` command line, a ``known_hosts`` line or an ``ssh_config`` file, so
it is checked strictly: a malformed answer is an error, never text pasted into a config.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumarket.renter.api import ApiError, Client, CliError

SSH = "ssh"
# What an alias, a login user or a rental id may be: safe in argv, ssh_config and known_hosts.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# "<type> <base64>[ comment]", e.g. "ssh-ed25519 AAAAC3Nz... agent@h-1"
HOST_KEY_RE = re.compile(r"((?:ssh|ecdsa|sk)-[A-Za-z0-9@.-]+) ([A-Za-z0-9+/]+={0,2})(?: [^\r\n]*)?")


class BadAnswer(CliError):
    """The API answered 200 with something that is not a connect ticket."""


@dataclass(frozen=True)
class SshEndpoint:
    host_key: str  # "<type> <base64>", the comment dropped
    host_alias: str
    user: str


@dataclass(frozen=True)
class Ticket:
    """What ``connect`` answers: where and how to open the tunnel."""

    rental_id: str
    kind: str
    port: int
    relay_url: str
    token: str
    expires_at: str
    ca_pem: str
    ssh: SshEndpoint | None = None
    web_url: str | None = None


def port_body(port: str | int) -> dict[str, str | int]:
    return {"port": SSH if port == SSH else int(port)}


async def request_ticket(client: Client, rental_id: str, port: str | int) -> Ticket:
    """Ask the API for a ticket to ``port`` (``"ssh"`` or a declared TCP port) of ``rental_id``.

    Raises ``ApiError`` with the API's code (``rental_not_found``, ``rental_not_running``,
    ``host_offline``, ``port_not_declared``, ``no_ssh_host_key``) and ``BadAnswer`` for a
    malformed ticket. Not retried: each call mints a token.
    """
    if is_volume(rental_id):
        if port != SSH:
            raise CliError(f"{rental_id} is a volume: it serves files over SSH only (sftp, scp, rsync), no ports")
        body = await client.request("POST", f"/volumes/{rental_id}/connect", json_body={})
        if isinstance(body, dict) and "rental_id" not in body:
            body = {**body, "rental_id": body.get("volume_id")}  # the stream's target: the volume's id
        return parse_ticket(body, want_ssh=True)
    body = await client.request("POST", f"/rentals/{rental_id}/connect", json_body=port_body(port))
    return parse_ticket(body, want_ssh=port == SSH)


def is_volume(target: str) -> bool:
    """Whether a connect target names a volume (``vol-…`` or a volume's name) rather than a rental: rental ids are
    ``r-…`` (docs/volumes.md; a volume named ``r-…`` is reached by its id)."""
    return target.startswith("vol-") or not target.startswith("r-")


def parse_ticket(body: Any, *, want_ssh: bool) -> Ticket:
    if not isinstance(body, dict):
        raise _bad("not a JSON object")
    strings = {}
    for name in ("rental_id", "kind", "relay_url", "token", "expires_at", "ca_pem"):
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise _bad(f"no {name}")
        strings[name] = value
    port = body.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise _bad("no port")
    if not strings["relay_url"].startswith("wss://"):
        raise _bad(f"the relay URL {strings['relay_url'][:60]!r} is not wss://")
    if "BEGIN CERTIFICATE" not in strings["ca_pem"]:
        raise _bad("ca_pem is not a PEM certificate")
    if not NAME_RE.fullmatch(strings["rental_id"]):
        raise _bad("a malformed rental_id")
    ssh = _parse_ssh(body.get("ssh")) if want_ssh else None
    web_url = body.get("web_url")
    return Ticket(
        rental_id=strings["rental_id"], kind=strings["kind"], port=port, relay_url=strings["relay_url"],
        token=strings["token"], expires_at=strings["expires_at"], ca_pem=strings["ca_pem"], ssh=ssh,
        web_url=web_url if isinstance(web_url, str) else None,
    )  # fmt: skip


def _parse_ssh(raw: Any) -> SshEndpoint:
    if not isinstance(raw, dict):
        raise _bad("no ssh block for an SSH connect")
    key, alias, user = raw.get("host_key"), raw.get("host_alias"), raw.get("user")
    match = HOST_KEY_RE.fullmatch(key) if isinstance(key, str) else None
    if match is None:
        raise _bad("a malformed ssh.host_key")
    for name, value in (("host_alias", alias), ("user", user)):
        if not isinstance(value, str) or not NAME_RE.fullmatch(value):
            raise _bad(f"a malformed ssh.{name}")
    assert isinstance(alias, str) and isinstance(user, str)
    return SshEndpoint(host_key=f"{match[1]} {match[2]}", host_alias=alias, user=user)


def rental_arg(text: str) -> str:
    """A rental id as an argparse type."""
    if not NAME_RE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a rental id: {text!r} (`gpumarket rentals` lists yours)")
    return text


# ---- web ports ----------------------------------------------------------------------------------


def declared_ports(rental: Mapping[str, Any]) -> list[int]:
    """The TCP ports a rental's container workload declared (a template's included); none for a hold or a process."""
    workload = rental.get("workload") or {}
    if workload.get("kind") != "container":
        return []
    return [int(p) for p in workload.get("ports") or []]


def no_web_port(rental_id: str, number: int) -> str:
    return f"its relay serves no web ports; pipe the port with `gpumarket tunnel {rental_id} --port {number}`"


async def port_lines(client: Client, rental: Mapping[str, Any]) -> list[str]:
    """``port 8000  https://…`` for each port the running ``rental`` declared: its web address through the relay, or
    why there is none now (its host offline, say)."""
    lines = []
    for number in declared_ports(rental):
        try:
            ticket = await request_ticket(client, rental["id"], number)
        except ApiError as exc:
            lines.append(f"port {number}  no address now: {exc.message}")
            continue
        lines.append(f"port {number}  {ticket.web_url or no_web_port(rental['id'], number)}")
    return lines


def _bad(what: str) -> BadAnswer:
    return BadAnswer(f"the API's connect answer is malformed ({what}); is the master up to date with this gpumarket?")
