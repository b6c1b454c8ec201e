"""Connecting to a rental: ``POST /rentals/{id}/connect`` hands its renter a short-lived token and
the relay to use it at.

Only the rental's renter connects (an admin included answers 404 for another account's rental,
as for any unknown id). What it reaches:

* ``port="ssh"``: the agent's SSH server for the rental (a shell, commands, SFTP, ``-L``), while the
  rental runs, and after its workload exited on its own until ``workspace_until`` (SFTP only: the
  agent refuses a shell then). The answer pins the rental's SSH host key.
* ``port=N``: a TCP port the rental's container declared (``workload.ports``), while it runs; with
  the relay's web-port address (``web_url``) for a browser.

The token (``shared.crypto.tokens``) names renter, rental, host, kind and port, and is signed with
the CA's key; the relay the host is connected to now verifies it with the CA certificate. A host
on no live relay answers 409 ``host_offline``.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from master.context import Master
from master.models import Host, Rental
from master.services.accounts import Principal
from master.services.lifecycle.rentals import RentalState
from master.services.rentals.core import get_rental
from shared.crypto.tokens import new_claims
from shared.errors import Conflict, GpumarketError, NotFound, ValidationFailed
from shared.registry import RelayRecord
from shared.streams import CONNECT_PATH

log = logging.getLogger(__name__)

SSH = "ssh"
SSH_USER = "gpumarket"  # any user name logs in as the workload's user; this one reads well


def host_alias(rental_id: str) -> str:
    """The name renters' SSH clients know the rental by (its pinned host key is filed under it)."""
    return f"{rental_id}.gpumarket"


def web_label(rental_id: str, port: int) -> str:
    """The DNS label of a rental's port under the relay's ports domain."""
    return f"{rental_id}-{port}"


async def connect(master: Master, principal: Principal, rental_id: str, port: str | int) -> dict[str, Any]:
    now = master.clock.now()
    async with master.db.session() as session:
        rental = await get_rental(session, principal, rental_id)
        if rental.renter_id != principal.account_id:
            raise NotFound(f"no rental {rental_id!r} in your account", code="rental_not_found")
        kind, number = _target(rental, port, now_ok=_reachable(rental, now, port))
        host = await session.get(Host, rental.host_id) if rental.host_id else None
    relay_id = current_relay_id(host.relay_id, host.state) if host is not None else None
    record = (await live_relays(master)).get(relay_id) if relay_id is not None else None
    if record is None:
        raise Conflict(f"the host of rental {rental.id} is not connected to any relay right now; try again in a minute",
                       code="host_offline")
    assert rental.host_id is not None
    token, expires = connect_token(master, account_id=principal.account_id, rental_id=rental.id, host_id=rental.host_id,
                                   kind=kind, port=number, now=now)
    view: dict[str, Any] = {
        "rental_id": rental.id,
        "kind": kind,
        "port": number,
        "relay_id": record.relay_id,
        "relay_url": connect_url(record),
        "token": token,
        "expires_at": expires.isoformat().replace("+00:00", "Z"),
        "ca_pem": master.ca.cert_pem.decode(),
        "ssh": None,
        "web_url": None,
    }
    if kind == SSH:
        view["ssh"] = {"host_key": rental.ssh_host_key, "host_alias": host_alias(rental.id), "user": SSH_USER}
    elif record.ports_url:
        base = record.ports_url.replace("{label}", web_label(rental.id, number))
        view["web_url"] = f"{base}?gm_token={quote(token)}"
    return view


def current_relay_id(relay_id: str | None, host_state: str) -> str | None:
    """The relay a host (its ``relay_id`` and ``state`` columns) is connected through now, as far as the database
    knows: ``None`` for a host offline or revoked, whose last relay is history."""
    return relay_id if host_state not in ("offline", "revoked") else None


async def live_relays(master: Master) -> dict[str, RelayRecord]:
    """The relays registered now that take new connections (not draining), by id; none when the registry does not
    answer (logged): a renter's connection then waits for it, as for a host on no relay."""
    try:
        return {r.relay_id: r for r in await master.registry.relays() if not r.draining}
    except (GpumarketError, OSError) as exc:
        log.warning("cannot read the relay registry (%s)", exc)
        return {}


def connect_token(
    master: Master, *, account_id: str, rental_id: str, host_id: str, kind: str, port: int, now: datetime
) -> tuple[str, datetime]:
    """A connect token for one port (or SSH) of one rental, signed by the CA, and when it expires
    (``connect_token_ttl_s`` from ``now``)."""
    expires = now + timedelta(seconds=master.settings.connect_token_ttl_s)
    claims = new_claims(account_id=account_id, rental_id=rental_id, host_id=host_id, kind=kind, port=port,
                        expires_at=expires.timestamp())
    return master.ca.sign_connect_token(claims), expires


def connect_url(record: RelayRecord) -> str:
    """``wss://<relay>/v1/connect``: where connections opened with a connect token go on that relay."""
    agent_url = urlsplit(record.url)
    return urlunsplit((agent_url.scheme, agent_url.netloc, CONNECT_PATH, "", ""))


def _reachable(rental: Rental, now: Any, port: str | int) -> bool:
    if rental.state == RentalState.RUNNING:
        return True
    # Ended on its own: SFTP into /workspace until the retention passes or the renter releases it.
    return port == SSH and rental.workspace_until is not None and rental.workspace_until > now


def _target(rental: Rental, port: str | int, *, now_ok: bool) -> tuple[str, int]:
    if not now_ok:
        raise Conflict(f"rental {rental.id} is {rental.state}, not running: nothing to connect to", code="rental_not_running")
    workload = rental.workload or {}
    if port == SSH:
        if workload.get("kind", "hold") == "hold":
            raise Conflict(f"rental {rental.id} holds GPUs and runs nothing to log into; rent with a template or an image",
                           code="nothing_to_log_into")
        if not rental.ssh_host_key:
            raise Conflict(f"the host of rental {rental.id} serves no SSH (its agent predates it); use its ports or logs",
                           code="no_ssh_host_key")
        return SSH, 22
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValidationFailed("port must be \"ssh\" or a TCP port number 1..65535", code="validation_failed")
    declared = workload.get("ports") or []
    if workload.get("kind") != "container" or port not in declared:
        listed = ", ".join(str(p) for p in declared) or "none"
        raise ValidationFailed(f"rental {rental.id} does not declare port {port} (its ports: {listed}); "
                               "declare ports when you rent", code="port_not_declared")
    return "tcp", port
