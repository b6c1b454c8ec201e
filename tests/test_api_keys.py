"""API keys an account manages: named, scoped, expiring, bound to networks, revoked at once everywhere.

Real aiohttp apps on SQLite and PostgreSQL (the ``api`` fixture), a second master on the same database for
revocation, and an aiohttp client with a cookie jar as the console.
"""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import select, update

from master.api.base import API
from master.api.openapi import build_openapi
from master.api.table import ROUTES
from master.app import close_master, create_app, open_master
from master.models import ApiKey
from master.services.accounts.sessions import CSRF_HEADER
from shared.bus import InProcessBus
from tests.apiclient import Api, assert_error, bearer
from tests.factories import master_settings
from tests.helpers import eventually
from tests.test_renter_cli import Cli


async def make(api: Api, key: str, **body: Any) -> tuple[int, Any]:
    return await api.call("POST", "/api-keys", key, json={"name": "ci", **body})


async def made(api: Api, key: str, **body: Any) -> dict[str, Any]:
    status, view = await make(api, key, **body)
    assert status == 201, view
    return dict(view)


class TestScopes:
    async def test_a_read_key_reads_and_is_refused_a_rental_saying_which_scope(self, api: Api) -> None:
        await api.host(1)
        view = await made(api, api.renter_key, scopes=["read"])
        assert view["key"].startswith("gmk_") and view["scopes"] == ["read"] and view["state"] == "active"
        assert (await api.call("GET", "/rentals", view["key"]))[0] == 200
        status, body = await api.call("POST", "/rentals", view["key"], json={"gpu_count": 1})
        assert_error(status, body, 403, "scope_missing")
        assert "'rent' scope" in body["message"] and "gpumarket keys create --scope rent" in body["message"]
        status, body = await api.call("PUT", "/account/spend-cap", view["key"], json={"monthly_spend_cap": "5.00"})
        assert_error(status, body, 403, "scope_missing")
        rent = await made(api, api.renter_key, name="runner", scopes=["rent", "read"])
        assert rent["scopes"] == ["read", "rent"]
        assert (await api.call("POST", "/rentals", rent["key"], json={"gpu_count": 1}))[0] == 201

    async def test_the_role_still_decides_first(self, api: Api) -> None:
        """A renter's key with the provider scope is still no provider's."""
        view = await made(api, api.renter_key, scopes=["provider", "read"])
        status, body = await api.call("POST", "/enrollment-tokens", view["key"], json={})
        assert_error(status, body, 403, "forbidden")

    async def test_a_key_makes_and_revokes_only_keys_within_its_own_scopes(self, api: Api) -> None:
        read = await made(api, api.renter_key, scopes=["read"])
        status, body = await make(api, read["key"], scopes=["read", "rent"])
        assert_error(status, body, 403, "scope_missing")
        status, body = await make(api, read["key"])  # every scope: more than it has
        assert_error(status, body, 403, "scope_missing")
        other_read = await made(api, read["key"], name="also-read", scopes=["read"])
        full_id = next(k for k in (await api.as_renter("GET", "/api-keys"))[1]["items"] if k["all_scopes"])["id"]
        status, body = await api.call("DELETE", f"/api-keys/{full_id}", read["key"])
        assert_error(status, body, 403, "scope_missing")
        assert (await api.call("DELETE", f"/api-keys/{other_read['id']}", read["key"]))[0] == 200
        assert (await api.call("DELETE", f"/api-keys/{read['id']}", read["key"]))[0] == 200  # itself
        assert_error(*await api.call("GET", "/rentals", read["key"]), 401, "invalid_api_key")

    async def test_every_route_declares_the_scope_a_key_needs(self) -> None:
        document = build_openapi(ROUTES)
        scopes = {op["x-api-key-scope"] for ops in document["paths"].values() for op in ops.values() if "security" in op}
        assert scopes == {"read", "rent", "billing", "provider", "admin"}
        needs = {(route.method, route.path): route.needs for route in ROUTES}
        assert needs[("POST", "/rentals")] == needs[("DELETE", "/services/{service_id}")] == "rent"
        assert needs[("POST", "/account/credit")] == needs[("GET", "/invoices")] == "billing"
        assert needs[("PUT", "/hosts/{host_id}/listing")] == "provider" and needs[("PUT", "/templates/{name}")] == "admin"
        assert all(needs[(route.method, route.path)] == "read" for route in ROUTES if route.method == "GET" and route.scope is None)


class TestLifetime:
    async def test_the_list_never_shows_a_secret_and_says_when_a_key_was_used(self, api: Api) -> None:
        view = await made(api, api.renter_key, scopes=["read"])
        await api.call("GET", "/offers", view["key"])
        status, listing = await api.as_renter("GET", "/api-keys")
        assert status == 200 and view["key"] not in str(listing)
        [mine] = [k for k in listing["items"] if k["id"] == view["id"]]
        assert mine["prefix"] == view["key"][:12] and mine["last_used_at"] is not None and mine["name"] == "ci"
        other = (await api.as_provider("GET", "/api-keys"))[1]
        assert view["id"] not in str(other)
        assert_error(*await api.as_provider("DELETE", f"/api-keys/{view['id']}"), 404, "api_key_not_found")

    async def test_an_expired_key_stops_working(self, api: Api) -> None:
        soon = datetime.now(UTC) + timedelta(hours=1)
        view = await made(api, api.renter_key, expires_at=soon.isoformat())
        assert view["expires_at"] == soon.isoformat()
        assert (await api.call("GET", "/rentals", view["key"]))[0] == 200
        async with api.master.db.session() as session:
            await session.execute(update(ApiKey).where(ApiKey.id == view["id"]).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        status, body = await api.call("GET", "/rentals", view["key"])
        assert_error(status, body, 401, "api_key_expired")
        status, body = await make(api, api.renter_key, expires_at=(datetime.now(UTC) - timedelta(minutes=1)).isoformat())
        assert_error(status, body, 422, "validation_failed")
        status, body = await make(api, api.renter_key, expires_at="2030-01-01T00:00:00")  # no time zone
        assert_error(status, body, 422, "validation_failed")

    async def test_a_key_bound_to_networks_works_only_from_them(self, api: Api) -> None:
        elsewhere = await made(api, api.renter_key, allowed_networks=["203.0.113.0/24", "2001:db8::/32"])
        status, body = await api.call("GET", "/rentals", elsewhere["key"])
        assert_error(status, body, 403, "address_not_allowed")
        assert "203.0.113.0/24" in body["message"] and "127.0.0.1" in body["message"]
        here = await made(api, api.renter_key, allowed_networks=["127.0.0.1"])
        assert here["allowed_networks"] == ["127.0.0.1/32"]
        assert (await api.call("GET", "/rentals", here["key"]))[0] == 200
        for bad in (["not-a-network"], ["10.0.0.0/8\n"], ["１０.0.0.1"], []):
            assert_error(*await make(api, api.renter_key, allowed_networks=bad), 422, "validation_failed")

    async def test_a_revoked_key_stops_at_once_on_every_master_with_its_console_sessions(self, api: Api, tmp_path: Path) -> None:
        view = await made(api, api.renter_key, scopes=["read", "rent"])
        other = await open_master(master_settings(tmp_path / "second", database_url=api.master.settings.database_url), bus=InProcessBus())
        client: TestClient[Any, Any] = TestClient(TestServer(create_app(other, background=False)))
        await client.start_server()
        try:
            async with client.get(API + "/rentals", headers=bearer(view["key"])) as response:
                assert response.status == 200
            async with api.client.post(API + "/sessions", json={"api_key": view["key"]}) as response:
                assert response.status == 201
            assert (await api.as_renter("DELETE", f"/api-keys/{view['id']}"))[0] == 200
            async with client.get(API + "/rentals", headers=bearer(view["key"])) as response:
                assert response.status == 401 and (await response.json())["code"] == "invalid_api_key"
            async with api.client.get(API + "/sessions/current") as response:
                assert response.status == 401
        finally:
            await client.close()
            await close_master(other)
        again = await api.as_renter("DELETE", f"/api-keys/{view['id']}")
        assert again[0] == 200 and again[1]["state"] == "revoked"  # idempotent
        async with api.master.db.session() as session:
            kinds = (await session.scalars(select(ApiKey.revoked_at).where(ApiKey.id == view["id"]))).all()
        assert kinds[0] is not None

    async def test_a_console_session_opened_with_a_read_key_cannot_rent(self, api: Api) -> None:
        view = await made(api, api.renter_key, scopes=["read"])
        async with api.client.post(API + "/sessions", json={"api_key": view["key"]}) as response:
            csrf = (await response.json())["csrf_token"]
        async with api.client.post(API + "/rentals", json={"gpu_count": 1}, headers={CSRF_HEADER: csrf}) as response:
            assert_error(response.status, await response.json(), 403, "scope_missing")

    async def test_made_and_revoked_keys_are_in_the_audit_log(self, api: Api) -> None:
        view = await made(api, api.renter_key, scopes=["read"])
        await api.as_renter("DELETE", f"/api-keys/{view['id']}")
        _, log = await api.as_renter("GET", "/audit-events")
        assert [item["kind"] for item in log["items"]] == ["api_key_revoked", "api_key_created"]
        assert log["items"][1]["detail"] == {"key_id": view["id"], "prefix": view["key"][:12], "name": "ci", "scopes": ["read"]}
        assert view["key"] not in str(log)


class TestDeviceLogin:
    async def test_a_cli_gets_a_key_of_the_scopes_its_user_approves_once(self, api: Api) -> None:
        status, started = await api.call("POST", "/device-codes", None, json={"client_name": "gpumarket CLI on laptop"})
        assert status == 200 and re.fullmatch(r"[B-Z]{4}-[B-Z]{4}", started["user_code"]) and started["interval"] >= 1
        assert started["verification_uri_complete"].endswith(f"/#/device/{started['user_code']}")
        token = {"device_code": started["device_code"]}
        assert_error(*await api.call("POST", "/device-codes/token", None, json=token), 400, "authorization_pending")
        user_code = started["user_code"]
        assert_error(*await api.as_renter("GET", f"/device-codes/{user_code}"), 403, "console_session_required")
        assert_error(*await api.as_renter("POST", f"/device-codes/{user_code}/approve", json={}), 403, "console_session_required")

        async with api.client.post(API + "/sessions", json={"api_key": api.renter_key}) as response:
            csrf = (await response.json())["csrf_token"]
        async with api.client.get(API + f"/device-codes/{user_code.lower()}") as response:
            assert (await response.json())["client_name"] == "gpumarket CLI on laptop"
        async with api.client.post(API + f"/device-codes/{user_code}/approve", json={"scopes": ["read"]}, headers={CSRF_HEADER: csrf}) as response:
            assert response.status == 200
        status, made = await api.call("POST", "/device-codes/token", None, json=token)
        assert status == 200 and made["scopes"] == ["read"] and made["name"] == "gpumarket CLI on laptop"
        assert (await api.call("GET", "/rentals", made["key"]))[0] == 200
        assert_error(*await api.call("POST", "/device-codes/token", None, json=token), 400, "expired_token")  # once
        async with api.client.post(API + f"/device-codes/{user_code}/approve", json={}, headers={CSRF_HEADER: csrf}) as response:
            assert response.status == 404


async def test_login_through_the_browser_saves_the_key_the_console_approved(
    api: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cli = Cli(api, capsys, monkeypatch, tmp_path / "home")
    cli.env(url=None, key=None)
    login = cli.start("login", "--api", cli.url, "--browser")

    async def shown() -> str | None:
        found = re.search(r"approve the code ([B-Z]{4}-[B-Z]{4})", cli.peek()[1])
        return found.group(1) if found else None

    user_code = await eventually(shown, timeout=30, what="the CLI to show its code")
    async with api.client.post(API + "/sessions", json={"api_key": api.renter_key}) as response:
        csrf = (await response.json())["csrf_token"]
    async with api.client.post(API + f"/device-codes/{user_code}/approve", json={"scopes": ["read", "rent"]}, headers={CSRF_HEADER: csrf}) as response:
        assert response.status == 200
    assert await asyncio.wait_for(login, 60) == 0
    out, err = cli.take()
    assert "logged in to" in out and "renter-1" in out, (out, err)
    code, out, err = await cli("keys", "list", "--json")
    assert code == 0 and [k["scopes"] for k in json.loads(out) if k["name"].startswith("gpumarket CLI on ")] == [["read", "rent"]]
