"""What the web console stands on: cookie sessions with CSRF tokens, the live telemetry stream, money in the views.

Real aiohttp app, real SQLite and PostgreSQL (the ``api`` fixture); the browser's side is an
aiohttp client with a cookie jar, which keeps and sends cookies as a browser does.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import aiohttp
import pytest
from sqlalchemy import select, update

from billing.payouts import payout_pass
from billing.rating import rate_open_rentals
from master.api.base import API
from master.models import ApiKey, Rental
from master.services.accounts.sessions import COOKIE, CSRF_HEADER
from master.telemetry import hosts
from tests.apiclient import Api, assert_error
from tests.factories import MS, create_principal, envelope, gpu_info, online_host, telemetry
from tests.helpers import ManualClock
from tests.test_billing import POLICY, charges, make_rental


async def sign_in(api: Api, key: str) -> dict[str, Any]:
    """Sign the test client (its cookie jar) in with ``key``; returns the session body."""
    async with api.client.post(API + "/sessions", json={"api_key": key}) as response:
        assert response.status == 201, await response.text()
        body: dict[str, Any] = await response.json()
        return body


async def call(api: Api, method: str, path: str, *, csrf: str | None = None, **kwargs: Any) -> tuple[int, Any]:
    """A call that carries only what a browser would: the cookie jar, and the CSRF header if given."""
    headers = {CSRF_HEADER: csrf} if csrf is not None else {}
    async with api.client.request(method, API + path, headers=headers, **kwargs) as response:
        return response.status, await response.json()


class TestSignIn:
    async def test_sign_in_sets_an_http_only_strict_cookie_that_is_not_the_key(self, api: Api) -> None:
        """Signing in answers the account and a CSRF token, and sets an HttpOnly, SameSite=Strict cookie holding a fresh token."""
        async with api.client.post(API + "/sessions", json={"api_key": api.renter_key}) as response:
            assert response.status == 201
            body = await response.json()
            cookie = response.cookies[COOKIE]
        assert body["account"] == {"id": api.renter.account_id, "name": api.renter.name, "role": "renter", "email_verified": True}
        assert len(body["csrf_token"]) >= 32
        assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/"
        assert not cookie["secure"]  # plain http on loopback; https or an https public_url makes it Secure
        assert cookie.value != api.renter_key and api.renter_key not in cookie.value
        status, account = await call(api, "GET", "/account")
        assert (status, account["id"]) == (200, api.renter.account_id)

    async def test_the_cookie_is_secure_behind_an_https_public_url(self, api: Api) -> None:
        """With an https public URL the cookie is marked Secure."""
        api.master.settings.public_url = "https://console.example"
        async with api.client.post(API + "/sessions", json={"api_key": api.provider_key}) as response:
            assert response.status == 201
            assert response.cookies[COOKIE]["secure"]

    async def test_a_wrong_key_is_refused_and_sets_no_cookie(self, api: Api) -> None:
        """An unknown API key is 401 invalid_api_key, and no session comes of it."""
        async with api.client.post(API + "/sessions", json={"api_key": "gmk_not-a-real-key-at-all"}) as response:
            assert_error(response.status, await response.json(), 401, "invalid_api_key")
            assert COOKIE not in response.cookies
        status, body = await call(api, "GET", "/sessions/current")
        assert_error(status, body, 401, "not_signed_in")
        async with api.client.post(API + "/sessions", json={"api_key": "short"}) as response:
            assert_error(response.status, await response.json(), 401, "invalid_api_key")

    async def test_sign_in_takes_a_json_body_only(self, api: Api) -> None:
        """A form post (what a cross-site page could send) is 415: nobody can sign a browser in behind its back."""
        async with api.client.post(API + "/sessions", data={"api_key": api.renter_key}) as response:
            assert_error(response.status, await response.json(), 415, "unsupported_media_type")
            assert COOKIE not in response.cookies

    async def test_current_session_answers_the_same_csrf_token(self, api: Api) -> None:
        """GET /sessions/current gives the page its CSRF token again (after a reload)."""
        session = await sign_in(api, api.renter_key)
        status, current = await call(api, "GET", "/sessions/current")
        assert status == 200
        assert current["csrf_token"] == session["csrf_token"] and current["account"]["role"] == "renter"

    async def test_an_api_key_call_has_no_console_session(self, api: Api) -> None:
        """With a bearer key, /sessions/current is 404 no_session (API clients keep working as before)."""
        status, body = await api.as_renter("GET", "/sessions/current")
        assert_error(status, body, 404, "no_session")

    async def test_a_forged_cookie_is_refused(self, api: Api) -> None:
        """A cookie that is no session's token is 401 not_signed_in."""
        api.client.session.cookie_jar.update_cookies({COOKIE: "forged-token-value"})
        status, body = await call(api, "GET", "/account")
        assert_error(status, body, 401, "not_signed_in")


class TestCsrf:
    async def test_a_change_without_the_csrf_token_is_refused_and_changes_nothing(self, api: Api) -> None:
        """A cookie-authenticated PUT without X-CSRF-Token, or with a wrong one, is 403 csrf_failed and sets nothing."""
        session = await sign_in(api, api.renter_key)
        for csrf in (None, "wrong-token"):
            status, body = await call(api, "PUT", "/account/spend-cap", csrf=csrf, json={"monthly_spend_cap": "50.00"})
            assert_error(status, body, 403, "csrf_failed")
        _, account = await call(api, "GET", "/account")
        assert account["credit"]["monthly_spend_cap"] is None
        status, body = await call(api, "PUT", "/account/spend-cap", csrf=session["csrf_token"], json={"monthly_spend_cap": "50.00"})
        assert (status, body["monthly_spend_cap"]) == (200, "50.00")

    async def test_a_rental_needs_the_csrf_token_too(self, api: Api) -> None:
        """POST /rentals through the cookie without the token creates no rental; with it, one."""
        await api.host(1)
        session = await sign_in(api, api.renter_key)
        status, body = await call(api, "POST", "/rentals", json={"gpu_count": 1})
        assert_error(status, body, 403, "csrf_failed")
        assert await api.count(Rental) == 0
        status, body = await call(api, "POST", "/rentals", csrf=session["csrf_token"], json={"gpu_count": 1})
        assert status == 201, body
        assert await api.count(Rental) == 1

    async def test_another_sessions_token_does_not_do(self, api: Api) -> None:
        """The CSRF token is per session: the provider's token does not authorize the renter's session."""
        provider_session = await sign_in(api, api.provider_key)
        await sign_in(api, api.renter_key)  # the jar now holds the renter's cookie
        status, body = await call(api, "PUT", "/account/spend-cap", csrf=provider_session["csrf_token"], json={"monthly_spend_cap": "5.00"})
        assert_error(status, body, 403, "csrf_failed")


class TestSessionEnd:
    async def test_sign_out_ends_the_session_and_clears_the_cookie(self, api: Api) -> None:
        """DELETE /sessions/current (with the token) ends the session: the old cookie is refused afterwards."""
        session = await sign_in(api, api.renter_key)
        token = api.client.session.cookie_jar.filter_cookies(api.client.make_url("/"))[COOKIE].value
        status, _ = await call(api, "DELETE", "/sessions/current")
        assert status == 403  # sign-out is a change too
        async with api.client.delete(API + "/sessions/current", headers={CSRF_HEADER: session["csrf_token"]}) as response:
            assert response.status == 200
            assert response.cookies[COOKIE].value == ""
        api.client.session.cookie_jar.update_cookies({COOKIE: token})  # a copy kept by someone
        status, body = await call(api, "GET", "/account")
        assert_error(status, body, 401, "not_signed_in")

    async def test_a_session_expires_after_idle_time_and_at_its_end(self, api: Api) -> None:
        """A session idle for console_session_idle_s, or older than console_session_max_s, is 401 session_expired."""
        clock = ManualClock(datetime.now(UTC))
        api.master.clock = clock
        api.master.settings.console_session_idle_s = 600
        api.master.settings.console_session_max_s = 3600
        await sign_in(api, api.renter_key)
        for _ in range(6):  # active every 9 minutes: never idle for 10, but the hour runs out
            clock.advance(540)
            status, _ = await call(api, "GET", "/account")
            assert status == 200
        clock.advance(540)  # 63 minutes after signing in
        status, body = await call(api, "GET", "/account")
        assert_error(status, body, 401, "session_expired")
        await sign_in(api, api.renter_key)
        clock.advance(601)
        status, body = await call(api, "GET", "/account")
        assert_error(status, body, 401, "session_expired")
        assert "sign in again" in body["message"]

    async def test_revoking_the_api_key_ends_its_sessions(self, api: Api) -> None:
        """A session opened with a key ends when that key is revoked."""
        await sign_in(api, api.renter_key)
        async with api.master.db.session() as session:
            await session.execute(update(ApiKey).where(ApiKey.account_id == api.renter.account_id).values(revoked_at=datetime.now(UTC)))
        status, body = await call(api, "GET", "/account")
        assert_error(status, body, 401, "session_expired")


async def read_events(response: aiohttp.ClientResponse, count: int) -> list[tuple[str, str, dict[str, Any]]]:
    """The next ``count`` Server-Sent Events as (id, event, data)."""
    events: list[tuple[str, str, dict[str, Any]]] = []
    fields: dict[str, str] = {}
    async with asyncio.timeout(10):
        while len(events) < count:
            line = (await response.content.readline()).decode().rstrip("\n")
            if line == "" and "data" in fields:
                events.append((fields.get("id", ""), fields.get("event", "message"), json.loads(fields["data"])))
                fields = {}
            elif line and not line.startswith(":"):
                name, _, value = line.partition(": ")
                fields[name] = value
    return events


class TestTelemetryStream:
    async def feed(self, api: Api, host_id: str, gpus: list[Any], seqs: range) -> None:
        async with api.master.db.session() as session:
            for seq in seqs:
                await hosts.handle_telemetry(session, envelope(telemetry(host_id, seq, gpus)))

    async def test_stream_sends_the_recent_samples_then_each_new_one(self, api: Api) -> None:
        """The stream replays the newest `backlog` samples in order, then pushes samples stored later, with their seq as id."""
        api.master.settings.stream_poll_interval = 20 * MS
        gpus = [gpu_info(0), gpu_info(1)]
        host_id = await online_host(api.master, api.provider, gpus)
        await self.feed(api, host_id, gpus, range(1, 6))
        path = f"{API}/hosts/{host_id}/metrics/stream?backlog=3"
        async with api.client.get(path, headers={"Authorization": f"Bearer {api.renter_key}"}) as response:
            assert response.status == 200 and response.content_type == "text/event-stream"
            first = await read_events(response, 3)
            assert [(e[0], e[1], e[2]["seq"]) for e in first] == [("3", "sample", 3), ("4", "sample", 4), ("5", "sample", 5)]
            assert [g["uuid"] for g in first[0][2]["gpus"]] == [gpus[0].uuid, gpus[1].uuid]
            await self.feed(api, host_id, gpus, range(6, 8))
            later = await read_events(response, 2)
            assert [e[2]["seq"] for e in later] == [6, 7]
            assert later[0][2]["gpus"][0]["gpu_util_pct"] == 6.0

    async def test_stream_resumes_after_last_event_id(self, api: Api) -> None:
        """A reconnecting EventSource (Last-Event-ID) gets only what it missed."""
        gpus = [gpu_info(0)]
        host_id = await online_host(api.master, api.provider, gpus)
        await self.feed(api, host_id, gpus, range(1, 9))
        headers = {"Authorization": f"Bearer {api.provider_key}", "Last-Event-ID": "6"}
        async with api.client.get(f"{API}/hosts/{host_id}/metrics/stream", headers=headers) as response:
            assert [e[2]["seq"] for e in await read_events(response, 2)] == [7, 8]

    async def test_stream_ends_after_its_time_and_works_through_the_cookie(self, api: Api) -> None:
        """The console's EventSource is authorized by the cookie (a GET needs no CSRF token); the stream closes after stream_max_s."""
        api.master.settings.stream_poll_interval = 20 * MS
        api.master.settings.stream_max_s = 0.2
        gpus = [gpu_info(0)]
        host_id = await online_host(api.master, api.provider, gpus)
        await self.feed(api, host_id, gpus, range(1, 3))
        await sign_in(api, api.renter_key)
        async with api.client.get(f"{API}/hosts/{host_id}/metrics/stream") as response:
            assert response.status == 200
            async with asyncio.timeout(10):
                text = (await response.read()).decode()
        assert text.startswith("retry: ") and text.count("event: sample") == 2

    @pytest.mark.parametrize("ending", ["sign_out", "idle", "key_revoked"])
    async def test_a_stream_ends_when_its_console_session_does(self, api: Api, ending: str) -> None:
        """Regression (issue 21): a live stream stayed open after its session signed out. It now ends at its next
        poll once the session is over (signed out, idle too long, its key revoked) and sends nothing stored after."""
        clock = ManualClock(datetime.now(UTC))
        api.master.clock = clock
        settings = api.master.settings
        settings.stream_poll_interval, settings.stream_max_s = 20 * MS, 86400  # only the session can end it here
        settings.console_session_idle_s = 600
        gpus = [gpu_info(0)]
        host_id = await online_host(api.master, api.provider, gpus)
        await self.feed(api, host_id, gpus, range(1, 3))
        session = await sign_in(api, api.renter_key)
        async with api.client.get(f"{API}/hosts/{host_id}/metrics/stream") as response:
            assert [e[2]["seq"] for e in await read_events(response, 2)] == [1, 2]
            await self.feed(api, host_id, gpus, range(3, 4))
            assert [e[2]["seq"] for e in await read_events(response, 1)] == [3]  # live, polling with the session checked
            if ending == "sign_out":
                status, _ = await call(api, "DELETE", "/sessions/current", csrf=session["csrf_token"])
                assert status == 200
            elif ending == "idle":
                clock.advance(601)
            else:
                async with api.master.db.session() as db:
                    await db.execute(update(ApiKey).where(ApiKey.account_id == api.renter.account_id).values(revoked_at=clock.now()))
            await self.feed(api, host_id, gpus, range(4, 6))
            async with asyncio.timeout(10):  # generous: the stream ends at its next poll, 20 ms away
                rest = (await response.read()).decode()
        assert "event: sample" not in rest

    async def test_another_providers_host_is_not_found(self, api: Api) -> None:
        """A provider cannot watch another provider's host: 404, as for a host that does not exist."""
        host_id, _ = await api.host(1)
        _, other_key = await create_principal(api.master, "provider-2", "provider")
        for target in (host_id, "h-does-not-exist"):
            status, body = await api.call("GET", f"/hosts/{target}/metrics/stream", other_key)
            assert_error(status, body, 404, "host_not_found")


class TestMoneyInViews:
    async def test_rentals_show_their_price_per_hour_and_what_they_charged(self, api: Api) -> None:
        """A rated rental's view says what it charged the renter; a share costs its part of the GPU price per hour."""
        host_id, _ = await api.host(2)
        now = datetime.now(UTC)
        whole = await make_rental(api, host_id, price="0.60", start=now - timedelta(hours=1), end=now, gpus=2)
        share = await make_rental(api, host_id, price="0.60", start=now - timedelta(minutes=30), end=now, milli=250)
        status, body = await api.as_renter("GET", f"/rentals/{whole}")
        assert (status, body["price_per_hour"], body["charged"]) == (200, "1.200000", "0.000000")
        await rate_open_rentals(api.master.db, now=now, policy=POLICY)
        _, body = await api.as_renter("GET", f"/rentals/{whole}")
        assert body["charged"] == "1.200000"  # 2 GPUs × 0.60 × 1 h
        _, listed = await api.as_renter("GET", "/rentals")
        by_id = {r["id"]: r for r in listed["items"]}
        assert (by_id[share]["price_per_hour"], by_id[share]["charged"]) == ("0.150000", "0.075000")

    async def test_hosts_show_tier_rentals_and_earnings_to_their_provider(self, api: Api) -> None:
        """The provider sees each host's earnings after the fee and its active rentals; renters see no earnings."""
        host_id, _ = await api.host(1)
        now = datetime.now(UTC)
        done = await make_rental(api, host_id, price="1.00", start=now - timedelta(hours=2), end=now)
        running = await make_rental(api, host_id, price="1.00", start=now - timedelta(minutes=5), end=None, state="running")
        await rate_open_rentals(api.master.db, now=now, policy=POLICY)
        async with api.master.db.session() as session:
            assert (await session.scalar(select(Rental.state).where(Rental.id == done))) == "stopped"
        status, listed = await api.as_provider("GET", "/hosts")
        [host] = [h for h in listed["items"] if h["id"] == host_id]
        assert status == 200 and host["active_rentals"] == [running]
        provider_legs = [(await charges(api, rental_id))["provider"] for rental_id in (done, running)]
        assert Decimal(host["earned"]) == sum(provider_legs, Decimal(0))
        assert Decimal("1.76") < Decimal(host["earned"]) < Decimal("1.78")  # 2 h 5 min at 1.00/h, less the 15 % fee
        assert host["tier"] is not None and host["score"] is not None
        _, detail = await api.as_provider("GET", f"/hosts/{host_id}")
        assert detail["earned"] == host["earned"] and detail["active_rentals"] == [running]
        _, seen_by_renter = await api.as_renter("GET", f"/hosts/{host_id}")
        assert seen_by_renter["earned"] is None

    async def test_a_providers_account_shows_what_it_is_owed_and_was_paid(self, api: Api) -> None:
        """GET /account for a provider: payable now, paid out by payout batches, and their sum earned in all; renters have none."""
        host_id, _ = await api.host(1)
        now = datetime.now(UTC)
        await make_rental(api, host_id, price="10.00", start=now - timedelta(hours=3), end=now - timedelta(hours=1))
        await rate_open_rentals(api.master.db, now=now, policy=POLICY)
        status, before = await api.as_provider("GET", "/account")
        assert status == 200 and before["earnings"]["payable"] == "17.000000"  # 2 h × 10.00, less 15 %
        assert (before["earnings"]["paid_out"], before["earnings"]["payouts"]) == ("0.000000", 0)
        await payout_pass(api.master.db, api.master.settings, now)
        _, after = await api.as_provider("GET", "/account")
        assert after["earnings"] == {"payable": "0.000000", "paid_out": "17.000000", "earned_total": "17.000000", "payouts": 1}
        _, renter = await api.as_renter("GET", "/account")
        assert "earnings" not in renter
