"""Clusters' restart policies acted on: ``stop`` stops every member when one breaks, ``replace`` places a new one.

Driven through ``/api/v1`` on SQLite and PostgreSQL (the ``api`` fixture); agents' results are applied
as the ingestor would, lost hosts as the heartbeat sweep does, replacements as the queue pass does.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from sqlalchemy import select

from master.models import Rental
from master.services.clusters import policy as cluster_policy
from master.services.market import FailureCode
from master.services.rentals import lifecycle as rental_lifecycle
from tests.apiclient import Api
from tests.test_clusters import IMAGE, create
from tests.test_rentals_market import set_host


async def running_cluster(api: Api, nodes: int, **body: Any) -> tuple[str, list[str]]:
    """A cluster of ``nodes`` single-GPU nodes whose every member the agents confirmed running."""
    status, cluster = await create(api, node_count=nodes, workload=IMAGE, **body)
    assert status == 201, cluster
    ids = [m["rental_id"] for m in cluster["members"]]
    for rental_id in ids:
        await api.agent_reports(rental_id, "start_workload")
    return cluster["id"], ids


async def view(api: Api, cluster_id: str) -> dict[str, Any]:
    status, body = await api.as_renter("GET", f"/clusters/{cluster_id}")
    assert status == 200, body
    return dict(body)


async def workload_fails(api: Api, rental_id: str) -> None:
    async with api.master.db.session() as session:
        rental = await session.get(Rental, rental_id)
        assert rental is not None
        await rental_lifecycle.fail_rental(session, rental, code=FailureCode.WORKLOAD_EXITED, reason="workload exited with code 1", at=api.master.clock.now())


class TestStopPolicy:
    async def test_a_failed_member_stops_the_others_and_the_cluster_ends_failed(self, api: Api) -> None:
        """restart_policy stop: node 1's failure sends nodes 0 and 2 stop_workload; the cluster ends failed, saying why."""
        for _ in range(3):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 3)
        await workload_fails(api, ids[1])
        body = await view(api, cluster_id)
        assert body["state"] == "stopping"
        assert [m["state"] for m in body["members"]] == ["stopping", "failed", "stopping"]
        for rental_id in (ids[0], ids[2]):
            [stop] = await api.commands(rental_id, "stop_workload")
            assert ids[1] in stop.args["reason"]
            await api.agent_reports(rental_id, "stop_workload")
        assert await api.commands(ids[1], "stop_workload") == []
        body = await view(api, cluster_id)
        assert body["state"] == "failed" and body["stopped_at"] is not None
        assert body["failure_reason"].startswith(f"node 1 ({ids[1]}) failed: workload exited with code 1")
        assert "restart_policy stop" in body["failure_reason"]
        assert [e["to"] for e in body["events"]] == ["pending", "starting", "running", "stopping", "failed"]

    async def test_a_preempted_member_stops_the_cluster(self, api: Api) -> None:
        """An on-demand rental preempting an interruptible cluster's node 0 stops node 1 too, once its start is confirmed."""
        hosts = [(await api.host(1))[0] for _ in range(2)]
        cluster_id, ids = await running_cluster(api, 2, kind="interruptible", bid="0.20")
        async with api.master.db.session() as session:
            first = await session.get(Rental, ids[0])
            assert first is not None and first.host_id in hosts
            target = first.host_id
        status, rental = await api.as_renter("POST", "/rentals", json={"offer_id": f"{target}:NVIDIA GeForce RTX 4090"})
        assert status == 201, rental
        body = await view(api, cluster_id)
        assert [m["state"] for m in body["members"]] == ["running", "running"]  # until the new rental really starts
        await api.agent_reports(rental["id"], "start_workload")
        body = await view(api, cluster_id)
        assert [m["state"] for m in body["members"]] == ["preempted", "stopping"]
        assert len(await api.commands(ids[1], "stop_workload")) == 1
        await api.agent_reports(ids[1], "stop_workload")
        body = await view(api, cluster_id)
        assert body["state"] == "failed" and "preempted" in body["failure_reason"]

    async def test_members_confirmed_at_the_same_moment_run_the_cluster(self, api: Api) -> None:
        """Two agents' start results applied at once (two masters): neither transaction may decide from the other member's
        old state, or the cluster would stay starting for good (the cluster row is locked, and the members re-read)."""
        for _ in range(3):
            await api.host(1)
        for attempt in range(3):
            status, cluster = await create(api, node_count=3, workload=IMAGE)
            assert status == 201, cluster
            starts = [c for m in cluster["members"] for c in await api.commands(m["rental_id"], "start_workload")]
            await asyncio.gather(*(api.agent_answers(c) for c in starts))
            body = await view(api, cluster["id"])
            assert [m["state"] for m in body["members"]] == ["running"] * 3
            assert body["state"] == "running", (attempt, body["events"])
            status, _ = await api.as_renter("DELETE", f"/clusters/{cluster['id']}")
            for m in cluster["members"]:
                await api.agent_reports(m["rental_id"], "stop_workload")

    async def test_a_silent_members_host_degrades_the_cluster_until_it_is_back(self, api: Api) -> None:
        """A member's agent killed: its host goes offline (the sweep), and the cluster is degraded at once, the renter told
        why in its events, nothing stopped; when the host is heard again within the grace period the cluster runs again."""
        for _ in range(2):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 2)
        async with api.master.db.session() as session:
            member = await session.get(Rental, ids[1])
            assert member is not None and member.host_id is not None
            host_id = member.host_id
        silent_since = api.master.clock.now() - timedelta(minutes=1)
        await set_host(api, host_id, state="offline")
        async with api.master.db.session() as session:  # the sweep's transaction: state changed, then the rentals told
            await rental_lifecycle.note_host_unreachable(session, host_id, since=silent_since)
        body = await view(api, cluster_id)
        assert body["state"] == "degraded"
        assert body["events"][-1]["cause"].startswith(f"node 1 ({ids[1]}): its host {host_id} went silent")
        assert [m["state"] for m in body["members"]] == ["running", "running"]
        assert await api.commands(ids[0], "stop_workload") == []
        await set_host(api, host_id, state="rented")
        async with api.master.db.session() as session:
            await rental_lifecycle.note_host_back(session, host_id, silent_since=silent_since)
        body = await view(api, cluster_id)
        assert body["state"] == "running" and [e["to"] for e in body["events"]][-2:] == ["degraded", "running"]

    async def test_a_member_whose_host_is_lost_stops_the_cluster(self, api: Api) -> None:
        """The heartbeat sweep failing node 0 with its silent host stops node 1 in the same transaction."""
        for _ in range(2):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 2)
        async with api.master.db.session() as session:
            lost = await session.get(Rental, ids[0])
            assert lost is not None and lost.host_id is not None
            host_id = lost.host_id
        now = api.master.clock.now()
        await set_host(api, host_id, state="offline", state_changed_at=now - timedelta(hours=1), last_seen_at=now - timedelta(hours=1))
        async with api.master.db.session() as session:
            failed = await rental_lifecycle.fail_rentals_of_lost_hosts(session, now=now, grace=timedelta(minutes=5))
        assert failed == [ids[0]]
        body = await view(api, cluster_id)
        assert [m["state"] for m in body["members"]] == ["failed", "stopping"]
        assert "lost" in body["failure_reason"]
        assert len(await api.commands(ids[1], "stop_workload")) == 1

    async def test_a_cluster_that_never_ran_fails_and_stops_the_rest_whatever_its_policy(self, api: Api) -> None:
        """A start that fails on node 0 of a starting ``replace`` cluster fails it at once and stops node 1."""
        for _ in range(2):
            await api.host(1)
        status, cluster = await create(api, node_count=2, workload=IMAGE, restart_policy="replace")
        assert status == 201, cluster
        ids = [m["rental_id"] for m in cluster["members"]]
        await api.agent_reports(ids[0], "start_workload", ok=False, detail="image_pull_failed: no such image")
        body = await view(api, cluster_id := cluster["id"])
        assert body["state"] == "failed" and "image_pull_failed" in body["failure_reason"]
        assert [m["state"] for m in body["members"]] == ["failed", "stopping"]
        assert await cluster_policy.replace_broken_members(api.master) == []
        assert len((await view(api, cluster_id))["members"]) == 2


class TestMemberStoppedOnItsOwn:
    async def test_deleting_one_member_stops_the_whole_cluster(self, api: Api) -> None:
        """DELETE /rentals/{member} stops the other members too; the cluster ends stopped, not failed."""
        for _ in range(3):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 3)
        status, _ = await api.as_renter("DELETE", f"/rentals/{ids[2]}")
        assert status == 202
        body = await view(api, cluster_id)
        assert body["state"] == "stopping"
        assert [m["state"] for m in body["members"]] == ["stopping"] * 3
        for rental_id in ids:
            assert len(await api.commands(rental_id, "stop_workload")) == 1
            await api.agent_reports(rental_id, "stop_workload")
        body = await view(api, cluster_id)
        assert (body["state"], body["failure_reason"]) == ("stopped", None)


class TestReplacePolicy:
    async def test_a_failed_member_is_replaced_on_another_host_and_the_cluster_runs_again(self, api: Api) -> None:
        """restart_policy replace: node 1 fails, the cluster is degraded, node 1 is placed again on the free host."""
        hosts = [(await api.host(1))[0] for _ in range(3)]
        cluster_id, ids = await running_cluster(api, 2, restart_policy="replace")
        await workload_fails(api, ids[1])
        body = await view(api, cluster_id)
        assert body["state"] == "degraded"
        assert await api.commands(ids[0], "stop_workload") == []
        used = {m["host_id"] for m in body["members"]}
        [free] = set(hosts) - used

        published = await cluster_policy.replace_broken_members(api.master)
        assert await cluster_policy.replace_broken_members(api.master) == []  # idempotent: node 1 has its replacement
        async with api.master.db.session() as session:
            [new] = (await session.scalars(select(Rental).where(Rental.cluster_id == cluster_id, Rental.id.not_in(ids)))).all()
        assert (new.node_rank, new.host_id, new.replaces_id, new.state) == (1, free, ids[1], "starting")
        [start] = await api.commands(new.id, "start_workload")
        assert published == [start.id]
        assert start.args["workload"]["env"]["NODE_RANK"] == "1"
        assert (await view(api, cluster_id))["state"] == "degraded"
        await api.agent_reports(new.id, "start_workload")
        body = await view(api, cluster_id)
        assert body["state"] == "running" and body["failure_reason"] is None
        assert [e["to"] for e in body["events"]] == ["pending", "starting", "running", "degraded", "running"]

    async def test_no_host_for_the_replacement_stops_the_cluster_as_failed(self, api: Api) -> None:
        """With no host the cluster does not use, replacing falls back to stop: node 0 is stopped, the cluster fails."""
        for _ in range(2):
            await api.host(1)
        cluster_id, ids = await running_cluster(api, 2, restart_policy="replace")
        await workload_fails(api, ids[0])
        assert (await view(api, cluster_id))["state"] == "degraded"
        published = await cluster_policy.replace_broken_members(api.master)
        [stop] = await api.commands(ids[1], "stop_workload")
        # Both members had joined the private network: each gets its delete_cluster in the same transaction.
        deletes = [c.id for rental_id in ids for c in await api.commands(rental_id, "delete_cluster")]
        assert len(deletes) == 2 and sorted(published) == sorted([stop.id, *deletes])
        body = await view(api, cluster_id)
        assert body["state"] == "stopping" and "no host could replace it" in body["failure_reason"]
        await api.agent_reports(ids[1], "stop_workload")
        body = await view(api, cluster_id)
        assert body["state"] == "failed" and len(body["members"]) == 2


class TestDerive:
    def test_a_failing_cluster_ends_failed_not_stopped(self) -> None:
        """A cluster its stop policy is stopping ends failed once every member ended; without failing, stopped."""
        from master.services.lifecycle.clusters import ClusterState, Member, derive

        ended = [Member("stopped"), Member("failed")]
        assert derive("stopping", ended, failing=True) == [ClusterState.FAILED]
        assert derive("stopping", ended) == [ClusterState.STOPPED]
        assert derive("running", [Member("stopped"), Member("stopped")], failing=True) == [ClusterState.STOPPING, ClusterState.FAILED]
