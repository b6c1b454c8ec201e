"""Self-service accounts: sign up with an email address and a password, prove the address, reset a lost password.

Sign-up never says whether an address already has an account: it answers the same, and mails the address either
a verification link (a new account) or a note that it has one already (with the way to reset its password). Only
the owner of the address learns which. The links carry a random token (the row keeps its SHA-256), work once, and
expire (``email_token_ttl_s``, ``password_reset_ttl_s``); the console reads them from its URL's fragment
(``#/verify/<token>``, ``#/reset/<token>``), which browsers never send to a server.

A new account is a renter or a provider, named by its address; one that signs up as both is a renter with a provider
team of its own (``teams.py``: "<address> hosts"), for which it acts as for any team. It may sign in at once, and may rent (or enrol hosts)
once its address is verified (403 ``email_not_verified`` before: ``Principal.email_verified``) and, for renting, it
has credit. A password reset proves the address too, sets the new password and ends every console session of the
account. Every step is in the account's audit log (``audit.py``).

Each function works in the caller's transaction and returns the ``Mail`` to send; the caller sends it before it
commits, so an address the mail server refuses leaves nothing behind (``shared.mail``).
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Account, EmailToken
from master.services.accounts import passwords, teams
from master.services.accounts.audit import Audit, record
from master.services.accounts.core import (
    InvalidEmail,
    Principal,
    console_link,
    find_by_email,
    normalize_email,
)
from master.services.accounts.sessions import end_all
from shared.errors import BadRequest, Conflict, ValidationFailed
from shared.ids import new_id, secret_hash
from shared.mail import Mail
from shared.settings import MasterSettings

ROLES_AT_SIGN_UP = ("renter", "provider", "both")
BOTH = "both"  # a renter account and a provider team of its own (teams.py), between which the person switches
VERIFY, RESET = "verify", "reset"


class InvalidLink(BadRequest):
    code = "invalid_link"


async def _new_token(session: AsyncSession, account_id: str, purpose: str, *, ttl_s: float, now: datetime) -> str:
    """A new token of ``purpose`` for the account; the ones it had before stop working."""
    await session.execute(
        update(EmailToken)
        .where(EmailToken.account_id == account_id, EmailToken.purpose == purpose, EmailToken.used_at.is_(None))
        .values(used_at=now)
    )
    token = secrets.token_urlsafe(32)
    session.add(EmailToken(id=new_id("etok"), account_id=account_id, purpose=purpose, token_hash=secret_hash(token),
                           created_at=now, expires_at=now + timedelta(seconds=ttl_s)))  # fmt: skip
    await session.flush()
    return token


def verification_mail(settings: MasterSettings, email: str, token: str) -> Mail:
    hours = settings.email_token_ttl_s / 3600
    return Mail(email, "Verify your gpumarket address", (
        f"Welcome to gpumarket.\n\nOpen this link to verify your address (it works once, for {hours:g} hours):\n\n"
        f"{console_link(settings, VERIFY, token)}\n\nIf you did not sign up, ignore this mail: nothing happens without the link.\n"
    ))  # fmt: skip


def _already_mail(settings: MasterSettings, email: str) -> Mail:
    return Mail(email, "You already have a gpumarket account", (
        "Someone (you, we hope) tried to sign up to gpumarket with this address, which has an account already.\n\n"
        f"Sign in at {console_link(settings, 'signin', '').removesuffix('/')}, or, if you lost your password, ask for a "
        "reset link on the sign-in page.\n\nIf it was not you, ignore this mail: nothing changed.\n"
    ))  # fmt: skip


async def sign_up(
    session: AsyncSession, *, email: str, password: str, role: str, settings: MasterSettings, now: datetime,
    address: str | None,
) -> Mail:
    """Make an account (unverified) and return its verification mail; for an address that has an account, the
    mail that says so, and nothing else changes. 422 for an invalid address or a weak password."""
    if role not in ROLES_AT_SIGN_UP:
        raise ValidationFailed(f"role: must be one of {', '.join(ROLES_AT_SIGN_UP)}")
    email = normalize_email(email)
    passwords.check_policy(password, email=email, min_length=settings.password_min_length)
    existing = await find_by_email(session, email)
    if existing is not None:
        await passwords.hash_password(password, settings)  # as long as a new account takes: the time tells nothing
        record(session, existing.id, Audit.SIGNED_UP, at=now, address=address, outcome="the address has an account already")
        return _already_mail(settings, email)
    name = email if await session.scalar(select(Account.id).where(Account.name == email)) is None else f"{email}-{new_id('a')}"
    account = Account(id=new_id("acct"), name=name, role="renter" if role == BOTH else role, email=email,
                      password_hash=await passwords.hash_password(password, settings), created_at=now)  # fmt: skip
    session.add(account)
    await session.flush()
    record(session, account.id, Audit.SIGNED_UP, at=now, address=address, role=role)
    if role == BOTH:
        await _provider_team(session, account, now=now, address=address)
    token = await _new_token(session, account.id, VERIFY, ttl_s=settings.email_token_ttl_s, now=now)
    return verification_mail(settings, email, token)


async def _provider_team(session: AsyncSession, account: Account, *, now: datetime, address: str | None) -> None:
    """The provider side of a person who signed up as both: a provider team they own, named after their address."""
    owner = Principal.of(account)
    try:
        async with session.begin_nested():
            await teams.create_team(session, owner, f"{account.email} hosts", now=now, address=address, kind="provider")
    except (ValidationFailed, Conflict):  # an address the team names refuse, or the name taken
        await teams.create_team(session, owner, f"hosts {account.id}", now=now, address=address, kind="provider")


async def _use_token(session: AsyncSession, token: str, purpose: str, *, now: datetime) -> Account:
    """The account of a valid, unused ``purpose`` token, which is used up; 400 ``invalid_link`` otherwise."""
    row = await session.scalar(
        select(EmailToken).where(EmailToken.token_hash == secret_hash(token), EmailToken.purpose == purpose).with_for_update()
    )
    if row is None or row.used_at is not None or now >= row.expires_at:
        again = "sign in and ask for a new one" if purpose == VERIFY else "ask for a new reset link on the sign-in page"
        raise InvalidLink(f"this link is not valid any more (used, replaced by a newer one, or expired); {again}")
    row.used_at = now
    account = await session.get(Account, row.account_id)
    assert account is not None  # the token's row goes with its account (ON DELETE CASCADE)
    return account


async def verify_email(session: AsyncSession, token: str, *, now: datetime, address: str | None) -> Account:
    account = await _use_token(session, token, VERIFY, now=now)
    if account.email_verified_at is None:
        account.email_verified_at = now
        record(session, account.id, Audit.EMAIL_VERIFIED, at=now, address=address, email=account.email)
    await session.flush()
    return account


async def resend_verification(
    session: AsyncSession, account_id: str, *, settings: MasterSettings, now: datetime, address: str | None
) -> Mail | None:
    """A new verification mail for the account's address (earlier links stop working); ``None`` when it is verified
    already or has no address."""
    account = await session.get(Account, account_id)
    if account is None or account.email is None or account.email_verified_at is not None:
        return None
    token = await _new_token(session, account.id, VERIFY, ttl_s=settings.email_token_ttl_s, now=now)
    record(session, account.id, Audit.VERIFICATION_SENT, at=now, address=address)
    return verification_mail(settings, account.email, token)


async def request_reset(
    session: AsyncSession, email: str, *, settings: MasterSettings, now: datetime, address: str | None
) -> Mail | None:
    """The reset mail for the account of ``email``; for an address with no account, a mail that says so (as sign-up
    mails an address that has one): a mail goes out either way, so neither the answer nor its time tells whether the
    address has an account. ``None`` only for what is no address at all."""
    try:
        email = normalize_email(email)
    except InvalidEmail:
        return None
    account = await find_by_email(session, email)
    if account is None:
        return Mail(email, "No gpumarket account has this address", (
            "Someone (you, we hope) asked to reset the password of a gpumarket account with this address, but no "
            f"account has it.\n\nSign up at {console_link(settings, 'signup', '').removesuffix('/')} if you meant to, or "
            "ask again with the address you signed up with.\n\nIf it was not you, ignore this mail: nothing changed.\n"
        ))  # fmt: skip
    token = await _new_token(session, account.id, RESET, ttl_s=settings.password_reset_ttl_s, now=now)
    record(session, account.id, Audit.PASSWORD_RESET_REQUESTED, at=now, address=address)
    minutes = settings.password_reset_ttl_s / 60
    return Mail(email, "Reset your gpumarket password", (
        f"Open this link to choose a new password (it works once, for {minutes:g} minutes):\n\n"
        f"{console_link(settings, RESET, token)}\n\nSetting a new password signs you out of every browser.\n"
        "If you did not ask for it, ignore this mail: your password stays as it is.\n"
    ))  # fmt: skip


async def reset_password(
    session: AsyncSession, token: str, password: str, *, settings: MasterSettings, now: datetime, address: str | None
) -> tuple[Account, int]:
    """Set a new password with a reset link's token: the address is proved (verified, if it was not), every console
    session of the account ends (how many: the second value), the other reset links stop working."""
    account = await _use_token(session, token, RESET, now=now)
    assert account.email is not None
    passwords.check_policy(password, email=account.email, min_length=settings.password_min_length)
    account.password_hash = await passwords.hash_password(password, settings)
    if account.email_verified_at is None:
        account.email_verified_at = now
    await session.execute(
        update(EmailToken)
        .where(EmailToken.account_id == account.id, EmailToken.purpose == RESET, EmailToken.used_at.is_(None))
        .values(used_at=now)
    )
    ended = await end_all(session, account.id, now=now)
    record(session, account.id, Audit.PASSWORD_RESET, at=now, address=address, sessions_ended=ended)
    await session.flush()
    return account, ended
