"""Volumes through ``/api/v1/volumes`` (docs/volumes.md): making one on a host chosen by id, region or price, the
refusals, idempotency, reading by id or name, who sees what, deleting (and ``volume_in_use``), the agents' results;
and hosts' storage terms in listings, host views and offers.

Driven on SQLite and PostgreSQL (the ``api`` fixture); the agents' answers are applied as the ingestor would
(``Api.agent_answers``). The agent's own side (loop disks, a real agent's round trip) is ``test_volumes_agent.py``.
"""

from __future__ import annotations

import asyncio
from decimal import Decimal
from typing import Any

from sqlalchemy import select, update

from master.models import Command, Host, Volume, VolumeAttachment, VolumeEvent
from master.services.market import Tier, load_price_bounds
from shared import protocol
from tests.apiclient import Api, assert_error
from tests.factories import create_principal, gpu_info, online_host

KEEPS = protocol.IsolationFacts(kinds=["hold", "container"], volumes=True)
KEEPS_NONE = protocol.IsolationFacts(
    kinds=["hold", "container"], volumes=False, volumes_unavailable="the agent is not root"
)


async def lending_host(api: Api, *, price: str | None = "0.0002", gib: int = 100, region: str | None = None,
                       isolation: protocol.IsolationFacts = KEEPS, listed: bool = True,
                       gpus: list[protocol.GpuInfoModel] | None = None) -> str:  # fmt: skip
    """An online host of the provider whose agent keeps volumes (``isolation``), listed at its tier's default GPU price
    lending ``gib`` GiB at ``price`` per GiB-hour (``listed=False``: no listing at all), with ``gpus`` (one RTX 4090)."""
    host_id = await online_host(api.master, api.provider, gpus or [gpu_info(0)], isolation=isolation)
    if region is not None:
        async with api.master.db.session() as session:
            await session.execute(update(Host).where(Host.id == host_id).values(region=region))
    if listed:
        status, host = await api.as_provider("GET", f"/hosts/{host_id}")
        body: dict[str, Any] = {
            "price_per_gpu_hour": str(load_price_bounds()[Tier(host["tier"])].default),
            "volume_gib": gib,
        }
        if price is not None:
            body["storage_price_per_gib_hour"] = price
        status, listing = await api.as_provider("PUT", f"/hosts/{host_id}/listing", json=body)
        assert status == 201, listing
    return host_id


async def create(
    api: Api, key: str | None = None, headers: dict[str, str] | None = None, **body: Any
) -> tuple[int, Any]:
    return await api.call("POST", "/volumes", key or api.renter_key, json={"name": "data", "size_gib": 10, **body},
                          headers=headers or {})  # fmt: skip


async def volume_commands(api: Api, volume_id: str, kind: str) -> list[Command]:
    async with api.master.db.session() as session:
        rows = (
            await session.scalars(select(Command).where(Command.kind == kind).order_by(Command.created_at))
        ).all()
    return [c for c in rows if c.args.get("volume_id") == volume_id]


class TestCreate:
    async def test_a_volume_on_a_named_host_is_creating_until_its_agent_made_it(self, api: Api) -> None:
        """201 creating with the host's storage price kept on it, one create_volume for the host; the agent's ok makes
        it ready."""
        host_id = await lending_host(api, price="0.0002")
        status, volume = await create(api, host_id=host_id, size_gib=50)
        assert status == 201, volume
        assert volume["id"].startswith("vol-") and len(volume["id"]) == 20
        assert (volume["name"], volume["state"], volume["host_id"], volume["size_gib"]) == (
            "data",
            "creating",
            host_id,
            50,
        )
        assert volume["price_per_gib_hour"] == "0.000200" and Decimal(volume["cost_per_hour"]) == Decimal(
            "0.01"
        )
        [command] = await volume_commands(api, volume["id"], "create_volume")
        assert command.host_id == host_id and command.args == {"volume_id": volume["id"], "size_gib": 50}
        await api.agent_answers(command, data={"volume_id": volume["id"], "size_gib": 50})
        for ref in (volume["id"], "data"):
            status, shown = await api.as_renter("GET", f"/volumes/{ref}")
            assert status == 200 and shown["state"] == "ready" and shown["ready_at"] is not None
        assert [(e["from"], e["to"]) for e in shown["events"]] == [(None, "creating"), ("creating", "ready")]
        status, listed = await api.as_renter("GET", "/volumes")
        assert listed["total"] == 1 and listed["items"][0]["id"] == volume["id"]

    async def test_an_agent_that_cannot_make_it_fails_it_with_its_code(self, api: Api) -> None:
        host_id = await lending_host(api)
        _, volume = await create(api, host_id=host_id)
        [command] = await volume_commands(api, volume["id"], "create_volume")
        await api.agent_answers(command, ok=False, detail="this host has 3 GiB free for volumes (its reserve kept), not 10",
                                data={"code": "volume_no_space"})  # fmt: skip
        _, shown = await api.as_renter("GET", f"/volumes/{volume['id']}")
        assert (
            shown["state"] == "failed"
            and shown["failure_code"] == "volume_no_space"
            and "3 GiB free" in shown["failure_reason"]
        )

    async def test_without_a_host_the_cheapest_with_room_is_chosen(self, api: Api) -> None:
        """Cheapest storage first; a cheaper host too full, one whose agent keeps none, one offline are passed over."""
        dear = await lending_host(api, price="0.0005", gib=100)
        await lending_host(api, price="0.0001", gib=5)  # too small
        await lending_host(api, price="0.00001", isolation=KEEPS_NONE)
        offline = await lending_host(api, price="0.00002")
        middle = await lending_host(api, price="0.0003", gib=100)
        async with api.master.db.session() as session:
            await session.execute(update(Host).where(Host.id == offline).values(state="offline"))
        status, volume = await create(api, size_gib=10)
        assert status == 201 and volume["host_id"] == middle, volume
        status, second = await create(api, name="more", size_gib=95)
        assert status == 201 and second["host_id"] == dear, second  # middle has 90 left

    async def test_a_region_picks_among_its_own_hosts(self, api: Api) -> None:
        await lending_host(api, price="0.0001", region="eu-west")
        us = await lending_host(api, price="0.0004", region="us-east")
        status, volume = await create(api, region="us-east")
        assert status == 201 and volume["host_id"] == us and volume["region"] == "us-east"
        status, body = await create(api, name="x", region="ap-south")
        assert_error(status, body, 409, "volume_host_lends_none")
        assert "region ap-south" in body["message"]

    async def test_a_repeated_idempotency_key_answers_the_first_volume(self, api: Api) -> None:
        host_id = await lending_host(api)
        headers = {"Idempotency-Key": "vol-once"}
        status, first = await create(api, headers=headers, host_id=host_id)
        assert status == 201
        status, again = await create(api, headers=headers, host_id=host_id)
        assert status == 200 and again["id"] == first["id"]
        assert len(await volume_commands(api, first["id"], "create_volume")) == 1
        status, body = await create(api, headers=headers, host_id=host_id, size_gib=11)
        assert_error(status, body, 409, "idempotency_key_reused")

    async def test_volumes_count_against_the_hosts_lent_gib(self, api: Api) -> None:
        """Live volumes take the host's volume_gib; a deleted one gives its GiB back."""
        host_id = await lending_host(api, gib=30)
        await create(api, host_id=host_id, size_gib=20)
        status, body = await create(api, name="second", host_id=host_id, size_gib=11)
        assert_error(status, body, 409, "volume_host_full")
        assert body["details"] == {"host_id": host_id, "gib_free": 10} and "10 GiB free" in body["message"]
        status, _ = await api.as_renter("DELETE", "/volumes/data")
        assert status == 202
        status, second = await create(api, name="second", host_id=host_id, size_gib=30)
        assert status == 201, second

    async def test_two_volumes_made_at_once_never_take_the_same_gib(self, api: Api) -> None:
        """Concurrent creates on a host with room for one: one is made, the other is refused as full (the listing's
        row locked while its room is read), named host or chosen alike."""
        for where in ("host", "anywhere"):
            host_id = await lending_host(api, gib=10)
            body: dict[str, Any] = {"host_id": host_id} if where == "host" else {}
            answers = await asyncio.gather(
                *(create(api, name=f"{where}-{i}", size_gib=6, **body) for i in range(4))
            )
            assert sorted(status for status, _ in answers) == [201, 409, 409, 409], answers
            assert all(b["code"] == "volume_host_full" for status, b in answers if status == 409), answers
            async with api.master.db.session() as session:
                sizes = (
                    await session.scalars(select(Volume.size_gib).where(Volume.host_id == host_id))
                ).all()
            assert list(sizes) == [6]
            async with api.master.db.session() as session:  # the next round's host is the only one with room
                await session.execute(update(Host).where(Host.id == host_id).values(state="offline"))


class TestRefusals:
    async def test_without_credit_for_an_hour_of_it_nothing_is_made(self, api: Api) -> None:
        """With ``require_credit`` a volume needs credit for an hour of its storage: 402, no volume, no command; a
        top-up lets the same request through."""
        api.master.settings.require_credit = True
        host_id = await lending_host(api, price="0.01")
        status, body = await create(api, host_id=host_id, size_gib=50)  # 0.50 an hour
        assert_error(status, body, 402, "insufficient_credit")
        async with api.master.db.session() as session:
            assert (await session.scalars(select(Volume))).all() == []
            assert (await session.scalars(select(Command).where(Command.kind == "create_volume"))).all() == []
        _, admin_key = await create_principal(api.master, "admin-credit", "admin")
        status, paid = await api.call("POST", "/account/credits", admin_key,
                                      json={"account_id": api.renter.account_id, "amount": "5.00", "reference": "v1"})  # fmt: skip
        assert status == 201, paid
        status, body = await create(api, host_id=host_id, size_gib=50)
        assert status == 201 and body["state"] == "creating", body

    async def test_an_unknown_host_is_404(self, api: Api) -> None:
        status, body = await create(api, host_id="h-0000000000000000")
        assert_error(status, body, 404, "host_not_found")

    async def test_a_host_that_lends_nothing(self, api: Api) -> None:
        unlisted = await lending_host(api, listed=False)
        status, body = await create(api, host_id=unlisted)
        assert_error(status, body, 409, "volume_host_lends_none")
        no_gib = await lending_host(api, gib=0)
        status, body = await create(api, host_id=no_gib)
        assert_error(status, body, 409, "volume_host_lends_none")

    async def test_a_host_whose_agent_keeps_no_volumes_says_why(self, api: Api) -> None:
        host_id = await lending_host(api, isolation=KEEPS_NONE)
        status, body = await create(api, host_id=host_id)
        assert_error(status, body, 409, "volume_host_unsupported")
        assert "the agent is not root" in body["message"]
        older = await lending_host(api, isolation=protocol.IsolationFacts.model_validate({"kinds": ["hold"]}))
        async with api.master.db.session() as session:  # an agent older than volumes sends no such fact
            host = await session.get(Host, older)
            assert host is not None and host.isolation is not None
            host.isolation = {k: v for k, v in host.isolation.items() if not k.startswith("volumes")}
        status, body = await create(api, host_id=older)
        assert_error(status, body, 409, "volume_host_unsupported")
        assert "older than volumes" in body["message"]

    async def test_an_offline_host(self, api: Api) -> None:
        host_id = await lending_host(api)
        async with api.master.db.session() as session:
            await session.execute(update(Host).where(Host.id == host_id).values(state="offline"))
        status, body = await create(api, host_id=host_id)
        assert_error(status, body, 409, "volume_host_offline")

    async def test_a_name_in_use(self, api: Api) -> None:
        host_id = await lending_host(api)
        await create(api, host_id=host_id)
        status, body = await create(api, host_id=host_id)
        assert_error(status, body, 409, "volume_name_taken")

    async def test_bad_names_sizes_and_both_host_and_region(self, api: Api) -> None:
        host_id = await lending_host(api)
        for name in (
            "Data",
            "-data",
            "da ta",
            "x" * 65,
            "vol-0123456789abcdef",
            "dаta",
        ):  # the last: a Cyrillic a
            status, body = await create(api, host_id=host_id, name=name)
            assert status in (400, 422), (name, body)
            assert body["code"] in ("invalid_volume_name", "validation_failed"), body
        status, body = await create(api, host_id=host_id, name="da\x00ta")
        assert status == 400, body  # control characters: refused by the body reader
        for size in (0, -1, 10**9, "ten", 1.5):
            status, body = await create(api, host_id=host_id, size_gib=size)
            assert_error(status, body, 422, "validation_failed")
        status, body = await create(api, host_id=host_id, region="eu-west")
        assert_error(status, body, 400, "host_or_region")
        async with api.master.db.session() as session:
            assert (await session.scalars(select(Volume))).all() == []

    async def test_nowhere_to_put_it(self, api: Api) -> None:
        status, body = await create(api)
        assert_error(status, body, 409, "volume_host_lends_none")
        await lending_host(api, gib=5)
        status, body = await create(api, size_gib=6)
        assert_error(status, body, 409, "volume_host_full")
        assert body["details"] == {"gib_free": 5}


class TestWhoSeesWhat:
    async def test_another_account_neither_sees_nor_deletes_it(self, api: Api) -> None:
        host_id = await lending_host(api)
        _, volume = await create(api, host_id=host_id)
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        for ref in (volume["id"], "data"):
            status, body = await api.call("GET", f"/volumes/{ref}", other_key)
            assert_error(status, body, 404, "volume_not_found")
            status, body = await api.call("DELETE", f"/volumes/{ref}", other_key)
            assert_error(status, body, 404, "volume_not_found")
        status, listed = await api.call("GET", "/volumes", other_key)
        assert listed["total"] == 0
        status, mine = await create(api, other_key, host_id=host_id)  # names are per account
        assert status == 201 and mine["id"] != volume["id"]
        _, shown = await api.as_renter("GET", f"/volumes/{volume['id']}")
        assert shown["state"] == "creating"

    async def test_a_provider_account_cannot_make_one(self, api: Api) -> None:
        host_id = await lending_host(api)
        status, body = await create(api, api.provider_key, host_id=host_id)
        assert status == 403, body


class TestDelete:
    async def test_deleting_is_asked_then_confirmed_and_idempotent(self, api: Api) -> None:
        host_id = await lending_host(api)
        _, volume = await create(api, host_id=host_id)
        [made] = await volume_commands(api, volume["id"], "create_volume")
        await api.agent_answers(made)
        status, deleting = await api.as_renter("DELETE", "/volumes/data")
        assert status == 202 and deleting["state"] == "deleting" and deleting["deleted_at"] is not None
        status, again = await api.as_renter("DELETE", f"/volumes/{volume['id']}")
        assert status == 202 and again["state"] == "deleting"
        [command] = await volume_commands(api, volume["id"], "delete_volume")
        assert command.args == {"volume_id": volume["id"]}
        await api.agent_answers(command, data={"volume_id": volume["id"]})
        _, shown = await api.as_renter("GET", f"/volumes/{volume['id']}")
        assert shown["state"] == "deleted"
        status, body = await api.as_renter("GET", "/volumes/data")  # a name names live volumes only
        assert_error(status, body, 404, "volume_not_found")
        _, listed = await api.as_renter("GET", "/volumes")
        assert listed["total"] == 0
        _, listed = await api.as_renter("GET", "/volumes?deleted=true")
        assert [v["id"] for v in listed["items"]] == [volume["id"]]
        status, reused = await create(api, host_id=host_id)
        assert status == 201 and reused["id"] != volume["id"]

    async def test_a_volume_a_rental_mounts_is_in_use_until_the_rental_ends(self, api: Api) -> None:
        host_id = await lending_host(api)
        _, volume = await create(api, host_id=host_id)
        status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1})
        assert status == 201 and rental["host_id"] == host_id, rental
        async with (
            api.master.db.session() as session
        ):  # what rentals with volumes write (the attachments' slice)
            session.add(VolumeAttachment(volume_id=volume["id"], rental_id=rental["id"], mount="/data"))
        await api.agent_reports(rental["id"], "start_workload")
        status, body = await api.as_renter("DELETE", "/volumes/data")
        assert_error(status, body, 409, "volume_in_use")
        assert body["details"] == {"rentals": [rental["id"]]} and rental["id"] in body["message"]
        _, shown = await api.as_renter("GET", "/volumes/data")
        assert shown["mounted_by"] == [
            {"rental_id": rental["id"], "mount": "/data", "read_only": False, "rental_state": "running"}
        ]
        status, _ = await api.as_renter("DELETE", f"/rentals/{rental['id']}")
        status, body = await api.as_renter("DELETE", "/volumes/data")
        assert_error(status, body, 409, "volume_in_use")  # stopping: it still mounts it
        await api.agent_reports(rental["id"], "stop_workload")
        status, deleted = await api.as_renter("DELETE", "/volumes/data")
        assert status == 202 and deleted["state"] == "deleting", deleted

    async def test_a_volume_on_a_revoked_host_is_deleted_at_once(self, api: Api) -> None:
        host_id = await lending_host(api)
        _, volume = await create(api, host_id=host_id)
        async with api.master.db.session() as session:
            await session.execute(update(Host).where(Host.id == host_id).values(state="revoked"))
        status, deleted = await api.as_renter("DELETE", "/volumes/data")
        assert status == 202 and deleted["state"] == "deleted"
        assert await volume_commands(api, volume["id"], "delete_volume") == []
        async with api.master.db.session() as session:
            causes = (
                await session.scalars(select(VolumeEvent.cause).where(VolumeEvent.volume_id == volume["id"]))
            ).all()
        assert any("revoked" in c for c in causes)


class TestStorageTerms:
    async def test_a_listing_lends_storage_and_hosts_and_offers_show_what_is_free(self, api: Api) -> None:
        host_id = await lending_host(api, price="0.00025", gib=40)
        _, listing = await api.as_provider("GET", f"/hosts/{host_id}/listing")
        assert listing["storage_price_per_gib_hour"] == "0.000250" and listing["volume_gib"] == 40
        await create(api, host_id=host_id, size_gib=15)
        _, host = await api.as_renter("GET", f"/hosts/{host_id}")
        assert (
            host["storage_price_per_gib_hour"],
            host["volume_gib"],
            host["volume_gib_used"],
            host["volume_gib_free"],
        ) == ("0.000250", 40, 15, 25)
        assert host["volumes_kept"] is True and host["volumes_unavailable"] is None
        _, hosts = await api.as_renter("GET", "/hosts")
        assert [h["volume_gib_free"] for h in hosts["items"] if h["id"] == host_id] == [25]
        _, offers = await api.as_renter("GET", "/offers")
        [offer] = [o for o in offers["items"] if o["host_id"] == host_id]
        assert (offer["storage_price_per_gib_hour"], offer["volume_gib"], offer["volume_gib_free"]) == (
            "0.000250",
            40,
            25,
        )

    async def test_a_host_that_keeps_none_shows_no_room_and_why(self, api: Api) -> None:
        host_id = await lending_host(api, isolation=KEEPS_NONE)
        _, host = await api.as_renter("GET", f"/hosts/{host_id}")
        assert host["volume_gib"] == 100 and host["volume_gib_free"] == 0
        assert host["volumes_kept"] is False and host["volumes_unavailable"] == "the agent is not root"

    async def test_bad_storage_terms_are_422(self, api: Api) -> None:
        host_id = await lending_host(api, listed=False)
        _, host = await api.as_provider("GET", f"/hosts/{host_id}")
        price = str(load_price_bounds()[Tier(host["tier"])].default)
        for body, code in (
            ({"volume_gib": 10}, "storage_price_needed"),
            ({"storage_price_per_gib_hour": "0"}, "invalid_storage_price"),
            ({"storage_price_per_gib_hour": "0.0000001"}, "invalid_storage_price"),
            ({"storage_price_per_gib_hour": "11"}, "invalid_storage_price"),
            ({"storage_price_per_gib_hour": "1e-4"}, "invalid_storage_price"),
            ({"storage_price_per_gib_hour": "0.0001", "volume_gib": -1}, "validation_failed"),
        ):
            status, answer = await api.as_provider(
                "PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": price, **body}
            )
            assert_error(status, answer, 422, code)
