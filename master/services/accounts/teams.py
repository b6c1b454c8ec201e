"""Teams: accounts that people act for, with members, roles and mailed invitations.

A team is an ``Account`` of kind ``team``: it owns rentals, clusters, services, SSH keys, credit, a spend cap and
invoices exactly as a person's account does, so every route that works on "the caller's account" works on the
team's once the caller acts for it. A request acts for a team when it names it (the ``Gpumarket-Team`` header,
which the console and the CLI send in team context) or when its API key was made in the team's context
(``ApiKey.team_id``: such a key acts for that team only). ``act_for`` turns the person's ``Principal`` into the
team's, after checking the membership on every request: a removed member's next call is refused.

Roles, and what each may do in the team's context (``ROLE_SCOPES``, the API key scopes of ``keys.py``):

* ``owner``: everything, and the team's owners (at least one is always left);
* ``admin``: work and pay, invite and remove members, change roles other than an owner's;
* ``member``: work — rent (rentals, clusters, services, the team's SSH keys) in a renter team, run hosts (enrolment,
  listings, maintenance) in a provider team — and read everything;
* ``billing``: read everything and pay (credit, the spend cap, invoices, payouts); working is refused (403
  ``team_role_forbids``).

A team is a renter (the default) or a provider (``kind`` at creation): a provider team's hosts, listings, earnings
and payouts are the team's. A person who both rents and provides signs up as ``both``: a renter account and a
provider team of their own (``sign_up``), between which they switch as between any teams.

Invitations go to an address by mail (``#/invite/<token>``, the row keeps the token's hash) and are accepted by a
signed-in person whose verified address is the invited one, once, before they expire. Removing a member (or a
member leaving) deletes the team's SSH keys they added (the team's rentals stop accepting them at once:
``access.access_changed``) and revokes the API keys they made for the team. Every change is in the team's audit
log. Someone who is not a member gets 404 ``team_not_found`` for a team that exists, as for one that does not.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, ApiKey, SshKey, TeamInvitation, TeamMember
from master.services.accounts.access import access_changed, lock_account
from master.services.accounts.audit import Audit, record
from master.services.accounts.core import Principal, account_disabled, console_link, normalize_email
from master.services.accounts.keys import Scope
from shared.errors import BadRequest, Conflict, Forbidden, NotFound, ValidationFailed
from shared.ids import new_id, secret_hash
from shared.mail import Mail
from shared.settings import MasterSettings

HEADER = "Gpumarket-Team"
ID_PREFIX = "team"  # a team's account id is "team-…" (a person's "acct-…")
MAX_OWNED = 20  # teams a person may own
MAX_MEMBERS = 200
INVITATION_TTL = timedelta(days=7)
TEAM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._@+-]{0,62}[A-Za-z0-9._-]|[A-Za-z0-9]")
KINDS = ("renter", "provider")  # what a team is: it rents, or it lists hosts


class Role(StrEnum):
    OWNER = "owner"
    ADMIN = "admin"
    MEMBER = "member"
    BILLING = "billing"


# A renter team's routes are the renters' and a provider team's the providers' (the route's roles decide first), so
# ``rent`` and ``provider`` are one right: working with what the team does.
ROLE_SCOPES: dict[str, frozenset[str]] = {
    Role.OWNER: frozenset({Scope.READ, Scope.RENT, Scope.PROVIDER, Scope.BILLING}),
    Role.ADMIN: frozenset({Scope.READ, Scope.RENT, Scope.PROVIDER, Scope.BILLING}),
    Role.MEMBER: frozenset({Scope.READ, Scope.RENT, Scope.PROVIDER}),
    Role.BILLING: frozenset({Scope.READ, Scope.BILLING}),
}
MANAGERS = frozenset({Role.OWNER, Role.ADMIN})


def rights(who: Principal) -> frozenset[str]:
    """What the caller's role in the team it acts for gives, for what the team does: a renter team's members rent, a
    provider team's run hosts (a key made in the team's context holds at most these)."""
    assert who.team_role is not None
    return ROLE_SCOPES[who.team_role] - {Scope.PROVIDER if who.role == "renter" else Scope.RENT}


class TeamNotFound(NotFound):
    code = "team_not_found"


class TeamRoleForbids(Forbidden):
    code = "team_role_forbids"


class TeamMismatch(Forbidden):
    code = "team_mismatch"


class LastOwner(Conflict):
    code = "last_owner"


class InvitationInvalid(BadRequest):
    code = "invalid_invitation"


class InvitationForAnotherAddress(Forbidden):
    code = "invitation_for_another_address"


def _not_found(team_id: str) -> TeamNotFound:
    return TeamNotFound(
        f"no team {team_id[:60]!r} that you are a member of; list yours with GET /api/v1/teams (gpumarket team list)"
    )


def check_role_allows(who: Principal, needs: str) -> None:
    """403 ``team_role_forbids`` when the caller acts for a team and its role there does not give ``needs``."""
    if who.team_role is not None and needs not in ROLE_SCOPES[who.team_role]:
        able = ", ".join(role for role, scopes in ROLE_SCOPES.items() if needs in scopes)
        raise TeamRoleForbids(f"your role in team {who.name!r} is {who.team_role}; this needs the '{needs}' right, "
                              f"which {able} have (ask an owner or admin of the team)")  # fmt: skip


async def act_for(session: AsyncSession, who: Principal, team_id: str | None) -> Principal:
    """The principal of a request: the person's own, or — when the request names a team or its key is bound to one —
    the team's, with the person's role there. 404 ``team_not_found`` for a team the person is not in, 403
    ``team_mismatch`` for a key made for another team."""
    if who.key_team is not None:
        if team_id is not None and team_id != who.key_team:
            raise TeamMismatch(
                f"this API key acts for team {who.key_team} only; leave out the {HEADER} header or use another key"
            )
        team_id = who.key_team
    if team_id is None:
        return who
    row = (
        await session.execute(
            select(Account, TeamMember.role)
            .join(TeamMember, TeamMember.team_id == Account.id)
            .where(Account.id == team_id, Account.kind == "team", TeamMember.account_id == who.person_id)
        )
    ).first()
    if row is None:
        raise _not_found(team_id)
    team, role = row
    if team.disabled_at is not None:
        raise account_disabled()
    return Principal(account_id=team.id, name=team.name, role=team.role, email_verified=who.email_verified,
                     key_id=who.key_id, scopes=who.scopes, person=who.person_id, team_role=role, key_team=who.key_team)  # fmt: skip


def is_team(account_id: str) -> bool:
    return account_id.startswith(f"{ID_PREFIX}-")


def _check_name(name: str) -> str:
    if not TEAM_NAME.fullmatch(name):
        raise ValidationFailed(
            "name: 1 to 64 letters, digits, spaces, '.', '_' or '-', starting and ending with a letter or digit"
        )
    return name


async def create_team(
    session: AsyncSession, who: Principal, name: str, *, now: datetime, address: str | None, kind: str = "renter"
) -> Account:
    """A new team named ``name`` that rents (``kind`` renter) or lists hosts (provider), with the caller (a person, not
    acting for a team) as its owner."""
    if kind not in KINDS:
        raise ValidationFailed(f"kind: renter or provider, not {kind[:20]!r}")
    if who.team_role is not None:
        raise ValidationFailed(
            f"a team cannot make a team; leave out the {HEADER} header (your personal context)"
        )
    owned = await session.scalar(
        select(func.count())
        .select_from(TeamMember)
        .where(TeamMember.account_id == who.person_id, TeamMember.role == Role.OWNER)
    )
    if (owned or 0) >= MAX_OWNED:
        raise ValidationFailed(f"a person may own {MAX_OWNED} teams; delete or hand over one first")
    if await session.scalar(select(Account.id).where(Account.name == _check_name(name))) is not None:
        raise Conflict(f"the name {name!r} is taken; choose another", code="team_name_taken")
    team = Account(id=new_id(ID_PREFIX), name=name, role=kind, kind="team", created_at=now)
    session.add(team)
    await session.flush()
    session.add(
        TeamMember(
            team_id=team.id, account_id=who.person_id, role=Role.OWNER, added_at=now, added_by=who.person_id
        )
    )
    record(session, team.id, Audit.TEAM_CREATED, at=now, address=address, by=who.person_id, name=name, kind=kind)
    await session.flush()
    return team


async def list_teams(session: AsyncSession, person_id: str) -> list[dict[str, Any]]:
    members = func.count(TeamMember.account_id).label("members")
    counts = select(TeamMember.team_id, members).group_by(TeamMember.team_id).subquery()
    rows = await session.execute(
        select(Account, TeamMember.role, counts.c.members)
        .join(TeamMember, TeamMember.team_id == Account.id)
        .join(counts, counts.c.team_id == Account.id)
        .where(TeamMember.account_id == person_id, Account.kind == "team")
        .order_by(Account.name)
    )
    return [{"id": team.id, "name": team.name, "kind": team.role, "role": role, "members": count,
             "created_at": team.created_at.isoformat()} for team, role, count in rows]  # fmt: skip


async def _membership(session: AsyncSession, team_id: str, person_id: str, *, lock: bool = False) -> str:
    """The person's role in the team; 404 when not a member. ``lock``: serialise with other changes to the team."""
    if lock:
        await lock_account(session, team_id)
    role = await session.scalar(
        select(TeamMember.role).where(TeamMember.team_id == team_id, TeamMember.account_id == person_id)
    )
    if role is None:
        raise _not_found(team_id)
    return role


def _manager(team_id: str, role: str) -> None:
    if role not in MANAGERS:
        raise TeamRoleForbids(
            f"only the team's owners and admins manage its members; you are a {role} of {team_id}"
        )


async def team_view(session: AsyncSession, team_id: str, person_id: str, *, now: datetime) -> dict[str, Any]:
    """The team, its members and (for its owners and admins) its open invitations."""
    role = await _membership(session, team_id, person_id)
    team = await session.get(Account, team_id)
    assert team is not None
    rows = await session.execute(
        select(TeamMember, Account.name, Account.email)
        .join(Account, Account.id == TeamMember.account_id)
        .where(TeamMember.team_id == team_id)
        .order_by(TeamMember.added_at, Account.name)
    )
    members = [{"account_id": member.account_id, "name": name, "email": email, "role": member.role,
                "added_at": member.added_at.isoformat()} for member, name, email in rows]  # fmt: skip
    view: dict[str, Any] = {
        "id": team.id,
        "name": team.name,
        "kind": team.role,
        "role": role,
        "members": members,
        "created_at": team.created_at.isoformat(),
    }
    if role in MANAGERS:
        invitations = await session.scalars(
            select(TeamInvitation)
            .where(TeamInvitation.team_id == team_id, TeamInvitation.accepted_at.is_(None), TeamInvitation.revoked_at.is_(None),
                   TeamInvitation.expires_at > now)
            .order_by(TeamInvitation.created_at)
        )  # fmt: skip
        view["invitations"] = [invitation_view(row) for row in invitations]
    return view


def invitation_view(row: TeamInvitation) -> dict[str, Any]:
    return {"id": row.id, "email": row.email, "role": row.role, "created_at": row.created_at.isoformat(),
            "expires_at": row.expires_at.isoformat()}  # fmt: skip


def _link(settings: MasterSettings, token: str) -> str:
    return console_link(settings, "invite", token)


async def invite(
    session: AsyncSession,
    team_id: str,
    who: Principal,
    *,
    email: str,
    role: str,
    settings: MasterSettings,
    now: datetime,
    address: str | None,
) -> tuple[dict[str, Any], Mail]:
    """Invite an address with a role (owners may invite owners; admins the other roles). An open invitation to the
    same address is replaced (its link stops working). Returns the invitation's view and the mail to send."""
    mine = await _membership(session, team_id, who.person_id, lock=True)
    _manager(team_id, mine)
    if role == Role.OWNER and mine != Role.OWNER:
        raise TeamRoleForbids("only an owner may invite an owner")
    email = normalize_email(email)
    already = await session.scalar(
        select(TeamMember.account_id).join(Account, Account.id == TeamMember.account_id)
        .where(TeamMember.team_id == team_id, Account.email == email)
    )  # fmt: skip
    if already is not None:
        raise Conflict(
            f"{email} is a member of the team already; change its role instead", code="already_a_member"
        )
    count = await session.scalar(
        select(func.count()).select_from(TeamMember).where(TeamMember.team_id == team_id)
    )
    if (count or 0) >= MAX_MEMBERS:
        raise ValidationFailed(f"a team has at most {MAX_MEMBERS} members")
    await session.execute(
        update(TeamInvitation)
        .where(TeamInvitation.team_id == team_id, TeamInvitation.email == email, TeamInvitation.accepted_at.is_(None),
               TeamInvitation.revoked_at.is_(None))
        .values(revoked_at=now)
    )  # fmt: skip
    token = secrets.token_urlsafe(32)
    row = TeamInvitation(id=new_id("inv"), team_id=team_id, email=email, role=role, token_hash=secret_hash(token),
                         invited_by=who.person_id, created_at=now, expires_at=now + INVITATION_TTL)  # fmt: skip
    session.add(row)
    team = await session.get(Account, team_id)
    assert team is not None
    record(
        session,
        team_id,
        Audit.MEMBER_INVITED,
        at=now,
        address=address,
        by=who.person_id,
        email=email,
        role=role,
    )
    await session.flush()
    mail = Mail(email, f"You are invited to the team {team.name} on gpumarket", (
        f"{who.name} invited you to the team {team.name!r} on gpumarket, as {'an' if role in ('owner', 'admin') else 'a'} {role}.\n\n"
        f"Open this link to join (it works once, for {INVITATION_TTL.days} days):\n\n{_link(settings, token)}\n\n"
        "Sign in (or sign up) with this address first: only it can accept. If you did not expect this, ignore this mail.\n"
    ))  # fmt: skip
    return invitation_view(row), mail


async def revoke_invitation(
    session: AsyncSession, team_id: str, invitation_id: str, who: Principal, *, now: datetime
) -> None:
    _manager(team_id, await _membership(session, team_id, who.person_id, lock=True))
    row = await session.scalar(
        select(TeamInvitation).where(TeamInvitation.id == invitation_id, TeamInvitation.team_id == team_id)
    )
    if row is None:
        raise NotFound(f"no invitation {invitation_id[:60]!r} in this team", code="invitation_not_found")
    if row.revoked_at is None and row.accepted_at is None:
        row.revoked_at = now
        record(session, team_id, Audit.INVITATION_REVOKED, at=now, by=who.person_id, email=row.email)
    await session.flush()


async def accept(
    session: AsyncSession, token: str, who: Principal, *, now: datetime, address: str | None
) -> dict[str, Any]:
    """Join the team of a valid invitation: the caller's verified address must be the invited one."""
    row = await session.scalar(
        select(TeamInvitation).where(TeamInvitation.token_hash == secret_hash(token)).with_for_update()
    )
    if row is None or row.accepted_at is not None or row.revoked_at is not None or now >= row.expires_at:
        raise InvitationInvalid(
            "this invitation is not valid any more (used, replaced, withdrawn or expired); ask the team for a new one"
        )
    person = await session.get(Account, who.person_id)
    assert person is not None
    if person.email != row.email or person.email_verified_at is None:
        raise InvitationForAnotherAddress(
            f"this invitation is for {row.email}; sign in with that address (and verify it) to accept"
        )
    await lock_account(session, row.team_id)
    row.accepted_at, row.accepted_by = now, person.id
    existing = await session.get(TeamMember, (row.team_id, person.id))
    if existing is None:
        session.add(
            TeamMember(
                team_id=row.team_id,
                account_id=person.id,
                role=row.role,
                added_at=now,
                added_by=row.invited_by,
            )
        )
        record(
            session,
            row.team_id,
            Audit.MEMBER_ADDED,
            at=now,
            address=address,
            member=person.id,
            email=person.email,
            role=row.role,
        )
    await session.flush()
    team = await session.get(Account, row.team_id)
    assert team is not None
    return {"id": team.id, "name": team.name, "kind": team.role, "role": existing.role if existing is not None else row.role}


async def _owners(session: AsyncSession, team_id: str) -> int:
    return (await session.scalar(
        select(func.count()).select_from(TeamMember).where(TeamMember.team_id == team_id, TeamMember.role == Role.OWNER)
    )) or 0  # fmt: skip


async def _member(session: AsyncSession, team_id: str, member_id: str) -> TeamMember:
    row = await session.get(TeamMember, (team_id, member_id))
    if row is None:
        raise NotFound(f"no member {member_id[:60]!r} in this team", code="member_not_found")
    return row


async def set_role(
    session: AsyncSession,
    team_id: str,
    member_id: str,
    role: str,
    who: Principal,
    *,
    now: datetime,
    address: str | None,
) -> dict[str, Any]:
    """Change a member's role: owners change anyone's, admins anyone's but an owner's (and make no owner). The last
    owner stays an owner (409 ``last_owner``)."""
    mine = await _membership(session, team_id, who.person_id, lock=True)
    _manager(team_id, mine)
    member = await _member(session, team_id, member_id)
    if mine != Role.OWNER and Role.OWNER in (member.role, role):
        raise TeamRoleForbids("only an owner may make an owner or change an owner's role")
    if member.role == Role.OWNER and role != Role.OWNER and await _owners(session, team_id) <= 1:
        raise LastOwner("a team keeps at least one owner; make another member an owner first")
    if member.role != role:
        record(session, team_id, Audit.MEMBER_ROLE_CHANGED, at=now, address=address, by=who.person_id, member=member_id,
               role=role, was=member.role)  # fmt: skip
        member.role = role
    await session.flush()
    return {"account_id": member_id, "role": member.role}


async def remove_member(
    session: AsyncSession, team_id: str, member_id: str, who: Principal, *, now: datetime, address: str | None
) -> list[str]:
    """Remove a member (owners and admins; admins not an owner), or leave (anyone, themselves). The team's SSH keys
    the member added are deleted (its rentals stop accepting them) and the API keys they made for it revoked.
    Returns the ``update_access`` commands to publish after the commit."""
    mine = await _membership(session, team_id, who.person_id, lock=True)
    member = await _member(session, team_id, member_id)
    if member_id != who.person_id:
        _manager(team_id, mine)
        if member.role == Role.OWNER and mine != Role.OWNER:
            raise TeamRoleForbids("only an owner may remove an owner")
    if member.role == Role.OWNER and await _owners(session, team_id) <= 1:
        raise LastOwner(
            "a team keeps at least one owner; make another member an owner first (or, alone, keep the team)"
        )
    await session.delete(member)
    keys = (await session.execute(
        delete(SshKey).where(SshKey.account_id == team_id, SshKey.added_by == member_id).returning(SshKey.id)
    )).scalars().all()  # fmt: skip
    await session.execute(
        update(ApiKey).where(ApiKey.account_id == member_id, ApiKey.team_id == team_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now)
    )  # fmt: skip
    record(session, team_id, Audit.MEMBER_REMOVED, at=now, address=address, by=who.person_id, member=member_id,
           ssh_keys_removed=len(keys))  # fmt: skip
    await session.flush()
    return await access_changed(session, team_id, now=now) if keys else []


async def team_ids_of(session: AsyncSession, person_id: str) -> Sequence[str]:
    return (await session.scalars(select(TeamMember.team_id).where(TeamMember.account_id == person_id))).all()
