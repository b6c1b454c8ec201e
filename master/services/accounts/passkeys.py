"""Passkeys: WebAuthn credentials a person signs in with, verified by py_webauthn (Duo Labs' ``webauthn``).

Adding one takes two calls: ``registration_options`` hands out a challenge bound to the account (the browser passes the
options to ``navigator.credentials.create``), ``register`` verifies the authenticator's answer against that challenge,
the relying party id and the console's origins (``relying_party``), and keeps the credential id, the COSE public key and
the signature counter. Signing in is the same pair without an account: ``sign_in_options`` names no credential (a
discoverable one, "usernameless", so the answer tells nothing about which addresses have accounts) and ``sign_in``
finds the passkey by the credential id the authenticator answers with.

A challenge is kept as its SHA-256 in ``passkey_challenges`` until ``passkey_challenge_ttl_s`` and is deleted as it is
answered, right or wrong: a replayed answer finds none. The callers commit that deletion (and a failed sign-in's audit
record) before they answer the error, so ``register`` and ``sign_in`` return their refusal rather than raise it.

User verification (the authenticator's PIN or biometric) is required both when a passkey is made and at each use, so a
passkey sign-in is two factors (something held, something known or been) and skips the TOTP code. An unknown credential
and a bad signature answer the same 401 ``invalid_passkey``; a signature counter that goes backwards (a cloned
authenticator, where the counter is not zero) is refused alike, and the audit log says why.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import webauthn
from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from webauthn.helpers import base64url_to_bytes, bytes_to_base64url, parse_client_data_json
from webauthn.helpers.exceptions import WebAuthnException
from webauthn.helpers.structs import (
    AuthenticationCredential,
    AuthenticatorSelectionCriteria,
    AuthenticatorTransport,
    PublicKeyCredentialDescriptor,
    RegistrationCredential,
    ResidentKeyRequirement,
    UserVerificationRequirement,
)

from master.models import Account, Passkey, PasskeyChallenge
from master.services.accounts import sessions
from master.services.accounts.audit import Audit, record
from master.services.accounts.core import Principal, account_disabled, console_base
from shared.errors import BadRequest, ClientError, Conflict, NotFound, ServiceUnavailable, Unauthorized
from shared.ids import new_id, secret_hash
from shared.settings import MasterSettings

MAX_PASSKEYS = 20  # per account: a person has a few devices, not hundreds
REGISTER, SIGN_IN = "register", "sign_in"


class PasskeysUnavailable(ServiceUnavailable):
    code = "passkeys_unavailable"


class PasskeyChallengeExpired(BadRequest):
    code = "passkey_challenge_expired"


class InvalidPasskeyResponse(BadRequest):
    code = "invalid_passkey_response"


class PasskeyRejected(BadRequest):
    code = "passkey_rejected"


class InvalidPasskey(Unauthorized):
    code = "invalid_passkey"


@dataclass(frozen=True)
class RelyingParty:
    """Who the passkeys are for: the RP id a credential is bound to, the origins an answer may come from, the name."""

    rp_id: str
    origins: tuple[str, ...]
    name: str


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def relying_party(settings: MasterSettings) -> RelyingParty:
    """The relying party of the settings: ``webauthn_rp_id`` and ``webauthn_origins``, or what ``public_url`` says (a
    loopback address as ``localhost``: an IP address is never an RP id); 503 ``passkeys_unavailable`` where neither names
    a domain."""
    public = urlsplit(console_base(settings))
    host = (public.hostname or "").lower()
    if _loopback(host):
        host = "localhost"
    rp_id = (settings.webauthn_rp_id or host).lower()
    try:
        ipaddress.ip_address(rp_id)
        named = False
    except ValueError:
        named = bool(rp_id)
    if not named:
        raise PasskeysUnavailable("passkeys need the console at a domain name: the operator sets webauthn_rp_id and "
                                  "webauthn_origins (docs/operations.md)")  # fmt: skip
    if settings.webauthn_origins:
        origins = tuple(origin.rstrip("/") for origin in settings.webauthn_origins)
    else:
        port = f":{public.port}" if public.port else ""
        origins = (f"{public.scheme or 'http'}://{host}{port}",)
    return RelyingParty(rp_id=rp_id, origins=origins, name=settings.webauthn_rp_name)


def _challenge(
    session: AsyncSession, purpose: str, account_id: str | None, *, settings: MasterSettings, now: datetime
) -> bytes:
    challenge = webauthn.helpers.generate_challenge()
    session.add(PasskeyChallenge(id=new_id("pkc"), challenge_hash=secret_hash(bytes_to_base64url(challenge)), purpose=purpose,
                                 account_id=account_id, created_at=now,
                                 expires_at=now + timedelta(seconds=settings.passkey_challenge_ttl_s)))  # fmt: skip
    return challenge


async def _forget_expired(session: AsyncSession, now: datetime) -> None:
    # Unanswered challenges go as new ones are made, so the table holds only the live ones.
    await session.execute(delete(PasskeyChallenge).where(PasskeyChallenge.expires_at <= now))


async def _consume(
    session: AsyncSession, challenge: str, purpose: str, account_id: str | None, *, now: datetime
) -> bool:
    """Delete the challenge the answer names; whether it was live and for this purpose (and account)."""
    row = await session.scalar(
        select(PasskeyChallenge)
        .where(PasskeyChallenge.challenge_hash == secret_hash(challenge))
        .with_for_update()
    )
    if row is None:
        return False
    await session.delete(row)
    return row.purpose == purpose and row.account_id == account_id and now < row.expires_at


def _answered_challenge(credential: RegistrationCredential | AuthenticationCredential) -> str:
    return bytes_to_base64url(parse_client_data_json(credential.response.client_data_json).challenge)


def _bad_response() -> InvalidPasskeyResponse:
    return InvalidPasskeyResponse("that is not a passkey answer a browser makes: send the PublicKeyCredential of "
                                  "navigator.credentials as JSON (its toJSON())")  # fmt: skip


def _expired() -> PasskeyChallengeExpired:
    return PasskeyChallengeExpired(
        "this passkey request expired or was answered already: ask for new options and try again"
    )


def view(passkey: Passkey) -> dict[str, Any]:
    return {"id": passkey.id, "name": passkey.name, "created_at": passkey.created_at.isoformat(),
            "last_used_at": passkey.last_used_at.isoformat() if passkey.last_used_at else None,
            "transports": passkey.transports or []}  # fmt: skip


async def list_passkeys(session: AsyncSession, account_id: str) -> list[dict[str, Any]]:
    rows = await session.scalars(
        select(Passkey).where(Passkey.account_id == account_id).order_by(Passkey.created_at, Passkey.id)
    )
    return [view(row) for row in rows]


async def registration_options(
    session: AsyncSession, account: Account, *, settings: MasterSettings, now: datetime
) -> dict[str, Any]:
    """Options for ``navigator.credentials.create`` (JSON, as ``PublicKeyCredentialCreationOptionsJSON``): a new challenge
    bound to the account (its earlier unanswered ones go), the account's passkeys excluded, a discoverable credential
    with user verification required."""
    party = relying_party(settings)
    await _forget_expired(session, now)
    await session.execute(
        delete(PasskeyChallenge).where(
            PasskeyChallenge.account_id == account.id, PasskeyChallenge.purpose == REGISTER
        )
    )
    existing = (
        await session.scalars(select(Passkey.credential_id).where(Passkey.account_id == account.id))
    ).all()
    options = webauthn.generate_registration_options(
        rp_id=party.rp_id, rp_name=party.name, user_id=account.id.encode(), user_name=account.email or account.name,
        user_display_name=account.email or account.name,
        challenge=_challenge(session, REGISTER, account.id, settings=settings, now=now),
        timeout=int(settings.passkey_challenge_ttl_s * 1000),
        authenticator_selection=AuthenticatorSelectionCriteria(resident_key=ResidentKeyRequirement.REQUIRED,
                                                               user_verification=UserVerificationRequirement.REQUIRED),
        exclude_credentials=[PublicKeyCredentialDescriptor(id=base64url_to_bytes(c)) for c in existing],
    )  # fmt: skip
    answer: dict[str, Any] = json.loads(webauthn.options_to_json(options))
    return answer


async def register(
    session: AsyncSession,
    account_id: str,
    credential: dict[str, Any],
    name: str,
    *,
    settings: MasterSettings,
    now: datetime,
    address: str | None,
) -> Passkey | ClientError:
    """Verify the authenticator's answer to the account's registration challenge and keep the passkey; else the 400 (or
    409) to answer once the caller has committed the challenge's deletion."""
    party = relying_party(settings)
    try:
        parsed = webauthn.helpers.parse_registration_credential_json(credential)
        challenge = _answered_challenge(parsed)
    except (WebAuthnException, ValueError, TypeError, KeyError):
        return _bad_response()
    if not await _consume(session, challenge, REGISTER, account_id, now=now):
        return _expired()
    try:
        verified = webauthn.verify_registration_response(
            credential=parsed, expected_challenge=base64url_to_bytes(challenge), expected_rp_id=party.rp_id,
            expected_origin=list(party.origins), require_user_verification=True,
        )  # fmt: skip
    except (WebAuthnException, ValueError, TypeError, KeyError) as exc:
        return PasskeyRejected(f"the browser's answer did not verify ({exc}); add the passkey again from the console at "
                               f"{party.origins[0]}")  # fmt: skip
    credential_id = bytes_to_base64url(verified.credential_id)
    if await session.scalar(select(Passkey.id).where(Passkey.credential_id == credential_id)) is not None:
        return Conflict("this passkey is added already", code="passkey_exists")
    count = await session.scalar(
        select(func.count()).select_from(Passkey).where(Passkey.account_id == account_id)
    )
    if int(count or 0) >= MAX_PASSKEYS:
        return Conflict(f"an account holds at most {MAX_PASSKEYS} passkeys: remove one you no longer use first",
                        code="too_many_passkeys")  # fmt: skip
    transports = [t.value for t in parsed.response.transports or [] if isinstance(t, AuthenticatorTransport)]
    passkey = Passkey(id=new_id("pk"), account_id=account_id, name=name.strip() or "passkey", credential_id=credential_id,
                      public_key=verified.credential_public_key, sign_count=verified.sign_count, transports=transports,
                      created_at=now)  # fmt: skip
    session.add(passkey)
    await session.flush()
    record(
        session,
        account_id,
        Audit.PASSKEY_ADDED,
        at=now,
        address=address,
        passkey_id=passkey.id,
        name=passkey.name,
    )
    return passkey


async def delete_passkey(
    session: AsyncSession, account_id: str, passkey_id: str, *, now: datetime, address: str | None
) -> None:
    """Remove one of the account's passkeys: it signs in no more. Another account's is as one that does not exist."""
    passkey = await session.scalar(
        select(Passkey).where(Passkey.id == passkey_id, Passkey.account_id == account_id)
    )
    if passkey is None:
        raise NotFound(
            "no such passkey on your account; list them with GET /account/passkeys", code="passkey_not_found"
        )
    await session.delete(passkey)
    record(
        session,
        account_id,
        Audit.PASSKEY_REMOVED,
        at=now,
        address=address,
        passkey_id=passkey.id,
        name=passkey.name,
    )


async def sign_in_options(
    session: AsyncSession, *, settings: MasterSettings, now: datetime
) -> dict[str, Any]:
    """Options for ``navigator.credentials.get``: a new challenge, no credential named (the authenticator offers the
    discoverable ones it holds for the RP id), user verification required."""
    party = relying_party(settings)
    await _forget_expired(session, now)
    options = webauthn.generate_authentication_options(
        rp_id=party.rp_id, challenge=_challenge(session, SIGN_IN, None, settings=settings, now=now),
        timeout=int(settings.passkey_challenge_ttl_s * 1000), user_verification=UserVerificationRequirement.REQUIRED,
    )  # fmt: skip
    answer: dict[str, Any] = json.loads(webauthn.options_to_json(options))
    return answer


def _invalid() -> InvalidPasskey:
    return InvalidPasskey("that passkey did not sign you in: it is not one of an account here, or its answer did not "
                          "check out; sign in with your password")  # fmt: skip


async def sign_in(
    session: AsyncSession,
    credential: dict[str, Any],
    *,
    settings: MasterSettings,
    now: datetime,
    address: str | None,
) -> tuple[str, sessions.SignedIn] | ClientError:
    """Open a console session for a passkey's answer to a sign-in challenge (the cookie's token and the session), as a
    password sign-in does; else the error to answer once the caller has committed: 400 ``passkey_challenge_expired``,
    401 ``invalid_passkey`` alike for an unknown credential, a bad signature or a counter gone backwards."""
    party = relying_party(settings)
    try:
        parsed = webauthn.helpers.parse_authentication_credential_json(credential)
        challenge = _answered_challenge(parsed)
    except (WebAuthnException, ValueError, TypeError, KeyError):
        return _bad_response()
    if not await _consume(session, challenge, SIGN_IN, None, now=now):
        return _expired()
    found = await session.execute(
        select(Passkey, Account).join(Account, Account.id == Passkey.account_id)
        .where(Passkey.credential_id == bytes_to_base64url(parsed.raw_id)).with_for_update(of=Passkey)
    )  # fmt: skip
    row = found.first()
    if row is None:
        return _invalid()
    passkey, account = row
    handle = parsed.response.user_handle
    try:
        if handle is not None and handle != account.id.encode():
            raise webauthn.helpers.exceptions.InvalidAuthenticationResponse(
                "the user handle is another account's"
            )
        verified = webauthn.verify_authentication_response(
            credential=parsed, expected_challenge=base64url_to_bytes(challenge), expected_rp_id=party.rp_id,
            expected_origin=list(party.origins), credential_public_key=passkey.public_key,
            credential_current_sign_count=passkey.sign_count, require_user_verification=True,
        )  # fmt: skip
    except (WebAuthnException, ValueError, TypeError, KeyError) as exc:
        record(session, account.id, Audit.SIGN_IN_FAILED, at=now, address=address, method="passkey", passkey_id=passkey.id,
               reason=str(exc)[:200])  # fmt: skip
        return _invalid()
    if account.disabled_at is not None:
        return account_disabled()
    passkey.sign_count, passkey.last_used_at = verified.new_sign_count, now
    token, signed_in = await sessions.open_session(session, Principal.of(account), settings=settings, now=now)
    record(session, account.id, Audit.SIGNED_IN, at=now, address=address, method="passkey", passkey_id=passkey.id,
           session_id=signed_in.session_id)  # fmt: skip
    return token, signed_in
