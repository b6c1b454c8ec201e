"""The master's side of a cluster's private network: the three rounds of ``create_cluster``, the figures, failures,
``delete_cluster`` at the end, a replacement joining (``master/services/lifecycle/cluster_network.py``).

Driven through ``/api/v1`` on SQLite and PostgreSQL (the ``api`` fixture); the agents' answers are applied as the
ingestor would. The agent's side, on a real engine and real WireGuard, is ``tests/test_clusternet.py``.
"""

from __future__ import annotations

import base64
import ipaddress
import os
from typing import Any

import pytest

from master.models import Command
from master.services.clusters import policy as cluster_policy
from master.services.lifecycle import cluster_network
from shared import protocol
from shared.crypto import certificate_public_key
from shared.crypto.tokens import verify_connect_token
from tests.apiclient import Api
from tests.test_cluster_policy import running_cluster, view, workload_fails
from tests.test_clusters import create


def key() -> str:
    return base64.b64encode(os.urandom(32)).decode()


async def opened(api: Api, rental_id: str) -> list[Command]:
    return [c for c in await api.commands(rental_id, "create_cluster") if c.state != "succeeded"]


async def answer_round(api: Api, ids: list[str], keys: dict[str, str], *, measure: list[dict[str, Any]] | None = None) -> list[str]:
    """Each member's agent answers its open ``create_cluster``; returns what the last answer issued."""
    issued: list[str] = []
    for rental_id in ids:
        [command] = await opened(api, rental_id)
        rank = command.args["rank"]
        data = {"public_key": keys[rental_id], "address": f"10.64.0.{rank + 1}", "listen_port": 51000 + rank,
                "endpoints": [f"127.0.0.1:{51000 + rank}"], "peers": len(command.args.get("peers", [])),
                "relay_url": f"wss://relay-{rank}.example:8443/v1/connect",
                "measurements": [{k: v for k, v in m.items() if k != "from"} for m in (measure or [])
                                 if command.args.get("measure") and m["from"] == rank]}  # fmt: skip
        issued = await api.agent_answers(command, data=data)
    return issued


class TestRounds:
    async def test_join_peers_measure_then_up_with_figures(self, api: Api) -> None:
        """Round 1 to each running member; round 2 (peers) only once all are keyed; round 3 (measure) once all are peered."""
        for _ in range(3):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 3)
        first = [await opened(api, r) for r in ids]
        assert [len(c) for c in first] == [1, 1, 1]
        subnet = first[0][0].args["subnet"]
        assert ipaddress.IPv4Network(subnet).subnet_of(protocol.CLUSTER_SUPERNET)
        assert [c[0].args for c in first] == [
            {"cluster_id": cluster_id, "rental_id": r, "rank": rank, "node_count": 3, "subnet": subnet, "peers": [], "measure": False}
            for rank, r in enumerate(ids)
        ]
        body = await view(api, cluster_id)
        assert body["private_network"]["state"] == "creating"
        assert [n["address"] for n in body["private_network"]["nodes"]] == [str(ipaddress.IPv4Network(subnet)[i]) for i in (1, 2, 3)]

        keys = {r: key() for r in ids}
        # Two of three keyed: no peers are sent yet (the third's key is unknown).
        [command] = await opened(api, ids[0])
        await api.agent_answers(command, data={"public_key": keys[ids[0]], "address": "x", "listen_port": 1, "endpoints": ["127.0.0.1:51000"],
                                               "relay_url": "wss://relay-0.example:8443/v1/connect"})  # fmt: skip
        assert await opened(api, ids[1]) and len(await api.commands(ids[0], "create_cluster")) == 1
        [command] = await opened(api, ids[1])
        await api.agent_answers(command, data={"public_key": keys[ids[1]], "address": "x", "listen_port": 1, "endpoints": ["127.0.0.1:51001"]})
        [command] = await opened(api, ids[2])
        issued = await api.agent_answers(command, data={"public_key": keys[ids[2]], "address": "x", "listen_port": 1, "endpoints": []})
        # Round 2 one member at a time: node 0 first; node 1 once node 0 has its peers.
        assert [len(await opened(api, r)) for r in ids] == [1, 0, 0]
        [peers_for_0] = await opened(api, ids[0])
        assert issued == [peers_for_0.id]  # the ingestor publishes it at once
        issued = await api.agent_answers(peers_for_0, data={"public_key": keys[ids[0]], "address": "x", "listen_port": 1})
        round2 = [[peers_for_0], *[await opened(api, r) for r in ids[1:]]]
        assert [len(c) for c in round2] == [1, 1, 0] and issued == [round2[1][0].id]
        peers0 = round2[0][0].args["peers"]
        assert [{k: v for k, v in p.items() if k != "relay_token"} for p in peers0] == [
            {"rank": 1, "public_key": keys[ids[1]], "endpoint": "127.0.0.1:51001"}, {"rank": 2, "public_key": keys[ids[2]]}]
        # Node 0 said where its relay is: the others get a token for a wg stream to it through that relay, signed by the CA.
        peers1 = round2[1][0].args["peers"]
        assert peers1[0]["relay_url"] == "wss://relay-0.example:8443/v1/connect"
        claims = verify_connect_token(certificate_public_key(api.master.ca.certificate), peers1[0]["relay_token"],
                                      now=api.master.clock.now().timestamp())  # fmt: skip
        assert (claims.kind, claims.rental_id, claims.port) == ("wg", ids[0], cluster_network.RELAY_PORT)
        assert claims.host_id == first[0][0].host_id and claims.expires_at > api.master.clock.now().timestamp() + 86400
        assert not round2[0][0].args["measure"]
        assert (await view(api, cluster_id))["private_network"]["state"] == "connecting"

        await answer_round(api, ids[1:], keys)
        round3 = [await opened(api, r) for r in ids]
        assert all(c[0].args["measure"] and c[0].args["peers"] for c in round3)
        assert (await view(api, cluster_id))["private_network"]["state"] == "measuring"
        measured = [{"from": 0, "rank": 1, "rtt_ms": 0.4, "mbit_s": 900.0, "path": "direct"},
                    {"from": 0, "rank": 2, "rtt_ms": 0.5, "mbit_s": 800.0, "path": "relay"},
                    {"from": 1, "rank": 2, "rtt_ms": 0.6, "mbit_s": 700.0, "path": "direct"}]  # fmt: skip
        await answer_round(api, ids, keys, measure=measured)
        body = await view(api, cluster_id)
        net = body["private_network"]
        assert net["state"] == "up" and net["measured_at"]
        assert net["pairs"] == [
            {"a": 0, "b": 1, "rtt_ms": 0.4, "mbit_s": 900.0, "loss_pct": None, "error": None, "path": "direct"},
            {"a": 0, "b": 2, "rtt_ms": 0.5, "mbit_s": 800.0, "loss_pct": None, "error": None, "path": "relay"},
            {"a": 1, "b": 2, "rtt_ms": 0.6, "mbit_s": 700.0, "loss_pct": None, "error": None, "path": "direct"},
        ]
        assert [n["step"] for n in net["nodes"]] == ["measured"] * 3
        assert any(e["cause"].startswith(f"private network up on {subnet}: node-0 ↔ node-1 0.4 ms, 900.0 Mbit/s") for e in body["events"])
        assert [await opened(api, r) for r in ids] == [[], [], []]  # nothing more is sent

    async def test_a_failed_join_fails_the_network_and_says_why(self, api: Api) -> None:
        for _ in range(2):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 2)
        [command] = await opened(api, ids[1])
        await api.agent_answers(command, ok=False, detail="wireguard-go is not installed on this host", data={"code": "cluster_network_unavailable"})
        body = await view(api, cluster_id)
        assert body["private_network"]["state"] == "failed"
        assert body["private_network"]["reason"] == f"node-1 ({ids[1]}): wireguard-go is not installed on this host"
        assert any(e["cause"].startswith("private network failed: node-1") for e in body["events"])
        [command] = await opened(api, ids[0])
        await api.agent_answers(command, data={"public_key": key(), "address": "x", "listen_port": 1})
        assert len(await api.commands(ids[0], "create_cluster")) == 1  # no peers round after a failure

    async def test_stopping_the_cluster_deletes_each_members_tunnel(self, api: Api) -> None:
        for _ in range(2):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 2)
        status, _ = await api.as_renter("DELETE", f"/clusters/{cluster_id}")
        assert status == 202
        for rental_id in ids:
            [delete] = await api.commands(rental_id, "delete_cluster")
            assert delete.args == {"cluster_id": cluster_id, "rental_id": rental_id}
        assert (await view(api, cluster_id))["private_network"]["state"] == "deleted"
        for rental_id in ids:  # a late answer to round 1 changes nothing
            [command] = await api.commands(rental_id, "create_cluster")
            await api.agent_answers(command, data={"public_key": key(), "address": "x", "listen_port": 1})
        assert (await view(api, cluster_id))["private_network"]["state"] == "deleted"
        assert [len(await api.commands(r, "create_cluster")) for r in ids] == [1, 1]

    async def test_a_hold_cluster_has_no_network(self, api: Api) -> None:
        for _ in range(2):
            await api.host(1)
        status, cluster = await create(api, node_count=2)
        assert status == 201, cluster
        for member in cluster["members"]:
            await api.agent_reports(member["rental_id"], "start_workload")
        body = await view(api, cluster["id"])
        assert body["private_network"]["state"] == "none" and "runs no container" in body["private_network"]["reason"]
        assert [await api.commands(m["rental_id"], "create_cluster") for m in cluster["members"]] == [[], []]


class TestReplacement:
    async def test_a_replacement_joins_and_every_member_gets_the_new_peers(self, api: Api) -> None:
        for _ in range(3):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 2, restart_policy="replace")
        keys = {r: key() for r in ids}
        await answer_round(api, ids, keys)
        await answer_round(api, ids, keys)
        await answer_round(api, ids, keys, measure=[{"from": 0, "rank": 1, "rtt_ms": 1.0, "mbit_s": 10.0}])
        assert (await view(api, cluster_id))["private_network"]["state"] == "up"
        await workload_fails(api, ids[1])
        await cluster_policy.replace_broken_members(api.master)
        body = await view(api, cluster_id)
        new = next(m["rental_id"] for m in body["members"] if m["rental_id"] not in ids)
        await api.agent_reports(new, "start_workload")
        [join] = await opened(api, new)
        assert join.args["rank"] == 1 and join.args["peers"] == []
        assert (await view(api, cluster_id))["private_network"]["state"] == "creating"
        # The broken member's late answer is not the new one's.
        [old] = [c for c in await api.commands(ids[1], "create_cluster") if c.args["measure"]]
        keys[new] = key()
        await api.agent_answers(join, data={"public_key": keys[new], "address": "x", "listen_port": 1, "endpoints": ["127.0.0.1:52000"]})
        [peers0] = await opened(api, ids[0])
        assert peers0.args["peers"] == [{"rank": 1, "public_key": keys[new], "endpoint": "127.0.0.1:52000"}]
        assert await opened(api, new) == []  # one member at a time: node 1 once node 0 has the new key
        await api.agent_answers(peers0, data={"public_key": keys[ids[0]], "address": "x", "listen_port": 1})
        [peers1] = await opened(api, new)
        assert peers1.args["peers"][0]["public_key"] == keys[ids[0]]
        assert old.state == "succeeded"


@pytest.mark.parametrize("cluster_id", ["c-0", "c-1f2e3d4c5b6a7980", "c-" + "z" * 61])
def test_subnet_for_is_a_slash_24_of_the_supernet_and_stable(cluster_id: str) -> None:
    subnet = ipaddress.IPv4Network(cluster_network.subnet_for(cluster_id))
    assert subnet.prefixlen == 24 and subnet.subnet_of(protocol.CLUSTER_SUPERNET)
    assert cluster_network.subnet_for(cluster_id) == str(subnet)
    assert cluster_network.node_address(str(subnet), 0) == str(subnet[1])

