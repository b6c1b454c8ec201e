"""The master's side of a cluster's three paths (docs/clusters.md, "Three paths"): the hello's ``cluster_network``
kept and shown, fabric addresses given to members on a declared fabric, peers told each other's fabric address only
when their pair is on one fabric, every pair's path in the view, and placement preferring one fabric when a cluster
asks for more than a tunnel carries (``cluster_paths``, ``cluster_network``, ``clusters.placement``).

Driven through ``/api/v1`` on SQLite and PostgreSQL (the ``api`` fixture); agents' answers are applied as the ingestor
would (``answer_round``). The agent's side, with real interfaces, is ``tests/test_cluster_fabric.py``.
"""

from __future__ import annotations

import ipaddress
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import select

from master.models import Host
from master.services.lifecycle import cluster_paths
from master.telemetry.hosts import handle_hello
from shared import protocol
from tests.apiclient import Api
from tests.factories import envelope, gpu_info
from tests.test_cluster_bounds import hosts_of, placed_on, stop
from tests.test_cluster_network import answer_round, key, opened
from tests.test_cluster_policy import running_cluster, view
from tests.test_clusters import IMAGE, create

FABRIC = {"name": "dc1", "parent": "eth1", "subnet": "10.200.0.0/24"}


async def declare(api: Api, *host_ids: str, fabric: dict[str, Any] | None = None, kernel: bool = False, owner: str | None = None,
                  rdma: list[str] | None = None) -> None:  # fmt: skip
    """What these hosts' hellos said of their cluster network (as ``handle_hello`` keeps it)."""
    facts = protocol.ClusterNetworkFacts.model_validate({"kernel_wireguard": kernel, "wireguard_go": True, "fabric": fabric,
                                                         "rdma_devices": rdma or []})  # fmt: skip
    async with api.master.db.session() as session:
        for host in (await session.scalars(select(Host).where(Host.id.in_(host_ids)))).all():
            host.facts = {**(host.facts or {}), "cluster_network": facts.model_dump(mode="json")}
            if owner is not None:
                host.owner_id = owner
        await session.commit()


class TestFabricMembers:
    async def test_members_on_one_fabric_get_addresses_and_each_others(self, api: Api) -> None:
        """Two of three hosts declare the fabric: their members get distinct addresses of it in round 1, and in round 2
        each hears the other's fabric address (not the third member's, whose pair is a tunnel); the view says so."""
        hosts = [(await api.host(1))[0] for _ in range(3)]
        await declare(api, hosts[0], hosts[1], fabric=FABRIC)
        cluster_id, ids = await running_cluster(api, 3)
        on_fabric = [host in hosts[:2] for host in await hosts_of(api, ids)]
        keys = {r: key() for r in ids}
        fabric_args = [(await opened(api, r))[0].args.get("fabric") for r in ids]
        assert [a is not None for a in fabric_args] == on_fabric
        addresses = {rank: a["address"] for rank, a in enumerate(fabric_args) if a}
        assert len(set(addresses.values())) == 2
        assert all(ipaddress.IPv4Address(a) in ipaddress.IPv4Network("10.200.0.0/24") for a in addresses.values())
        assert "10.200.0.1" not in addresses.values()  # kept for the provider's gateway
        await answer_round(api, ids, keys)
        await answer_round(api, ids, keys)
        for rank, rental_id in enumerate(ids):  # each member's last round: the peers with their fabric address, or none
            told = {p["rank"]: p.get("fabric_address") for p in (await opened(api, rental_id))[0].args["peers"]}
            assert told == {other: addresses.get(other) if rank in addresses else None for other in range(3) if other != rank}
        shown = (await view(api, cluster_id))["private_network"]
        paired = sorted(addresses)
        assert [(x["a"], x["b"], x["path"]) for x in shown["links"]] == [
            (a, b, "fabric" if [a, b] == paired else "wireguard-go") for a, b in ((0, 1), (0, 2), (1, 2))]
        assert [n["fabric_address"] for n in shown["nodes"]] == [addresses.get(rank) for rank in range(3)]

    async def test_another_providers_fabric_of_the_same_name_is_not_shared(self, api: Api) -> None:
        """Same fabric name, different owners: each gets an address, but the pair is a tunnel."""
        hosts = [(await api.host(1))[0] for _ in range(2)]
        await declare(api, hosts[0], fabric=FABRIC)
        await declare(api, hosts[1], fabric=FABRIC, owner=await _another_owner(api))
        cluster_id, ids = await running_cluster(api, 2)
        keys = {r: key() for r in ids}
        assert all([(await opened(api, r))[0].args.get("fabric") for r in ids])
        await answer_round(api, ids, keys)
        await answer_round(api, ids, keys)
        for rental_id in ids:
            assert [p.get("fabric_address") for p in (await opened(api, rental_id))[0].args["peers"]] == [None]
        assert [x["path"] for x in (await view(api, cluster_id))["private_network"]["links"]] == ["wireguard-go"]


async def _another_owner(api: Api) -> str:
    """An account other than the host's owner (the renter's: any account id will do for the fabric's key)."""
    status, account = await api.as_renter("GET", "/account")
    assert status == 200, account
    return str(account["id"])


class TestRdmaDevices:
    async def test_members_on_a_fabric_that_lets_rdma_through_are_started_with_the_hosts_devices(self, api: Api) -> None:
        """The fabric says ``rdma``: each member's start command lists its host's devices; a fabric without it, none."""
        hosts = [(await api.host(1))[0] for _ in range(2)]
        await declare(api, *hosts, fabric={**FABRIC, "rdma": True}, rdma=["/dev/infiniband/uverbs0"])
        _, ids = await running_cluster(api, 2)
        assert [(await api.commands(r, "start_workload"))[0].args.get("rdma_devices") for r in ids] == [["/dev/infiniband/uverbs0"]] * 2
        await declare(api, *hosts, fabric=FABRIC, rdma=["/dev/infiniband/uverbs0"])
        more = [(await api.host(1))[0] for _ in range(2)]
        await declare(api, *more, fabric=FABRIC, rdma=["/dev/infiniband/uverbs0"])
        _, others = await running_cluster(api, 2)
        assert [(await api.commands(r, "start_workload"))[0].args.get("rdma_devices") for r in others] == [None, None]


class TestFabricPlacement:
    async def test_more_than_a_tunnel_carries_goes_to_one_fabric(self, api: Api) -> None:
        """Four hosts, two of them on one fabric: a cluster asking above ``TUNNEL_MAX_MBIT_S`` lands on those two, every
        time."""
        hosts = [(await api.host(1))[0] for _ in range(4)]
        await declare(api, hosts[1], hosts[3], fabric=FABRIC)
        wanted = {"min_mbit_s": cluster_paths.TUNNEL_MAX_MBIT_S * 2}
        for _ in range(3):  # not by chance
            status, cluster = await create(api, node_count=2, workload=IMAGE, network=wanted)
            assert status == 201, cluster
            assert {m["host_id"] for m in cluster["members"]} == {hosts[1], hosts[3]}
            await stop(api, cluster["id"], [m["rental_id"] for m in cluster["members"]])

    async def test_without_a_fabric_with_room_the_whole_fleet_is_tried(self, api: Api) -> None:
        """Only one host on the fabric: the fabric group is too small, and the cluster is placed as before."""
        hosts = [(await api.host(1))[0] for _ in range(2)]
        await declare(api, hosts[0], fabric=FABRIC)
        assert await placed_on(api, node_count=2, network={"min_mbit_s": cluster_paths.TUNNEL_MAX_MBIT_S * 2}) == set(hosts)


class TestHostFacts:
    async def test_the_hello_keeps_cluster_network_and_the_host_view_shows_it(self, api: Api) -> None:
        """Through ``handle_hello``, as the ingestor applies a hello: kept beside the host's own facts, shown on its view."""
        host_id, uuids = await api.host(1)
        facts = protocol.ClusterNetworkFacts(kernel_wireguard=True, wireguard_go=True, fabric=FABRIC, rdma_names=["mlx5_0"],
                                             rdma_devices=["/dev/infiniband/uverbs0"])  # fmt: skip
        message = protocol.Hello(host_id=host_id, seq=10_000, ts=datetime.now(UTC), body=protocol.HelloBody(
            agent_version="test", gpu_backend="sim", host={"hostname": "test", "cluster_network": "forged by the agent's dict"},
            gpus=[gpu_info(0, uuid=uuids[0])], cluster_network=facts,
        ))  # fmt: skip
        async with api.master.db.session() as session:
            await handle_hello(session, envelope(message))
            await session.commit()
        status, host = await api.as_provider("GET", f"/hosts/{host_id}")
        assert status == 200, host
        assert host["cluster_network"] == facts.model_dump(mode="json")
        assert host["cluster_network"]["fabric"] == {**FABRIC, "vlan": None, "rdma": False}

    def test_a_hello_whose_paths_do_not_parse_is_refused(self) -> None:
        with pytest.raises(ValidationError):
            protocol.HelloBody(agent_version="t", gpu_backend="sim", gpus=[],
                               cluster_network={"fabric": {"name": "dc1", "parent": "eth1", "subnet": "8.8.8.0/24"}})
