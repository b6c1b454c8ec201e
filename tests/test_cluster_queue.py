"""Queued clusters: ``queue: true`` waits as one unit in the rental queue, placed whole or given up at ``queue_until``.

Driven through ``/api/v1/clusters`` on SQLite and PostgreSQL (the ``api`` fixture); the queue pass is
``rental_queue.process_queue``, run by hand as the queue loop would.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

from billing.rating import RatingPolicy, rate_open_rentals
from master.models import Cluster, Command, GpuAllocation, LedgerTransaction, Rental
from master.services import queue as rental_queue
from master.services.clusters import placement as cluster_placement
from tests.apiclient import Api, assert_error

RTX = "NVIDIA GeForce RTX 4090"


async def create(api: Api, **body: Any) -> tuple[int, Any]:
    return await api.call("POST", "/clusters", api.renter_key, json=body)


async def rent(api: Api, host_id: str, **body: Any) -> dict[str, Any]:
    status, rental = await api.as_renter("POST", "/rentals", json={"offer_id": f"{host_id}:{RTX}", **body})
    assert status == 201, rental
    return dict(rental)


async def free(api: Api, rental_id: str) -> None:
    await api.as_renter("DELETE", f"/rentals/{rental_id}")
    await api.agent_reports(rental_id, "stop_workload")


async def count(api: Api, model: type[Any], *where: Any) -> int:
    async with api.master.db.session() as session:
        return int(await session.scalar(select(func.count()).select_from(model).where(*where)) or 0)


async def queued_cluster(api: Api, node_count: int = 3) -> tuple[list[str], dict[str, Any], list[dict[str, Any]]]:
    """``node_count`` one-GPU hosts, each taken by a rental, and a cluster over them queued behind those rentals."""
    hosts = [(await api.host(1))[0] for _ in range(node_count)]
    blockers = [await rent(api, host) for host in hosts]
    status, cluster = await create(api, node_count=node_count, queue=True, queue_timeout_s=600)
    assert status == 201, cluster
    return hosts, cluster, blockers


class TestQueueing:
    async def test_a_busy_fleet_queues_the_cluster_with_nothing_allocated(self, api: Api) -> None:
        """With every host taken the cluster is pending and queued: its members wait with no host, GPU or command."""
        _hosts, cluster, _ = await queued_cluster(api)
        assert cluster["state"] == "pending" and cluster["queue_until"] is not None
        assert cluster["queue"]["position"] == 1
        assert [(m["node_rank"], m["host_id"], m["state"]) for m in cluster["members"]] == [(r, None, "pending") for r in range(3)]
        ids = [m["rental_id"] for m in cluster["members"]]
        assert await count(api, GpuAllocation, GpuAllocation.rental_id.in_(ids)) == 0
        assert await count(api, Command, Command.rental_id.in_(ids)) == 0
        assert "queued for up to 600s" in cluster["events"][-1]["cause"]

    async def test_exceeds_fleet_is_refused_even_with_queue(self, api: Api) -> None:
        """Two hosts can never take three nodes: 409 exceeds_fleet with queue: true too, and nothing is kept."""
        await api.host(1)
        await api.host(1)
        status, body = await create(api, node_count=3, queue=True)
        assert_error(status, body, 409, "exceeds_fleet")
        assert [await count(api, m) for m in (Cluster, Rental)] == [0, 0]

    async def test_a_timeout_beyond_the_masters_limit_is_422(self, api: Api) -> None:
        """queue_timeout_s is bounded by max_queue_timeout_s, as for rentals."""
        await api.host(1)
        await api.host(1)
        status, body = await create(api, node_count=2, queue=True, queue_timeout_s=api.master.settings.max_queue_timeout_s + 1)
        assert_error(status, body, 422, "invalid_queue_timeout")


class TestQueuePass:
    async def test_placed_as_one_unit_once_every_host_is_free(self, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
        """Not placed while only two of three hosts are free; once the third frees, one pass places every member on a
        distinct host in one transaction (one place_cluster call), each with its start command."""
        hosts, cluster, blockers = await queued_cluster(api)
        await free(api, blockers[0]["id"])
        await free(api, blockers[1]["id"])
        assert await rental_queue.process_queue(api.master) == 0
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "pending" and {m["host_id"] for m in view["members"]} == {None}
        assert await count(api, GpuAllocation, GpuAllocation.rental_id.in_([m["rental_id"] for m in view["members"]])) == 0

        calls: list[list[str]] = []
        real = cluster_placement.place_cluster

        async def spy(*args: Any, **kwargs: Any) -> list[str]:
            calls.append(list(kwargs.get("queued", ())))
            return await real(*args, **kwargs)

        monkeypatch.setattr(cluster_placement, "place_cluster", spy)
        await free(api, blockers[2]["id"])
        assert await rental_queue.process_queue(api.master) == 1
        ids = [m["rental_id"] for m in cluster["members"]]
        assert calls == [ids]  # the queued members themselves, placed together
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "starting" and view["queue"] is None
        assert sorted(m["host_id"] for m in view["members"]) == sorted(hosts)
        for rental_id in ids:
            assert len(await api.commands(rental_id, "start_workload")) == 1
        assert await rental_queue.process_queue(api.master) == 0  # placed once

    async def test_a_member_claim_failing_leaves_the_whole_cluster_queued(self, api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
        """A claim lost on node 2 rolls back nodes 0 and 1 too: the cluster stays queued with no allocation, then places."""
        from master.services.rentals import allocation

        _hosts, cluster, blockers = await queued_cluster(api)
        for blocker in blockers:
            await free(api, blocker["id"])
        real_claim = allocation.claim

        async def claim(session: Any, rental: Rental, *args: Any, **kwargs: Any) -> bool:
            return False if rental.node_rank == 2 else await real_claim(session, rental, *args, **kwargs)

        monkeypatch.setattr(allocation, "claim", claim)
        assert await rental_queue.process_queue(api.master) == 0
        ids = [m["rental_id"] for m in cluster["members"]]
        assert await count(api, GpuAllocation, GpuAllocation.rental_id.in_(ids)) == 0
        assert await count(api, Rental, Rental.id.in_(ids), Rental.host_id.is_(None), Rental.state == "pending") == 3
        monkeypatch.setattr(allocation, "claim", real_claim)
        assert await rental_queue.process_queue(api.master) == 1

    async def test_gives_up_at_queue_until_with_nothing_billed(self, api: Api) -> None:
        """Past queue_until the cluster is failed with the reason, every member with it, and rating charges nothing."""
        _hosts, cluster, _ = await queued_cluster(api)
        ids = [m["rental_id"] for m in cluster["members"]]
        now = api.master.clock.now()
        async with api.master.db.session() as session:
            await session.execute(update(Rental).where(Rental.id.in_(ids)).values(queue_until=now - timedelta(seconds=1)))
        assert await rental_queue.process_queue(api.master) == 0
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "failed" and view["queue"] is None
        assert "not placed within its queue timeout" in view["failure_reason"]
        assert "3 hosts with 1 × any GPU each were never free together" in view["failure_reason"]
        assert {(m["state"], m["host_id"]) for m in view["members"]} == {("failed", None)}
        rated = await rate_open_rentals(api.master.db, now=now + timedelta(hours=1), policy=RatingPolicy())
        assert not {r.rental_id for r in rated} & set(ids)
        assert await count(api, LedgerTransaction, LedgerTransaction.rental_id.in_(ids)) == 0


class TestCancel:
    async def test_delete_while_queued_ends_it_at_once_without_commands(self, api: Api) -> None:
        """DELETE on a queued cluster: stopped at once, every member stopped, no command, never placed afterwards."""
        _hosts, cluster, blockers = await queued_cluster(api)
        status, view = await api.as_renter("DELETE", f"/clusters/{cluster['id']}")
        assert (status, view["state"]) == (202, "stopped")
        assert {m["state"] for m in view["members"]} == {"stopped"} and view["queue"] is None
        ids = [m["rental_id"] for m in cluster["members"]]
        assert await count(api, Command, Command.rental_id.in_(ids)) == 0
        for blocker in blockers:
            await free(api, blocker["id"])
        assert await rental_queue.process_queue(api.master) == 0

    async def test_cancelling_one_queued_member_ends_the_cluster(self, api: Api) -> None:
        """DELETE /rentals on one queued member cancels the whole queued cluster: it is never placed in part."""
        _hosts, cluster, blockers = await queued_cluster(api, node_count=2)
        status, _ = await api.as_renter("DELETE", f"/rentals/{cluster['members'][0]['rental_id']}")
        assert status == 202
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert view["state"] == "stopped" and {m["state"] for m in view["members"]} == {"stopped"}
        for blocker in blockers:
            await free(api, blocker["id"])
        assert await rental_queue.process_queue(api.master) == 0


class TestStanding:
    async def test_a_queued_rental_and_a_queued_cluster_each_count_once(self, api: Api) -> None:
        """A rental queued first is 1 of 2 and the three-node cluster after it 2 of 2 (once, not per member); the
        cluster's message names what it waits for; once the rental is placed the cluster is 1 of 1."""
        hosts = [(await api.host(1))[0] for _ in range(3)]
        blockers = [await rent(api, host) for host in hosts]
        status, first = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "queue": True, "queue_timeout_s": 600})
        assert status == 201, first
        status, cluster = await create(api, node_count=3, queue=True)
        assert status == 201, cluster
        _, one = await api.as_renter("GET", f"/rentals/{first['id']}")
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert (one["queue"]["position"], one["queue"]["length"]) == (1, 2)
        assert (view["queue"]["position"], view["queue"]["length"]) == (2, 2)
        assert view["queue"]["message"].startswith("queued: will start when 3 hosts with 1 × any GPU each are free; position 2 of 2")
        assert "gives up at" in view["queue"]["message"]
        _, member = await api.as_renter("GET", f"/rentals/{cluster['members'][1]['rental_id']}")
        assert (member["queue"]["position"], member["queue"]["length"]) == (2, 2)
        _, listing = await api.as_renter("GET", "/clusters")
        assert listing["items"][0]["queue"] == view["queue"]

        await free(api, blockers[0]["id"])
        assert await rental_queue.process_queue(api.master) == 1  # the rental takes the freed GPU; the cluster waits
        _, view = await api.as_renter("GET", f"/clusters/{cluster['id']}")
        assert (view["queue"]["position"], view["queue"]["length"]) == (1, 1)
