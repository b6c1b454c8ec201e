"""``gpumarket cluster create | list | show | stop | ssh`` against a real master served on loopback.

As in ``tests/test_renter_cli.py`` (whose ``Cli`` runs the command in a thread while the test's loop serves
the API), the agents' side is played by applying their command results as the ingestor would.
"""

from __future__ import annotations

import json
import shutil
from decimal import Decimal
from typing import Any

import pytest

from gpumarket.cli import main
from gpumarket.renter import sshcmds
from master.models import Rental
from shared.money import format_usd
from tests.apiclient import RTX, Api
from tests.helpers import eventually
from tests.test_cluster_network import answer_round, key
from tests.test_renter_cli import Cli, _async, cli, database_url, fast_polls, help_examples, one_line

__all__ = ["cli", "database_url", "fast_polls"]  # the fixtures, shared with test_renter_cli

ACTIONS = ["create", "list", "show", "stop", "ssh"]


async def hosts(api: Api, count: int, gpus: int = 1) -> list[str]:
    return [(await api.host(gpus))[0] for _ in range(count)]


async def running_cluster(cli: Cli, api: Api, nodes: int = 2) -> dict[str, object]:
    code, out, err = await cli("cluster", "create", "--nodes", str(nodes), "--no-wait", "--json")
    assert code == 0, err
    cluster = json.loads(out)
    for member in cluster["members"]:
        await api.agent_reports(member["rental_id"], "start_workload")
    return dict(cluster)


class TestHelp:
    @pytest.mark.parametrize("action", ACTIONS)
    def test_every_cluster_action_has_help_with_examples(self, action: str, capsys: pytest.CaptureFixture[str]) -> None:
        assert f"gpumarket cluster {action}" in help_examples(["cluster", action], capsys)

    def test_the_topology_command_keeps_its_options_under_its_new_name(self, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit) as done:
            main(["topology", "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "--fresh" in out and "--check" in out and "--agents" in out


class TestCreate:
    async def test_create_posts_once_and_waits_until_running_with_progress(self, cli: Cli, api: Api) -> None:
        """Progress lines on stderr until every member runs; then the id, size and the whole cluster's price per hour."""
        await hosts(api, 3)
        task = cli.start("cluster", "create", "--nodes", "2", "--gpus-per-node", "1", "--model", "RTX 4090",
                         "--image", "ubuntu:24.04", "--command", "sleep infinity")  # fmt: skip
        cluster_id = await eventually(lambda: _one_cluster(api), what="the cluster")
        await eventually(lambda: _async(f"{cluster_id}: starting" in cli.peek()[1]), what="the first progress line")
        assert not task.done()
        status, view = await api.as_renter("GET", f"/clusters/{cluster_id}")
        assert status == 200
        for member in view["members"]:
            [start] = await api.commands(member["rental_id"], "start_workload")
            assert start.args["workload"]["image"] == "ubuntu:24.04" and start.args["workload"]["command"] == ["sleep", "infinity"]
            await api.agent_reports(member["rental_id"], "start_workload")
        code = await task
        out, err = cli.take()
        assert code == 0, err
        assert f"{cluster_id}: running" in err
        rate = sum(Decimal(m["price_per_gpu_hour"]) for m in view["members"])
        assert out.startswith(f"{cluster_id} running: 2 x 1 x {RTX}, {format_usd(rate, 'rate')}/h"), out
        assert f"gpumarket cluster ssh {cluster_id} node-0" in err
        assert await api.count(Rental) == 2

    async def test_no_capacity_is_one_line_that_offers_queue(self, cli: Cli, api: Api) -> None:
        """409 insufficient_capacity (one of two hosts busy) is one line naming --queue, exit 1, and nothing is left."""
        busy, _ = await hosts(api, 2)
        status, _rental = await api.as_renter("POST", "/rentals", json={"offer_id": f"{busy}:{RTX}"})
        assert status == 201
        code, out, err = await cli("cluster", "create", "--nodes", "2")
        assert code == 1 and out == ""
        assert "(insufficient_capacity)" in one_line(err) and "add --queue to wait" in err and "gpumarket offers" in err
        assert await api.count(Rental) == 1

    async def test_queue_waits_with_the_queue_message_until_placed_and_running(self, cli: Cli, api: Api) -> None:
        """--queue: the cluster is created queued, the progress line carries its queue message, and once the busy host
        frees and the queue pass places it, the command finishes with the cluster running."""
        from master.services import queue as rental_queue

        busy, _ = await hosts(api, 2)
        status, rental = await api.as_renter("POST", "/rentals", json={"offer_id": f"{busy}:{RTX}"})
        assert status == 201
        task = cli.start("cluster", "create", "--nodes", "2", "--queue")
        cluster_id = await eventually(lambda: _one_cluster(api), what="the cluster")
        await eventually(lambda: _async("queued: will start when 2 hosts with 1 × any GPU each are free" in cli.peek()[1]),
                         what="the queued progress line")  # fmt: skip
        assert not task.done()
        await api.as_renter("DELETE", f"/rentals/{rental['id']}")
        await api.agent_reports(rental["id"], "stop_workload")
        assert await rental_queue.process_queue(api.master) == 1
        _, view = await api.as_renter("GET", f"/clusters/{cluster_id}")
        for member in view["members"]:
            await api.agent_reports(member["rental_id"], "start_workload")
        code = await task
        out, err = cli.take()
        assert code == 0, err
        assert out.startswith(f"{cluster_id} running: 2 x 1 x {RTX}"), out

    async def test_network_bounds_are_the_clusters_network(self, cli: Cli, api: Api) -> None:
        await hosts(api, 2)
        code, out, err = await cli("cluster", "create", "--nodes", "2", "--max-latency-ms", "2.5", "--max-loss-pct", "0",
                                   "--no-wait", "--json")  # fmt: skip
        assert code == 0, err
        assert json.loads(out)["network"] == {"max_latency_ms": 2.5, "max_loss_pct": 0.0, "min_mbit_s": None}

    async def test_wrong_options_are_one_line_exit_2(self, cli: Cli, api: Api) -> None:
        for argv, words in ((["--nodes", "1"], "gpumarket rent"), (["--nodes", "2", "--command", "true"], "--image")):
            code, _, err = await cli("cluster", "create", *argv)
            assert code == 2 and words in one_line(err), err
        assert await api.count(Rental) == 0


    async def test_show_gives_the_private_network_and_each_pairs_figures(self, cli: Cli, api: Api) -> None:
        """A container cluster's network: being made, then up with the worst round trip, the slowest pair and a table."""
        await hosts(api, 3)
        code, out, err = await cli("cluster", "create", "--nodes", "3", "--image", "ubuntu:24.04", "--command", "sleep infinity", "--no-wait", "--json")
        assert code == 0, err
        cluster = json.loads(out)
        ids = [m["rental_id"] for m in cluster["members"]]
        for rental_id in ids:
            await api.agent_reports(rental_id, "start_workload")
        code, out, err = await cli("cluster", "show", cluster["id"])
        assert code == 0 and "network    being made\n" in out, err
        keys = {r: key() for r in ids}
        await answer_round(api, ids, keys)
        await answer_round(api, ids, keys)
        await answer_round(api, ids, keys, measure=[{"from": 0, "rank": 1, "rtt_ms": 0.4, "mbit_s": 900.0, "path": "relay"},
                                                    {"from": 0, "rank": 2, "rtt_ms": 2.5, "mbit_s": 80.5},
                                                    {"from": 1, "rank": 2, "error": "node-2 did not answer"}])  # fmt: skip
        code, out, err = await cli("cluster", "show", cluster["id"])
        assert code == 0, err
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        subnet = view["private_network"]["subnet"]
        assert f"network    up on {subnet}: worst round trip 2.5 ms, slowest 80.5 Mbit/s, 1 pair(s) unreachable\n" in out
        pairs = out.split("between nodes (through the cluster's private network):\n", 1)[1].splitlines()
        assert pairs[0].split() == ["PAIR", "ROUND", "TRIP", "THROUGHPUT", "PATH", "PROBLEM"]
        assert pairs[1].split() == ["node-0", "<->", "node-1", "0.4", "ms", "900", "Mbit/s", "through", "the", "relays"]
        assert pairs[2].split() == ["node-0", "<->", "node-2", "2.5", "ms", "80.5", "Mbit/s", "wireguard-go"]  # each pair's path
        assert pairs[3].split()[:6] == ["node-1", "<->", "node-2", "-", "-", "wireguard-go"] and pairs[3].endswith("node-2 did not answer")


async def _one_cluster(api: Api) -> str | None:
    status, body = await api.as_renter("GET", "/clusters")
    assert status == 200
    return str(body["items"][0]["id"]) if body["items"] else None


class TestListShowStop:
    async def test_list_show_and_stop(self, cli: Cli, api: Api) -> None:
        host_ids = await hosts(api, 3)
        cluster = await running_cluster(cli, api, nodes=3)
        cid = str(cluster["id"])

        code, out, err = await cli("cluster", "list")
        assert code == 0, err
        header, row = out.splitlines()
        assert header.split() == ["ID", "STATE", "NODES", "GPUS", "MODEL", "RUNS", "$/H", "STARTED", "(UTC)"]
        assert row.split()[:4] == [cid, "running", "3", "3"] and "hold" in row

        code, out, err = await cli("cluster", "show", cid)
        assert code == 0, err
        assert out.startswith(f"{cid} running\n")
        assert "network    none: a hold cluster runs no container: it has no private network" in out
        member_lines = [line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"])]
        assert [line.split()[1] for line in member_lines] == ["node-0", "node-1", "node-2"]
        _, view = await api.as_renter("GET", f"/clusters/{cid}")
        names = {h: (await api.as_renter("GET", f"/hosts/{h}"))[1]["name"] for h in host_ids}
        for line, member in zip(member_lines, view["members"], strict=True):
            assert line.split()[2] == member["rental_id"] and names[member["host_id"]] in line and "running" in line
        assert "events:" in out and "starting -> running" in out

        task = cli.start("cluster", "stop", cid, "--wait")
        for rental_id in [str(m["rental_id"]) for m in view["members"]]:
            await eventually(lambda rid=rental_id: _stop_sent(api, rid), what="the stop command")  # type: ignore[misc]
            await api.agent_reports(rental_id, "stop_workload")
        code = await task
        out, err = cli.take()
        assert code == 0, err
        assert out == f"{cid} stopped\n"
        code, out, _ = await cli("cluster", "list")
        assert out.startswith("no active clusters")
        code, out, _ = await cli("cluster", "list", "--all", "--json")
        assert [c["state"] for c in json.loads(out)["items"]] == ["stopped"]

    async def test_an_unknown_cluster_is_one_line_saying_how_to_list_them(self, cli: Cli) -> None:
        for action in ("show", "stop"):
            code, out, err = await cli("cluster", action, "c-nosuchcluster")
            assert code == 1 and out == ""
            assert "(cluster_not_found)" in one_line(err) and "gpumarket cluster list --all" in err


async def _stop_sent(api: Api, rental_id: str) -> bool:
    return len(await api.commands(rental_id, "stop_workload")) == 1


class TestSsh:
    async def test_a_node_outside_the_cluster_or_not_running_is_one_line(self, cli: Cli, api: Api) -> None:
        await hosts(api, 2)
        code, out, err = await cli("cluster", "create", "--nodes", "2", "--no-wait", "--json")
        cluster = json.loads(out)
        cid, members = cluster["id"], cluster["members"]
        code, _, err = await cli("cluster", "ssh", cid, "node-2")
        assert code == 2 and "node-0 to node-1" in one_line(err)
        code, _, err = await cli("cluster", "ssh", cid, "node-1")
        assert code == 1 and f"node-1 of cluster {cid} ({members[1]['rental_id']}) is starting" in one_line(err)

    @pytest.mark.skipif(shutil.which("ssh") is None, reason="OpenSSH's client is not installed")
    async def test_ssh_goes_to_that_nodes_rental(self, cli: Cli, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
        """``cluster ssh C 1`` asks for node 1's rental's SSH ticket (the ``gpumarket ssh`` path): a hold serves
        nothing to log into, so the answer names that rental."""
        await hosts(api, 2)
        cluster = await running_cluster(cli, api)
        asked: list[str] = []
        real_ticket = sshcmds.ssh_ticket

        async def ticket(client: Any, rental_id: str) -> Any:
            asked.append(rental_id)
            return await real_ticket(client, rental_id)

        monkeypatch.setattr(sshcmds, "ssh_ticket", ticket)
        code, _, err = await cli("cluster", "ssh", str(cluster["id"]), "1", "nvidia-smi")
        members: Any = cluster["members"]
        assert asked == [members[1]["rental_id"]]
        assert code == 1 and f"rental {members[1]['rental_id']} holds GPUs" in one_line(err)
