"""``gpumarket volume create | list | show | delete`` against a real master served on loopback (as
``tests/test_renter_cli_services.py``): the CLI runs in a thread while the test plays the host's agent, applying its
results as the ingestor would."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from master.models import Command
from tests.apiclient import Api
from tests.helpers import eventually
from tests.test_renter_cli import Cli, cli, database_url, fast_polls, help_examples, one_line
from tests.test_volumes_api import lending_host

__all__ = ["cli", "database_url", "fast_polls"]  # the fixtures, shared with test_renter_cli

ACTIONS = ["create", "list", "show", "delete"]


async def command_for(api: Api, kind: str, volume_name: str | None = None) -> Command:
    """The one ``kind`` command the master wrote (waiting for it: the CLI runs in a thread)."""

    async def find() -> Command | None:
        async with api.master.db.session() as session:
            rows = (await session.scalars(select(Command).where(Command.kind == kind))).all()
        return rows[0] if len(rows) == 1 else None

    return await eventually(find, what=f"a {kind} command")


class TestHelp:
    @pytest.mark.parametrize("action", ACTIONS)
    def test_every_volume_action_has_help_with_examples(
        self, action: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert f"gpumarket volume {action}" in help_examples(["volume", action], capsys)


class TestCreate:
    async def test_create_waits_until_the_agent_made_it_then_says_where_and_what_it_costs(
        self, cli: Cli, api: Api
    ) -> None:
        host_id = await lending_host(api, price="0.0002", region="eu-west")
        running = cli.start("volume", "create", "data", "--size", "50", "--region", "eu-west")
        command = await command_for(api, "create_volume")
        await eventually(lambda: _says(cli, "waiting for host"), what="the progress line")
        assert not running.done()  # it waits for the agent
        await api.agent_answers(command)
        assert await running == 0
        out, err = cli.take()
        [line] = out.splitlines()
        assert (
            line.startswith("vol-")
            and f" data ready: 50 GiB on host {host_id} (eu-west), $0.0002/GiB-hour, $0.01/h" in line
        )
        assert (
            f"waiting for host {host_id} (eu-west) to make volume data" in err
            and "gpumarket volume delete data" in err
        )

    async def test_no_wait_returns_while_it_is_made_and_json_is_the_api_answer(
        self, cli: Cli, api: Api
    ) -> None:
        host_id = await lending_host(api)
        code, out, err = await cli(
            "volume", "create", "ckpt", "--size", "5", "--host", host_id, "--no-wait", "--json"
        )
        assert code == 0, err
        volume = json.loads(out)
        assert volume["state"] == "creating" and volume["host_id"] == host_id and volume["name"] == "ckpt"

    async def test_a_volume_its_agent_could_not_make_is_one_line_and_exit_1(self, cli: Cli, api: Api) -> None:
        await lending_host(api)
        running = cli.start("volume", "create", "data", "--size", "5")
        command = await command_for(api, "create_volume")
        await api.agent_answers(
            command, ok=False, detail="this host has 2 GiB free for volumes", data={"code": "volume_no_space"}
        )
        assert await running == 1
        _, err = cli.take()
        last = err.strip().splitlines()[-1]
        assert (
            last.startswith("gpumarket: volume data (vol-")
            and "volume_no_space: this host has 2 GiB free" in last
        )
        assert "gpumarket volume delete vol-" in last

    async def test_refusals_are_one_line_with_what_to_do(self, cli: Cli, api: Api) -> None:
        await lending_host(api, gib=10)
        code, _, err = await cli("volume", "create", "big", "--size", "11")
        assert code == 1
        line = one_line(err)
        assert "volume_host_full" in line and "the most free is 10 GiB" in line and "gpumarket offers" in line
        code, _, err = await cli("volume", "create", "Bad Name", "--size", "1")
        assert code == 1 and "invalid_volume_name" in one_line(err)
        code, _, err = await cli("volume", "create", "x", "--size", "0")
        assert code == 2 and "--size" in err
        code, _, err = await cli("volume", "show", "nothing")
        assert code == 1 and "volume_not_found" in one_line(err) and "gpumarket volume list --all" in err


class TestListShowDelete:
    async def test_list_show_and_delete_by_name(self, cli: Cli, api: Api) -> None:
        host_id = await lending_host(api, price="0.0001")
        code, out, err = await cli("volume", "create", "data", "--size", "20", "--no-wait")
        assert code == 0, err
        await api.agent_answers(await command_for(api, "create_volume"))
        code, out, _ = await cli("volume", "list")
        header, row = out.splitlines()
        assert header.split() == ["ID", "NAME", "STATE", "SIZE", "HOST", "REGION", "$/H", "MOUNTED", "BY"]
        assert row.split()[1:5] == ["data", "ready", "20", "GiB"] and host_id in row and "$0.002" in row
        code, out, _ = await cli("volume", "show", "data")
        assert code == 0 and out.splitlines()[0].endswith(" data ready") and "size       20 GiB" in out
        assert (
            "price      $0.0001/GiB-hour, $0.002/h" in out
            and "events (UTC):" in out
            and "ready: its host's agent made it" in out
        )
        code, out, err = await cli("volume", "delete", "data")
        assert code == 0, err
        assert out.strip().endswith(
            "data deleting: billing stopped; its files are deleted when its host's agent confirms"
        )
        code, out, _ = await cli("volume", "list")
        assert " deleting " in out.splitlines()[1]  # until its agent confirms
        await api.agent_answers(await command_for(api, "delete_volume"))
        code, out, _ = await cli("volume", "list")
        assert "no volumes;" in out
        code, out, _ = await cli("volume", "list", "--all", "--json")
        assert [v["state"] for v in json.loads(out)["items"]] == ["deleted"]


async def _says(cli: Cli, text: str) -> bool | None:
    return True if text in cli.peek()[1] else None


class TestOffers:
    async def test_offers_show_what_each_host_lends_to_volumes(self, cli: Cli, api: Api) -> None:
        """STORAGE: the GiB still free for volumes and the price per GiB-hour; - where the host lends none."""
        lending = await lending_host(api, price="0.0002", gib=100)
        unlisted = await lending_host(api, listed=False)
        await api.as_renter("POST", "/volumes", json={"name": "data", "size_gib": 30, "host_id": lending})
        code, out, err = await cli("offers")
        assert code == 0, err
        header, *rows = out.splitlines()
        column = header.split().index("STORAGE")
        shown = {host_id: next(row for row in rows if host_id in row) for host_id in (lending, unlisted)}
        assert "70G $0.0002" in shown[lending] and " - " in shown[unlisted]
        assert header.split()[column + 1] == "VERIFIED"
