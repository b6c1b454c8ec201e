"""Clusters: one rental over several hosts, placed together or not at all, stopped as one.

Driven through ``/api/v1/clusters`` on SQLite and PostgreSQL (the ``api`` fixture); the agents'
side is simulated by applying their command results as the ingestor would.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from master.models import Cluster, Command, GpuAllocation, Rental
from master.services.lifecycle.clusters import TRANSITIONS, ClusterState, Member, derive
from master.services.market import FailureCode
from master.services.rentals import allocation
from tests.apiclient import Api, assert_error
from tests.factories import create_principal

IMAGE = {"kind": "container", "image": "ubuntu:24.04", "command": ["sleep", "infinity"]}


async def create(api: Api, key: str | None = None, headers: dict[str, str] | None = None, **body: Any) -> tuple[int, Any]:
    return await api.call("POST", "/clusters", key or api.renter_key, json=body, headers=headers or {})


async def rows(api: Api, model: type[Any]) -> int:
    async with api.master.db.session() as session:
        return int(await session.scalar(select(func.count()).select_from(model)) or 0)


class TestCreate:
    async def test_three_nodes_land_on_three_distinct_hosts_with_the_cluster_env(self, api: Api) -> None:
        """Each node is a member rental on its own host, whose start command carries the distributed environment."""
        for _ in range(3):
            await api.host(2)
        status, cluster = await create(api, node_count=3, gpus_per_node=2, workload=IMAGE)
        assert status == 201, cluster
        assert cluster["id"].startswith("c-") and cluster["state"] == "starting"
        members = cluster["members"]
        assert [m["node_rank"] for m in members] == [0, 1, 2]
        assert len({m["host_id"] for m in members}) == 3
        assert all(len(m["gpu_uuids"]) == 2 and m["state"] == "starting" for m in members)
        for member in members:
            [start] = await api.commands(member["rental_id"], "start_workload")
            env = start.args["workload"]["env"]
            rank = member["node_rank"]
            assert env == {
                "MASTER_ADDR": "node-0", "MASTER_PORT": "29500", "WORLD_SIZE": "6", "RANK": str(rank * 2),
                "NODE_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "NNODES": "3",
                "PET_NNODES": "3", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "node-0",
                "PET_MASTER_PORT": "29500", "GLOO_SOCKET_IFNAME": "cluster0", "NCCL_SOCKET_IFNAME": "cluster0",
            }  # fmt: skip
            status, rental = await api.as_renter("GET", f"/rentals/{member['rental_id']}")
            assert (rental["cluster_id"], rental["node_rank"]) == (cluster["id"], member["node_rank"])

    async def test_not_enough_hosts_is_409_and_leaves_nothing(self, api: Api) -> None:
        """Two hosts cannot take three nodes: exceeds_fleet, and no cluster, rental, allocation or command remains."""
        await api.host(4)
        await api.host(4)
        status, body = await create(api, node_count=3)
        assert_error(status, body, 409, "exceeds_fleet")
        assert [await rows(api, m) for m in (Cluster, Rental, GpuAllocation, Command)] == [0, 0, 0, 0]

    async def test_busy_hosts_are_409_insufficient_capacity_and_leave_nothing(self, api: Api) -> None:
        """With one of three hosts full, the first two members would fit but the third cannot: nothing is kept."""
        hosts = [(await api.host(1))[0] for _ in range(3)]
        status, rental = await api.as_renter("POST", "/rentals", json={"offer_id": f"{hosts[2]}:NVIDIA GeForce RTX 4090"})
        assert status == 201, rental
        status, body = await create(api, node_count=3)
        assert_error(status, body, 409, "insufficient_capacity")
        assert "3 distinct hosts" in body["message"]
        assert [await rows(api, m) for m in (Cluster, Rental, GpuAllocation)] == [0, 1, 1]

    async def test_a_claim_failing_on_the_last_member_rolls_back_every_member(self, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
        """A race lost on node 2's GPUs (every claim of it fails) undoes nodes 0 and 1 too."""
        for _ in range(3):
            await api.host(1)
        real_claim = allocation.claim
        calls: list[str] = []

        async def claim(session: Any, rental: Rental, *args: Any, **kwargs: Any) -> bool:
            calls.append(rental.id)
            if rental.node_rank == 2:
                return False
            return await real_claim(session, rental, *args, **kwargs)

        monkeypatch.setattr(allocation, "claim", claim)
        status, body = await create(api, node_count=3)
        assert_error(status, body, 409, "insufficient_capacity")
        assert len(calls) > 3  # nodes 0 and 1 were claimed, then node 2 failed
        assert [await rows(api, m) for m in (Cluster, Rental, GpuAllocation, Command)] == [0, 0, 0, 0]
        monkeypatch.setattr(allocation, "claim", real_claim)
        status, cluster = await create(api, node_count=3)
        assert status == 201, cluster

    async def test_idempotency_key_returns_the_first_cluster(self, api: Api) -> None:
        """The same key and body answer 200 with the same cluster; another body is 409 idempotency_key_reused."""
        for _ in range(4):
            await api.host(1)
        first = await create(api, headers={"Idempotency-Key": "k1"}, node_count=2)
        again = await create(api, headers={"Idempotency-Key": "k1"}, node_count=2)
        assert (first[0], again[0], again[1]["id"]) == (201, 200, first[1]["id"])
        assert await rows(api, Rental) == 2
        status, body = await create(api, headers={"Idempotency-Key": "k1"}, node_count=3)
        assert_error(status, body, 409, "idempotency_key_reused")

    async def test_keeps_the_cluster_in_one_region(self, api: Api) -> None:
        """Two nodes go to the two hosts of one region, never one in each (the gang search's first preference)."""
        from tests.test_rentals_market import set_host

        small = [(await api.host(1))[0] for _ in range(2)]
        big = [(await api.host(4))[0] for _ in range(2)]
        for host in (small[0], big[0]):
            await set_host(api, host, region="eu-west")
        for host in (small[1], big[1]):
            await set_host(api, host, region="us-east")
        lone = (await api.host(4))[0]
        await set_host(api, lone, region="ap-south")
        status, cluster = await create(api, node_count=2)
        assert status == 201, cluster
        placed = sorted(m["host_id"] for m in cluster["members"])
        assert placed in (sorted([small[0], big[0]]), sorted([small[1], big[1]]))

    async def test_a_fragmented_fleet_still_takes_a_cluster(self, api: Api) -> None:
        """Hosts with 4, 4, 3 and 3 free GPUs after a 3-GPU rental: a 2 × 4 cluster lands on the two 4-free hosts."""
        fours = [(await api.host(4))[0] for _ in range(2)]
        three = (await api.host(3))[0]
        six = (await api.host(6))[0]
        status, rental = await api.as_renter("POST", "/rentals", json={"offer_id": f"{six}:NVIDIA GeForce RTX 4090", "gpu_count": 3})
        assert status == 201, rental
        status, cluster = await create(api, node_count=2, gpus_per_node=4)
        assert status == 201, cluster
        assert sorted(m["host_id"] for m in cluster["members"]) == sorted(fours)
        assert three not in {m["host_id"] for m in cluster["members"]}

    async def test_one_model_chosen_among_hosts_that_have_it_for_every_node(self, api: Api) -> None:
        """A large host of a model no other host has is never node 0 of a same-model cluster: both nodes get the other model."""
        from tests.test_rentals_market import H100

        await api.host(8, name=H100)
        rtx = [(await api.host(2))[0] for _ in range(2)]
        status, cluster = await create(api, node_count=2, gpus_per_node=2)
        assert status == 201, cluster
        assert sorted(m["host_id"] for m in cluster["members"]) == sorted(rtx)
        assert {m["gpu_model"] for m in cluster["members"]} == {"NVIDIA GeForce RTX 4090"}


class TestStates:
    @pytest.mark.parametrize(
        ("current", "members", "expected"),
        [
            ("pending", ["starting", "starting"], ["starting"]),
            ("pending", ["starting", "pending"], []),
            ("starting", ["running", "starting"], []),
            ("starting", ["running", "running"], ["running"]),
            ("starting", ["running", "failed"], ["failed"]),
            ("running", ["running", "failed"], ["degraded"]),
            ("running", ["running", "preempted"], ["degraded"]),
            ("degraded", ["running", "running"], ["running"]),
            ("running", ["stopping", "running"], ["stopping"]),
            ("stopping", ["stopped", "stopping"], []),
            ("stopping", ["stopped", "failed"], ["stopped"]),
            ("running", ["stopped", "stopped"], ["stopping", "stopped"]),
            ("stopped", ["running"], []),
            ("failed", ["running"], []),
        ],
    )
    def test_derived_state(self, current: str, members: list[str], expected: list[str]) -> None:
        """The cluster's state follows its members' as the table says, each step allowed by TRANSITIONS."""
        steps = derive(current, [Member(s) for s in members])
        assert steps == expected
        state = ClusterState(current)
        for step in steps:
            assert step in TRANSITIONS[state]
            state = step

    def test_a_lost_host_degrades_a_running_cluster(self) -> None:
        """A member whose host was lost counts as broken even before its rental is failed."""
        assert derive("running", [Member("running"), Member("running", host_lost=True)]) == [ClusterState.DEGRADED]

    def test_a_silent_host_degrades_a_running_cluster_only(self) -> None:
        """A member whose host is offline (within the grace period) degrades a running cluster; a starting one waits;
        the cluster runs again once no host is silent."""
        silent = Member("running", silent=True)
        assert derive("running", [Member("running"), silent]) == [ClusterState.DEGRADED]
        assert derive("starting", [Member("starting"), Member("starting", silent=True)]) == []
        assert derive("degraded", [Member("running"), silent]) == []
        assert derive("degraded", [Member("running"), Member("running")]) == [ClusterState.RUNNING]

    async def test_members_running_then_failing_move_the_cluster(self, api: Api) -> None:
        """Agents confirming every start make the cluster running; a member's workload failing makes a ``replace`` cluster degraded."""
        for _ in range(2):
            await api.host(1)
        _, cluster = await create(api, node_count=2, workload=IMAGE, restart_policy="replace")
        ids = [m["rental_id"] for m in cluster["members"]]
        await api.agent_reports(ids[0], "start_workload")
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "starting"
        await api.agent_reports(ids[1], "start_workload")
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "running" and view["started_at"] is not None
        async with api.master.db.session() as session:
            from master.services.rentals.lifecycle import fail_rental

            rental = await session.get(Rental, ids[1])
            assert rental is not None
            await fail_rental(session, rental, code=FailureCode.WORKLOAD_EXITED, reason="workload exited 1", at=api.master.clock.now())
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "degraded"
        assert [e["to"] for e in view["events"]] == ["pending", "starting", "running", "degraded"]


class TestDelete:
    async def test_delete_stops_every_member_then_the_cluster(self, api: Api) -> None:
        """DELETE sends each member's agent its stop; when every agent confirmed, the cluster is stopped."""
        for _ in range(3):
            await api.host(1)
        _, cluster = await create(api, node_count=3)
        ids = [m["rental_id"] for m in cluster["members"]]
        for rid in ids:
            await api.agent_reports(rid, "start_workload")
        status, view = await api.as_renter("DELETE", f"/clusters/{cluster['id']}")
        assert status == 202, view
        assert view["state"] == "stopping" and {m["state"] for m in view["members"]} == {"stopping"}
        for rid in ids:
            assert len(await api.commands(rid, "stop_workload")) == 1
            await api.agent_reports(rid, "stop_workload")
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "stopped" and view["stopped_at"] is not None
        status, again = await api.as_renter("DELETE", f"/clusters/{cluster['id']}")
        assert (status, again["state"]) == (202, "stopped")
        assert [len(await api.commands(rid, "stop_workload")) for rid in ids] == [1, 1, 1]

    async def test_another_renter_can_neither_see_nor_delete_it(self, api: Api) -> None:
        """Someone else's cluster is 404 cluster_not_found, absent from their list, and left running."""
        for _ in range(2):
            await api.host(1)
        _, cluster = await create(api, node_count=2)
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        for method in ("GET", "DELETE"):
            status, body = await api.call(method, f"/clusters/{cluster['id']}", other_key)
            assert_error(status, body, 404, "cluster_not_found")
        status, page = await api.call("GET", "/clusters", other_key)
        assert (status, page["total"]) == (200, 0)
        _, mine = await api.as_renter("GET", "/clusters")
        assert [c["id"] for c in mine["items"]] == [cluster["id"]]
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "starting"
