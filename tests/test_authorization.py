"""Authorization on every route: who may call it, and what someone else's object answers.

The OWASP API Security Top 10's object-level (API1) and function-level (API5) authorization
as one table, ``MATRIX``: for each route of ``master.api.table.ROUTES``, what each of five
callers gets — two renters, two providers and an admin — when the route names the first
renter's or the first provider's objects. ``TestCompleteness`` fails when a route exists
without a row, so no endpoint ships without its authorization written down.

The rules the table pins (docs/reliability.md, "Authorization"):

* no credentials, or an unknown or revoked key: 401 on every route that is not public;
* a role the route is not for: 403 ``forbidden``; admins pass every role check;
* someone else's rental, host (for a provider), invoice or alert: 404 ``*_not_found``,
  exactly as an id that does not exist, so ids cannot be probed; admins reach every object;
* renters see every host (they shop the marketplace), never another renter's rentals;
* lists hold the caller's own objects only, and a filter naming someone else's object
  never widens them;
* a refused call changes nothing.

Each test runs on SQLite and PostgreSQL. Bodies are valid, so a refusal is about who calls,
never about what was sent; every refusal is checked for its exact status and code.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from billing import credits
from master.api.base import API
from master.api.table import ROUTES
from master.models import Account, Alert, ApiKey, Base, Payout, TeamInvitation, TeamMember, Volume
from master.services.accounts import (
    TEAM_HEADER,
    add_registry_credential,
    make_api_key,
    sessions,
    ssh_keys,
    teams,
)
from master.services.accounts.core import Principal
from master.services.hosts import enrollment
from shared.crypto import generate_private_key, make_csr
from shared.ids import new_id
from tests.apiclient import RTX, Api, bearer
from tests.factories import MS, create_principal, gpu_info, online_host

# ---- the callers -----------------------------------------------------------------------------

RENTER, OTHER_RENTER = "renter", "other_renter"
PROVIDER, OTHER_PROVIDER = "provider", "other_provider"
ADMIN = "admin"
# Every row runs its refusals first (so nothing an owner changes can make one pass), then its
# successes in this order.
CALLERS = (OTHER_RENTER, OTHER_PROVIDER, RENTER, PROVIDER, ADMIN)
ROLE = {RENTER: "renter", OTHER_RENTER: "renter", PROVIDER: "provider", OTHER_PROVIDER: "provider", ADMIN: "admin"}

# What a call answers: a success status, or an error status with its code.
Outcome = int | tuple[int, str]

FORBIDDEN: Outcome = (403, "forbidden")
NO_RENTAL: Outcome = (404, "rental_not_found")
NO_HOST: Outcome = (404, "host_not_found")
NO_INVOICE: Outcome = (404, "invoice_not_found")
NO_ACCOUNT: Outcome = (404, "account_not_found")
NO_SSH_KEY: Outcome = (404, "ssh_key_not_found")
NO_TEAM: Outcome = (404, "team_not_found")


def everyone(outcome: Outcome) -> dict[str, Outcome]:
    return dict.fromkeys(CALLERS, outcome)


def only(ok: Outcome, role: str) -> dict[str, Outcome]:
    """A route for one role (and admins, who pass every role check): the others get 403."""
    return {who: ok if ROLE[who] in (role, "admin") else FORBIDDEN for who in CALLERS}


def the_renters(ok: Outcome, *, others: Outcome = NO_RENTAL) -> dict[str, Outcome]:
    """The first renter's object: its renter and admins; anyone else as if it did not exist."""
    return {**everyone(others), RENTER: ok, ADMIN: ok}


def host_read(ok: Outcome = 200) -> dict[str, Outcome]:
    """Reading the first provider's host: renters (the marketplace), its provider and admins; not another provider."""
    return {**everyone(ok), OTHER_PROVIDER: NO_HOST}


def host_write(ok: Outcome) -> dict[str, Outcome]:
    """Operating the first provider's host: its provider and admins; renters are refused the route."""
    return {OTHER_RENTER: FORBIDDEN, RENTER: FORBIDDEN, OTHER_PROVIDER: NO_HOST, PROVIDER: ok, ADMIN: ok}


# ---- the world every test calls into ---------------------------------------------------------


@dataclass
class World:
    """Two renters with a running rental and an invoice each, two providers with a listed host, an alert and a payout each."""

    api: Api
    keys: dict[str, str]
    accounts: dict[str, Principal]
    hosts: dict[str, str]
    rentals: dict[str, str]
    alerts: dict[str, str]  # provider → the alert on its host; "fleet" → one on no host
    payouts: dict[str, str]
    month: str  # "YYYY-MM" of the top-ups on the invoices
    ssh_keys: dict[str, str] = field(default_factory=dict)  # caller → the id of an SSH key it registered
    cluster: str = ""  # the first renter's cluster (two nodes, one on each provider's host)
    cluster_members: frozenset[str] = frozenset()  # its member rentals, left out where a test counts the world's rentals
    service: str = ""  # the first renter's service (asleep: min_replicas 0, so no replica to count)
    api_key: str = ""  # the id of a second API key of the first renter (read only)
    registry_credential: str = ""  # the id of the first renter's registry credential
    team: str = ""  # the first renter's team (it is its owner, alone)
    invitation: str = ""  # an open invitation of that team
    volume: str = ""  # the first renter's volume (ready, on the first provider's host)

    def account(self, who: str) -> str:
        return self.accounts[who].account_id

    def document(self, who: str) -> str:
        """The caller's invoice (renters) or statement (providers) of this month."""
        return f"{'inv' if ROLE[who] == 'renter' else 'stm'}-{self.month}-{self.account(who)}"

    def objects(self) -> dict[str, str]:
        """What the placeholders of a row's path and query name: the first renter's and first provider's objects."""
        return {
            "rental_id": self.rentals[RENTER], "host_id": self.hosts[PROVIDER], "alert_id": self.alerts[PROVIDER],
            "account_id": self.account(RENTER), "invoice_id": self.document(RENTER), "statement_id": self.document(PROVIDER),
            "other_host_id": self.hosts[OTHER_PROVIDER], "other_provider_id": self.account(OTHER_PROVIDER),
            "name": "pytorch",  # a seeded template
            "ssh_key_id": self.ssh_keys[RENTER], "cluster_id": self.cluster, "service_id": self.service,
            "start": MAINTENANCE["start"],  # the window the provider's POST adds
            "key_id": self.api_key, "user_code": "BCDF-GHJK", "passkey_id": "pk-0000000000000000", "credential_id": self.registry_credential,
            "team_id": self.team, "invitation_id": self.invitation, "team_owner": self.account(RENTER),
            "volume_id": self.volume,
        }  # fmt: skip


@pytest.fixture
async def world(api: Api) -> World:
    master = api.master
    accounts, keys = {RENTER: api.renter, PROVIDER: api.provider}, {RENTER: api.renter_key, PROVIDER: api.provider_key}
    for who, name in ((OTHER_RENTER, "renter-2"), (OTHER_PROVIDER, "provider-2"), (ADMIN, "admin-1")):
        accounts[who], keys[who] = await create_principal(master, name, ROLE[who])
    hosts = {who: await online_host(master, accounts[who], [gpu_info(i) for i in range(12)]) for who in (PROVIDER, OTHER_PROVIDER)}
    for who in (PROVIDER, OTHER_PROVIDER):
        status, body = await api.call("PUT", f"/hosts/{hosts[who]}/listing", keys[who], json={"price_per_gpu_hour": "0.50"})
        assert status == 201, body
    # Both renters run a rental on the first provider's host, so its views could leak one to the other.
    rentals: dict[str, str] = {}
    for who in (RENTER, OTHER_RENTER):
        status, body = await api.call("POST", "/rentals", keys[who], json={"offer_id": f"{hosts[PROVIDER]}:{RTX}"})
        assert status == 201, body
        rentals[who] = body["id"]
        await api.agent_reports(body["id"], "start_workload")
    now = master.clock.now()
    async with master.db.session() as session:
        for who in (RENTER, OTHER_RENTER):
            await credits.top_up(session, accounts[who].account_id, "100.00", reference=f"setup-{who}", at=now)
        alerts = {who: _alert(session, hosts.get(who), now) for who in (PROVIDER, OTHER_PROVIDER, "fleet")}
        payouts = {}
        for who in (PROVIDER, OTHER_PROVIDER):
            payouts[who] = new_id("po")
            session.add(Payout(id=payouts[who], provider_id=accounts[who].account_id, amount=Decimal("12.00"),
                               batch="2026-11-01", ledger_key=f"test-payout:{who}", created_at=now))  # fmt: skip
        ssh = {who: (await ssh_keys.add_key(session, accounts[who].account_id, _ssh_key_line(), now=now)).id for who in CALLERS}
        second_key, _ = await make_api_key(session, accounts[RENTER].account_id, name="second", scopes=["read"], expires_at=None,
                                           allowed_networks=None, now=now)  # fmt: skip
        registry, _ = await add_registry_credential(session, accounts[RENTER].account_id, prefix="registry.example.com/team/",
                                                    username="robot", password="token", settings=master.settings, now=now)  # fmt: skip
    status, body = await api.call("POST", "/clusters", keys[RENTER], json={"node_count": 2})
    assert status == 201, body
    members = frozenset(m["rental_id"] for m in body["members"])
    cluster = body["id"]
    status, body = await api.call("POST", "/services", keys[RENTER], json=SERVICE)
    assert status == 201, body
    service = body["id"]
    async with master.db.session() as session:
        team = await teams.create_team(session, accounts[RENTER], "first renters team", now=now, address=None)
        invitation = TeamInvitation(id=new_id("inv"), team_id=team.id, email="someone@example.com", role="member",
                                    token_hash=new_id("hash"), created_at=now, expires_at=now + timedelta(days=1))  # fmt: skip
        session.add(invitation)
        volume = Volume(id="vol-00000000000000aa", account_id=accounts[RENTER].account_id, name="data", size_gib=10,
                        host_id=hosts[PROVIDER], state="ready", price_per_gib_hour=Decimal("0.0002"), created_at=now, ready_at=now)  # fmt: skip
        session.add(volume)
    return World(api, keys, accounts, hosts, rentals, alerts, payouts, f"{now:%Y-%m}", ssh, cluster, members, service,
                 second_key.id, registry.id, team.id, invitation.id, volume.id)  # fmt: skip


def _ssh_key_line() -> str:
    """A fresh Ed25519 public key line (``.pub``)."""
    key = ed25519.Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def _alert(session: AsyncSession, host_id: str | None, now: datetime) -> str:
    """A firing alert on the host (None: a fleet-wide one, which no provider sees)."""
    rule = "host_offline" if host_id else "relay_dead"
    key = f"{rule}:{host_id or 'relay-t'}"
    alert = Alert(id=new_id("alert"), rule=rule, key=key, open_key=key, severity="warning",
                  state="firing", host_id=host_id, summary=key, details={}, raised_at=now, last_seen_at=now)  # fmt: skip
    session.add(alert)
    return alert.id


# ---- bodies of the write routes (valid, so a refusal is about the caller) --------------------

BodyFn = Callable[[World, str], Awaitable[Any]]


def fixed(value: Any) -> BodyFn:
    async def body(world: World, who: str) -> Any:
        return value

    return body


async def enroll_body(world: World, who: str) -> Any:
    token, _ = await enrollment.create_token(world.api.master, world.account(PROVIDER))
    return {"token": token, "csr": make_csr(generate_private_key(), "test-host").decode(), "hostname": f"host-of-{who}"}


async def enroll_check_body(world: World, who: str) -> Any:
    token, _ = await enrollment.create_token(world.api.master, world.account(PROVIDER))
    return {"token": token}


async def top_up_body(world: World, who: str) -> Any:
    return {"account_id": world.account(RENTER), "amount": "10.00", "reference": f"payment-by-{who}"}


async def ssh_key_body(world: World, who: str) -> Any:
    return {"public_key": _ssh_key_line(), "name": f"added by {who}"}


# Far from the test clock's now, one day apart: the provider's and the admin's windows do not overlap.
MAINTENANCE = {"start": "2099-01-01T00:00:00Z", "end": "2099-01-01T04:00:00Z"}


async def maintenance_body(world: World, who: str) -> Any:
    return MAINTENANCE if who == PROVIDER else {"start": "2099-01-02T00:00:00Z", "end": "2099-01-02T04:00:00Z"}


async def team_body(world: World, who: str) -> Any:
    return {"name": f"team of {who}"}


async def session_body(world: World, who: str) -> Any:
    return {"api_key": world.keys.get(who, world.keys[RENTER])}


# ---- the matrix --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One route called with the first renter's / first provider's objects, and what each caller gets."""

    method: str
    path: str  # exactly as in ROUTES
    expect: Mapping[str, Outcome]
    ids: Mapping[str, str] = field(default_factory=dict)  # path placeholder → another World.objects key
    query: Mapping[str, str] = field(default_factory=dict)  # values may name World.objects as {key}
    body: BodyFn | None = None
    stream: bool = False  # Server-Sent Events: read until the stream ends
    last: bool = False  # its successes change what other rows read (a stop, a revocation): run them at the end

    def url(self, world: World) -> str:
        objects = world.objects()
        return self.path.format_map({**objects, **{name: objects[key] for name, key in self.ids.items()}})

    def params(self, world: World) -> dict[str, str]:
        return {name: value.format_map(world.objects()) for name, value in self.query.items()}

    def __str__(self) -> str:
        query = "&".join(f"{k}={v}" for k, v in self.query.items())
        return f"{self.method} {self.path}" + (f"?{query}" if query else "") + (f" ({', '.join(self.ids.values())})" if self.ids else "")


LISTING = {"price_per_gpu_hour": "0.60", "smallest_unit": "gpu"}
TEMPLATE = {"image": "ubuntu:24.04", "command": ["sleep", "infinity"], "description": "edited"}
SERVICE = {"name": "chat", "workload": {"image": "busybox:1", "ports": [8000]}, "port": 8000, "min_replicas": 0, "max_replicas": 2}

MATRIX: tuple[Rule, ...] = (
    # Core: health, the account, enrollment, hosts, rentals.
    Rule("GET", "/health", everyone(200)),
    Rule("GET", "/health/live", everyone(200)),
    Rule("GET", "/openapi.json", everyone(200)),
    Rule("GET", "/regions", everyone(200)),
    Rule("GET", "/account", everyone(200)),
    Rule("PUT", "/accounts/{account_id}/quota", only(200, "admin"), body=fixed({"max_gpus": 8, "max_spend_per_hour": 50})),
    Rule("PUT", "/accounts/{account_id}/fair-share", only(200, "admin"), body=fixed({"weight": 2})),
    Rule("POST", "/enrollment-tokens", only(201, "provider")),
    Rule("POST", "/enroll", everyone(201), body=enroll_body),
    Rule("POST", "/enroll/check", everyone(200), body=enroll_check_body),
    Rule("GET", "/hosts", everyone(200)),
    Rule("GET", "/hosts/{host_id}", host_read()),
    Rule("GET", "/hosts/{host_id}/metrics", host_read()),
    Rule("GET", "/hosts/{host_id}/events", host_read()),
    Rule("GET", "/hosts/{host_id}/network", host_read()),
    Rule("POST", "/hosts/{host_id}/health-check", host_write(202)),
    Rule("POST", "/hosts/{host_id}/network-test", host_write(202)),
    Rule("POST", "/rentals", only(201, "renter"), body=fixed({"gpu_count": 1})),
    Rule("GET", "/rentals", everyone(200)),
    Rule("GET", "/rentals/{rental_id}", the_renters(200)),
    Rule("POST", "/hosts/{host_id}/revoke", host_write(200), last=True),
    Rule("GET", "/relays", only(200, "admin")),
    Rule("GET", "/rentals/{rental_id}/logs", the_renters(200)),
    # Connecting: the renter alone, admins included among the others (what runs in a rental is the renter's);
    # the world's rental holds GPUs and runs nothing, so the renter's answer is nothing_to_log_into.
    Rule("POST", "/rentals/{rental_id}/connect", {**everyone(NO_RENTAL), RENTER: (409, "nothing_to_log_into")}, body=fixed({"port": "ssh"})),
    Rule("DELETE", "/rentals/{rental_id}", the_renters(202), last=True),
    # A volume's file-only session (docs/volumes.md): only its renter's own volume; no caller here has one by this name.
    Rule("POST", "/volumes/{volume}/connect", everyone((404, "volume_not_found")), ids={"volume": "name"}),
    Rule("POST", "/volumes/{volume}/copy", everyone((404, "volume_not_found")), ids={"volume": "name"}, body=fixed({"from": "other"})),
    Rule("GET", "/volumes/{volume}/copy", everyone((404, "volume_not_found")), ids={"volume": "name"}),
    # Clusters: as rentals; another renter's cluster is as one that does not exist.
    Rule("POST", "/clusters", only(201, "renter"), body=fixed({"node_count": 2})),
    Rule("GET", "/clusters", everyone(200)),
    Rule("GET", "/clusters/{cluster_id}", the_renters(200, others=(404, "cluster_not_found"))),
    Rule("DELETE", "/clusters/{cluster_id}", the_renters(202, others=(404, "cluster_not_found")), last=True),
    Rule("GET", "/demand-forecast", only(200, "provider")),
    # Off-peak power limits: a host's policy is its provider's (admins too); the world's GPUs report no adjustable
    # range, so the valid body opts out.
    Rule("PUT", "/hosts/{host_id}/power-policy", host_write(200), body=fixed({"enabled": False})),
    Rule("GET", "/hosts/{host_id}/power-policy", host_write(200)),
    # GPU verification: a host's challenges for its provider and admins; a challenge on demand for admins alone
    # (the world's host has a running rental, which a challenge never interrupts: 409 host_busy).
    Rule("GET", "/hosts/{host_id}/verifications", host_write(200)),
    Rule("POST", "/admin/hosts/{host_id}/verify", only((409, "host_busy"), "admin")),
    Rule("GET", "/provider/power", only(200, "provider")),
    # Services: as clusters.
    Rule("POST", "/services", only(201, "renter"), body=fixed(SERVICE)),
    Rule("GET", "/services", everyone(200)),
    Rule("GET", "/services/{service_id}", the_renters(200, others=(404, "service_not_found"))),
    Rule("GET", "/services/{service_id}/stats", the_renters(200, others=(404, "service_not_found"))),
    Rule("PUT", "/services/{service_id}/replicas", the_renters(200, others=(404, "service_not_found")), body=fixed({"max_replicas": 3})),
    Rule("POST", "/services/{service_id}/token", the_renters(200, others=(404, "service_not_found"))),
    Rule("DELETE", "/services/{service_id}", the_renters(202, others=(404, "service_not_found")), last=True),
    # Volumes: as services; the world's hosts lend no storage, so a renter's valid request is refused for that.
    Rule("POST", "/volumes", only((409, "volume_host_lends_none"), "renter"), body=fixed({"name": "scratch", "size_gib": 1})),
    Rule("GET", "/volumes", everyone(200)),
    Rule("GET", "/volumes/{volume_id}", the_renters(200, others=(404, "volume_not_found"))),
    Rule("DELETE", "/volumes/{volume_id}", the_renters(202, others=(404, "volume_not_found")), last=True),
    # The marketplace.
    Rule("GET", "/offers", everyone(200)),
    Rule("GET", "/offers/clusters", everyone(200), query={"nodes": "2"}),
    Rule("PUT", "/hosts/{host_id}/listing", host_write(200), body=fixed(LISTING)),
    Rule("GET", "/hosts/{host_id}/listing", host_read()),
    Rule("GET", "/price-bounds", everyone(200)),
    # After the listing's PUT (which would clear them): the provider adds MAINTENANCE, the admin another, the
    # provider clears MAINTENANCE. The admin's 404 runs with the refusals, before any window exists.
    Rule("POST", "/hosts/{host_id}/maintenance-windows", host_write(201), body=maintenance_body),
    Rule("DELETE", "/hosts/{host_id}/maintenance-windows/{start}",
         {**host_write(200), ADMIN: (404, "maintenance_window_not_found")}),
    # Alerts: providers (their own hosts') and admins.
    Rule("GET", "/alerts", only(200, "provider")),
    Rule("GET", "/alerts", only(200, "provider"), query={"host_id": "{other_host_id}"}),
    Rule("GET", "/alerts/{alert_id}", {**only(200, "provider"), OTHER_PROVIDER: (404, "alert_not_found")}),
    Rule("GET", "/metrics", only(200, "admin")),
    # Billing.
    Rule("POST", "/account/credits", only(201, "admin"), body=top_up_body),
    # An admin passes the role check but has no renter account to cap.
    Rule("PUT", "/account/spend-cap", {**only(200, "renter"), ADMIN: (422, "not_a_renter")},
         body=fixed({"monthly_spend_cap": "500.00"})),
    Rule("GET", "/payouts", only(200, "provider")),
    Rule("GET", "/payouts", only(200, "provider"), query={"provider_id": "{other_provider_id}"}),
    Rule("GET", "/admin/ledger/trial-balance", only(200, "admin")),
    # Self-serve credit: renters only; this master takes no payments (the default), which tests/test_payments.py turns on.
    Rule("GET", "/account/spend", only(200, "renter")),
    Rule("GET", "/provider/earnings", only(200, "provider")),
    Rule("GET", "/provider/occupancy", only(200, "provider")),
    Rule("GET", "/admin/marketplace", only(200, "admin")),
    Rule("POST", "/account/credit", only((409, "payments_disabled"), "renter"), body=fixed({"amount": "25.00"})),
    Rule("POST", "/payments/stripe/webhook", everyone(404)),  # public (Stripe signs it): 404 stripe_not_configured here
    # Invoices and statements.
    Rule("GET", "/invoices", {**everyone(200), ADMIN: (400, "missing_account_id")}),
    Rule("GET", "/invoices", the_renters(200, others=NO_ACCOUNT), query={"account_id": "{account_id}"}),
    Rule("GET", "/invoices/{invoice_id}", the_renters(200, others=NO_INVOICE)),
    Rule("GET", "/invoices/{invoice_id}", the_renters(200, others=NO_INVOICE), query={"format": "html"}),
    Rule("GET", "/invoices/{invoice_id}", {**everyone(NO_INVOICE), PROVIDER: 200, ADMIN: 200}, ids={"invoice_id": "statement_id"}),
    # The console: sessions are the caller's own; an API-key call has none.
    Rule("POST", "/sessions", everyone(201), body=session_body),
    Rule("GET", "/sessions/current", everyone((404, "no_session"))),
    Rule("DELETE", "/sessions/current", everyone((404, "no_session"))),
    # Self-service accounts (tests/test_signup.py): public, each answers everyone alike; the seeded accounts have no
    # address to verify, and signing an API-key caller out everywhere ends no session.
    Rule("POST", "/accounts", everyone(422), body=fixed({"email": "not an address", "password": "x", "role": "renter"})),
    Rule("POST", "/accounts/verify", everyone(400), body=fixed({"token": "not-a-token"})),
    Rule("POST", "/accounts/verify/resend", everyone(200)),
    Rule("POST", "/password-resets", everyone(422), body=fixed({"email": ""})),
    Rule("POST", "/password-resets/confirm", everyone(400), body=fixed({"token": "not-a-token", "password": "x"})),
    Rule("DELETE", "/sessions", everyone(200)),
    Rule("GET", "/audit-events", everyone(200)),
    # The second factor: read by anyone signed in; changed from a console session only (these calls carry keys).
    Rule("GET", "/account/totp", everyone(200)),
    Rule("POST", "/account/totp", everyone((403, "console_session_required"))),
    Rule("POST", "/account/totp/confirm", everyone((403, "console_session_required")), body=fixed({"code": "123456"})),
    Rule("POST", "/account/totp/disable", everyone((403, "console_session_required")), body=fixed({"code": "123456"})),
    # Passkeys (tests/test_passkeys.py): read by anyone signed in; added and removed from a password or passkey console
    # session only (these calls carry keys); signing in with one is public, and garbage is no answer.
    Rule("GET", "/account/passkeys", everyone(200)),
    Rule("POST", "/account/passkeys/options", everyone((403, "console_session_required"))),
    Rule("POST", "/account/passkeys", everyone((403, "console_session_required")), body=fixed({"name": "x", "credential": {}})),
    Rule("DELETE", "/account/passkeys/{passkey_id}", everyone((403, "console_session_required"))),
    Rule("POST", "/sessions/passkey/options", everyone(200), body=fixed({})),
    Rule("POST", "/sessions/passkey", everyone(400), body=fixed({"credential": {}})),
    # API keys: the account's own; another account's key is as one that does not exist.
    Rule("POST", "/api-keys", everyone(201), body=fixed({"name": "matrix", "scopes": ["read"]})),
    Rule("GET", "/api-keys", everyone(200)),
    Rule("DELETE", "/api-keys/{key_id}", {**everyone((404, "api_key_not_found")), RENTER: 200}, last=True),
    # The CLI's sign-in through the browser: anyone may start one and poll; approving is a console session's.
    Rule("POST", "/device-codes", everyone(200), body=fixed({"client_name": "matrix"})),
    Rule("POST", "/device-codes/token", everyone(400), body=fixed({"device_code": "not-a-code"})),
    Rule("GET", "/device-codes/{user_code}", everyone((403, "console_session_required"))),
    Rule("POST", "/device-codes/{user_code}/approve", everyone((403, "console_session_required")), body=fixed({})),
    Rule("GET", "/hosts/{host_id}/metrics/stream", host_read(), stream=True),
    # Templates: everyone signed in reads them, admins edit them.
    Rule("GET", "/templates", everyone(200)),
    Rule("GET", "/templates/{name}", everyone(200)),
    Rule("PUT", "/templates/{name}", only(200, "admin"), body=fixed(TEMPLATE)),
    Rule("DELETE", "/templates/{name}", only(200, "admin"), last=True),
    # SSH keys: every account manages its own; another's key (admins included) is as one that does not exist.
    Rule("GET", "/account/ssh-keys", everyone(200)),
    Rule("POST", "/account/ssh-keys", everyone(201), body=ssh_key_body),
    Rule("DELETE", "/account/ssh-keys/{ssh_key_id}", {**everyone(NO_SSH_KEY), RENTER: 200}, last=True),
    # Teams (tests/test_teams.py; the team dimension: TestTeamDimension): the caller's own; someone else's team is as
    # one that does not exist. The world has none to begin with, so each caller makes one (names must differ).
    Rule("POST", "/teams", everyone(201), body=team_body),
    Rule("GET", "/teams", everyone(200)),
    Rule("GET", "/teams/{team_id}", {**everyone(NO_TEAM), RENTER: 200}),
    # No mail server here: the owner's invitation is 503 and leaves nothing behind (tests/test_teams.py mails them).
    Rule("POST", "/teams/{team_id}/invitations", {**everyone(NO_TEAM), RENTER: (503, "mail_unavailable")},
         body=fixed({"email": "invited@example.com", "role": "member"})),
    Rule("DELETE", "/teams/{team_id}/invitations/{invitation_id}", {**everyone(NO_TEAM), RENTER: 200}),
    Rule("POST", "/team-invitations/accept", everyone((400, "invalid_invitation")), body=fixed({"token": "not-a-token"})),
    Rule("PATCH", "/teams/{team_id}/members/{account_id}", {**everyone(NO_TEAM), RENTER: 200}, ids={"account_id": "team_owner"},
         body=fixed({"role": "owner"})),
    Rule("DELETE", "/teams/{team_id}/members/{account_id}", {**everyone(NO_TEAM), RENTER: (409, "last_owner")},
         ids={"account_id": "team_owner"}),
    # Registry credentials: as SSH keys; their secrets never in an answer (tests/test_registry_credentials.py).
    Rule("GET", "/registry-credentials", everyone(200)),
    Rule("POST", "/registry-credentials", everyone(201), body=fixed({"prefix": "registry.example.com:5000/matrix/",
                                                                      "username": "robot", "password": "token"})),
    Rule("DELETE", "/registry-credentials/{credential_id}", {**everyone((404, "registry_credential_not_found")), RENTER: 200},
         last=True),
)  # fmt: skip

PUBLIC = {(route.method, route.path) for route in ROUTES if route.public}

# Routes outside /api/v1 (API keys do not apply there) and who may call them.
UNVERSIONED = {
    ("GET", "/metrics"): "the metrics_token setting; nobody without one, unless metrics_open (docs/operations.md)",
    ("GET", "/downloads/agent"): "anyone: a host is admitted by its enrollment token, not by the wheel",
    ("GET", "/downloads/install-agent.sh"): "anyone, as the agent wheel",
    ("GET", "/"): "anyone: the console's page, a client of this API",
    ("GET", "/static/{path}"): "anyone: the console's static files",
    ("GET", "/api/docs"): "anyone: the API reference's page (Swagger UI over the public OpenAPI document)",
    ("GET", "/api/docs/{name}"): "anyone: the API reference's files",
    ("*", "/svc/{service_id}"): "the service's token or its renter's API key; 404 for any other account (docs/gateway.md)",
    ("*", "/svc/{service_id}/{tail}"): "as /svc/{service_id}: a service's endpoint, any path under it",
}

# Query parameters that name an object: each must never widen what a non-admin sees
# (TestListsHoldOnlyYourOwn checks each).
SCOPING_PARAMETERS = {("GET", "/alerts", "host_id"), ("GET", "/invoices", "account_id"), ("GET", "/payouts", "provider_id"),
                      ("GET", "/volumes/{volume}/copy", "copy_id")}  # fmt: skip


# ---- calling -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    code: str | None
    body: Any

    def matches(self, expected: Outcome) -> bool:
        if isinstance(expected, int):
            return self.status == expected
        return (self.status, self.code) == expected


async def call(world: World, rule: Rule, headers: Mapping[str, str], who: str) -> Answer:
    client = world.api.client
    body = await rule.body(world, who) if rule.body is not None else None
    kwargs: dict[str, Any] = {"headers": dict(headers), "params": rule.params(world)}
    if body is not None:
        kwargs["json"] = body
    async with client.request(rule.method, API + rule.url(world), **kwargs) as response:
        if response.content_type == "application/json":
            payload = await response.json()
            code = payload.get("code") if isinstance(payload, dict) and response.status >= 400 else None
            answer = Answer(response.status, code, payload)
        else:
            answer = Answer(response.status, None, await response.text())  # HTML, or the stream (read to its end)
    client.session.cookie_jar.clear()  # a sign-in's cookie must not authenticate the next call
    return answer


def as_caller(world: World, who: str) -> dict[str, str]:
    return bearer(world.keys[who])


# What authenticating writes whatever the answer: when a key was last used (to the minute). A refused call used it.
NOT_CHANGES = {"api_keys": {"last_used_at"}}


async def snapshot(world: World) -> dict[str, list[str]]:
    """Every row of every table (but ``NOT_CHANGES``), to show that a refused call wrote nothing."""
    async with world.api.master.db.session() as session:
        return {
            table.name: sorted(
                repr(tuple(row)) for row in (await session.execute(
                    select(*(c for c in table.columns if c.name not in NOT_CHANGES.get(table.name, ())))
                )).all()
            )
            for table in Base.metadata.sorted_tables
        }  # fmt: skip


def changed_tables(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    return [name for name in before if before[name] != after[name]]


# ---- the tests ---------------------------------------------------------------------------------


class TestCompleteness:
    def test_every_route_is_in_the_matrix(self) -> None:
        """Each route of ROUTES has a row, and each row a route: a new endpoint without one fails the build."""
        routes = {(route.method, route.path) for route in ROUTES}
        rows = {(rule.method, rule.path) for rule in MATRIX}
        assert sorted(routes - rows) == [], "routes without an authorization rule: add them to MATRIX"
        assert sorted(rows - routes) == [], "rules for routes that no longer exist"

    def test_every_row_says_what_each_caller_gets(self) -> None:
        """No caller is left out of a row, and public rows let everyone in."""
        for rule in MATRIX:
            assert set(rule.expect) == set(CALLERS), rule
            if (rule.method, rule.path) in PUBLIC:
                assert all(isinstance(outcome, int) for outcome in rule.expect.values()), rule

    def test_the_403s_of_a_row_are_the_roles_its_route_declares(self) -> None:
        """A caller is refused a route (403) exactly when the route's documented roles leave it out (admins pass all)."""
        roles = {(route.method, route.path): route.roles for route in ROUTES}
        for rule in MATRIX:
            declared = roles[(rule.method, rule.path)]
            refused = {who for who, outcome in rule.expect.items() if outcome == FORBIDDEN}
            assert refused == {who for who in CALLERS if declared and ROLE[who] not in (*declared, "admin")}, rule

    def test_every_object_in_a_path_is_someone_elses_in_some_row(self) -> None:
        """Each route with an object id in its path has a caller who is refused that object (404) or the route (403)."""
        for rule in MATRIX:
            if re.search(r"\{\w+_id\}", rule.path):
                assert any(isinstance(outcome, tuple) for outcome in rule.expect.values()), rule

    def test_every_id_query_parameter_is_checked_for_widening(self) -> None:
        """Each query parameter naming an object (``*_id``) is in SCOPING_PARAMETERS, which the list tests cover."""
        named = {(route.method, route.path, q.name) for route in ROUTES for q in route.query if q.name.endswith("_id")}
        assert named == SCOPING_PARAMETERS

    async def test_every_unversioned_route_is_accounted_for(self, api: Api) -> None:
        """Routes outside /api/v1 are listed in UNVERSIONED with who may call them."""
        found = set()
        for route in api.client.app.router.routes():
            path = re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", route.resource.canonical if route.resource else "")
            if route.method != "HEAD" and not path.startswith(API + "/"):
                found.add((route.method, path))
        assert found == set(UNVERSIONED)


class TestMatrix:
    async def test_each_caller_gets_what_the_matrix_says_and_refusals_change_nothing(self, world: World) -> None:
        """Every route as every caller answers the matrix's status and code; the refused calls, all made first, write nothing."""
        world.api.master.settings.stream_poll_interval = 10 * MS
        world.api.master.settings.stream_max_s = 50 * MS
        wrong: list[str] = []

        async def check(rule: Rule, who: str) -> None:
            answer = await call(world, rule, as_caller(world, who), who)
            expected = rule.expect[who]
            if not answer.matches(expected):
                wrong.append(f"{rule} as {who}: expected {expected}, got {answer.status} {answer.code or ''} {str(answer.body)[:200]}")
            elif rule.stream and answer.status == 200:
                assert answer.body.startswith("retry: "), answer.body

        before = await snapshot(world)
        for rule in MATRIX:
            for who in CALLERS:
                if isinstance(rule.expect[who], tuple):
                    await check(rule, who)
        changed = changed_tables(before, await snapshot(world))
        for rule in (*(r for r in MATRIX if not r.last), *(r for r in MATRIX if r.last)):
            for who in CALLERS:
                if isinstance(rule.expect[who], int):
                    await check(rule, who)
        assert wrong == [], "\n".join(wrong)
        assert changed == [], f"refused calls wrote to {changed}"

    async def test_a_refusal_looks_like_an_object_that_does_not_exist(self, world: World) -> None:
        """Someone else's rental, host, invoice or alert answers exactly what an unknown id answers: ids cannot be probed."""
        cases = [
            (OTHER_RENTER, "GET", "/rentals/{}", world.rentals[RENTER], "r-0000000000000000"),
            (OTHER_RENTER, "DELETE", "/rentals/{}", world.rentals[RENTER], "r-0000000000000000"),
            (OTHER_PROVIDER, "GET", "/hosts/{}", world.hosts[PROVIDER], "h-0000000000000000"),
            (OTHER_PROVIDER, "PUT", "/hosts/{}/listing", world.hosts[PROVIDER], "h-0000000000000000"),
            (OTHER_PROVIDER, "DELETE", "/hosts/{}/maintenance-windows/2099-01-01T00:00:00Z", world.hosts[PROVIDER], "h-0000000000000000"),
            (OTHER_PROVIDER, "POST", "/hosts/{}/revoke", world.hosts[PROVIDER], "h-0000000000000000"),
            (OTHER_PROVIDER, "GET", "/alerts/{}", world.alerts[PROVIDER], "alert-0000000000000000"),
            (OTHER_RENTER, "GET", "/invoices/{}", world.document(RENTER), f"inv-{world.month}-acct-0000000000000000"),
            (OTHER_RENTER, "DELETE", "/account/ssh-keys/{}", world.ssh_keys[RENTER], "sshk-0000000000000000"),
            (ADMIN, "DELETE", "/account/ssh-keys/{}", world.ssh_keys[RENTER], "sshk-0000000000000000"),
        ]
        for who, method, path, theirs, unknown in cases:
            body = LISTING if method == "PUT" else None
            seen = [await world.api.call(method, path.format(target), world.keys[who], json=body) for target in (theirs, unknown)]
            assert (seen[0][0], seen[0][1]["code"]) == (seen[1][0], seen[1][1]["code"]), (method, path, seen)
            assert seen[0][0] == 404, (method, path, seen)


class TestCredentials:
    async def test_every_private_route_refuses_a_missing_unknown_or_revoked_key(self, world: World) -> None:
        """No key, another scheme, an unknown key or a revoked admin key: 401 on every non-public route, and nothing written."""
        master = world.api.master
        admin, revoked = await create_principal(master, "admin-revoked", "admin")
        async with master.db.session() as session:
            await session.execute(update(ApiKey).where(ApiKey.account_id == admin.account_id).values(revoked_at=datetime.now(UTC)))
        attempts: tuple[tuple[dict[str, str], str], ...] = (
            ({}, "missing_api_key"),
            ({"Authorization": f"Basic {world.keys[ADMIN]}"}, "missing_api_key"),
            ({"Authorization": "Bearer "}, "missing_api_key"),
            (bearer("gmk_not-a-real-key"), "invalid_api_key"),
            (bearer(revoked), "invalid_api_key"),
        )
        before = await snapshot(world)
        wrong = []
        seen = set()
        for rule in MATRIX:
            if (rule.method, rule.path) in PUBLIC or (rule.method, rule.path) in seen:
                continue
            seen.add((rule.method, rule.path))
            for headers, code in attempts:
                if not headers and rule.path.startswith("/sessions"):
                    code = "not_signed_in"  # the console, which holds no key, is told to sign in
                answer = await call(world, rule, headers, ADMIN)
                if (answer.status, answer.code) != (401, code):
                    wrong.append(f"{rule} with {headers or 'no key'}: expected 401 {code}, got {answer.status} {answer.code}")
        assert wrong == [], "\n".join(wrong)
        assert changed_tables(before, await snapshot(world)) == []

    async def test_public_routes_answer_without_credentials(self, world: World) -> None:
        """Health, the OpenAPI document, enrollment and sign-in need no key."""
        for rule in MATRIX:
            if (rule.method, rule.path) in PUBLIC:
                answer = await call(world, rule, {}, "anonymous")
                assert answer.matches(rule.expect[RENTER]), (str(rule), answer)

    async def test_a_console_session_is_held_to_the_same_rules(self, world: World) -> None:
        """Through the console's cookie (and its CSRF token) another renter's rental and another provider's host are still 404."""
        master = world.api.master
        signed: dict[str, dict[str, str]] = {}
        for who in (OTHER_RENTER, OTHER_PROVIDER, RENTER):
            async with master.db.session() as session:
                token, signed_in = await sessions.sign_in(session, world.keys[who], settings=master.settings, now=master.clock.now())
            signed[who] = {"Cookie": f"{sessions.COOKIE}={token}", sessions.CSRF_HEADER: signed_in.csrf_token}
        rental, host = world.rentals[RENTER], world.hosts[PROVIDER]
        cases: list[tuple[str, str, str, Outcome]] = [
            (OTHER_RENTER, "GET", f"/rentals/{rental}", NO_RENTAL),
            (OTHER_RENTER, "DELETE", f"/rentals/{rental}", NO_RENTAL),
            (OTHER_RENTER, "GET", f"/invoices/{world.document(RENTER)}", NO_INVOICE),
            (OTHER_PROVIDER, "GET", f"/hosts/{host}", NO_HOST),
            (OTHER_PROVIDER, "POST", f"/hosts/{host}/revoke", NO_HOST),
            (OTHER_PROVIDER, "GET", "/admin/ledger/trial-balance", FORBIDDEN),
            (RENTER, "GET", f"/rentals/{rental}", 200),
        ]
        for who, method, path, expected in cases:
            async with world.api.client.request(method, API + path, headers=signed[who]) as response:
                body = await response.json()
            assert Answer(response.status, body.get("code"), body).matches(expected), (who, method, path, body)


class TestListsHoldOnlyYourOwn:
    async def get(self, world: World, who: str, path: str, **params: str) -> dict[str, Any]:
        status, body = await world.api.call("GET", path, world.keys[who], params=params)
        assert status == 200, body
        assert isinstance(body, dict)
        return body

    async def test_rentals(self, world: World) -> None:
        """Each renter lists its own rentals only; providers have none; admins see all."""
        for who in (RENTER, OTHER_RENTER):
            body = await self.get(world, who, "/rentals")
            mine = [r["id"] for r in body["items"] if r["id"] not in world.cluster_members]
            assert (mine, body["total"]) == ([world.rentals[who]], 1 + (len(world.cluster_members) if who == RENTER else 0))
        assert (await self.get(world, PROVIDER, "/rentals"))["items"] == []
        assert {r["id"] for r in (await self.get(world, ADMIN, "/rentals"))["items"]} == set(world.rentals.values()) | world.cluster_members

    async def test_hosts_and_the_rentals_on_them(self, world: World) -> None:
        """A provider lists its own hosts; a renter every host, with only its own rentals among a host's active ones."""
        for who in (PROVIDER, OTHER_PROVIDER):
            body = await self.get(world, who, "/hosts")
            assert ([h["id"] for h in body["items"]], body["total"]) == ([world.hosts[who]], 1)
        shared = world.hosts[PROVIDER]
        for who in (RENTER, OTHER_RENTER):
            listed = {h["id"]: h for h in (await self.get(world, who, "/hosts"))["items"]}
            assert set(listed) == set(world.hosts.values())
            detail = await self.get(world, who, f"/hosts/{shared}")
            members = world.cluster_members if who == RENTER else frozenset()
            assert listed[shared]["active_rentals"] == detail["active_rentals"]
            assert set(detail["active_rentals"]) - members == {world.rentals[who]}
        for who in (PROVIDER, ADMIN):
            detail = await self.get(world, who, f"/hosts/{shared}")
            assert set(detail["active_rentals"]) - world.cluster_members == set(world.rentals.values())

    async def test_a_hosts_history_names_no_rental_to_renters(self, world: World) -> None:
        """Renters see a host's state changes without cause or actor, which name other renters' rentals; its provider sees them."""
        shared, rental = world.hosts[PROVIDER], world.rentals[RENTER]
        events = (await self.get(world, PROVIDER, f"/hosts/{shared}/events"))["items"]
        assert any(rental in (e["cause"] or "") for e in events), events
        for who in (RENTER, OTHER_RENTER):
            for events in ((await self.get(world, who, f"/hosts/{shared}/events"))["items"],
                           (await self.get(world, who, f"/hosts/{shared}"))["recent_events"]):  # fmt: skip
                assert events and all((e["cause"], e["actor"]) == (None, None) for e in events), events
                assert rental not in str(events)

    async def test_invoices_and_the_account_filter(self, world: World) -> None:
        """A renter lists its own invoices; naming another account is 404 ``account_not_found``, not a wider list."""
        for who in (RENTER, OTHER_RENTER):
            body = await self.get(world, who, "/invoices")
            assert [i["id"] for i in body["items"]] == [world.document(who)]
            own = await self.get(world, who, "/invoices", account_id=world.account(who))
            assert own["items"] == body["items"]
        for who, target in ((OTHER_RENTER, RENTER), (PROVIDER, RENTER), (RENTER, OTHER_PROVIDER)):
            status, body = await world.api.call("GET", "/invoices", world.keys[who], params={"account_id": world.account(target)})
            assert (status, body["code"]) == NO_ACCOUNT, body
        body = await self.get(world, ADMIN, "/invoices", account_id=world.account(OTHER_RENTER))
        assert [i["id"] for i in body["items"]] == [world.document(OTHER_RENTER)]

    async def test_alerts_and_the_host_filter(self, world: World) -> None:
        """A provider sees the alerts on its own hosts, none fleet-wide; naming another's host finds nothing."""
        for who, other in ((PROVIDER, OTHER_PROVIDER), (OTHER_PROVIDER, PROVIDER)):
            body = await self.get(world, who, "/alerts")
            assert ([a["id"] for a in body["items"]], body["total"]) == ([world.alerts[who]], 1)
            body = await self.get(world, who, "/alerts", host_id=world.hosts[other])
            assert (body["items"], body["total"]) == ([], 0)
        body = await self.get(world, ADMIN, "/alerts")
        assert {a["id"] for a in body["items"]} == set(world.alerts.values())
        body = await self.get(world, ADMIN, "/alerts", host_id=world.hosts[OTHER_PROVIDER])
        assert [a["id"] for a in body["items"]] == [world.alerts[OTHER_PROVIDER]]

    async def test_payouts_and_the_provider_filter(self, world: World) -> None:
        """A provider lists its own payouts; naming another provider finds nothing; admins filter by provider."""
        for who, other in ((PROVIDER, OTHER_PROVIDER), (OTHER_PROVIDER, PROVIDER)):
            body = await self.get(world, who, "/payouts")
            assert ([p["id"] for p in body["items"]], body["total"]) == ([world.payouts[who]], 1)
            assert (await self.get(world, who, "/payouts", provider_id=world.account(who)))["items"] == body["items"]
            body = await self.get(world, who, "/payouts", provider_id=world.account(other))
            assert (body["items"], body["total"]) == ([], 0)
        body = await self.get(world, ADMIN, "/payouts")
        assert {p["id"] for p in body["items"]} == set(world.payouts.values())
        body = await self.get(world, ADMIN, "/payouts", provider_id=world.account(OTHER_PROVIDER))
        assert [p["id"] for p in body["items"]] == [world.payouts[OTHER_PROVIDER]]

    async def test_ssh_keys(self, world: World) -> None:
        """Each account, admins included, lists its own SSH keys only."""
        for who in CALLERS:
            body = await self.get(world, who, "/account/ssh-keys")
            assert [k["id"] for k in body["ssh_keys"]] == [world.ssh_keys[who]]

    async def test_the_account_is_the_callers_own(self, world: World) -> None:
        """GET /account shows the caller's account; there is no way to name another."""
        for who in CALLERS:
            body = await self.get(world, who, "/account")
            assert (body["id"], body["role"]) == (world.account(who), ROLE[who])


class TestTeamDimension:
    """The matrix again, acting for a team (the ``Gpumarket-Team`` header) of which the first renter is the owner: on
    every private route a non-member is told the team does not exist (404 ``team_not_found``), and a member or a
    ``billing`` member is refused (403) every route its role there does not give — ``member``: no billing, ``billing``:
    no renting — before anything is read or written. What members may do is tests/test_teams.py's."""

    async def test_each_team_role_is_refused_what_it_may_not_do_and_a_stranger_everything(self, world: World) -> None:
        master = world.api.master
        async with master.db.session() as session:
            team = Account(id=new_id("team"), name="matrix team", role="renter", kind="team")
            session.add(team)
            await session.flush()
            session.add(TeamMember(team_id=team.id, account_id=world.account(RENTER), role="owner"))
        callers = {"stranger": world.keys[OTHER_RENTER]}
        for role in ("member", "billing"):
            person, callers[role] = await create_principal(master, f"team-{role}", "renter")
            async with master.db.session() as session:
                session.add(TeamMember(team_id=team.id, account_id=person.account_id, role=role))
        rights = {"member": {"read", "rent"}, "billing": {"read", "billing"}}
        routes = {(route.method, route.path): route for route in ROUTES}
        before = await snapshot(world)
        wrong, checked = [], {"stranger": 0, "member": 0, "billing": 0}
        for rule in MATRIX:
            route = routes[(rule.method, rule.path)]
            if route.public:
                continue
            for who, key in callers.items():
                if who == "stranger":
                    expected: Outcome = (404, "team_not_found")
                elif route.roles and "renter" not in route.roles:
                    expected = FORBIDDEN  # a team rents: provider and admin routes are refused it, as a renter
                elif route.needs not in rights[who]:
                    expected = (403, "team_role_forbids")
                else:
                    continue
                checked[who] += 1
                answer = await call(world, rule, {**bearer(key), TEAM_HEADER: team.id}, RENTER)
                if not answer.matches(expected):
                    wrong.append(f"{rule} as the team's {who}: expected {expected}, got {answer.status} {answer.code}")
        assert wrong == [], "\n".join(wrong)
        assert changed_tables(before, await snapshot(world)) == []
        assert checked["member"] >= 5 and checked["billing"] >= 20 and checked["stranger"] > 80, checked


class TestUnversionedRoutes:
    async def test_metrics_take_the_metrics_token_not_an_api_key(self, world: World) -> None:
        """With metrics_token set, /metrics refuses no token and an admin's API key (401); the token opens it."""
        world.api.master.settings.metrics_token = "scrape-token"
        client = world.api.client
        for headers, expected in (({}, "missing_metrics_token"), (bearer(world.keys[ADMIN]), "invalid_metrics_token")):
            async with client.get("/metrics", headers=headers) as response:
                assert (response.status, (await response.json())["code"]) == (401, expected)
        async with client.get("/metrics", headers=bearer("scrape-token")) as response:
            assert response.status == 200

    async def test_metrics_are_closed_without_a_metrics_token(self, world: World) -> None:
        """Without metrics_token, /metrics refuses everyone, an admin's API key too (401 metrics_token_unset), unless
        the operator opened it on purpose (metrics_open). Issue 39: it answered anyone and listed service ids."""
        world.api.master.settings.metrics_token = None
        client = world.api.client
        for headers in ({}, bearer(world.keys[ADMIN]), bearer("scrape-token")):
            async with client.get("/metrics", headers=headers) as response:
                assert (response.status, (await response.json())["code"]) == (401, "metrics_token_unset")
        world.api.master.settings.metrics_open = True
        async with client.get("/metrics") as response:
            assert response.status == 200
