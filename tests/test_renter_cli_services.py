"""``gpumarket service create | list | show | scale | resume | delete | token`` against a real master served on loopback.

As in ``tests/test_renter_cli_clusters.py``: the CLI runs as ``main(argv)`` in a thread (``tests/test_renter_cli.py``'s
``Cli``) while the test's loop serves the API; the agents' side is played by applying their command results as the
ingestor would. The endpoint itself (the gateway) has its own tests.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal

import pytest

from master.models import Rental, Service
from master.services.endpoints import AutoscalerMemory
from shared.ids import secret_hash
from shared.money import format_usd
from tests.apiclient import Api
from tests.test_autoscale import MovableClock
from tests.test_renter_cli import Cli, cli, database_url, fast_polls, help_examples, one_line
from tests.test_service_backoff import PULL_DETAIL, fail_until, new_service

__all__ = ["cli", "database_url", "fast_polls"]  # the fixtures, shared with test_renter_cli

ACTIONS = ["create", "list", "show", "scale", "resume", "delete", "token"]
IMAGE = "gpumarket-test/openai-cpu:1"
TOKEN_LINE = re.compile(r"^token      (gms_\S+)$", re.MULTILINE)


async def create(cli: Cli, *argv: str) -> dict[str, object]:
    """``service create … --json``: the API's answer."""
    code, out, err = await cli("service", "create", *argv, "--json")
    assert code == 0, err
    return dict(json.loads(out))


async def token_hash(api: Api, service_id: str) -> str:
    async with api.master.db.session() as session:
        row = await session.get(Service, service_id)
        assert row is not None
        return row.token_hash


class TestHelp:
    @pytest.mark.parametrize("action", ACTIONS)
    def test_every_service_action_has_help_with_examples(self, action: str, capsys: pytest.CaptureFixture[str]) -> None:
        assert f"gpumarket service {action}" in help_examples(["service", action], capsys)


class TestCreate:
    async def test_create_prints_the_endpoint_and_the_token_once_with_how_to_call_it(self, cli: Cli, api: Api) -> None:
        """The endpoint and the token on stdout; on stderr that it is shown once, a curl line and an OpenAI base_url."""
        await api.host(2)
        code, out, err = await cli("service", "create", "chat", "--image", IMAGE, "--port", "8000", "--command", "serve --port 8000",
                                   "--env", "MODEL=tiny", "--min", "1", "--max", "3", "--target-inflight", "2")  # fmt: skip
        assert code == 0, err
        _, listed = await api.as_renter("GET", "/services")
        [service] = listed["items"]
        sid, endpoint = service["id"], service["endpoint_url"]
        assert out.splitlines()[0] == f"{sid} chat active: 1 to 3 replicas of {IMAGE}, port 8000"
        assert f"endpoint   {endpoint}\n" in out
        match = TOKEN_LINE.search(out)
        assert match is not None, out
        token = match[1]
        assert secret_hash(token) == await token_hash(api, sid)  # the token printed is the service's
        assert "shown this once" in err and f"gpumarket service token {sid}" in err
        assert f"curl -H 'Authorization: Bearer {token}' {endpoint}v1/models" in err
        assert f'base_url="{endpoint}v1"' in err
        _, view = await api.as_renter("GET", f"/services/{sid}")
        assert view["workload"]["command"] == ["serve", "--port", "8000"] and view["workload"]["env"] == {"MODEL": "tiny"}
        assert view["workload"]["ports"] == [8000] and view["scaling"]["target"] == 2.0
        assert await api.count(Rental) == 1

    async def test_a_template_gives_its_port_and_the_rule_its_options(self, cli: Cli, api: Api) -> None:
        """--template without --port takes the template's one port; --gpu-util, --period and the cooldowns make the rule."""
        await api.host(1)
        service = await create(cli, "llm", "--template", "vllm", "--min", "0", "--max", "2", "--gpu-util", "70", "--period", "60",
                               "--scale-down-cooldown", "120", "--health-path", "/v1/models")  # fmt: skip
        assert service["template"] == "vllm" and service["port"] == 8000 and service["health_path"] == "/v1/models"
        assert service["scaling"] == {"metric": "gpu_util", "threshold_pct": 70.0, "period_s": 60.0, "scale_down_below_pct": 35.0,
                                      "scale_up_cooldown_s": 30.0, "scale_down_cooldown_s": 120.0}  # fmt: skip
        assert str(service["token"]).startswith("gms_") and service["desired_replicas"] == 0

    async def test_the_same_idempotency_key_makes_one_service_and_shows_no_token_again(self, cli: Cli, api: Api) -> None:
        await api.host(2)
        argv = ("chat", "--image", IMAGE, "--port", "8000", "--idempotency-key", "deploy-42")
        code, first, err = await cli("service", "create", *argv)
        assert code == 0 and TOKEN_LINE.search(first), err
        code, again, err = await cli("service", "create", *argv)
        assert code == 0, err
        assert again.splitlines()[0] == first.splitlines()[0]
        assert TOKEN_LINE.search(again) is None and "token      not shown: this Idempotency-Key made the service before" in again
        async with api.master.db.session() as session:
            assert await session.get(Service, first.split()[0]) is not None
        _, listed = await api.as_renter("GET", "/services")
        assert listed["total"] == 1 and await api.count(Rental) == 1

    async def test_options_that_do_not_go_together_are_one_line_exit_2(self, cli: Cli, api: Api) -> None:
        for argv, words in (
            (["chat"], "--image IMAGE --port N, or --template T"),
            (["chat", "--image", IMAGE], "--image needs --port N"),
            (["chat", "--template", "vllm", "--command", "serve"], "--command goes with --image"),
            (["chat", "--template", "vllm", "--period", "60"], "--period goes with --gpu-util"),
            (["chat", "--image", IMAGE, "--port", "8000", "--bid", "0.2"], "needs both --interruptible and --bid"),
            (["chat", "--template", "base"], "template base serves ports none: say which one"),
        ):  # fmt: skip
            code, out, err = await cli("service", "create", *argv)
            assert code == 2 and out == "" and words in one_line(err), (argv, err)
        assert await api.count(Rental) == 0

    async def test_the_apis_refusal_is_one_line_with_its_message(self, cli: Cli, api: Api) -> None:
        for argv, words in (
            (["chat", "--image", IMAGE, "--port", "8000", "--min", "3", "--max", "2"], "min_replicas (3) must be at most max_replicas (2)"),
            (["Chat", "--image", IMAGE, "--port", "8000"], "(invalid_service_name)"),
            (["chat", "--template", "nosuch"], "(template_not_found)"),
        ):  # fmt: skip
            code, out, err = await cli("service", "create", *argv)
            assert code == 1 and out == "" and words in one_line(err), (argv, err)
        _, listed = await api.as_renter("GET", "/services")
        assert listed["total"] == 0


class TestListShowScaleDelete:
    async def test_list_show_scale_token_and_delete(self, cli: Cli, api: Api) -> None:
        await api.host(2)
        await api.host(2)
        service = await create(cli, "chat", "--image", IMAGE, "--port", "8000", "--min", "2", "--max", "3")
        sid = str(service["id"])
        replicas = [str(r["rental_id"]) for r in service["replica_rentals"]]  # type: ignore[attr-defined]
        await api.agent_reports(replicas[0], "start_workload")

        code, out, err = await cli("service", "list")
        assert code == 0, err
        header, row = out.splitlines()
        assert header.split() == ["ID", "NAME", "STATE", "READY/LIVE/DESIRED", "MIN..MAX", "ENDPOINT"]
        assert row.split() == [sid, "chat", "active", "0/2/2", "2..3", str(service["endpoint_url"])]

        code, out, err = await cli("service", "show", sid)
        assert code == 0, err
        _, view = await api.as_renter("GET", f"/services/{sid}")
        assert out.startswith(f"{sid} chat active\nendpoint   {view['endpoint_url']}\n")
        assert f"runs       {IMAGE}, port 8000, health check GET /health\n" in out
        assert "replicas   0 ready, 2 live (2 starting, 0 queued), 2 wanted, between 2 and 3\n" in out  # running, not yet healthy
        assert "scaling    requests in flight: 4 per replica; waits 30 s between scale-ups, 300 s between scale-downs\n" in out
        assert f"cost       {format_usd(Decimal(view['cost_so_far']), 'total')} so far\n" in out
        assert f"token      {view['token_prefix']}…" in out
        replica_lines = [line for line in out.splitlines() if line.split()[:1] in ([r] for r in replicas)]
        assert [line.split()[:3] for line in replica_lines] == [[r["rental_id"], r["state"], "no"] for r in view["replica_rentals"]]
        assert "events:" in out and "created  2 replicas: created with 2 to 3 replicas" in out

        code, out, err = await cli("service", "scale", sid, "--max", "5", "--min", "3")
        assert code == 0, err
        assert out == f"{sid}: 3 to 5 replicas, 3 wanted now, 0 ready\n"
        code, _, err = await cli("service", "scale", sid)
        assert code == 2 and "give --min N, --max N or both" in one_line(err)
        code, _, err = await cli("service", "scale", sid, "--min", "6")
        assert code == 1 and "(invalid_replica_bounds)" in one_line(err)

        old = await token_hash(api, sid)
        code, out, err = await cli("service", "token", sid)
        assert code == 0, err
        match = TOKEN_LINE.search(out)
        assert match is not None and secret_hash(match[1]) == await token_hash(api, sid) != old
        assert "the old token" in err and "shown this once" in err

        code, out, err = await cli("service", "delete", sid)
        assert code == 0, err
        assert out == f"{sid} deleted: its endpoint is closed; 2 replica(s) stopping\n"
        for rental_id in replicas:
            assert len(await api.commands(rental_id, "stop_workload")) == 1
        code, out, _ = await cli("service", "list")
        assert out.startswith("no services;")
        code, out, _ = await cli("service", "list", "--all", "--json")
        assert [s["state"] for s in json.loads(out)["items"]] == ["deleted"]
        code, _, err = await cli("service", "scale", sid, "--max", "2")
        assert code == 1 and "(service_deleted)" in one_line(err)

    async def test_an_unknown_service_is_one_line_saying_how_to_list_them(self, cli: Cli) -> None:
        for argv in (["show"], ["delete"], ["token"], ["scale", "--max", "2"]):
            code, out, err = await cli("service", argv[0], "svc-nosuchservice", *argv[1:])
            assert code == 1 and out == ""
            assert "(service_not_found)" in one_line(err) and "gpumarket service list --all" in err


class TestFailing:
    async def test_show_says_why_folds_the_failed_replicas_and_resume_tries_again(self, cli: Cli, api: Api) -> None:
        """A service whose image cannot be pulled: the cause and what happens next, the failed replicas counted (listed
        with --all), and ``service resume`` makes it active again."""
        await api.host(1)
        clock = MovableClock(at=api.master.clock.now())
        api.master.clock = clock
        sid, _ = await new_service(api)
        await fail_until(api, clock, sid, AutoscalerMemory(), failures=api.master.settings.service_failing_after)

        code, out, err = await cli("service", "show", sid)
        assert code == 0, err
        assert out.startswith(f"{sid} chat failing\n")
        assert "failure    image_pull_failed (provider's), 3 replica(s) in a row since " in out and PULL_DETAIL in out
        assert "next       a replica at " in out and f"`gpumarket service resume {sid}` tries now" in out
        assert f"(3 failed: `gpumarket service show {sid} --all` lists them)" in out
        _, full = await api.as_renter("GET", f"/services/{sid}?failed=true")
        failed = [str(r["rental_id"]) for r in full["replica_rentals"]]
        assert len(failed) == 3 and not any(line.startswith(tuple(failed)) for line in out.splitlines())
        code, out, err = await cli("service", "show", sid, "--all")
        assert code == 0, err
        assert sorted(line.split()[0] for line in out.splitlines() if line.startswith(tuple(failed))) == sorted(failed)

        code, out, err = await cli("service", "resume", sid)
        assert code == 0, err
        assert out.startswith(f"{sid} active: replicas are rented again")
        _, view = await api.as_renter("GET", f"/services/{sid}")
        assert view["state"] == "active" and view["failure"] is None and view["events"][-1]["kind"] == "resumed"
