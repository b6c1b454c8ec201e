"""Commands from the master to agents, tracked in the database by command id.

A command row is written in the same transaction as the change that needs it (a
rental, a stop); publishing to the host's relay happens after the commit. Until
the agent reports a result, the command is sent again on every reconnect (hello)
and every ``command_retry_interval``; the agent executes each id at most once and
re-reports its result, so resending is always safe.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from master.context import Master
from master.models import Command as CommandRow
from master.models import Host
from shared import protocol
from shared.errors import BusError
from shared.ids import new_id

log = logging.getLogger(__name__)

OPEN_STATES = ("pending", "sent")


def new_command(session: AsyncSession | Session, *, host_id: str, command: protocol.AnyCommand, rental_id: str | None) -> CommandRow:
    """Add a pending row for ``command`` (stored as its wire ``kind`` and ``args``); the caller publishes it after the commit."""
    row = CommandRow(
        id=new_id("cmd"), host_id=host_id, rental_id=rental_id, kind=command.kind, args=protocol.command_args(command), state="pending"
    )
    session.add(row)
    return row


async def publish(master: Master, command_ids: list[str]) -> int:
    """Send the given open commands to their hosts' relays; returns how many went out.

    A host with no known relay (not connected) keeps its commands pending; they go
    out when it says hello. A bus failure is logged and left to the retry loop.
    """
    if not command_ids:
        return 0
    async with master.db.session() as session:
        rows = (
            await session.execute(
                select(CommandRow, Host.relay_id)
                .join(Host, Host.id == CommandRow.host_id)
                .where(CommandRow.id.in_(command_ids), CommandRow.state.in_(OPEN_STATES))
                .order_by(CommandRow.created_at)
            )
        ).all()
        deliveries: list[tuple[CommandRow, str]] = [(c, relay) for c, relay in rows if relay]
        # Secrets the row never holds (a start's registry login), added to this sending only.
        extra = {} if master.command_secrets is None or not deliveries else await master.command_secrets.extra_args(
            session, [c for c, _ in deliveries], now=master.clock.now())  # fmt: skip
    sent: list[str] = []
    for command, relay_id in deliveries:
        delivery = protocol.CommandDelivery(
            host_id=command.host_id,
            # The row holds what ``new_command`` built from a typed command: sent as stored, plus ``extra``.
            command=protocol.Command(body=protocol.CommandBody(command_id=command.id, kind=command.kind,
                                                               args={**command.args, **extra.get(command.id, {})})),
        )  # fmt: skip
        try:
            await master.bus.publish(protocol.commands_stream(relay_id), delivery.model_dump_json().encode())
        except BusError as exc:
            log.warning("could not publish command %s for host %s: %s; will retry", command.id, command.host_id, exc)
            break
        sent.append(command.id)
    if sent:
        # Conditional UPDATE, not load-modify-save: the agent's result may have been
        # recorded meanwhile, and "sent" must never overwrite "succeeded".
        async with master.db.session() as session:
            await session.execute(
                update(CommandRow)
                .where(CommandRow.id.in_(sent), CommandRow.state.in_(OPEN_STATES))
                .values(state="sent", last_sent_at=master.clock.now(), send_count=CommandRow.send_count + 1)
            )
    return len(sent)


async def open_command_ids(session: AsyncSession, host_id: str) -> list[str]:
    return list(
        (
            await session.scalars(
                select(CommandRow.id)
                .where(CommandRow.host_id == host_id, CommandRow.state.in_(OPEN_STATES))
                .order_by(CommandRow.created_at)
            )
        ).all()
    )


async def due_for_resend(master: Master, now: datetime) -> list[str]:
    cutoff = now - timedelta(seconds=master.settings.command_retry_interval)
    async with master.db.session() as session:
        return list(
            (
                await session.scalars(
                    select(CommandRow.id)
                    .where(
                        CommandRow.state.in_(OPEN_STATES),
                        or_(CommandRow.last_sent_at.is_(None), CommandRow.last_sent_at < cutoff),
                    )
                    .order_by(CommandRow.created_at)
                    .limit(1000)
                )
            ).all()
        )


def complete(row: CommandRow, *, ok: bool, result: dict[str, Any], at: datetime) -> bool:
    """Record an agent's result once; returns False for a duplicate report."""
    if row.state not in OPEN_STATES:
        return False
    row.state = "succeeded" if ok else "failed"
    row.completed_at = at
    row.result = result
    return True


async def cancel_open(session: AsyncSession, rental_id: str, *, at: datetime, reason: str) -> None:
    """Fail the rental's unanswered commands as cancelled (a host that comes back is not told to run them)."""
    await session.execute(
        update(CommandRow)
        .where(CommandRow.rental_id == rental_id, CommandRow.state.in_(OPEN_STATES))
        .values(state="failed", completed_at=at, result={"ok": False, "detail": f"cancelled: {reason}"})
    )
