"""Access that follows the account live (issue 35, ``master/services/accounts/access.py``): every SSH key change and a
disabled account reach the agents of the account's live rentals as ``update_access`` commands.

Driven through the REST API on SQLite and PostgreSQL (the ``api`` fixture); the agent's side is simulated by
command results, as the ingestor applies them. What the agent does with the command is proven against Debian's
OpenSSH in ``tests/test_agent_ssh.py::TestLiveAccess``, and end to end in ``tests/test_tunnels.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from gpumarket.cli import main
from master.db import Database, sqlite_url
from master.models import Account, Command
from master.services.accounts import access
from master.services.accounts.core import authenticate
from shared.errors import Unauthorized
from shared.settings import MasterSettings
from tests.apiclient import Api, assert_error
from tests.factories import create_principal
from tests.test_ssh_keys import PATH, add, ed25519_line


def canonical(line: str) -> str:
    return " ".join(line.split()[:2])


async def running_rental(api: Api) -> dict[str, Any]:
    """A hold rental of the renter on a fresh host, confirmed started by its agent."""
    await api.host(1)
    status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {"kind": "hold"}})
    assert status == 201, rental
    await api.agent_reports(rental["id"], "start_workload")
    return dict(rental)


async def open_updates(api: Api, rental_id: str) -> list[Command]:
    return [c for c in await api.commands(rental_id, "update_access") if c.state in ("pending", "sent")]


class TestKeyChanges:
    async def test_deleting_a_key_sends_each_live_rental_the_remaining_keys(self, api: Api) -> None:
        """Regression for "a deleted SSH key keeps working": a DELETE writes an ``update_access`` with the account's other
        keys and a newer version for the running rental, and nothing for another account's rental."""
        line_a, line_b = ed25519_line("a"), ed25519_line("b")
        (_, key_a), (_, _) = await add(api, line_a), await add(api, line_b)
        rental = await running_rental(api)
        [start] = await api.commands(rental["id"], "start_workload")
        assert start.args["authorized_keys"] == [canonical(line_a), canonical(line_b)]
        await api.host(1)
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        assert (await add(api, ed25519_line("theirs"), other_key))[0] == 201
        _, other = await api.call("POST", "/rentals", other_key, json={"gpu_count": 1, "workload": {"kind": "hold"}})

        status, _ = await api.as_renter("DELETE", f"{PATH}/{key_a['id']}")
        assert status == 200
        [update] = await open_updates(api, rental["id"])
        assert update.args["authorized_keys"] == [canonical(line_b)] and update.args["rental_id"] == rental["id"]
        assert update.args["version"] > start.args["access_version"] and update.host_id == rental["host_id"]
        assert await api.commands(other["id"], "update_access") == []

    async def test_a_newer_list_supersedes_an_open_one_and_a_key_added_is_sent_too(self, api: Api) -> None:
        """Adding a key sends the whole list; an older ``update_access`` still unanswered is superseded, not sent after it."""
        line_a, line_c = ed25519_line("a"), ed25519_line("c")
        _, key_a = await add(api, line_a)
        rental = await running_rental(api)
        assert (await api.as_renter("DELETE", f"{PATH}/{key_a['id']}"))[0] == 200
        [first] = await open_updates(api, rental["id"])
        assert first.args["authorized_keys"] == []
        assert (await add(api, line_c))[0] == 201
        [second] = await open_updates(api, rental["id"])
        assert second.args["authorized_keys"] == [canonical(line_c)] and second.args["version"] == first.args["version"] + 1
        [superseded] = [c for c in await api.commands(rental["id"], "update_access") if c.id == first.id]
        assert superseded.state == "failed" and "superseded" in (superseded.result or {})["detail"]
        await api.agent_answers(second, data={"applied": True, "version": second.args["version"], "known": True, "closed": 0})
        [answered] = [c for c in await api.commands(rental["id"], "update_access") if c.id == second.id]
        assert answered.state == "succeeded"
        assert (await api.as_renter("GET", f"/rentals/{rental['id']}"))[1]["state"] == "running"

    async def test_a_start_not_yet_confirmed_is_resent_with_the_current_keys(self, api: Api) -> None:
        """A start the agent has not answered (it was offline) carries the keys of now, not those of its placement."""
        line_a, line_b = ed25519_line("a"), ed25519_line("b")
        (_, key_a), _ = await add(api, line_a), await add(api, line_b)
        await api.host(1)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {"kind": "hold"}})
        assert (await api.as_renter("DELETE", f"{PATH}/{key_a['id']}"))[0] == 200
        [start] = await api.commands(rental["id"], "start_workload")
        [update] = await open_updates(api, rental["id"])
        assert start.args["authorized_keys"] == [canonical(line_b)] and start.args["access_version"] == update.args["version"]

    async def test_a_released_rental_is_not_told(self, api: Api) -> None:
        """A stopped rental (its keys released on the agent) gets no ``update_access``."""
        _, key_a = await add(api, ed25519_line("a"))
        rental = await running_rental(api)
        assert (await api.as_renter("DELETE", f"/rentals/{rental['id']}"))[0] == 202
        await api.agent_reports(rental["id"], "stop_workload")
        assert (await api.as_renter("DELETE", f"{PATH}/{key_a['id']}"))[0] == 200
        assert await api.commands(rental["id"], "update_access") == []


class TestDisabledAccount:
    async def test_disabling_sends_an_empty_list_and_refuses_the_accounts_api_keys(self, api: Api) -> None:
        """A disabled account's rentals are sent no key at all, its API key answers 401 ``account_disabled`` and a new
        start would carry no key; enabling it again sends its keys back."""
        line_a = ed25519_line("a")
        await add(api, line_a)
        rental = await running_rental(api)
        async with api.master.db.session() as session:
            issued = await access.disable_account(session, api.renter.account_id, now=api.master.clock.now())
        [update] = await open_updates(api, rental["id"])
        assert [update.id] == issued and update.args["authorized_keys"] == [] and update.args["disabled"] is True
        status, body = await api.as_renter("GET", "/account")
        assert_error(status, body, 401, "account_disabled")
        async with api.master.db.session() as session:
            assert (await access.current_keys(session, api.renter.account_id))[0] == []
            assert await session.scalar(select(Account.disabled_at).where(Account.id == api.renter.account_id)) is not None

        async with api.master.db.session() as session:
            await access.enable_account(session, api.renter.account_id, now=api.master.clock.now())
        [again] = await open_updates(api, rental["id"])
        assert again.args["authorized_keys"] == [canonical(line_a)] and again.args["version"] > update.args["version"]
        assert again.args["disabled"] is False
        assert (await api.as_renter("GET", "/account"))[0] == 200


class TestAdminCli:
    def test_disable_account_and_enable_account_switch_its_api_key(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
        """``gpumarket admin disable-account`` makes the account's API key answer ``account_disabled``; ``enable-account``
        lets it in again."""
        monkeypatch.setenv("GPUMARKET_DATA_DIR", str(tmp_path))
        monkeypatch.delenv("GPUMARKET_DATABASE_URL", raising=False)  # the data dir's own SQLite file
        main(["admin", "create-account", "--name", "mallory", "--role", "renter"])
        api_key = capsys.readouterr().out.strip()
        main(["admin", "disable-account", "--name", "mallory"])
        assert "account 'mallory' disabled" in capsys.readouterr().out
        with pytest.raises(Unauthorized) as refused:
            asyncio.run(_authenticate(api_key))
        assert refused.value.code == "account_disabled"
        main(["admin", "enable-account", "--name", "mallory"])
        assert asyncio.run(_authenticate(api_key)) == "mallory"
        with pytest.raises(SystemExit, match="no account named 'nobody'"):
            main(["admin", "disable-account", "--name", "nobody"])


async def _authenticate(api_key: str) -> str:
    settings = MasterSettings.load()
    database = Database(settings.database_url or sqlite_url(settings.data_dir / "gpumarket.db"))
    try:
        async with database.session() as session:
            return (await authenticate(session, api_key)).name
    finally:
        await database.close()
