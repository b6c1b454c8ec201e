"""Access that follows the account, live: who may log into an account's rentals, pushed to their agents.

The agents' SSH servers accept the keys their rental was given (``StartWorkload.authorized_keys``). When
that changes — an SSH key added or deleted, the account disabled or enabled again — ``access_changed``
(called in the transaction of the change) bumps the account's ``access_version`` and, for each rental
whose agent holds keys for it, writes an ``update_access`` command with the whole new list and that
version; the caller publishes the returned command ids after the commit. The agent refuses the removed
keys at once and closes the connections that logged in with them.

Ordering: the version is a per-account counter bumped under the account's row lock, the lock placement
takes first too (``rentals.check_quota``), so a start and a change never interleave: either the
start reads the new list, or its rental is committed before the change looks for rentals. An agent
ignores a list older than the one it holds, so commands that arrive late or twice change nothing. An
older ``update_access`` still open for the rental is superseded (the new one carries everything), and a
start not yet confirmed gets the new list too: a start resent to an agent that was offline carries the
current keys, never the ones of when it was placed.

Must not import the API, billing or ``gpumarket``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, Rental, Volume
from master.models import Command as CommandRow
from master.services import commands
from master.services.accounts import ssh_keys
from master.services.lifecycle.rentals import ACTIVE_STATES
from shared import protocol
from shared.errors import NotFound

log = logging.getLogger(__name__)

UPDATE_ACCESS = protocol.UpdateAccess.model_fields["kind"].default
START_WORKLOAD = protocol.StartWorkload.model_fields["kind"].default


async def lock_account(session: AsyncSession, account_id: str) -> None:
    """Take the account's row lock until the transaction ends (PostgreSQL: the row; SQLite: the database's write
    lock, where ``SELECT … FOR UPDATE`` would lock nothing): changes to its access are serialised with each other
    and with its placements."""
    await session.execute(
        update(Account).where(Account.id == account_id).values(name=Account.name).execution_options(synchronize_session=False)
    )


async def current_keys(session: AsyncSession, account_id: str) -> tuple[list[str], int]:
    """The key lines the account's rentals accept now (none for a disabled account) and the access version they are of."""
    row = (await session.execute(select(Account.access_version, Account.disabled_at).where(Account.id == account_id))).first()
    if row is None:
        return [], 0
    version, disabled_at = row
    return ([] if disabled_at is not None else await ssh_keys.authorized_keys(session, account_id)), version


async def live_rentals(session: AsyncSession, account_id: str) -> Sequence[Rental]:
    """The account's rentals whose agent holds SSH keys for them: placed and not ended, or ended with their
    ``/workspace`` kept for SFTP (until the release). Cluster members and service replicas are rentals too."""
    query = (
        select(Rental)
        .where(
            Rental.renter_id == account_id,
            Rental.host_id.is_not(None),
            or_(Rental.state.in_([state.value for state in ACTIVE_STATES]), Rental.workspace_until.is_not(None)),
        )
        .order_by(Rental.id)
    )
    return (await session.scalars(query)).all()


async def access_changed(session: AsyncSession, account_id: str, *, now: datetime) -> list[str]:
    """The account's access changed in this transaction: bump its version and write, for each live rental, an
    ``update_access`` with the whole current list. Returns the command ids to publish after the commit."""
    version = await session.scalar(
        update(Account).where(Account.id == account_id).values(access_version=Account.access_version + 1)
        .returning(Account.access_version).execution_options(synchronize_session=False)
    )  # fmt: skip
    if version is None:
        raise NotFound(f"no account {account_id[:60]!r}", code="account_not_found")
    keys, _ = await current_keys(session, account_id)
    disabled = await session.scalar(select(Account.disabled_at).where(Account.id == account_id)) is not None
    issued = []
    for rental in await live_rentals(session, account_id):
        assert rental.host_id is not None
        await _supersede(session, rental.id, keys, version, at=now)
        command = commands.new_command(
            session, host_id=rental.host_id, rental_id=rental.id,
            command=protocol.UpdateAccess(rental_id=rental.id, authorized_keys=keys, version=version, disabled=disabled),
        )  # fmt: skip
        command.created_at = now
        issued.append(command.id)
    # A ready volume's file-only session takes the account's keys too (docs/volumes.md; the agent keeps a list only
    # for a volume opened there, and ignores an older version).
    for volume_id, host_id in await session.execute(
        select(Volume.id, Volume.host_id).where(Volume.account_id == account_id, Volume.state == "ready").order_by(Volume.id)
    ):
        command = commands.new_command(
            session, host_id=host_id, rental_id=None,
            command=protocol.UpdateAccess(rental_id=volume_id, authorized_keys=keys, version=version, disabled=disabled),
        )  # fmt: skip
        command.created_at = now
        issued.append(command.id)
    if issued:
        log.info("account %s: access version %d (%d key(s)) sent to %d rental(s)", account_id, version, len(keys), len(issued))
    return issued


async def _supersede(session: AsyncSession, rental_id: str, keys: list[str], version: int, *, at: datetime) -> None:
    """Open commands of the rental that carry keys: an older ``update_access`` is superseded (marked failed); a start
    not yet confirmed carries the new list from now on, so every resend does."""
    await session.execute(
        update(CommandRow)
        .where(CommandRow.rental_id == rental_id, CommandRow.kind == UPDATE_ACCESS, CommandRow.state.in_(commands.OPEN_STATES))
        .values(state="failed", completed_at=at, result={"ok": False, "detail": f"superseded by access version {version}"})
        .execution_options(synchronize_session=False)
    )
    starts = await session.scalars(
        select(CommandRow).where(
            CommandRow.rental_id == rental_id, CommandRow.kind == START_WORKLOAD, CommandRow.state.in_(commands.OPEN_STATES)
        )
    )
    for start in starts:
        start.args = {**start.args, "authorized_keys": keys, "access_version": version}


async def disable_account(session: AsyncSession, account_id: str, *, now: datetime) -> list[str]:
    """Disable the account: its API keys and console sessions stop working, and every rental of it accepts no
    SSH key from now on (its open SSH connections are closed). Idempotent. Returns the commands to publish."""
    await lock_account(session, account_id)
    account = await session.get(Account, account_id)
    if account is None:
        raise NotFound(f"no account {account_id[:60]!r}", code="account_not_found")
    if account.disabled_at is None:
        account.disabled_at = now
        await session.flush()
    return await access_changed(session, account_id, now=now)


async def enable_account(session: AsyncSession, account_id: str, *, now: datetime) -> list[str]:
    """Enable a disabled account again: its keys work again, on its live rentals too. Returns the commands to publish."""
    await lock_account(session, account_id)
    account = await session.get(Account, account_id)
    if account is None:
        raise NotFound(f"no account {account_id[:60]!r}", code="account_not_found")
    account.disabled_at = None
    await session.flush()
    return await access_changed(session, account_id, now=now)
