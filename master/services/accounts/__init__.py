"""Accounts: who they are and how they sign in and reach their rentals.

* ``core.py``: accounts, roles and API keys, email addresses, and the ``Principal`` a request acts as.
* ``passwords.py``: the password policy and Argon2id hashes.
* ``signup.py``: self-service sign-up, the address's verification, password resets (the mails they send).
* ``sessions.py``: the console's sessions (cookie, CSRF token, expiry), signing in by password or API key, out everywhere.
* ``keys.py``: the API keys an account manages (scopes, expiry, networks).
* ``totp.py``: the TOTP second factor and its recovery codes.
* ``passkeys.py``: passkeys (WebAuthn through py_webauthn): adding, listing, removing them, and signing in with one.
* ``devices.py``: the CLI's sign-in through the browser (device codes).
* ``teams.py``: teams (accounts people act for), their members, roles and invitations.
* ``audit.py``: each account's security log.
* ``registries.py``: private registry credentials (one per image prefix, sealed; sent only inside a start command).
* ``vault.py``: the ``secrets_key`` setting as registry credentials and TOTP secrets use it.
* ``ssh_keys.py``: a renter's SSH public keys (parsing, fingerprints, limits).
* ``access.py``: what a renter's keys reach: ``update_access`` commands to the hosts of the account's rentals.

The lowest of the aggregates: it imports ``master.services.lifecycle`` and ``master.services.commands`` (``access``
tells hosts) and nothing else of ``master.services``; every other aggregate may import it.
"""

from master.services.accounts import devices, passkeys, teams
from master.services.accounts.access import access_changed, current_keys, disable_account, enable_account
from master.services.accounts.audit import Audit, audit_log
from master.services.accounts.core import (
    Principal,
    authenticate,
    authenticate_key,
    create_account,
    create_api_key,
    key_is_valid,
)
from master.services.accounts.keys import ALL_SCOPES, Scope, ScopeMissing
from master.services.accounts.keys import key_view as api_key_view
from master.services.accounts.keys import list_keys as list_api_keys
from master.services.accounts.keys import make_key as make_api_key
from master.services.accounts.keys import revoke_key as revoke_api_key
from master.services.accounts.registries import RegistryLogins, host_certificate_keys
from master.services.accounts.registries import add as add_registry_credential
from master.services.accounts.registries import list_credentials as list_registry_credentials
from master.services.accounts.registries import remove as remove_registry_credential
from master.services.accounts.registries import view as registry_credential_view
from master.services.accounts.sessions import (
    COOKIE,
    CSRF_HEADER,
    SignedIn,
    is_live,
    resolve,
    sign_in,
    sign_in_password,
    sign_out,
    sign_out_everywhere,
    wrong_password,
)
from master.services.accounts.signup import (
    ROLES_AT_SIGN_UP,
    request_reset,
    resend_verification,
    reset_password,
    sign_up,
    verify_email,
)
from master.services.accounts.ssh_keys import add_key, delete_key, key_view, list_keys, mark_used
from master.services.accounts.teams import HEADER as TEAM_HEADER
from master.services.accounts.teams import act_for
from master.services.accounts.teams import check_role_allows as check_team_role
from master.services.accounts.totp import begin as totp_begin
from master.services.accounts.totp import confirm as totp_confirm
from master.services.accounts.totp import disable as totp_disable
from master.services.accounts.vault import key_of as secrets_key_of

__all__ = [
    "ALL_SCOPES",
    "COOKIE",
    "CSRF_HEADER",
    "ROLES_AT_SIGN_UP",
    "TEAM_HEADER",
    "Audit",
    "Principal",
    "RegistryLogins",
    "Scope",
    "ScopeMissing",
    "SignedIn",
    "access_changed",
    "act_for",
    "add_key",
    "add_registry_credential",
    "api_key_view",
    "audit_log",
    "authenticate",
    "authenticate_key",
    "check_team_role",
    "create_account",
    "create_api_key",
    "current_keys",
    "delete_key",
    "devices",
    "disable_account",
    "enable_account",
    "host_certificate_keys",
    "is_live",
    "key_is_valid",
    "key_view",
    "list_api_keys",
    "list_keys",
    "list_registry_credentials",
    "make_api_key",
    "mark_used",
    "passkeys",
    "registry_credential_view",
    "remove_registry_credential",
    "request_reset",
    "resend_verification",
    "reset_password",
    "resolve",
    "revoke_api_key",
    "secrets_key_of",
    "sign_in",
    "sign_in_password",
    "sign_out",
    "sign_out_everywhere",
    "sign_up",
    "teams",
    "totp_begin",
    "totp_confirm",
    "totp_disable",
    "verify_email",
    "wrong_password",
]
