"""The renter's command line (`gpumarket login | offers | rent | rentals | logs | stop | account`)
against a real master served on loopback: what it prints, what it sends, and its errors as one line.

The CLI runs as a user runs it: ``main(argv)`` with its own event loop (in a thread, so the
test's loop keeps serving the API and plays the agent's side), configured by the environment.
The CLI does not touch the database, so the master runs on SQLite only here.
"""

from __future__ import annotations

import asyncio
import io
import json
import stat
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from gpumarket.cli import main
from gpumarket.renter import api as api_module
from gpumarket.renter import outcome, output, renting
from master.models import Command, Gpu, HostListing, Rental
from master.services.rentals import lifecycle as rental_lifecycle
from master.telemetry import hosts
from shared import protocol
from tests.apiclient import A100, RTX, Api
from tests.factories import envelope, gpu_info, online_host
from tests.helpers import eventually

RENTER_COMMANDS = ["login", "offers", "rent", "rentals", "logs", "stop", "account"]


@pytest.fixture
def database_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'test.db'}"


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(renting, "POLL_INTERVAL_S", 0.05)


class Cli:
    """Runs ``gpumarket ...`` in a thread against the test's master, as the renter unless told otherwise."""

    def __init__(self, api: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
        self.api, self.capsys, self.monkeypatch = api, capsys, monkeypatch
        self.url = str(api.client.make_url("/")).rstrip("/")
        self._out = self._err = ""
        monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
        monkeypatch.delenv("GPUMARKET_CONFIG", raising=False)
        self.env(url=self.url, key=api.renter_key)

    def env(self, *, url: str | None, key: str | None) -> None:
        for name, value in (("GPUMARKET_API_URL", url), ("GPUMARKET_API_KEY", key)):
            if value is None:
                self.monkeypatch.delenv(name, raising=False)
            else:
                self.monkeypatch.setenv(name, value)

    def start(self, *argv: str) -> asyncio.Task[int]:
        def call() -> int:
            try:
                main(list(argv))
            except SystemExit as exc:
                return int(exc.code or 0)
            return 0

        return asyncio.ensure_future(asyncio.to_thread(call))

    async def __call__(self, *argv: str) -> tuple[int, str, str]:
        code = await self.start(*argv)
        out, err = self.take()
        return code, out, err

    def peek(self) -> tuple[str, str]:
        """stdout and stderr so far (since the last ``take``), of the commands still running too."""
        out, err = self.capsys.readouterr()
        self._out, self._err = self._out + out, self._err + err
        return self._out, self._err

    def take(self) -> tuple[str, str]:
        out, err = self.peek()
        self._out = self._err = ""
        return out, err


@pytest.fixture
def cli(api: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Cli:
    return Cli(api, capsys, monkeypatch, tmp_path / "home")


def help_examples(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``gpumarket ARGV --help``, which exits 0: its text after ``examples:``."""
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out, out
    return out.split("examples:", 1)[1]


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("gpumarket: "), err
    return err


class TestHelp:
    @pytest.mark.parametrize("command", RENTER_COMMANDS)
    def test_every_renter_command_has_help_with_examples(self, command: str, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert f"usage: gpumarket {command}" in out and "examples:" in out
        assert "Undefined" not in out and "pydantic" not in out.lower()

    def test_without_a_login_every_command_says_how_to_log_in(self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
        for name in ("GPUMARKET_API_URL", "GPUMARKET_API_KEY", "GPUMARKET_CONFIG"):
            monkeypatch.delenv(name, raising=False)
        with pytest.raises(SystemExit) as done:
            main(["offers"])
        assert done.value.code == 2
        assert "gpumarket login" in one_line(capsys.readouterr().err)


class TestLogin:
    async def test_login_checks_the_key_and_saves_it_for_the_owner_only(self, cli: Cli, api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        cli.env(url=None, key=None)
        monkeypatch.setattr(sys, "stdin", io.StringIO(api.renter_key + "\n"))
        code, out, err = await cli("login", "--api", cli.url + "/api/v1/")
        assert code == 0, err
        assert "renter-1" in out and api.renter.account_id in out
        path = tmp_path / "home" / "gpumarket" / "config.json"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert json.loads(path.read_text()) == {"api_url": cli.url, "api_key": api.renter_key}
        # Later commands use the saved login; the environment overrides it.
        code, out, err = await cli("account")
        assert code == 0 and "renter-1 (renter)" in out, err
        cli.env(url=None, key="gmk_not_a_key")
        code, out, err = await cli("account")
        assert code == 1 and "(invalid_api_key)" in one_line(err) and "gpumarket login" in err

    async def test_a_bad_key_is_one_line_and_writes_nothing(self, cli: Cli, tmp_path: Path) -> None:
        code, _out, err = await cli("login", "--api", cli.url, "--key", "gmk_wrong")
        assert code == 1
        assert "(invalid_api_key)" in one_line(err)
        assert not (tmp_path / "home" / "gpumarket" / "config.json").exists()

    async def test_an_unreachable_api_is_one_line_naming_the_url(self, cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(api_module.Client, "__init__", _no_retry(api_module.Client.__init__))
        cli.env(url="http://127.0.0.1:9", key="gmk_x")
        code, _out, err = await cli("offers")
        assert code == 1
        assert "http://127.0.0.1:9 did not answer" in one_line(err) and "gpumarket login" in err


def _no_retry(init: Callable[..., None]) -> Callable[..., None]:
    def patched(self: Any, login: Any, **kwargs: Any) -> None:
        init(self, login, **{**kwargs, "retries": 0})

    return patched


def _fast_retry(init: Callable[..., None]) -> Callable[..., None]:
    def patched(self: Any, login: Any, **kwargs: Any) -> None:
        init(self, login, **{**kwargs, "retry_delay": 0.01})

    return patched


class TestOffers:
    async def test_the_table_and_json_show_the_apis_offers(self, cli: Cli, api: Api) -> None:
        _host_id, _ = await api.host(2)
        code, out, err = await cli("offers", "--json")
        assert code == 0, err
        _, body = await api.as_renter("GET", "/offers")
        assert json.loads(out)["items"] == body["items"]
        [offer] = body["items"]
        code, out, err = await cli("offers")
        assert code == 0, err
        header, row = out.splitlines()
        assert header.split()[:5] == ["MODEL", "FREE", "MIG", "VRAM", "$/GPU-H"]
        assert row.startswith(RTX) and row.endswith(offer["id"])
        price = f"${float(offer['price_per_gpu_hour']):.2f}"
        assert price in row and "24 GiB" in row

    async def test_a_gpu_in_mig_mode_shows_its_free_instances_not_a_free_gpu_and_rent_mig_takes_one(self, cli: Cli, api: Api) -> None:
        """Regression test for issue 39: the demo's A100 in MIG mode showed ``FREE 1`` and ``rent --model A100`` then
        answered insufficient_capacity. Its offer says FREE 0 and lists the instances; ``rent --mig`` rents one."""
        instances = [protocol.GpuMigInstanceModel(uuid=f"MIG-cli-{n}", profile=p) for n, p in enumerate(["3g.40gb", "1g.10gb", "1g.10gb"])]
        gpu = gpu_info(0, name=A100, memory=81920).model_copy(update={"mig_mode": True, "mig_instances": instances})
        host_id = await online_host(api.master, api.provider, [gpu])
        code, out, err = await cli("offers")
        assert code == 0, err
        [row] = [line for line in out.splitlines()[1:] if host_id in line]
        assert row.split()[row.split().index("3g.40gb") - 1] == "0" and "3g.40gb x1 1g.10gb x2" in row
        code, _out, err = await cli("rent", "--model", "A100", "--no-wait", "--json")
        assert code != 0 and "MIG" in err
        code, out, err = await cli("rent", f"{host_id}:{A100}", "--mig", "3g.40gb", "--no-wait", "--json")
        assert code == 0, err
        assert json.loads(out)["mig_profile"] == "3g.40gb"
        code, out, err = await cli("offers")
        assert "1g.10gb x2" in out and "3g.40gb" not in out

    async def test_the_query_words_filter_and_a_bad_query_is_one_line(self, cli: Cli, api: Api) -> None:
        await api.host(2)
        code, out, err = await cli("offers", "vram>=24", "num_gpus>=2")
        assert code == 0 and RTX in out, err
        code, out, err = await cli("offers", "vram>=100")
        assert code == 0 and out.startswith("no offers match"), err
        code, out, err = await cli("offers", "vram>>1")
        assert code == 1 and "(invalid_query)" in one_line(err)


    async def test_the_verified_column_and_filter(self, cli: Cli, api: Api) -> None:
        """VERIFIED says what the GPU challenge proved (the measured median / expected TFLOP/s); --verified sends
        verified=true and lists only the proven hosts."""
        proven, _ = await api.host(2)
        failed, _ = await api.host(1)
        never, _ = await api.host(1)
        now = datetime.now(UTC)
        async with api.master.db.session() as session:
            for host_id, outcome, tflops in ((proven, "passed", 160.4), (failed, "failed", None)):
                await session.execute(update(Gpu).where(Gpu.host_id == host_id).values(
                    verification_outcome=outcome, verified_at=now, verified_tflops=tflops))  # fmt: skip
            session.add(HostListing(host_id=proven, price_per_gpu_hour=Decimal("0.4"), verified=True, created_at=now, updated_at=now))
        code, out, err = await cli("offers")
        assert code == 0, err
        header, *rows = out.splitlines()
        column = header.split().index("VERIFIED")
        shown = {host_id: next(row for row in rows if host_id in row) for host_id in (proven, failed, never)}
        assert "yes 160/198TF" in shown[proven] and " failed " in shown[failed] and " no " in shown[never]
        assert header.split()[column + 1] == "OFFER"
        code, out, err = await cli("offers", "--verified")
        assert code == 0, err
        [row] = out.splitlines()[1:]
        assert proven in row
        code, out, err = await cli("offers", "verified=false", "--json")
        assert code == 0, err
        assert {o["host_id"] for o in json.loads(out)["items"]} == {failed, never}


class TestClusterOffers:
    async def test_nodes_prices_the_cluster_per_group_and_json_is_the_apis_answer(self, cli: Cli, api: Api) -> None:
        """``offers --nodes N --gpus G``: one row per group (model, region, hosts, the whole cluster's $/h from the
        cheapest to the dearest set), the cheapest first; --json prints GET /offers/clusters as it is."""
        from tests.test_cluster_offers import offer_host

        for price in ("0.40", "0.50", "0.60"):
            await offer_host(api, price, gpus=2)
        for price in ("0.30", "0.35"):
            await offer_host(api, price, gpus=2, region="us-east")
        code, out, err = await cli("offers", "--nodes", "2", "--gpus", "2", "--json")
        assert code == 0, err
        _, body = await api.as_renter("GET", "/offers/clusters", params={"nodes": "2", "gpus_per_node": "2", "limit": "50"})
        assert json.loads(out) == body
        code, out, err = await cli("offers", "--nodes", "2", "--gpus", "2")
        assert code == 0, err
        header, first, second = out.splitlines()
        assert header.split() == ["MODEL", "REGION", "HOSTS", "$/H", "(CHEAPEST", "-", "DEAREST)"]
        assert first.startswith(RTX) and "us-east" in first and first.rstrip().endswith("$1.30")  # (0.30 + 0.35) × 2
        assert "eu-west" in second and second.rstrip().endswith("$1.80 - $2.20")
        assert "placement picks the hosts" in err

    async def test_too_few_hosts_says_how_many_and_bad_options_exit_2(self, cli: Cli, api: Api) -> None:
        """Three nodes on two hosts: one line with the most nodes possible; mixed models across regions then fit."""
        from tests.test_cluster_offers import offer_host

        await offer_host(api, "0.40")
        await offer_host(api, "1.00", model=A100, region="us-east")
        code, out, err = await cli("offers", "--nodes", "2", "reliability>=0.5")
        assert code == 0, err
        assert out.startswith("no 2 hosts with 1 free GPU of one model now (at most 0 nodes matching") and "--allow-mixed" in out
        code, out, err = await cli("offers", "--nodes", "2", "--allow-mixed")
        assert code == 0, err
        assert out.splitlines()[1].startswith("mixed") and "across regions (eu-west, us-east)" in out and "$1.40" in out
        for argv in (("--nodes", "1"), ("--nodes", "65"), ("--nodes", "2", "--sort", "price"), ("--allow-mixed",)):
            code, _, err = await cli("offers", *argv)
            assert code == 2, (argv, err)

    async def test_network_bounds_go_to_the_api_and_bad_ones_are_one_line(self, cli: Cli, api: Api) -> None:
        """``--max-latency-ms`` and its kin reach GET /offers/clusters (whose answer echoes them); without --nodes, or not
        a number, exit 2 with one line; out of the API's range, its 400 in one line."""
        from tests.test_cluster_offers import offer_host

        for price in ("0.40", "0.50"):
            await offer_host(api, price)
        code, out, err = await cli("offers", "--nodes", "2", "--max-latency-ms", "5", "--min-mbit-s", "900.5", "--json")
        assert code == 0, err
        assert json.loads(out)["network"] == {"max_latency_ms": 5.0, "min_mbit_s": 900.5}
        for argv, words in ((("--max-latency-ms", "5"), "--max-latency-ms prices a cluster: give --nodes N too"),
                            (("--nodes", "2", "--max-loss-pct", "lots"), "must be a number"),
                            (("--nodes", "2", "--max-loss-pct", "nan"), "must be a number of at least 0"),
                            (("--nodes", "2", "--max-loss-pct", "101"), "'max_loss_pct' must be at least 0 and at most 100")):  # fmt: skip
            code, _, err = await cli("offers", *argv)
            assert code in (1, 2) and words in err, (argv, err)


class TestRent:
    async def test_each_invocation_rents_once_and_a_repeated_key_does_not(self, cli: Cli, api: Api) -> None:
        await api.host(4)
        for expected in (1, 2):
            code, out, err = await cli("rent", "--no-wait", "--json")
            assert code == 0, err
            assert json.loads(out)["state"] == "starting"
            assert await api.count(Rental) == expected
        key = str(uuid.uuid4())
        for status in (201, 200):
            got, _ = await api.as_renter("POST", "/rentals", json={"workload": {"kind": "hold"}}, headers={"Idempotency-Key": key})
            assert got == status
        assert await api.count(Rental) == 3

    async def test_failover_after_and_restart_on_failure_go_into_the_request(self, cli: Cli, api: Api) -> None:
        """--failover-after 120 --restart-on-failure: the rental asks for both; a value outside 10..86400 is refused first."""
        await api.host(1)
        code, out, err = await cli("rent", "--no-wait", "--json", "--restart-on-failure", "--failover-after", "120")
        assert code == 0, err
        rental = json.loads(out)
        assert (rental["failover_after_s"], rental["restart_on_failure"]) == (120, True)
        for value in ("9", "86401", "1.5", "soon"):
            code, _, err = await cli("rent", "--no-wait", "--failover-after", value)
            assert code == 2 and "--failover-after" in err, (value, err)
        assert await api.count(Rental) == 1

    async def test_a_lost_answer_is_retried_with_the_same_key_and_rents_once(self, cli: Cli, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
        """The first POST /rentals is made but its answer is lost: the retry sends the same Idempotency-Key and gets that rental."""
        await api.host(2)
        sent: list[str] = []
        once = api_module.Client._once

        async def lossy(self: api_module.Client, method: str, path: str, **kwargs: Any) -> Any:
            body = await once(self, method, path, **kwargs)
            if method == "POST":
                sent.append(kwargs["headers"]["Idempotency-Key"])
                if len(sent) == 1:
                    raise api_module.Unreachable("the answer was lost")
            return body

        monkeypatch.setattr(api_module.Client, "_once", lossy)
        monkeypatch.setattr(api_module.Client, "__init__", _fast_retry(api_module.Client.__init__))
        code, _out, err = await cli("rent", "--no-wait", "--json")
        assert code == 0, err
        assert len(sent) == 2 and sent[0] == sent[1]
        assert await api.count(Rental) == 1

    async def test_rent_waits_until_running_with_progress(self, cli: Cli, api: Api) -> None:
        host_id, _ = await api.host(1)
        task = cli.start("rent", "--image", "ubuntu:24.04", "--command", "sleep infinity", "--port", "8000", "--env", "A=1")

        command = await eventually(lambda: the_start(api), what="the start_workload command")
        rental_id = command.rental_id
        assert rental_id is not None
        assert command.args["workload"]["image"] == "ubuntu:24.04"
        assert command.args["workload"]["command"] == ["sleep", "infinity"]
        assert command.args["workload"]["ports"] == [8000] and command.args["workload"]["env"]["A"] == "1"
        await eventually(lambda: _async(f"{rental_id}: starting" in cli.peek()[1]), what="the first progress line")
        # Two events between two polls: both are shown, each once.
        async with api.master.db.session() as session:
            for stage, percent in (("pulling", 45.0), ("starting", None)):
                await rental_lifecycle.apply_workload_progress(
                    session, host_id, rental_id, stage=stage, text="ubuntu:24.04", percent=percent, at=datetime.now(UTC)
                )
        await eventually(lambda: _async("workload starting: ubuntu:24.04" in cli.peek()[1]), what="the progress lines")
        await asyncio.sleep(0.2)  # polls that see nothing new print nothing
        await api.agent_reports(rental_id, "start_workload")
        code = await task
        out, err = cli.take()
        assert code == 0, err
        progress = [line.split("] ", 1)[1] for line in err.splitlines() if line.startswith("[")]
        assert progress[1:] == [
            f"{rental_id}: starting: workload pulling: ubuntu:24.04 (45%)",
            f"{rental_id}: starting: workload starting: ubuntu:24.04",
            f"{rental_id}: running: agent confirmed the workload started",
        ], err
        assert out.startswith(f"{rental_id} running: 1 x {RTX}")
        assert f"gpumarket stop {rental_id}" in err

    async def test_an_event_seen_before_the_rentals_state_moves_is_shown_once(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A poll whose answer has the ``running`` event while the rental still reads ``starting`` (its two reads
        straddled the change) shows the event; the next poll's ``running`` state is no news: no second line."""
        started = {"to": "starting", "cause": "start command sent"}
        running = {"to": "running", "cause": "agent confirmed the workload started"}
        answers = iter([
            {"id": "r-1", "state": "starting", "events": [started]},
            {"id": "r-1", "state": "starting", "events": [started, running]},
            {"id": "r-1", "state": "running", "events": [started, running]},
        ])

        class Client:
            async def get(self, path: str) -> dict[str, Any]:
                assert path == "/rentals/r-1"
                return next(answers)

        rental = await renting.wait_for(Client(), "r-1", ("running",))  # type: ignore[arg-type]
        assert rental["state"] == "running"
        lines = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()]
        assert lines == ["r-1: starting: start command sent", "r-1: running: agent confirmed the workload started"]

    async def test_a_rental_that_fails_to_start_exits_1_with_its_reason(self, cli: Cli, api: Api) -> None:
        await api.host(1)
        task = cli.start("rent", "--template", "base")
        command = await eventually(lambda: the_start(api), what="the start_workload command")
        assert command.rental_id is not None
        await api.agent_reports(command.rental_id, "start_workload", ok=False, detail="image not found")
        code = await task
        out, err = cli.take()
        assert code == 1
        assert out == f"{command.rental_id} failed\n"
        assert "image not found" in err.splitlines()[-1]

    async def test_api_and_usage_errors_are_one_line(self, cli: Cli, api: Api) -> None:
        await api.host(1)
        code, _, err = await cli("rent", "--template", "no-such-template")
        assert code == 1 and "(template_not_found)" in one_line(err)
        code, _, err = await cli("rent", "--model", "H100", "--no-wait")
        assert code == 1 and "(exceeds_fleet)" in one_line(err) and "gpumarket offers" in err
        code, _, err = await cli("rent", "--command", "true")
        assert code == 2 and "--image" in one_line(err)
        code, _, err = await cli("rent", "--bid", "0.2")
        assert code == 2 and "--interruptible" in one_line(err)
        assert await api.count(Rental) == 0


async def start_commands(api: Api) -> list[Command]:
    async with api.master.db.session() as session:
        return list((await session.scalars(select(Command).where(Command.kind == "start_workload"))).all())


async def the_start(api: Api) -> Command | None:
    rows = await start_commands(api)
    return rows[0] if rows else None


async def _async(value: bool) -> bool:
    return value


class TestRentals:
    async def test_rentals_logs_and_stop(self, cli: Cli, api: Api) -> None:
        host_id, _ = await api.host(1)
        code, out, err = await cli("rent", "--template", "base", "--no-wait", "--json")
        rental = json.loads(out)
        rid = rental["id"]
        await api.agent_reports(rid, "start_workload")

        code, out, err = await cli("rentals")
        assert code == 0, err
        header, row = out.splitlines()
        assert header.split()[:3] == ["ID", "STATE", "GPUS"]
        assert row.startswith(rid) and "running" in row and "template base" in row

        # The output as the agent shipped it, from an offset, and followed until the rental ends.
        first, second = "hello from the rental\n", "bytes é and more\n"
        await ship_logs(api, host_id, rid, 0, first, seq=1)
        code, out, err = await cli("logs", rid)
        assert code == 0 and out == first, err
        follow = cli.start("logs", rid, "-f", "--since-offset", "6")
        await eventually(lambda: _async(cli.peek()[0] == first[6:]), what="the first output")
        await ship_logs(api, host_id, rid, len(first.encode()), second, seq=2)
        await eventually(lambda: _async(cli.peek()[0] == first[6:] + second), what="the new output")

        status, _ = await api.as_renter("DELETE", f"/rentals/{rid}")
        assert status == 202
        await api.agent_reports(rid, "stop_workload")
        assert await follow == 0
        out, err = cli.take()
        assert out == first[6:] + second

        # `stop` asks for the stop; with --wait it returns once the host has confirmed it.
        _, out, _ = await cli("rent", "--no-wait", "--json")
        other = json.loads(out)["id"]
        await api.agent_reports(other, "start_workload")
        code, out, err = await cli("stop", other)
        assert code == 0 and out.startswith(f"{other} stopping"), err
        waiting = cli.start("stop", other, "--wait", "--json")
        await eventually(lambda: _async(f"{other}: stopping" in cli.peek()[1]), what="the stop's progress line")
        await api.agent_reports(other, "stop_workload")
        assert await waiting == 0
        out, err = cli.take()
        assert json.loads(out)["state"] == "stopped", err
        code, out, err = await cli("rentals")
        assert out.startswith("no active rentals")
        code, out, err = await cli("rentals", "--all", "--json")
        assert [r["id"] for r in json.loads(out)["items"]] == [other, rid]

    async def test_an_unknown_rental_is_one_line_saying_how_to_list_them(self, cli: Cli) -> None:
        for argv in (("logs", "r_nope"), ("stop", "r_nope")):
            code, _, err = await cli(*argv)
            assert code == 1 and "(rental_not_found)" in one_line(err) and "gpumarket rentals" in err

    async def test_account_shows_money_and_quotas(self, cli: Cli, api: Api) -> None:
        code, out, err = await cli("account")
        assert code == 0, err
        assert out.splitlines()[0] == f"renter-1 (renter), account {api.renter.account_id}"
        assert "balance        $0.00" in out and "GPUs held      0" in out
        cli.env(url=cli.url, key=api.provider_key)
        code, out, err = await cli("account", "--json")
        assert code == 0 and "earnings" in json.loads(out)
        code, out, err = await cli("account")
        assert "earnings       $0.00 in all" in out


async def ship_logs(api: Api, host_id: str, rental_id: str, offset: int, text: str, *, seq: int) -> None:
    data = text.encode()
    message = protocol.WorkloadLogs(
        host_id=host_id, seq=1000 + seq, ts=datetime.now(UTC),
        body=protocol.WorkloadLogsBody(rental_id=rental_id, offset=offset, length=len(data), data=text),
    )  # fmt: skip
    async with api.master.db.session() as session:
        assert await hosts.handle_workload_logs(session, envelope(message))


@pytest.mark.parametrize(
    ("view", "failed"),
    [
        ({"state": "running", "started_at": "t"}, False),
        ({"state": "stopped", "started_at": "t", "failure_reason": None}, False),  # it ran and its workload ended
        ({"state": "stopped", "started_at": None, "failure_reason": None}, True),  # stopped before it ran (a queue's end)
        ({"state": "failed", "started_at": "t", "failure_reason": "workload exited with status 1"}, True),
        ({"state": "preempted", "started_at": "t"}, True),
    ],
)
def test_what_rent_counts_as_failed(view: dict[str, Any], failed: bool) -> None:
    assert outcome.failed({"id": "r-1", **view}) is failed


def test_money_columns_write_amounts_as_the_console_does_aligned_on_the_point() -> None:
    """Each cell is format_usd's (rates to the millionth, totals in cents), padded so the decimal points line up."""
    assert output.money_column(["0.450000", "1.000000", None], "rate") == ["$0.45", "$1.00", " -"]
    assert output.money_column(["0.450000", "0.003300", "1250.5"], "rate") == ["    $0.45", "    $0.0033", "$1,250.50"]
    assert output.money_column(["0.123456", "0.004"]) == [" $0.12", "<$0.01"]
