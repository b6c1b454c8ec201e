"""Preemption only for a rental that really starts, and ``queue: true`` victims back in the queue in their place.

Driven through ``POST /api/v1/rentals`` on SQLite and PostgreSQL (the ``api`` fixture); the agent's side is
simulated by applying its command results as the ingestor would (the agent's own ordering — pull, then stop the
victims, then start — is tested against a real engine in ``tests/test_agent_preemption.py``).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from master.models import Command, Gpu, GpuAllocation, Rental
from master.services import queue as rental_queue
from tests.apiclient import Api, assert_error
from tests.test_rentals_market import rent


async def start_command(api: Api, rental_id: str) -> Command:
    [start] = await api.commands(rental_id, "start_workload")
    return start


async def held_gpus(api: Api, rental_id: str) -> list[str]:
    """The uuids of the GPUs the books say ``rental_id`` holds now."""
    async with api.master.db.session() as session:
        rows = await session.scalars(
            select(Gpu.uuid).join(GpuAllocation, GpuAllocation.gpu_id == Gpu.id)
            .where(GpuAllocation.rental_id == rental_id, GpuAllocation.released_at.is_(None)).order_by(Gpu.uuid)
        )  # fmt: skip
        return list(rows.all())


async def get(api: Api, rental_id: str) -> dict[str, Any]:
    status, body = await api.as_renter("GET", f"/rentals/{rental_id}")
    assert status == 200, body
    return dict(body)


class TestThePreemptionWaitsForTheStart:
    async def test_the_start_names_its_victims_who_keep_running_until_it_is_confirmed(self, api: Api) -> None:
        """The cheapest bid is chosen, but only marked: no stop of its own; the start names it with the grace, and it ends
        ``preempted`` (billing stopped then) only when the agent confirms the start, which stopped it first."""
        await api.host(2)
        _, cheap = await rent(api, kind="interruptible", bid="0.20")
        _, dear = await rent(api, kind="interruptible", bid="0.30")
        for rental in (cheap, dear):
            await api.agent_reports(rental["id"], "start_workload")
        status, on_demand = await rent(api, gpu_count=1)
        assert status == 201, on_demand
        assert on_demand["gpu_uuids"] == cheap["gpu_uuids"]

        victim = await get(api, cheap["id"])
        assert (victim["state"], victim["preempting_by"], victim["preempted_by"], victim["stopped_at"]) == (
            "running", on_demand["id"], None, None
        )
        assert on_demand["id"] in victim["events"][-1]["cause"] and "keeps running" in victim["events"][-1]["cause"]
        assert await api.commands(cheap["id"], "stop_workload") == []  # the start does it, after the pull
        start = await start_command(api, on_demand["id"])
        assert start.args["preempts"] == [{"rental_id": cheap["id"], "grace_s": 30.0, "reason": f"preempted by rental {on_demand['id']}"}]
        assert await held_gpus(api, on_demand["id"]) == sorted(cheap["gpu_uuids"])  # the GPUs are the new rental's in the books

        await api.agent_answers(start, data={"kind": "container", "preempted": [cheap["id"]]})
        victim = await get(api, cheap["id"])
        assert (victim["state"], victim["preempted_by"], victim["preempting_by"]) == ("preempted", on_demand["id"], None)
        assert victim["stopped_at"] is not None and victim["stopped_at"] == victim["events"][-1]["at"]
        assert "stopped this workload" in victim["events"][-1]["cause"]
        assert (await get(api, on_demand["id"]))["state"] == "running"
        assert (await get(api, dear["id"]))["state"] == "running"
        assert await api.count(Rental) == 3  # not sent with queue: true: not queued again

        await api.agent_answers(start, data={"kind": "container", "preempted": [cheap["id"]]})  # a redelivered result
        assert await get(api, cheap["id"]) == victim

    async def test_a_failed_pull_rolls_the_preemption_back(self, api: Api) -> None:
        """Regression (issue 39): an on-demand rental whose image pull failed a second later had already preempted an
        interruptible one. Now the victim is never stopped: it keeps running with its GPUs, an event says the
        preemption was rolled back, and the new rental fails with its code, the renter's."""
        await api.host(1)
        _, victim = await rent(api, kind="interruptible", bid="0.20")
        await api.agent_reports(victim["id"], "start_workload")
        _, on_demand = await rent(api, gpu_count=1, workload={"kind": "container", "image": "example/missing:1"})
        start = await start_command(api, on_demand["id"])

        await api.agent_answers(start, ok=False, detail="image_not_found: no such image example/missing:1",
                                data={"code": "image_not_found", "preempted": []})  # fmt: skip
        kept = await get(api, victim["id"])
        assert (kept["state"], kept["preempting_by"], kept["preempted_by"], kept["stopped_at"]) == ("running", None, None, None)
        assert "rolled back" in kept["events"][-1]["cause"] and "image_not_found" in kept["events"][-1]["cause"]
        assert await held_gpus(api, victim["id"]) == sorted(victim["gpu_uuids"])
        assert await api.commands(victim["id"], "stop_workload") == []
        failed = await get(api, on_demand["id"])
        assert (failed["state"], failed["failure_code"], failed["failure_owner"]) == ("failed", "image_not_found", "renter")
        assert await held_gpus(api, on_demand["id"]) == []

        # It can be preempted again, for real this time.
        status, again = await rent(api, gpu_count=1)
        assert status == 201, again
        await api.agent_answers(await start_command(api, again["id"]), data={"kind": "hold", "preempted": [victim["id"]]})
        assert (await get(api, victim["id"]))["state"] == "preempted"

    async def test_victims_the_agent_stopped_before_a_later_failure_end_preempted(self, api: Api) -> None:
        """A start that fails after its agent stopped the victims (the container could not be made) ends those it lists;
        the GPUs go back to no one, and no victim is left marked."""
        await api.host(1)
        _, victim = await rent(api, kind="interruptible", bid="0.20")
        await api.agent_reports(victim["id"], "start_workload")
        _, on_demand = await rent(api, gpu_count=1)
        await api.agent_answers(await start_command(api, on_demand["id"]), ok=False, detail="workload_start_failed: engine said no",
                                data={"code": "workload_start_failed", "preempted": [victim["id"]]})  # fmt: skip
        ended = await get(api, victim["id"])
        assert (ended["state"], ended["preempted_by"], ended["preempting_by"]) == ("preempted", on_demand["id"], None)
        assert await held_gpus(api, victim["id"]) == [] and await held_gpus(api, on_demand["id"]) == []
        status, fresh = await rent(api, gpu_count=1)
        assert status == 201 and (await start_command(api, fresh["id"])).args.get("preempts") is None

    async def test_a_higher_bid_preempts_a_lower_one_but_not_the_reverse(self, api: Api) -> None:
        """Interruptible rentals outrank lower bids only; an equal or lower bid waits, and on-demand rentals are never preempted."""
        await api.host(1)
        _, low = await rent(api, kind="interruptible", bid="0.20")
        status, body = await rent(api, kind="interruptible", bid="0.20")
        assert_error(status, body, 409, "insufficient_capacity")
        status, high = await rent(api, kind="interruptible", bid="0.35")
        assert status == 201, high
        assert (await get(api, low["id"]))["preempting_by"] == high["id"]
        status, body = await rent(api, gpu_count=1)
        assert_error(status, body, 409, "insufficient_capacity")  # a preemption in flight is not preempted in turn
        await api.agent_answers(await start_command(api, high["id"]), data={"kind": "hold", "preempted": [low["id"]]})
        assert (await get(api, low["id"]))["state"] == "preempted"
        status, on_demand = await rent(api, gpu_count=1)
        assert status == 201
        status, body = await rent(api, gpu_count=1)
        assert_error(status, body, 409, "insufficient_capacity")  # on-demand never preempts on-demand
        await api.agent_answers(await start_command(api, on_demand["id"]), data={"kind": "hold", "preempted": [high["id"]]})
        high_now = await get(api, high["id"])
        assert (high_now["state"], high_now["preempted_by"]) == ("preempted", on_demand["id"])

    async def test_preemption_takes_only_the_victims_it_needs(self, api: Api) -> None:
        """Freeing two GPUs on a four-GPU host marks the two cheapest there and leaves the others alone."""
        await api.host(4)
        bids = ["0.40", "0.10", "0.30", "0.20"]
        made = [(await rent(api, kind="interruptible", bid=bid))[1] for bid in bids]
        status, on_demand = await rent(api, gpu_count=2)
        assert status == 201, on_demand
        marks = {bid: (await get(api, rental["id"]))["preempting_by"] for rental, bid in zip(made, bids, strict=True)}
        assert marks == {"0.10": on_demand["id"], "0.20": on_demand["id"], "0.30": None, "0.40": None}
        start = await start_command(api, on_demand["id"])
        assert sorted(p["rental_id"] for p in start.args["preempts"]) == sorted(r["id"] for r, b in zip(made, bids, strict=True) if b in ("0.10", "0.20"))


class TestRequeue:
    async def test_a_queue_true_victim_goes_back_to_the_queue_in_its_place_and_runs_again(self, api: Api) -> None:
        """An interruptible rental sent with ``queue: true`` that is preempted ends ``preempted`` and is queued again as a
        new rental naming it, with its creation time: ahead of a rental queued after it, and placed first when GPUs free."""
        host_id, _ = await api.host(1)
        _, first = await rent(api, kind="interruptible", bid="0.20", queue=True, queue_timeout_s=900)
        await api.agent_reports(first["id"], "start_workload")
        _, later = await rent(api, kind="interruptible", bid="0.20", queue=True)  # an equal bid waits in the queue
        assert later["queued"] is True
        _, on_demand = await rent(api, gpu_count=1)
        await api.agent_answers(await start_command(api, on_demand["id"]), data={"kind": "hold", "preempted": [first["id"]]})

        ended = await get(api, first["id"])
        assert ended["state"] == "preempted"
        async with api.master.db.session() as session:
            again = await session.scalar(select(Rental).where(Rental.requeued_from_id == first["id"]))
            waiting = await session.get(Rental, later["id"])
            assert again is not None and waiting is not None
            standing = await rental_queue.queue_standing(session, [again, waiting])
        assert f"requeued as rental {again.id}" in ended["events"][-1]["cause"]
        requeued = await get(api, again.id)
        assert (requeued["state"], requeued["queued"], requeued["requeued_from"], requeued["created_at"]) == (
            "pending", True, first["id"], first["created_at"]
        )
        assert requeued["kind"] == "interruptible" and requeued["bid_per_gpu_hour"] == "0.200000"
        assert first["id"] in requeued["events"][0]["cause"] and on_demand["id"] in requeued["events"][0]["cause"]
        assert (standing[again.id]["position"], standing[later["id"]]["position"]) == (1, 2)

        assert await rental_queue.process_queue(api.master) == 0  # the GPU is the on-demand rental's
        await api.as_renter("DELETE", f"/rentals/{on_demand['id']}")
        await api.agent_reports(on_demand["id"], "stop_workload")
        assert await rental_queue.process_queue(api.master) == 1
        placed = await get(api, again.id)
        assert (placed["state"], placed["host_id"]) == ("starting", host_id)
        assert (await get(api, later["id"]))["queued"] is True

    async def test_a_rolled_back_preemption_queues_nothing(self, api: Api) -> None:
        """A ``queue: true`` victim of a start that failed before touching it keeps running, and nothing is queued."""
        await api.host(1)
        _, victim = await rent(api, kind="interruptible", bid="0.20", queue=True)
        await api.agent_reports(victim["id"], "start_workload")
        _, on_demand = await rent(api, gpu_count=1)
        await api.agent_answers(await start_command(api, on_demand["id"]), ok=False, detail="image_pull_failed: registry down",
                                data={"code": "image_pull_failed", "preempted": []})  # fmt: skip
        assert (await get(api, victim["id"]))["state"] == "running"
        assert await api.count(Rental) == 2
