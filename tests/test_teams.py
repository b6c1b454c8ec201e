"""Teams: a person makes one, invites teammates by mail, and they rent, pay and see together, each within a role.

Real aiohttp app on SQLite and PostgreSQL (the ``api`` fixture) and a real SMTP server on loopback (``MailSink``):
invitations are read from the mails as a person would. People are accounts with a verified address; a call acts for
the team with the ``Gpumarket-Team`` header, or with an API key made in the team's context.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from billing import credits
from gpumarket.mailsink import MailSink
from master.api.base import API
from master.models import Account, AuditEvent, Rental, SshKey, TeamInvitation, TeamMember
from master.services.accounts import TEAM_HEADER
from tests.apiclient import Api, assert_error, bearer
from tests.factories import create_principal
from tests.test_ssh_keys import ed25519_line

pytestmark = pytest.mark.usefixtures("sink")


@dataclass
class Person:
    account_id: str
    key: str
    email: str


async def person(api: Api, name: str) -> Person:
    """An account with a verified address, as sign-up and the mailed link leave it, and a key of every scope."""
    principal, key = await create_principal(api.master, name, "renter")
    email = f"{name}@example.com"
    async with api.master.db.session() as session:
        await session.execute(
            update(Account)
            .where(Account.id == principal.account_id)
            .values(email=email, email_verified_at=api.master.clock.now())
        )
    return Person(principal.account_id, key, email)


def team(team_id: str) -> dict[str, str]:
    return {TEAM_HEADER: team_id}


async def ok(api: Api, method: str, path: str, key: str, expected: int = 200, **kwargs: Any) -> Any:
    status, body = await api.call(method, path, key, **kwargs)
    assert status == expected, body
    return body


async def invite(api: Api, sink: MailSink, team_id: str, by: Person, who: Person, role: str) -> str:
    before = len(sink.messages)
    await ok(
        api, "POST", f"/teams/{team_id}/invitations", by.key, 201, json={"email": who.email, "role": role}
    )
    mail = await sink.wait_for(who.email, after=before)
    [link] = [link for link in mail.links() if "/#/invite/" in link]
    assert link.startswith("http://console.test/#/invite/")
    return link.rsplit("/", 1)[1]


async def join(api: Api, sink: MailSink, team_id: str, by: Person, who: Person, role: str) -> None:
    token = await invite(api, sink, team_id, by, who, role)
    joined = await ok(api, "POST", "/team-invitations/accept", who.key, json={"token": token})
    assert joined == {"id": team_id, "name": joined["name"], "kind": joined["kind"], "role": role}


@dataclass
class Crew:
    owner: Person
    member: Person
    billing: Person
    stranger: Person
    team_id: str


@pytest.fixture
async def crew(api: Api, sink: MailSink) -> Crew:
    owner, member, billing, stranger = [await person(api, name) for name in ("olga", "mo", "bill", "stan")]
    made = await ok(api, "POST", "/teams", owner.key, 201, json={"name": "Acme ML"})
    assert made["role"] == "owner" and [m["account_id"] for m in made["members"]] == [owner.account_id]
    await join(api, sink, made["id"], owner, member, "member")
    await join(api, sink, made["id"], owner, billing, "billing")
    return Crew(owner, member, billing, stranger, made["id"])


class TestMembership:
    async def test_members_list_their_teams_and_see_the_members(self, api: Api, crew: Crew) -> None:
        listed = await ok(api, "GET", "/teams", crew.member.key)
        assert listed["items"] == [{"id": crew.team_id, "name": "Acme ML", "kind": "renter", "role": "member", "members": 3,
                                    "created_at": listed["items"][0]["created_at"]}]  # fmt: skip
        view = await ok(api, "GET", f"/teams/{crew.team_id}", crew.member.key)
        assert {m["email"]: m["role"] for m in view["members"]} == {"olga@example.com": "owner", "mo@example.com": "member",
                                                                    "bill@example.com": "billing"}  # fmt: skip
        assert "invitations" not in view  # a member does not manage
        assert (await ok(api, "GET", f"/teams/{crew.team_id}", crew.owner.key))["invitations"] == []
        assert (await ok(api, "GET", "/teams", crew.stranger.key))["items"] == []

    async def test_a_stranger_gets_404_for_the_team_however_it_asks(self, api: Api, crew: Crew) -> None:
        for method, path, extra in (("GET", f"/teams/{crew.team_id}", {}), ("GET", "/rentals", {"headers": team(crew.team_id)}),
                                    ("GET", "/teams/team-0000000000000000", {})):  # fmt: skip
            assert_error(*await api.call(method, path, crew.stranger.key, **extra), 404, "team_not_found")
        status, body = await api.call("POST", f"/teams/{crew.team_id}/invitations", crew.stranger.key,
                                      json={"email": "x@example.com", "role": "owner"})  # fmt: skip
        assert_error(status, body, 404, "team_not_found")
        assert_error(
            *await api.call("GET", "/rentals", crew.stranger.key, headers={TEAM_HEADER: "t" * 41}),
            400,
            "invalid_team",
        )

    async def test_an_invitation_is_for_its_address_only_and_works_once(
        self, api: Api, sink: MailSink, crew: Crew
    ) -> None:
        other = await person(api, "otto")
        token = await invite(api, sink, crew.team_id, crew.owner, other, "member")
        status, body = await api.call(
            "POST", "/team-invitations/accept", crew.stranger.key, json={"token": token}
        )
        assert_error(status, body, 403, "invitation_for_another_address")
        assert "otto@example.com" in body["message"]
        await ok(api, "POST", "/team-invitations/accept", other.key, json={"token": token})
        assert_error(
            *await api.call("POST", "/team-invitations/accept", other.key, json={"token": token}),
            400,
            "invalid_invitation",
        )
        assert_error(
            *await api.call("POST", "/team-invitations/accept", other.key, json={"token": "forged"}),
            400,
            "invalid_invitation",
        )

    async def test_a_new_invitation_replaces_the_open_one_and_a_withdrawn_one_stops(
        self, api: Api, sink: MailSink, crew: Crew
    ) -> None:
        other = await person(api, "otto")
        first = await invite(api, sink, crew.team_id, crew.owner, other, "member")
        second = await invite(api, sink, crew.team_id, crew.owner, other, "admin")
        assert_error(
            *await api.call("POST", "/team-invitations/accept", other.key, json={"token": first}),
            400,
            "invalid_invitation",
        )
        [open_one] = (await ok(api, "GET", f"/teams/{crew.team_id}", crew.owner.key))["invitations"]
        assert open_one["email"] == other.email and open_one["role"] == "admin"
        await ok(api, "DELETE", f"/teams/{crew.team_id}/invitations/{open_one['id']}", crew.owner.key)
        assert_error(
            *await api.call("POST", "/team-invitations/accept", other.key, json={"token": second}),
            400,
            "invalid_invitation",
        )
        assert (await ok(api, "GET", "/teams", other.key))["items"] == []

    async def test_an_expired_invitation_does_not_work(self, api: Api, sink: MailSink, crew: Crew) -> None:
        other = await person(api, "otto")
        token = await invite(api, sink, crew.team_id, crew.owner, other, "member")
        async with api.master.db.session() as session:
            await session.execute(
                update(TeamInvitation).values(expires_at=api.master.clock.now() - timedelta(seconds=1))
            )
        assert_error(
            *await api.call("POST", "/team-invitations/accept", other.key, json={"token": token}),
            400,
            "invalid_invitation",
        )

    async def test_only_owners_and_admins_invite_and_only_owners_make_owners(
        self, api: Api, sink: MailSink, crew: Crew
    ) -> None:
        status, body = await api.call("POST", f"/teams/{crew.team_id}/invitations", crew.member.key,
                                      json={"email": "x@example.com", "role": "member"})  # fmt: skip
        assert_error(status, body, 403, "team_role_forbids")
        await ok(
            api,
            "PATCH",
            f"/teams/{crew.team_id}/members/{crew.member.account_id}",
            crew.owner.key,
            json={"role": "admin"},
        )
        status, body = await api.call("POST", f"/teams/{crew.team_id}/invitations", crew.member.key,
                                      json={"email": "x@example.com", "role": "owner"})  # fmt: skip
        assert_error(status, body, 403, "team_role_forbids")
        status, body = await api.call("PATCH", f"/teams/{crew.team_id}/members/{crew.owner.account_id}", crew.member.key,
                                      json={"role": "member"})  # fmt: skip
        assert_error(status, body, 403, "team_role_forbids")
        await ok(
            api,
            "POST",
            f"/teams/{crew.team_id}/invitations",
            crew.member.key,
            201,
            json={"email": "x@example.com", "role": "billing"},
        )

    async def test_the_team_keeps_an_owner(self, api: Api, crew: Crew) -> None:
        for method, body in (("PATCH", {"role": "admin"}), ("DELETE", None)):
            status, answer = await api.call(
                method, f"/teams/{crew.team_id}/members/{crew.owner.account_id}", crew.owner.key, json=body
            )
            assert_error(status, answer, 409, "last_owner")
        await ok(
            api,
            "PATCH",
            f"/teams/{crew.team_id}/members/{crew.member.account_id}",
            crew.owner.key,
            json={"role": "owner"},
        )
        await ok(
            api, "DELETE", f"/teams/{crew.team_id}/members/{crew.owner.account_id}", crew.owner.key
        )  # leaves
        assert_error(*await api.call("GET", f"/teams/{crew.team_id}", crew.owner.key), 404, "team_not_found")

    async def test_a_team_name_is_checked_and_unique(self, api: Api, crew: Crew) -> None:
        assert_error(
            *await api.call("POST", "/teams", crew.stranger.key, json={"name": "Acme ML"}),
            409,
            "team_name_taken",
        )
        for bad in ("acme\n", " acme", "acme\x00", "аcme"):  # the last one's first letter is Cyrillic
            assert_error(
                *await api.call("POST", "/teams", crew.stranger.key, json={"name": bad}),
                400 if "\x00" in bad else 422,  # NUL: the body reader's invalid_character (master/api/characters.py)
                "invalid_character" if "\x00" in bad else "validation_failed",
            )
        status, body = await api.call(
            "POST", "/teams", crew.owner.key, json={"name": "Nested"}, headers=team(crew.team_id)
        )
        assert_error(status, body, 422, "validation_failed")


class TestActingForTheTeam:
    async def test_the_team_rents_on_its_own_credit_and_every_member_sees_its_rentals(
        self, api: Api, crew: Crew
    ) -> None:
        api.master.settings.require_credit = True
        await api.host(1)
        rent = {"gpu_count": 1}
        assert_error(
            *await api.call("POST", "/rentals", crew.member.key, json=rent, headers=team(crew.team_id)),
            402,
            "insufficient_credit",
        )
        async with api.master.db.session() as session:
            await credits.top_up(
                session, crew.team_id, "50.00", reference="team-setup", at=api.master.clock.now()
            )
        rental = await ok(
            api, "POST", "/rentals", crew.member.key, 201, json=rent, headers=team(crew.team_id)
        )
        async with api.master.db.session() as session:
            assert (await session.get(Rental, rental["id"])).renter_id == crew.team_id  # type: ignore[union-attr]
        for who in (crew.owner, crew.member, crew.billing):
            listed = await ok(api, "GET", "/rentals", who.key, headers=team(crew.team_id))
            assert [r["id"] for r in listed["items"]] == [rental["id"]]
            await ok(api, "GET", f"/rentals/{rental['id']}", who.key, headers=team(crew.team_id))
            # In their own context, their own rentals only.
            assert (await ok(api, "GET", "/rentals", who.key))["items"] == []
            assert_error(*await api.call("GET", f"/rentals/{rental['id']}", who.key), 404, "rental_not_found")
        assert_error(
            *await api.call("GET", f"/rentals/{rental['id']}", crew.stranger.key), 404, "rental_not_found"
        )
        account = await ok(api, "GET", "/account", crew.billing.key, headers=team(crew.team_id))
        assert (account["id"], account["name"], account["kind"]) == (crew.team_id, "Acme ML", "team")
        assert (account["person_id"], account["team_role"]) == (crew.billing.account_id, "billing")

    async def test_a_billing_member_pays_and_reads_but_cannot_rent(self, api: Api, crew: Crew) -> None:
        await api.host(1)
        status, body = await api.call(
            "POST", "/rentals", crew.billing.key, json={"gpu_count": 1}, headers=team(crew.team_id)
        )
        assert_error(status, body, 403, "team_role_forbids")
        assert "billing" in body["message"]
        await ok(
            api,
            "PUT",
            "/account/spend-cap",
            crew.billing.key,
            json={"monthly_spend_cap": "25.00"},
            headers=team(crew.team_id),
        )
        async with api.master.db.session() as session:
            assert str((await session.get(Account, crew.team_id)).monthly_spend_cap) == "25.00"  # type: ignore[union-attr]
            assert (await session.get(Account, crew.billing.account_id)).monthly_spend_cap is None  # type: ignore[union-attr]
        status, body = await api.call("PUT", "/account/spend-cap", crew.member.key, json={"monthly_spend_cap": "1.00"},
                                      headers=team(crew.team_id))  # fmt: skip
        assert_error(status, body, 403, "team_role_forbids")
        assert_error(
            *await api.call("GET", "/audit-events", crew.billing.key, headers=team(crew.team_id)),
            403,
            "team_role_forbids",
        )

    async def test_a_key_made_for_the_team_acts_for_it_only_and_within_the_role(
        self, api: Api, crew: Crew
    ) -> None:
        other = await ok(api, "POST", "/teams", crew.member.key, 201, json={"name": "Side project"})
        made = await ok(
            api, "POST", "/api-keys", crew.member.key, 201, json={"name": "ci"}, headers=team(crew.team_id)
        )
        assert made["team_id"] == crew.team_id and made["scopes"] == ["read", "rent"]  # a member's rights
        assert (await ok(api, "GET", "/account", made["key"]))["id"] == crew.team_id
        status, body = await api.call("GET", "/rentals", made["key"], headers=team(other["id"]))
        assert_error(status, body, 403, "team_mismatch")
        assert_error(
            *await api.call("PUT", "/account/spend-cap", made["key"], json={"monthly_spend_cap": "1.00"}),
            403,
            "team_role_forbids",
        )
        status, body = await api.call("POST", "/api-keys", crew.billing.key, json={"name": "x", "scopes": ["rent"]},
                                      headers=team(crew.team_id))  # fmt: skip
        assert_error(status, body, 403, "scope_missing")

    async def test_removing_a_member_takes_back_their_ssh_keys_and_team_keys(
        self, api: Api, crew: Crew
    ) -> None:
        added = await ok(api, "POST", "/account/ssh-keys", crew.member.key, 201, json={"public_key": ed25519_line(), "name": "mo's laptop"},
                         headers=team(crew.team_id))  # fmt: skip
        made = await ok(
            api, "POST", "/api-keys", crew.member.key, 201, json={"name": "ci"}, headers=team(crew.team_id)
        )
        async with api.master.db.session() as session:
            row = await session.get(SshKey, added["id"])
            assert (
                row is not None and row.account_id == crew.team_id and row.added_by == crew.member.account_id
            )
        listed = await ok(api, "GET", "/account/ssh-keys", crew.owner.key, headers=team(crew.team_id))
        assert [k["id"] for k in listed["ssh_keys"]] == [added["id"]]
        await ok(api, "DELETE", f"/teams/{crew.team_id}/members/{crew.member.account_id}", crew.owner.key)
        async with api.master.db.session() as session:
            assert await session.get(SshKey, added["id"]) is None
        assert_error(*await api.call("GET", "/rentals", made["key"]), 401, "invalid_api_key")
        assert_error(
            *await api.call("GET", "/rentals", crew.member.key, headers=team(crew.team_id)),
            404,
            "team_not_found",
        )
        assert (await ok(api, "GET", "/rentals", crew.member.key))[
            "items"
        ] == []  # their own account is untouched

    async def test_the_team_log_says_who_joined_left_and_changed(self, api: Api, crew: Crew) -> None:
        await ok(
            api,
            "PATCH",
            f"/teams/{crew.team_id}/members/{crew.billing.account_id}",
            crew.owner.key,
            json={"role": "member"},
        )
        await ok(
            api, "DELETE", f"/teams/{crew.team_id}/members/{crew.billing.account_id}", crew.billing.key
        )  # leaves
        log = await ok(api, "GET", "/audit-events", crew.owner.key, headers=team(crew.team_id))
        kinds = [item["kind"] for item in reversed(log["items"])]
        assert kinds == ["team_created", "member_invited", "member_added", "member_invited", "member_added",
                         "member_role_changed", "member_removed"]  # fmt: skip
        async with api.master.db.session() as session:
            details = (
                await session.scalars(select(AuditEvent.detail).where(AuditEvent.account_id == crew.team_id))
            ).all()
        assert all("token" not in str(detail) for detail in details)
        assert (await ok(api, "GET", "/audit-events", crew.owner.key))[
            "items"
        ] == []  # the person's own log is apart


class TestProviderTeams:
    async def test_a_provider_team_enrols_hosts_for_its_members_and_not_for_its_billing_member(
        self, api: Api, sink: MailSink, crew: Crew
    ) -> None:
        made = await ok(api, "POST", "/teams", crew.owner.key, 201, json={"name": "Acme Hosts", "kind": "provider"})
        assert made["kind"] == "provider"
        await join(api, sink, made["id"], crew.owner, crew.member, "member")
        await join(api, sink, made["id"], crew.owner, crew.billing, "billing")
        token = await ok(api, "POST", "/enrollment-tokens", crew.member.key, 201, headers=team(made["id"]))
        assert token["token"]
        status, body = await api.call("POST", "/enrollment-tokens", crew.billing.key, headers=team(made["id"]))
        assert_error(status, body, 403, "team_role_forbids")
        # The renter team lists no hosts, and the provider team rents nothing: the route's role decides first.
        assert_error(*await api.call("POST", "/enrollment-tokens", crew.member.key, headers=team(crew.team_id)), 403, "forbidden")
        status, body = await api.call("POST", "/rentals", crew.member.key, json={"gpu_count": 1}, headers=team(made["id"]))
        assert_error(status, body, 403, "forbidden")

    async def test_signing_up_as_both_makes_a_renter_with_a_provider_team(self, api: Api, sink: MailSink) -> None:
        before = len(sink.messages)
        status, body = await api.call("POST", "/accounts", None, json={"email": "Both@Example.com", "password": "correct horse battery staple",
                                                                         "role": "both"})  # fmt: skip
        assert status == 202, body
        await sink.wait_for("both@example.com", after=before)
        async with api.master.db.session() as session:
            person = await session.scalar(select(Account).where(Account.email == "both@example.com"))
            assert person is not None and person.role == "renter"
            hosts = await session.scalar(select(Account).where(Account.name == "both@example.com hosts"))
            assert hosts is not None and (hosts.kind, hosts.role) == ("team", "provider")
            member = await session.get(TeamMember, (hosts.id, person.id))
            assert member is not None and member.role == "owner"


class TestTheBrowsersStream:
    async def test_the_metrics_stream_takes_the_team_in_its_query_and_only_it(self, api: Api, crew: Crew) -> None:
        """An EventSource sends no header: the one streaming route names the team in ``?team=``, checked as the header is."""
        api.master.settings.stream_max_s = 0.05
        host, _ = await api.host(1)
        path = f"/hosts/{host}/metrics/stream"
        async with api.client.get(API + path, params={"team": crew.team_id}, headers=bearer(crew.member.key)) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            await response.read()
        async with api.client.get(API + path, params={"team": crew.team_id}, headers=bearer(crew.stranger.key)) as response:
            assert (response.status, (await response.json())["code"]) == (404, "team_not_found")
        status, body = await api.call("GET", "/rentals", crew.member.key, params={"team": crew.team_id})
        assert_error(status, body, 400, "unknown_parameter")
