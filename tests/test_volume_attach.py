"""Rentals mount volumes (issue 41, point 2; docs/volumes.md "Rentals mount them"), on the master.

Placement goes only to the volume's host and says which volume and why when that host cannot take the rental; a
volume is mounted read-write by one unfinished rental at a time (409 ``volume_in_use`` naming it), read-only by many;
the attachments are released whichever way a rental ends; ``queue: true`` waits for the volume's host. Each test runs
on SQLite and PostgreSQL (the ``api`` fixture). Volumes are inserted as rows: making them is the volumes resource's.
"""

from __future__ import annotations

import secrets
from decimal import Decimal
from typing import Any

from sqlalchemy import select, update

from master.models import Host, Rental, Volume, VolumeAttachment
from master.services import queue as rental_queue
from tests.apiclient import Api, assert_error
from tests.factories import create_principal

CONTAINER = {"kind": "container", "image": "ubuntu:24.04", "command": ["sleep", "infinity"]}


async def volume(
    api: Api, host_id: str, name: str = "data", *, state: str = "ready", account_id: str | None = None
) -> str:
    """A volume of the renter's (or ``account_id``'s) on ``host_id``, as the volumes resource would have made it."""
    volume_id = f"vol-{secrets.token_hex(8)}"
    async with api.master.db.session() as session:
        session.add(Volume(id=volume_id, account_id=account_id or api.renter.account_id, name=name, size_gib=10, host_id=host_id,
                           state=state, price_per_gib_hour=Decimal("0.0001")))  # fmt: skip
    return volume_id


async def rent(
    api: Api, *mounts: dict[str, Any], key: str | None = None, expect: int = 201, **body: Any
) -> dict[str, Any]:
    status, view = await api.call("POST", "/rentals", key or api.renter_key,
                                  json={"gpu_count": 1, "workload": CONTAINER, "volumes": list(mounts), **body})  # fmt: skip
    assert status == expect, view
    return dict(view)


async def attachments(api: Api, volume_id: str) -> list[tuple[str, bool, bool]]:
    """(rental, read_only, released) of the volume's attachments, oldest first."""
    async with api.master.db.session() as session:
        rows = await session.scalars(
            select(VolumeAttachment)
            .where(VolumeAttachment.volume_id == volume_id)
            .order_by(VolumeAttachment.id)
        )
        return [(a.rental_id, a.read_only, a.released_at is not None) for a in rows.all()]


async def start_volumes(api: Api, rental_id: str) -> Any:
    [command] = await api.commands(rental_id, "start_workload")
    return command.args.get("volumes")


async def stopped(api: Api, rental_id: str) -> None:
    """The renter stops the rental and its agent confirms."""
    status, _ = await api.as_renter("DELETE", f"/rentals/{rental_id}")
    assert status == 202
    await api.agent_reports(rental_id, "stop_workload")


class TestPlacement:
    async def test_a_rental_goes_to_its_volumes_host_and_its_start_names_the_mount(self, api: Api) -> None:
        """Two hosts with free GPUs: the rental lands on the one with the volume, and its start command mounts it."""
        await api.host(2)
        host, _ = await api.host(2)
        volume_id = await volume(api, host)
        rental = await rent(api, {"name": "data", "mount": "/data"})
        assert rental["host_id"] == host
        assert rental["volumes"] == [{"name": "data", "mount": "/data", "read_only": False}]
        assert await start_volumes(api, rental["id"]) == [
            {"volume_id": volume_id, "mount": "/data", "read_only": False}
        ]
        assert await attachments(api, volume_id) == [(rental["id"], False, False)]

    async def test_a_volume_named_by_id_mounts_read_only(self, api: Api) -> None:
        host, _ = await api.host(1)
        volume_id = await volume(api, host)
        rental = await rent(api, {"id": volume_id, "mount": "/weights", "read_only": True})
        assert await start_volumes(api, rental["id"]) == [
            {"volume_id": volume_id, "mount": "/weights", "read_only": True}
        ]

    async def test_a_full_volume_host_is_409_naming_the_volume_and_its_host(self, api: Api) -> None:
        """Another host has room, but the volume's host has none: 409, naming both, never a GPU elsewhere."""
        await api.host(2)
        host, _ = await api.host(1)
        await volume(api, host)
        await api.as_renter("POST", "/rentals", json={"offer_id": f"{host}:NVIDIA GeForce RTX 4090"})
        body = await rent(api, {"name": "data", "mount": "/data"}, expect=409)
        assert_error(409, body, 409, "insufficient_capacity")
        assert "'data'" in body["message"] and host in body["message"] and "only host" in body["message"], (
            body
        )

    async def test_an_offline_volume_host_is_409_volume_host_offline(self, api: Api) -> None:
        await api.host(2)
        host, _ = await api.host(1)
        await volume(api, host)
        async with api.master.db.session() as session:
            await session.execute(update(Host).where(Host.id == host).values(state="offline"))
        body = await rent(api, {"name": "data", "mount": "/data"}, expect=409)
        assert_error(409, body, 409, "volume_host_offline")
        assert f"{host} is offline" in body["message"] and "'data'" in body["message"], body

    async def test_a_host_too_small_for_ever_is_exceeds_fleet_even_with_queue(self, api: Api) -> None:
        await api.host(4)
        host, _ = await api.host(1)
        await volume(api, host)
        body = await rent(api, {"name": "data", "mount": "/data"}, gpu_count=2, queue=True, expect=409)
        assert_error(409, body, 409, "exceeds_fleet")
        assert host in body["message"], body

    async def test_volumes_on_two_hosts_are_409(self, api: Api) -> None:
        first, _ = await api.host(1)
        second, _ = await api.host(1)
        await volume(api, first, "a")
        await volume(api, second, "b")
        body = await rent(api, {"name": "a", "mount": "/a"}, {"name": "b", "mount": "/b"}, expect=409)
        assert_error(409, body, 409, "volumes_on_different_hosts")
        assert first in body["message"] and second in body["message"]

    async def test_an_offer_on_another_host_is_409(self, api: Api) -> None:
        first, _ = await api.host(1)
        second, _ = await api.host(1)
        await volume(api, first)
        body = await rent(
            api, {"name": "data", "mount": "/data"}, offer_id=f"{second}:NVIDIA GeForce RTX 4090", expect=409
        )
        assert_error(409, body, 409, "volume_on_other_host")


class TestRefusals:
    async def test_an_unknown_or_anothers_volume_is_404(self, api: Api) -> None:
        host, _ = await api.host(1)
        other, _ = await create_principal(api.master, "renter-2", "renter")
        await volume(api, host, "theirs", account_id=other.account_id)
        for mount in ({"name": "nope", "mount": "/data"}, {"name": "theirs", "mount": "/data"},
                      {"id": "vol-0123456789abcdef", "mount": "/data"}):  # fmt: skip
            body = await rent(api, mount, expect=404)
            assert_error(404, body, 404, "volume_not_found")
        assert await api.count(Rental) == 0

    async def test_a_volume_not_ready_is_409(self, api: Api) -> None:
        host, _ = await api.host(1)
        await volume(api, host, state="creating")
        body = await rent(api, {"name": "data", "mount": "/data"}, expect=409)
        assert_error(409, body, 409, "volume_not_ready")

    async def test_hold_and_process_workloads_and_bad_mount_points_are_422(self, api: Api) -> None:
        host, _ = await api.host(1)
        await volume(api, host)
        data = {"name": "data", "mount": "/data"}
        for workload in ({"kind": "hold"}, {"kind": "process", "argv": ["sleep", "1"]}):
            body = await rent(api, data, workload=workload, expect=422)
            assert_error(422, body, 422, "invalid_volumes")
            assert "container workload only" in body["message"], body
        for mount in ("/workspace", "/etc/x", "data", "/a/../b", "/"):
            body = await rent(api, {"name": "data", "mount": mount}, expect=422)
            assert_error(422, body, 422, "invalid_volumes")
            assert body["details"]["problems"][0]["field"] == "volumes[0].mount", body
        for twice in ([data, {"name": "data", "mount": "/b"}], [data, {"name": "other", "mount": "/data"}]):
            body = await rent(api, *twice, expect=422)
            assert_error(422, body, 422, "invalid_volumes")
        body = await rent(api, {"name": "data", "id": "vol-0123456789abcdef", "mount": "/data"}, expect=422)
        assert_error(422, body, 422, "invalid_volumes")
        assert await api.count(Rental) == 0


class TestOneWriter:
    async def test_a_second_writer_is_409_naming_the_first_until_it_ends(self, api: Api) -> None:
        """Read-write by one unfinished rental at a time: the second is refused naming the first; once the first
        has stopped, the next rental mounts it read-write on the same host."""
        host, _ = await api.host(3)
        volume_id = await volume(api, host)
        first = await rent(api, {"name": "data", "mount": "/data"})
        body = await rent(api, {"name": "data", "mount": "/data"}, expect=409)
        assert_error(409, body, 409, "volume_in_use")
        assert first["id"] in body["message"] and body["details"]["rental_id"] == first["id"], body
        await api.agent_reports(first["id"], "start_workload")
        await stopped(api, first["id"])
        second = await rent(api, {"name": "data", "mount": "/data"})
        assert second["host_id"] == host
        assert await attachments(api, volume_id) == [(first["id"], False, True), (second["id"], False, False)]

    async def test_readers_mount_it_together_beside_the_writer(self, api: Api) -> None:
        host, _ = await api.host(3)
        volume_id = await volume(api, host)
        ro = {"name": "data", "mount": "/data", "read_only": True}
        readers = [await rent(api, ro), await rent(api, ro)]
        writer = await rent(api, {"name": "data", "mount": "/data"})
        assert await attachments(api, volume_id) == [(readers[0]["id"], True, False), (readers[1]["id"], True, False),
                                                     (writer["id"], False, False)]  # fmt: skip

    async def test_a_failed_start_and_an_exit_release_the_volume(self, api: Api) -> None:
        host, _ = await api.host(2)
        volume_id = await volume(api, host)
        failed = await rent(api, {"name": "data", "mount": "/data"})
        await api.agent_reports(
            failed["id"], "start_workload", ok=False, detail="volume_not_found: volume is not on this host"
        )
        _, view = await api.as_renter("GET", f"/rentals/{failed['id']}")
        assert (view["state"], view["failure_code"], view["failure_owner"]) == (
            "failed",
            "volume_not_found",
            "platform",
        )
        exited = await rent(api, {"name": "data", "mount": "/data"})
        await api.agent_reports(exited["id"], "start_workload")
        async with api.master.db.session() as session:
            from master.services import rentals

            await rentals.apply_workload_exit(
                session, host, exited["id"], exit_code=0, reason="", at=api.master.clock.now()
            )
        assert [released for _, _, released in await attachments(api, volume_id)] == [True, True]
        await rent(api, {"name": "data", "mount": "/data"})

    async def test_two_racing_writers_get_one_attachment(self, api: Api) -> None:
        """The unique index is the last word: two placements at once, one rental mounts it, the other is 409."""
        import asyncio

        host, _ = await api.host(2)
        volume_id = await volume(api, host)
        results = await asyncio.gather(*(api.as_renter("POST", "/rentals", json={
            "gpu_count": 1, "workload": CONTAINER, "volumes": [{"name": "data", "mount": "/data"}]}) for _ in range(2)))  # fmt: skip
        assert sorted(status for status, _ in results) == [201, 409], results
        [(_, refused)] = [(s, b) for s, b in results if s == 409]
        assert refused["code"] == "volume_in_use"
        assert [ro for _, ro, released in await attachments(api, volume_id) if not released] == [False]


class TestQueue:
    async def test_a_queued_rental_waits_for_its_volumes_host_and_holds_the_volume(self, api: Api) -> None:
        """The volume's host is full: queued (holding the volume: a second writer is refused); placed there once free."""
        await api.host(2)
        host, _ = await api.host(1)
        volume_id = await volume(api, host)
        _, blocker = await api.as_renter(
            "POST", "/rentals", json={"offer_id": f"{host}:NVIDIA GeForce RTX 4090"}
        )
        queued = await rent(api, {"name": "data", "mount": "/data"}, queue=True, queue_timeout_s=600)
        assert queued["queued"] and queued["host_id"] is None
        assert await attachments(api, volume_id) == [(queued["id"], False, False)]
        body = await rent(api, {"name": "data", "mount": "/data"}, expect=409)
        assert_error(409, body, 409, "volume_in_use")
        assert await rental_queue.process_queue(api.master) == 0  # still full
        await api.agent_reports(blocker["id"], "start_workload")
        await stopped(api, blocker["id"])
        assert await rental_queue.process_queue(api.master) == 1
        _, view = await api.as_renter("GET", f"/rentals/{queued['id']}")
        assert (view["state"], view["host_id"]) == ("starting", host)
        assert await start_volumes(api, queued["id"]) == [
            {"volume_id": volume_id, "mount": "/data", "read_only": False}
        ]
        assert await attachments(api, volume_id) == [(queued["id"], False, False)]

    async def test_a_queued_rental_waits_for_an_offline_host_and_cancelling_releases_the_volume(
        self, api: Api
    ) -> None:
        host, _ = await api.host(1)
        volume_id = await volume(api, host)
        async with api.master.db.session() as session:
            await session.execute(update(Host).where(Host.id == host).values(state="offline"))
        queued = await rent(api, {"name": "data", "mount": "/data"}, queue=True)
        assert queued["queued"]
        status, _ = await api.as_renter("DELETE", f"/rentals/{queued['id']}")
        assert status == 202
        assert await attachments(api, volume_id) == [(queued["id"], False, True)]


class TestClusters:
    async def test_each_node_goes_to_its_own_volumes_host_and_mounts_it(self, api: Api) -> None:
        """``ckpt-{rank}``: node r mounts ckpt-r and is placed on its host, though another host has room too."""
        await api.host(2)
        hosts = [(await api.host(1))[0] for _ in range(2)]
        ids = [await volume(api, host, f"ckpt-{rank}") for rank, host in enumerate(hosts)]
        status, cluster = await api.as_renter("POST", "/clusters", json={
            "node_count": 2, "workload": CONTAINER, "volumes": [{"name": "ckpt-{rank}", "mount": "/ckpt"}]})  # fmt: skip
        assert status == 201, cluster
        members = sorted(cluster["members"], key=lambda m: m["node_rank"])
        assert [m["host_id"] for m in members] == hosts
        for member, volume_id in zip(members, ids, strict=True):
            assert await start_volumes(api, member["rental_id"]) == [{"volume_id": volume_id, "mount": "/ckpt", "read_only": False}]
            assert await attachments(api, volume_id) == [(member["rental_id"], False, False)]

    async def test_a_volume_without_rank_or_two_nodes_on_one_host_are_refused(self, api: Api) -> None:
        host, _ = await api.host(2)
        await api.host(2)
        await volume(api, host, "ckpt-0")
        await volume(api, host, "ckpt-1")
        body = {"node_count": 2, "workload": CONTAINER}
        status, refused = await api.as_renter("POST", "/clusters", json={**body, "volumes": [{"name": "ckpt-0", "mount": "/c"}]})
        assert_error(status, refused, 422, "invalid_volumes")
        status, refused = await api.as_renter("POST", "/clusters", json={**body, "volumes": [{"name": "ckpt-{rank}", "mount": "/c"}]})
        assert_error(status, refused, 409, "volumes_share_a_host")
        assert await api.count(Rental) == 0


SERVICE = {"name": "chat", "workload": {"kind": "container", "image": "gpumarket-test/openai-cpu:1", "ports": [8000]},
           "port": 8000, "min_replicas": 2, "max_replicas": 2}  # fmt: skip


class TestServices:
    async def test_replicas_go_only_where_a_copy_of_the_weights_lives_and_mount_it_read_only(self, api: Api) -> None:
        """Copies of the weights on two hosts at one mount point: a replica on each, each mounting its host's copy."""
        await api.host(2)
        hosts = [(await api.host(1))[0] for _ in range(2)]
        ids = {host: await volume(api, host, f"weights-{n}") for n, host in enumerate(hosts)}
        copies = [{"name": f"weights-{n}", "mount": "/weights", "read_only": True} for n in range(2)]
        status, service = await api.as_renter("POST", "/services", json={**SERVICE, "volumes": copies})
        assert status == 201, service
        assert service["volumes"] == copies
        replicas = [r["rental_id"] for r in service["replica_rentals"]]
        placed = set()
        for rental_id in replicas:
            _, rental = await api.as_renter("GET", f"/rentals/{rental_id}")
            placed.add(rental["host_id"])
            assert await start_volumes(api, rental_id) == [{"volume_id": ids[rental["host_id"]], "mount": "/weights", "read_only": True}]
        assert placed == set(hosts)

    async def test_a_read_write_volume_is_422(self, api: Api) -> None:
        host, _ = await api.host(1)
        await volume(api, host, "weights")
        status, refused = await api.as_renter("POST", "/services", json={**SERVICE, "volumes": [{"name": "weights", "mount": "/w"}]})
        assert_error(status, refused, 422, "invalid_volumes")
