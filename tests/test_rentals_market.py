"""Rentals on the marketplace: offers and requirements, shares, MIG, bids, preemption, the queue, quotas.

Driven through ``POST /api/v1/rentals`` on SQLite and PostgreSQL (the ``api`` fixture); the
agent's side is simulated by applying its command results as the ingestor would.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import delete, select, update

from master.app import open_master
from master.models import Account, Command, Gpu, GpuAllocation, Host, Rental, RentalEvent
from master.scheduler import UnknownPlacer
from master.services import queue as rental_queue
from master.services.market import FailureCode
from master.services.rentals import lifecycle as rental_lifecycle
from shared import protocol
from tests.apiclient import A100, RTX, Api, assert_error
from tests.factories import create_principal, gpu_info, master_settings, online_host

H100 = "NVIDIA H100 80GB HBM3"


async def rent(api: Api, key: str | None = None, **body: Any) -> tuple[int, Any]:
    """POST /rentals of ``body``: one GPU unless it says otherwise (a rental must name what it rents)."""
    return await api.call("POST", "/rentals", key or api.renter_key, json={"gpu_count": 1, **body})


async def list_host(api: Api, host_id: str, **terms: Any) -> None:
    status, body = await api.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": "0.50", **terms})
    assert status in (200, 201), body


async def set_host(api: Api, host_id: str, **values: Any) -> None:
    async with api.master.db.session() as session:
        await session.execute(update(Host).where(Host.id == host_id).values(**values))


async def mig_host(api: Api, profiles: list[str]) -> tuple[str, list[str]]:
    """A host with one H100 in MIG mode carved into instances of ``profiles``; returns its id and the instances' uuids."""
    instances = [protocol.GpuMigInstanceModel(uuid=f"MIG-{i}-{p}", profile=p) for i, p in enumerate(profiles)]
    gpu = gpu_info(0, name=H100, memory=81559).model_copy(update={"mig_mode": True, "mig_instances": instances})
    host_id = await online_host(api.master, api.provider, [gpu])
    return host_id, [m.uuid for m in instances]


async def allocations(api: Api, rental_id: str) -> list[GpuAllocation]:
    async with api.master.db.session() as session:
        return list((await session.scalars(select(GpuAllocation).where(GpuAllocation.rental_id == rental_id))).all())


async def gpu_rows(api: Api, host_id: str) -> list[Gpu]:
    async with api.master.db.session() as session:
        return list((await session.scalars(select(Gpu).where(Gpu.host_id == host_id).order_by(Gpu.index))).all())


class TestOffersAndRequirements:
    async def test_an_offer_id_places_on_that_host(self, api: Api) -> None:
        """``offer_id`` from GET /offers pins the host and model, whatever the placer would prefer."""
        await api.host(4)
        other, uuids = await api.host(2)
        _, offers = await api.as_renter("GET", "/offers")
        offer = next(o for o in offers["items"] if o["host_id"] == other)
        status, rental = await rent(api, offer_id=offer["id"], gpu_count=2)
        assert status == 201, rental
        assert (rental["host_id"], sorted(rental["gpu_uuids"]), rental["offer_id"]) == (other, sorted(uuids), offer["id"])
        assert Decimal(rental["price_per_gpu_hour"]) == Decimal(offer["price_per_gpu_hour"])

    async def test_unknown_offer_is_404(self, api: Api) -> None:
        """An offer id that names no host's GPUs is 404 ``offer_not_found``, and no rental is made."""
        host_id, _ = await api.host(1)
        for offer_id in ("h-nope:NVIDIA GeForce RTX 4090", f"{host_id}:NVIDIA Tesla T4"):
            status, body = await rent(api, offer_id=offer_id)
            assert_error(status, body, 404, "offer_not_found")
        assert await api.count(Rental) == 0

    async def test_offer_id_with_requirements_is_422(self, api: Api) -> None:
        """An offer already says where: combining it with requirements or a model is refused."""
        host_id, _ = await api.host(1)
        status, body = await rent(api, offer_id=f"{host_id}:{RTX}", requirements="vram>=24")
        assert_error(status, body, 422, "invalid_offer")

    async def test_requirements_filter_the_hosts(self, api: Api) -> None:
        """Requirements in the offer query language decide which hosts are candidates."""
        eu, _ = await api.host(1)
        us, _ = await api.host(1)
        await set_host(api, eu, region="eu-west")
        await set_host(api, us, region="us-east")
        status, rental = await rent(api, requirements="region=us-east")
        assert status == 201, rental
        assert rental["host_id"] == us
        assert rental["requirements"] == "region=us-east"
        status, body = await rent(api, requirements="region=us-east")
        assert_error(status, body, 409, "insufficient_capacity")

    async def test_price_requirement_excludes_dear_hosts(self, api: Api) -> None:
        """``price<=`` compares each host's price per GPU-hour: listing, else its tier's default."""
        cheap, _ = await api.host(1)
        dear, _ = await api.host(1)
        await list_host(api, cheap, price_per_gpu_hour="0.20")
        await list_host(api, dear, price_per_gpu_hour="1.50")
        status, rental = await rent(api, requirements="price<=0.3")
        assert (status, rental["host_id"], rental["price_per_gpu_hour"]) == (201, cheap, "0.200000")
        status, body = await rent(api, requirements="price<=0.3")
        assert_error(status, body, 409, "insufficient_capacity")

    async def test_a_query_that_does_not_parse_is_400(self, api: Api) -> None:
        """A bad requirements string is refused with the parser's message, before anything is placed."""
        await api.host(1)
        status, body = await rent(api, requirements="price<=<0.5")
        assert status == 400, body
        assert "price" in body["message"]
        assert await api.count(Rental) == 0

    async def test_network_limits_filter_hosts_by_measured_latency(self, api: Api) -> None:
        """Hosts whose latency to the renter's region breaks the limit, or that have none measured, are left out."""
        far, _ = await api.host(1)
        near, _ = await api.host(1)
        unmeasured, _ = await api.host(1)
        await set_host(api, far, region="eu-west", latest_network={"latency_ms": 80.0, "jitter_ms": 2.0, "loss": 0.0})
        await set_host(api, near, region="eu-west", latest_network={"latency_ms": 12.0, "jitter_ms": 1.0, "loss": 0.0})
        await set_host(api, unmeasured, region="eu-west")
        limits = {"region": "eu-west", "max_latency_ms": 30}
        status, rental = await rent(api, network=limits)
        assert (status, rental["host_id"], rental["network"]["max_latency_ms"]) == (201, near, 30)
        status, body = await rent(api, network=limits)
        assert_error(status, body, 409, "insufficient_capacity")
        status, rental = await rent(api, network={"region": "eu-west"})  # a region alone limits nothing
        assert status == 201 and rental["host_id"] in (far, unmeasured)


class TestFractionalShares:
    async def test_shares_of_one_gpu_add_up_to_at_most_1000_milli(self, api: Api) -> None:
        """Two 500-milli shares share one GPU; a third finds no room; the agent is told each share."""
        host_id, [uuid] = await api.host(1)
        await list_host(api, host_id, smallest_unit="milli:250")
        first_status, first = await rent(api, gpu_milli=500)
        second_status, second = await rent(api, gpu_milli=500, gpu_memory_mib=8000)
        assert (first_status, second_status) == (201, 201), (first, second)
        assert first["gpu_uuids"] == second["gpu_uuids"] == [uuid]
        assert first["gpu_memory_mib"] == 24564 // 2  # in proportion when not asked
        [start] = await api.commands(second["id"], "start_workload")
        assert start.args["share"] == {"milli": 500, "memory_mib": 8000}
        status, body = await rent(api, gpu_milli=250)
        assert_error(status, body, 409, "insufficient_capacity")
        [gpu] = await gpu_rows(api, host_id)
        assert (gpu.milli_used, gpu.memory_used_mib, gpu.rental_id) == (1000, 24564 // 2 + 8000, None)
        _, offers = await api.as_renter("GET", "/offers")
        assert offers["items"] == []  # a shared GPU is not offered whole

        await api.as_renter("DELETE", f"/rentals/{first['id']}")
        await api.agent_reports(first["id"], "stop_workload")
        [gpu] = await gpu_rows(api, host_id)
        assert (gpu.milli_used, gpu.memory_used_mib) == (500, 8000)
        status, body = await rent(api, gpu_count=1)
        assert_error(status, body, 409, "insufficient_capacity")  # half a GPU is not a whole one
        status, third = await rent(api, gpu_milli=250)
        assert status == 201, third

    async def test_shares_need_a_listing_that_rents_that_small(self, api: Api) -> None:
        """Unlisted hosts and listings with a larger smallest unit take whole GPUs only."""
        unlisted, _ = await api.host(1)
        coarse, _ = await api.host(1)
        await list_host(api, coarse, smallest_unit="milli:500")
        status, body = await rent(api, gpu_milli=250)
        assert_error(status, body, 409, "insufficient_capacity")
        assert "not renting shares that small" in body["message"]
        status, body = await rent(api, offer_id=f"{coarse}:{RTX}", gpu_milli=250)
        assert_error(status, body, 422, "share_unavailable")
        status, rental = await rent(api, gpu_milli=500)
        assert (status, rental["host_id"]) == (201, coarse)
        assert unlisted

    @pytest.mark.parametrize(
        "body",
        [{"gpu_milli": 1001}, {"gpu_milli": 0}, {"gpu_milli": -5}, {"gpu_milli": 500, "gpu_count": 2},
         {"gpu_memory_mib": 4096}, {"gpu_count": 0}, {"gpu_count": -1}],
        ids=["over-1000", "zero", "negative", "share-of-two", "memory-without-share", "zero-gpus", "negative-gpus"],
    )  # fmt: skip
    async def test_bad_shares_and_counts_are_422(self, api: Api, body: dict[str, Any]) -> None:
        """A share over 1000 milli, zero or negative GPUs and other impossible shapes are refused with 422."""
        await api.host(2)
        status, answer = await rent(api, **body)
        assert status == 422, answer
        assert await api.count(Rental) == 0


class TestMig:
    async def test_mig_rentals_take_a_free_instance_of_their_profile(self, api: Api) -> None:
        """A MIG request lands only on a MIG-mode GPU with a free instance of its profile, one rental per instance."""
        await api.host(2)  # no MIG here
        host_id, instances = await mig_host(api, ["1g.10gb", "1g.10gb", "3g.40gb"])
        status, first = await rent(api, mig_profile="1g.10gb")
        assert status == 201, first
        status, second = await rent(api, mig_profile="1g.10gb")
        assert status == 201, second
        assert {first["gpu_uuids"][0], second["gpu_uuids"][0]} == set(instances[:2])
        assert first["host_id"] == host_id and first["gpu_milli"] == 1000 // 7
        status, body = await rent(api, mig_profile="1g.10gb")
        assert_error(status, body, 409, "insufficient_capacity")
        status, big = await rent(api, mig_profile="3g.40gb")
        assert (status, big["gpu_uuids"]) == (201, [instances[2]])
        status, body = await rent(api, gpu_count=1, gpu_model="H100", queue=True)  # a MIG-mode GPU is never rented whole
        assert_error(status, body, 409, "exceeds_fleet")
        assert "has 0 whole" in body["message"]

        await api.as_renter("DELETE", f"/rentals/{first['id']}")
        await api.agent_reports(first["id"], "stop_workload")
        [allocation] = await allocations(api, first["id"])
        assert allocation.released_at is not None and allocation.active_mig is None
        status, again = await rent(api, mig_profile="1g.10gb")
        assert (status, again["gpu_uuids"]) == (201, first["gpu_uuids"])

    async def test_a_profile_the_host_lacks_is_422_on_its_offer(self, api: Api) -> None:
        """Asking an offer for a MIG profile its GPUs do not have says which profiles it has."""
        host_id, _ = await mig_host(api, ["1g.10gb"])
        status, body = await rent(api, offer_id=f"{host_id}:{H100}", mig_profile="2g.20gb")
        assert_error(status, body, 422, "mig_profile_unavailable")
        assert "1g.10gb" in body["message"]
        status, body = await rent(api, mig_profile="nonsense")
        assert_error(status, body, 422, "invalid_mig_profile")

    async def test_a_profile_no_host_has_is_not_queued(self, api: Api) -> None:
        """A profile no GPU of the fleet has (rented or not) fails fast even with queue: true, naming the ones it has;
        a profile that is only busy queues."""
        await mig_host(api, ["1g.10gb", "3g.40gb"])
        status, body = await rent(api, mig_profile="7g.80gb", queue=True)
        assert_error(status, body, 409, "exceeds_fleet")
        assert "1g.10gb, 3g.40gb" in body["message"]
        assert await api.count(Rental) == 0
        assert (await rent(api, mig_profile="3g.40gb"))[0] == 201
        status, queued = await rent(api, mig_profile="3g.40gb", queue=True)
        assert (status, queued["queued"]) == (201, True)


class TestInterruptibleAndPreemption:
    async def test_bids_are_checked(self, api: Api) -> None:
        """Interruptible rentals need a bid, at least the host's minimum; on-demand ones must not bid."""
        host_id, _ = await api.host(1)
        await list_host(api, host_id, min_bid_per_gpu_hour="0.25")
        status, body = await rent(api, kind="interruptible")
        assert_error(status, body, 422, "invalid_bid")
        status, body = await rent(api, bid="0.30")
        assert_error(status, body, 422, "invalid_bid")
        status, body = await rent(api, kind="interruptible", bid="-1")
        assert status == 422, body
        status, body = await rent(api, offer_id=f"{host_id}:{RTX}", kind="interruptible", bid="0.10")
        assert_error(status, body, 422, "bid_below_minimum")
        status, body = await rent(api, kind="interruptible", bid="0.10")
        assert_error(status, body, 409, "insufficient_capacity")
        assert "bids below their minimum" in body["message"]
        status, rental = await rent(api, kind="interruptible", bid="0.25")
        assert (status, rental["kind"], rental["price_per_gpu_hour"]) == (201, "interruptible", "0.250000")

    # Preemption itself: tests/test_preemption.py.


class TestBidsAreBoundedByOnDemand:
    """A bid is a price between the host's minimum bid and its on-demand price (docs/marketplace.md, "Price")."""

    async def test_a_bid_above_on_demand_is_charged_on_demand_and_still_ranks_as_bid(self, api: Api) -> None:
        """Regression (issue 21): a bid of 900 on a 0.50 GPU recorded 900 as the price; now 0.50, the bid kept for rank."""
        host_id, _ = await api.host(1)
        await list_host(api, host_id, price_per_gpu_hour="0.50", min_bid_per_gpu_hour="0.20")
        status, runaway = await rent(api, kind="interruptible", bid="900")
        assert status == 201, runaway
        assert (runaway["bid_per_gpu_hour"], runaway["price_per_gpu_hour"]) == ("900.000000", "0.500000")
        await api.agent_reports(runaway["id"], "start_workload")
        status, body = await rent(api, kind="interruptible", bid="899")
        assert_error(status, body, 409, "insufficient_capacity")  # a lower bid does not preempt it
        status, body = await rent(api, offer_id=f"{host_id}:{RTX}", kind="interruptible", bid="0.19")
        assert_error(status, body, 422, "bid_below_minimum")  # below the minimum is refused as before

    async def test_with_no_model_a_bid_never_pays_more_than_the_gpu_it_lands_on(self, api: Api) -> None:
        """The README's example with no model: wherever the placer puts a bid, it pays min(bid, that GPU's price)."""
        cheap, _ = await api.host(2)
        dear, _ = await api.host(2, name=A100)
        await list_host(api, cheap, price_per_gpu_hour="0.15", min_bid_per_gpu_hour="0.10")
        await list_host(api, dear, price_per_gpu_hour="1.20", min_bid_per_gpu_hour="0.30")
        prices = {cheap: Decimal("0.15"), dear: Decimal("1.20")}
        for _ in range(4):
            status, rental = await rent(api, kind="interruptible", bid="0.30")
            assert status == 201, rental
            charged = Decimal(rental["price_per_gpu_hour"])
            assert charged == min(Decimal("0.30"), prices[rental["host_id"]]), rental
            assert charged <= prices[rental["host_id"]]

    async def test_the_spend_quota_counts_what_is_charged_not_the_bid(self, api: Api) -> None:
        """A high bid on a cheap GPU fits a spend quota that the bid alone would not."""
        host_id, _ = await api.host(1)
        await list_host(api, host_id, price_per_gpu_hour="0.50")
        async with api.master.db.session() as session:
            await session.execute(update(Account).where(Account.id == api.renter.account_id).values(max_spend_per_hour=Decimal("1")))
        status, rental = await rent(api, kind="interruptible", bid="5")
        assert (status, rental.get("price_per_gpu_hour")) == (201, "0.500000"), rental


class TestWhatToRent:
    """A rental names what it rents, and model words are compared after Unicode normalisation."""

    @pytest.mark.parametrize("body", [None, {}, {"kind": "on_demand"}, {"queue": True}, {"gpu_model": None}])
    async def test_a_rental_that_names_nothing_is_422(self, api: Api, body: dict[str, Any] | None) -> None:
        """Regression (issue 21): POST /rentals with no body rented a GPU of the placer's choosing."""
        await api.host(1)
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        status, answer = await api.call("POST", "/rentals", api.renter_key, **kwargs)
        assert_error(status, answer, 422, "rental_target_missing")
        assert "gpu_count" in answer["message"] and "offer_id" in answer["message"]
        assert await api.count(Rental) == 0

    async def test_full_width_model_words_match_their_ascii_model(self, api: Api) -> None:
        """"ＲＴＸ ４０９０" is NFKC-normalised to "RTX 4090" and rents that model, not another."""
        await api.host(1, name=A100)
        rtx, _ = await api.host(1)
        status, rental = await rent(api, gpu_model="ＲＴＸ\u3000４０９０")
        assert (status, rental.get("host_id"), rental.get("gpu_model")) == (201, rtx, RTX), rental

    @pytest.mark.parametrize(
        ("model", "why"),
        [
            ("★★★", "no letter or digit"),
            ("", "no letter or digit"),
            ("   ", "no letter or digit"),
            ("\u200b", "no letter or digit"),
            ("R\u0422\u0425 4090", "not ASCII"),  # Cyrillic Т and Х
        ],
    )
    async def test_a_model_that_means_nothing_or_a_look_alike_is_400_never_any_model(self, api: Api, model: str, why: str) -> None:
        """Regression (issue 21): a model filter with no ASCII word matched every GPU; now 400 saying why, nothing rented."""
        await api.host(1)
        await api.host(1, name=A100)
        status, body = await rent(api, gpu_model=model)
        assert_error(status, body, 400, "invalid_gpu_model")
        assert why in body["message"], body
        assert body["details"]["problems"][0]["field"] == "gpu_model"
        status, body = await rent(api, requirements=f"gpu_name='{model}'")
        assert_error(status, body, 400, "invalid_query")
        assert await api.count(Rental) == 0


class TestQueue:
    async def test_a_queued_rental_is_placed_when_gpus_free_up(self, api: Api) -> None:
        """With queue: true a request that cannot be placed waits as pending, and the queue places it once GPUs free."""
        host_id, _ = await api.host(1)
        _, blocker = await rent(api, gpu_count=1)
        status, queued = await rent(api, gpu_count=1, queue=True, queue_timeout_s=600)
        assert status == 201, queued
        assert (queued["state"], queued["queued"], queued["host_id"]) == ("pending", True, None)
        assert queued["queue_until"] is not None
        assert await rental_queue.process_queue(api.master) == 0  # still full

        await api.as_renter("DELETE", f"/rentals/{blocker['id']}")
        await api.agent_reports(blocker["id"], "stop_workload")
        assert await rental_queue.process_queue(api.master) == 1
        _, placed = await api.as_renter("GET", f"/rentals/{queued['id']}")
        assert (placed["state"], placed["host_id"], placed["queued"]) == ("starting", host_id, False)
        assert [e["to"] for e in placed["events"]] == ["pending", "pending", "starting"]
        assert "queue" in placed["events"][1]["cause"]
        assert len(await api.commands(queued["id"], "start_workload")) == 1

    async def test_queue_timeout_fails_the_rental(self, api: Api) -> None:
        """A queued rental still unplaced at its queue_until fails with the reason."""
        await api.host(1)
        await rent(api, gpu_count=1)
        _, queued = await rent(api, gpu_count=1, queue=True, queue_timeout_s=5)
        async with api.master.db.session() as session:
            await session.execute(
                update(Rental).where(Rental.id == queued["id"]).values(queue_until=api.master.clock.now() - timedelta(seconds=1))
            )
        await rental_queue.process_queue(api.master)
        _, failed = await api.as_renter("GET", f"/rentals/{queued['id']}")
        assert (failed["state"], failed["failure_reason"]) == ("failed", "queue timeout")

    async def test_a_queued_rental_can_be_cancelled(self, api: Api) -> None:
        """DELETE on a queued rental ends it at once: nothing runs anywhere, no command is sent."""
        await api.host(1)
        await rent(api, gpu_count=1)
        _, queued = await rent(api, gpu_count=1, queue=True)
        status, body = await api.as_renter("DELETE", f"/rentals/{queued['id']}")
        assert (status, body["state"]) == (202, "stopped")
        assert await api.commands(queued["id"], "stop_workload") == []
        assert await rental_queue.process_queue(api.master) == 0

    async def test_a_request_no_host_could_ever_take_is_not_queued(self, api: Api) -> None:
        """More GPUs than the largest host has fails fast even with queue: true."""
        await api.host(2)
        status, body = await rent(api, gpu_count=4, queue=True)
        assert_error(status, body, 409, "exceeds_fleet")
        assert await api.count(Rental) == 0


class TestInterruptedPlacement:
    async def test_a_rental_left_pending_on_a_host_without_a_start_command_is_failed_and_its_gpus_released(self, api: Api) -> None:
        """Regression (issue 21): a `kill -9` mid-placement on SQLite left a rental ``pending``, holding a GPU, with no
        event and no start command, for good. The repair pass fails it with an event and frees the GPU; placed, queued
        and ended rentals are left alone, and a second pass finds nothing."""
        host_id, _ = await api.host(3)
        _, orphan = await rent(api, gpu_count=2)
        _, placed = await rent(api, gpu_count=1)
        _, queued = await rent(api, gpu_count=1, queue=True)
        async with api.master.db.session() as session:  # what the interrupted placement had committed: the claim alone
            await session.execute(delete(Command).where(Command.rental_id == orphan["id"]))
            await session.execute(delete(RentalEvent).where(RentalEvent.rental_id == orphan["id"]))
            await session.execute(update(Rental).where(Rental.id == orphan["id"]).values(state="pending"))
        assert await rental_queue.repair_interrupted_placements(api.master) == [orphan["id"]]
        _, failed = await api.as_renter("GET", f"/rentals/{orphan['id']}")
        assert (failed["state"], failed["failure_reason"]) == ("failed", "placement interrupted")
        [event] = failed["events"]
        assert (event["from"], event["to"]) == ("pending", "failed") and "before its start command" in event["cause"], event
        assert all(a.released_at is not None for a in await allocations(api, orphan["id"]))
        assert [g.rental_id for g in await gpu_rows(api, host_id)].count(None) == 2
        for other, state in ((placed, "starting"), (queued, "pending")):
            _, body = await api.as_renter("GET", f"/rentals/{other['id']}")
            assert body["state"] == state
        assert await rental_queue.repair_interrupted_placements(api.master) == []
        assert await rental_queue.process_queue(api.master) == 1  # the queued one takes a freed GPU

    async def test_gpus_held_by_a_pending_rental_with_no_host_are_released(self, api: Api) -> None:
        """A ``pending`` rental with no host but an unreleased claim (no command either) is failed and its GPU freed."""
        host_id, _ = await api.host(1)
        _, orphan = await rent(api, gpu_count=1)
        async with api.master.db.session() as session:
            await session.execute(delete(Command).where(Command.rental_id == orphan["id"]))
            await session.execute(update(Rental).where(Rental.id == orphan["id"]).values(state="pending", host_id=None))
        assert await rental_queue.repair_interrupted_placements(api.master) == [orphan["id"]]
        assert [g.rental_id for g in await gpu_rows(api, host_id)] == [None]
        assert (await rent(api, gpu_count=1))[0] == 201


class TestQuotas:
    async def test_gpu_quota(self, api: Api) -> None:
        """An admin sets an account's GPU quota; placements beyond it are 403 ``quota_exceeded``; /account shows usage."""
        await api.host(4)
        admin, admin_key = await create_principal(api.master, "admin-1", "admin")
        status, body = await api.call("PUT", f"/accounts/{api.renter.account_id}/quota", admin_key, json={"max_gpus": "1.5"})
        assert (status, body["quota"]["max_gpus"]) == (200, "1.5"), body
        status, body = await api.call("PUT", f"/accounts/{api.renter.account_id}/quota", api.renter_key, json={"max_gpus": 99})
        assert status == 403
        status, body = await api.call("PUT", "/accounts/acct-nope/quota", admin_key, json={"max_gpus": 1})
        assert_error(status, body, 404, "account_not_found")
        assert (await rent(api, gpu_count=1))[0] == 201
        status, body = await rent(api, gpu_count=1)
        assert_error(status, body, 403, "quota_exceeded")
        assert "1.5" in body["message"]
        assert admin.role == "admin"
        _, account = await api.as_renter("GET", "/account")
        assert account["quota"]["used_gpus"] == "1" and account["quota"]["max_gpus"] == "1.5"

    async def test_spend_quota_leaves_out_hosts_too_dear(self, api: Api) -> None:
        """Under a spend quota, a host whose price would break it is left out; none left is 403."""
        cheap, _ = await api.host(1)
        dear, _ = await api.host(2)
        await list_host(api, cheap, price_per_gpu_hour="0.20")
        await list_host(api, dear, price_per_gpu_hour="1.00")
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        await api.call("PUT", f"/accounts/{api.renter.account_id}/quota", admin_key, json={"max_spend_per_hour": "1.10"})
        status, first = await rent(api, gpu_count=1, requirements="price>=0.5")
        assert (status, first["host_id"]) == (201, dear)
        status, second = await rent(api, gpu_count=1)  # 0.10/h left: only the 0.20 host... is too dear as well
        assert_error(status, second, 409, "insufficient_capacity")
        assert "too dear for your spend quota" in second["message"]
        await api.call("PUT", f"/accounts/{api.renter.account_id}/quota", admin_key, json={"max_spend_per_hour": "1.20"})
        status, third = await rent(api, gpu_count=1)
        assert (status, third["host_id"]) == (201, cheap)
        status, body = await rent(api, gpu_count=1)
        assert_error(status, body, 403, "quota_exceeded")


class TestPlacerAndPrivacy:
    async def test_an_unknown_placer_fails_at_start(self, tmp_path: Any) -> None:
        """``placer`` names an algorithm; a typo stops the master before it opens anything."""
        with pytest.raises(UnknownPlacer, match="fgd_net"):
            await open_master(master_settings(tmp_path, placer="fgd_nett"))

    async def test_fgd_net_keeps_a_whole_host_for_gang_requests(self, api: Api) -> None:
        """The default placer puts a 1-GPU rental on the host already in use, keeping the empty 2-GPU host whole."""
        busy, _ = await api.host(2)
        empty, _ = await api.host(2)
        await set_host(api, busy, region="a")
        _, first = await rent(api, offer_id=f"{busy}:{RTX}", gpu_count=1)
        status, second = await rent(api, gpu_count=1)
        assert (status, second["host_id"]) == (201, busy)
        status, gang = await rent(api, gpu_count=2)
        assert (status, gang["host_id"]) == (201, empty)
        assert first["host_id"] == busy

    async def test_another_renters_rental_is_404_to_read_and_stop(self, api: Api) -> None:
        """Reading or stopping someone else's rental is 404, as for an id that does not exist."""
        await api.host(1)
        _, rental = await rent(api, gpu_count=1)
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        for method in ("GET", "DELETE"):
            status, body = await api.call(method, f"/rentals/{rental['id']}", other_key)
            assert_error(status, body, 404, "rental_not_found")
        _, mine = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert mine["state"] == "starting"


class TestAllocationRecords:
    async def test_every_placement_is_recorded_and_released_once(self, api: Api) -> None:
        """Whole GPUs are claimed on the GPU row and in gpu_allocations; a failed start releases both, once."""
        host_id, _ = await api.host(2)
        _, rental = await rent(api, gpu_count=2)
        held = await allocations(api, rental["id"])
        assert len(held) == 2 and all(a.whole and a.milli == 1000 and a.released_at is None for a in held)
        assert all(g.rental_id == rental["id"] and g.milli_used == 1000 for g in await gpu_rows(api, host_id))
        await api.agent_reports(rental["id"], "start_workload", ok=False, detail="image not found")
        async with api.master.db.session() as session:
            row = await session.get(Rental, rental["id"])
            assert row is not None
            await rental_lifecycle.fail_rental(session, row, code=FailureCode.HOST_LOST, reason="again", at=api.master.clock.now())  # already failed: no-op
        assert all(a.released_at is not None for a in await allocations(api, rental["id"]))
        assert all(g.rental_id is None and g.milli_used == 0 and g.memory_used_mib == 0 for g in await gpu_rows(api, host_id))
        async with api.master.db.session() as session:
            commands = (await session.scalars(select(Command).where(Command.rental_id == rental["id"]))).all()
        assert [c.kind for c in commands] == ["start_workload"]
        assert A100 != RTX
