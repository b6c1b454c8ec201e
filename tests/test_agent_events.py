"""What the master makes of the agent's newer messages: GPU events, network reports, workload
exits and logs, stale hellos; and the endpoints that show them (metrics, network, logs)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import func, select

from master.app import create_app
from master.context import Master
from master.models import Command, Gpu, GpuEvent, Host, Rental, RentalLogChunk
from master.services.accounts.core import Principal
from master.services.rentals import core as rentals
from master.services.rentals import request as rental_request
from master.telemetry import hosts
from shared import protocol
from tests.factories import (
    command_result,
    create_principal,
    envelope,
    gpu_info,
    hello,
    online_host,
    telemetry,
)


def _now() -> datetime:
    return datetime.now(UTC)


async def _apply(master: Master, message: protocol.AnyAgentMessage) -> Any:
    handlers: dict[type, Callable[..., Awaitable[Any]]] = {
        protocol.Hello: hosts.handle_hello, protocol.Telemetry: hosts.handle_telemetry,
        protocol.GpuEvents: hosts.handle_gpu_events, protocol.NetworkReport: hosts.handle_network_report,
        protocol.WorkloadExited: hosts.handle_workload_exited, protocol.WorkloadLogs: hosts.handle_workload_logs,
        protocol.CommandResult: hosts.handle_command_result,
    }
    async with master.db.session() as session:
        return await handlers[type(message)](session, envelope(message))


class World:
    def __init__(self, master: Master, client: TestClient[Any, Any], renter: Principal, renter_key: str,
                 provider: Principal, provider_key: str) -> None:
        self.master, self.client = master, client
        self.renter, self.renter_key, self.provider, self.provider_key = renter, renter_key, provider, provider_key
        self.seq = 100

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    async def get(self, path: str, key: str | None = None) -> tuple[int, Any]:
        async with self.client.get("/api/v1" + path, headers={"Authorization": f"Bearer {key or self.renter_key}"}) as r:
            return r.status, await r.json()

    async def running_rental(self, host_id: str, gpus: list[protocol.GpuInfoModel]) -> Rental:
        rental, _ = await rentals.create_rental(
            self.master, self.renter, rental_request.RentalRequest(gpu_count=1, gpu_model=gpus[0].name), idempotency_key=None
        )
        async with self.master.db.session() as session:
            command_id = await session.scalar(select(Command.id).where(Command.rental_id == rental.id))
        assert command_id is not None
        await _apply(self.master, command_result(host_id, self.next_seq(), command_id))
        return rental


@pytest.fixture
async def world(master: Master) -> AsyncIterator[World]:
    renter, renter_key = await create_principal(master, "r", "renter")
    provider, provider_key = await create_principal(master, "p", "provider")
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(master, background=False)))
    await client.start_server()
    try:
        yield World(master, client, renter, renter_key, provider, provider_key)
    finally:
        await client.close()


class TestGpuEvents:
    async def test_events_are_stored_once_per_position(self, world: World) -> None:
        """An XID event is recorded with its code; a redelivered message adds nothing."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        message = protocol.GpuEvents(
            host_id=host_id, seq=7, ts=_now(),
            body=protocol.GpuEventsBody(events=[protocol.GpuEventModel(uuid=gpus[0].uuid, kind="xid", code=79, at=_now())]),
        )
        assert await _apply(world.master, message) == 1
        assert await _apply(world.master, message) == 0
        async with world.master.db.session() as session:
            rows = (await session.scalars(select(GpuEvent))).all()
        assert [(r.kind, r.code, r.gpu_uuid) for r in rows] == [("xid", 79, gpus[0].uuid)]


class TestNetwork:
    async def test_reports_are_kept_and_the_latest_shows_on_the_host(self, world: World) -> None:
        """Each network report is stored once; the host detail shows the newest, the history lists all."""
        host_id = await online_host(world.master, world.provider, [gpu_info(0)])
        for i, mbps in enumerate((100.0, 250.0)):
            body = protocol.NetworkReportBody(
                relay_url="wss://relay/v1/agent", measured_at=_now() + timedelta(seconds=i), download_mbps=mbps, upload_mbps=50.0,
                latency_ms=12.5, jitter_ms=1.5, jitter_rfc3550_ms=0.8, loss=0.0, probes_sent=20, probes_answered=20, duration_s=4.0,
            )
            message = protocol.NetworkReport(host_id=host_id, seq=20 + i, ts=_now(), body=body)
            assert await _apply(world.master, message)
        assert not await _apply(world.master, message)  # redelivery
        status, detail = await world.get(f"/hosts/{host_id}")
        assert status == 200 and detail["latest_network"]["download_mbps"] == 250.0
        status, history = await world.get(f"/hosts/{host_id}/network")
        assert [m["download_mbps"] for m in history["items"]] == [250.0, 100.0]

    async def test_a_provider_can_ask_for_a_measurement_of_its_own_host_only(self, world: World) -> None:
        """POST network-test creates a measure_network command for the owner; others get 404."""
        host_id = await online_host(world.master, world.provider, [gpu_info(0)])
        headers = {"Authorization": f"Bearer {world.provider_key}"}
        async with world.client.post(f"/api/v1/hosts/{host_id}/network-test", headers=headers) as response:
            assert response.status == 202
            command_id = (await response.json())["command_id"]
        async with world.master.db.session() as session:
            command = await session.get(Command, command_id)
        assert command is not None and command.kind == "measure_network"
        _, other_key = await create_principal(world.master, "p2", "provider")
        async with world.client.post(f"/api/v1/hosts/{host_id}/network-test", headers={"Authorization": f"Bearer {other_key}"}) as r:
            assert r.status == 404


class TestWorkloadExit:
    @pytest.mark.parametrize(("code", "state"), [(0, "stopped"), (3, "failed")])
    async def test_a_workload_that_ends_on_its_own_ends_the_rental(self, world: World, code: int, state: str) -> None:
        """Exit 0 completes the rental, another code fails it; either way its GPU is free again."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        rental = await world.running_rental(host_id, gpus)
        body = protocol.WorkloadExitedBody(rental_id=rental.id, exit_code=code, at=_now())
        await _apply(world.master, protocol.WorkloadExited(host_id=host_id, seq=world.next_seq(), ts=_now(), body=body))
        async with world.master.db.session() as session:
            again = await session.get(Rental, rental.id)
            taken = await session.scalar(select(func.count()).select_from(Gpu).where(Gpu.rental_id.is_not(None)))
            host = await session.get(Host, host_id)
        assert again is not None and again.state == state and taken == 0
        assert host is not None and host.state == "online"
        if code:
            assert again.failure_reason is not None and str(code) in again.failure_reason

    async def test_an_exit_reported_by_another_host_changes_nothing(self, world: World) -> None:
        """A host cannot end a rental that runs elsewhere."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        rental = await world.running_rental(host_id, gpus)
        intruder = await online_host(world.master, world.provider, [gpu_info(0)])
        body = protocol.WorkloadExitedBody(rental_id=rental.id, exit_code=0, at=_now())
        await _apply(world.master, protocol.WorkloadExited(host_id=intruder, seq=5, ts=_now(), body=body))
        async with world.master.db.session() as session:
            again = await session.get(Rental, rental.id)
        assert again is not None and again.state == "running"


class TestLogs:
    async def test_logs_come_back_in_order_from_any_offset(self, world: World) -> None:
        """Shipped chunks (even out of order and duplicated) read back contiguously from an offset."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        rental = await world.running_rental(host_id, gpus)
        pieces = ["hello ", "wörld\n", "done\n"]
        offsets = [0, len(pieces[0].encode()), len((pieces[0] + pieces[1]).encode())]
        for i in (1, 0, 2, 1):
            body = protocol.WorkloadLogsBody(rental_id=rental.id, offset=offsets[i], length=len(pieces[i].encode()), data=pieces[i])
            await _apply(world.master, protocol.WorkloadLogs(host_id=host_id, seq=world.next_seq(), ts=_now(), body=body))
        status, logs = await world.get(f"/rentals/{rental.id}/logs")
        assert status == 200 and logs["data"] == "".join(pieces)
        assert logs["next_offset"] == len("".join(pieces).encode())
        status, tail = await world.get(f"/rentals/{rental.id}/logs?offset={offsets[1]}")
        assert tail["data"] == "wörld\ndone\n"
        _, other_key = await create_principal(world.master, "r2", "renter")
        status, _ = await world.get(f"/rentals/{rental.id}/logs", key=other_key)
        assert status == 404

    async def test_a_reshipment_from_a_cursor_left_behind_loses_nothing(self, world: World) -> None:
        """An agent whose saved cursor was behind what it sent ships again from there, in a longer chunk (its log grew):
        the master keeps the longer chunk at that offset and reads past the shorter ones it overlaps."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        rental = await world.running_rental(host_id, gpus)

        async def ship(offset: int, data: str) -> bool:
            body = protocol.WorkloadLogsBody(rental_id=rental.id, offset=offset, length=len(data.encode()), data=data)
            return bool(await _apply(world.master, protocol.WorkloadLogs(host_id=host_id, seq=world.next_seq(), ts=_now(), body=body)))

        assert await ship(0, "one\n") and await ship(4, "two\n") and await ship(8, "three\n")
        # Restarted with the cursor at 4: "two\nthree\n" and what came since, in one chunk; then on from its end.
        assert await ship(4, "two\nthree\nfour\n")
        assert not await ship(4, "two\n")  # a plain redelivery of the shorter one changes nothing
        assert await ship(19, "five\n")
        status, logs = await world.get(f"/rentals/{rental.id}/logs")
        assert status == 200 and logs["data"] == "one\ntwo\nthree\nfour\nfive\n" and logs["next_offset"] == 24
        _, tail = await world.get(f"/rentals/{rental.id}/logs?offset=9")
        assert tail["data"] == "hree\nfour\nfive\n"

    async def test_old_chunks_are_pruned_once_per_step_past_the_window(self, world: World, monkeypatch: pytest.MonkeyPatch) -> None:
        """The newest MAX_LOG_BYTES_PER_RENTAL are kept; older chunks go when a chunk crosses into another LOG_PRUNE_STEP
        of the log (not with every chunk), so at most a step more than the window is kept."""
        monkeypatch.setattr(hosts, "MAX_LOG_BYTES_PER_RENTAL", 20)
        monkeypatch.setattr(hosts, "LOG_PRUNE_STEP", 10)
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        rental = await world.running_rental(host_id, gpus)

        async def ship_and_count(offset: int) -> list[int]:
            body = protocol.WorkloadLogsBody(rental_id=rental.id, offset=offset, length=4, data="abc\n")
            assert await _apply(world.master, protocol.WorkloadLogs(host_id=host_id, seq=world.next_seq(), ts=_now(), body=body))
            async with world.master.db.session() as session:
                return sorted(await session.scalars(select(RentalLogChunk.offset).where(RentalLogChunk.rental_id == rental.id)))

        for offset in range(0, 28, 4):  # up to 28 bytes: the window's 20 passed, no step crossed past it (20..29)
            kept = await ship_and_count(offset)
        assert kept == [0, 4, 8, 12, 16, 20, 24]
        assert await ship_and_count(28) == [8, 12, 16, 20, 24, 28]  # 28..32 crosses into 30..39: what ends before 12 goes
        assert await ship_and_count(32) == [8, 12, 16, 20, 24, 28, 32]  # within that step: nothing pruned
        _, logs = await world.get(f"/rentals/{rental.id}/logs?offset=8")
        assert logs["data"] == "abc\n" * 7 and logs["next_offset"] == 36

    async def test_logs_for_a_rental_on_another_host_are_dropped(self, world: World) -> None:
        """A host cannot write into the logs of a rental it does not run."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        rental = await world.running_rental(host_id, gpus)
        intruder = await online_host(world.master, world.provider, [gpu_info(0)])
        body = protocol.WorkloadLogsBody(rental_id=rental.id, offset=0, length=4, data="evil")
        assert not await _apply(world.master, protocol.WorkloadLogs(host_id=intruder, seq=3, ts=_now(), body=body))


class TestMetricsAndHello:
    async def test_metrics_return_stored_samples_with_sequence_numbers(self, world: World) -> None:
        """GET /hosts/{id}/metrics lists telemetry oldest first with seq, and honours since and limit."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        for seq in (5, 3, 4):
            await _apply(world.master, telemetry(host_id, seq, gpus))
        status, body = await world.get(f"/hosts/{host_id}/metrics")
        assert status == 200 and sorted(i["seq"] for i in body["items"]) == [3, 4, 5]
        status, body = await world.get(f"/hosts/{host_id}/metrics?limit=2")
        assert len(body["items"]) == 2
        status, error = await world.get(f"/hosts/{host_id}/metrics?since=yesterday")
        assert status == 400 and error["code"] == "invalid_query"
        status, error = await world.get(f"/hosts/{host_id}/metrics?since=2026-01-01T00:00:00")
        assert status == 400

    async def test_a_stale_hello_does_not_undo_a_newer_one(self, world: World) -> None:
        """A hello replayed with an older seq is ignored, so vanished GPUs stay gone."""
        gpus = [gpu_info(0), gpu_info(1)]
        host_id = await online_host(world.master, world.provider, gpus)  # hello seq 0
        await _apply(world.master, hello(host_id, 10, gpus[:1]))
        await _apply(world.master, hello(host_id, 5, gpus))
        async with world.master.db.session() as session:
            present = {g.uuid: g.present for g in (await session.scalars(select(Gpu).where(Gpu.host_id == host_id))).all()}
        assert present == {gpus[0].uuid: True, gpus[1].uuid: False}


class TestCertificates:
    async def _renew(self, world: World, host_id: str, seq: int, csr: str) -> str | None:
        from master.services.hosts import enrollment

        message = protocol.RenewCertificate(host_id=host_id, seq=seq, ts=_now(), body=protocol.RenewCertificateBody(csr=csr))
        async with world.master.db.session() as session:
            return await enrollment.renew(world.master, session, envelope(message))

    async def test_renewal_signs_a_new_certificate_once_per_request(self, world: World) -> None:
        """A renewal CSR over the authenticated channel yields one install_certificate command; a redelivery none."""
        from shared.crypto import generate_private_key, host_id_from_certificate, load_certificate, make_csr

        host_id = await online_host(world.master, world.provider, [gpu_info(0)])
        async with world.master.db.session() as session:
            old_serial = (await session.get(Host, host_id)).cert_serial  # type: ignore[union-attr]
        csr = make_csr(generate_private_key(), "forged-subject").decode()
        command_id = await self._renew(world, host_id, 50, csr)
        assert command_id is not None
        assert await self._renew(world, host_id, 50, csr) is None
        async with world.master.db.session() as session:
            command = await session.get(Command, command_id)
            host = await session.get(Host, host_id)
        assert command is not None and command.kind == "install_certificate"
        cert = load_certificate(command.args["certificate"].encode())
        assert host_id_from_certificate(cert) == host_id  # the CSR's forged subject is ignored
        assert host is not None and host.cert_serial != old_serial and host.cert_serial == format(cert.serial_number, "040x")

    async def test_a_revoked_host_cannot_renew_and_its_messages_are_dropped(self, world: World) -> None:
        """After revocation, renewal is refused and telemetry from the host is not stored."""
        from master.services.hosts import enrollment
        from shared.crypto import generate_private_key, make_csr

        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        await enrollment.revoke_host(world.master, world.provider, host_id)
        assert await self._renew(world, host_id, 60, make_csr(generate_private_key(), "x").decode()) is None
        with pytest.raises(hosts.UnknownHost):
            await _apply(world.master, telemetry(host_id, 61, gpus))


async def _ingest(master: Master, *envelopes: protocol.BusEnvelope) -> None:
    """Put ``envelopes`` on the bus as a relay would and apply them with the master's ingestor."""
    from master.telemetry.ingest import Ingestor

    await master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, protocol.INGEST_GROUP)
    for item in envelopes:
        await master.bus.publish(protocol.AGENT_EVENTS_STREAM, item.model_dump_json().encode())
    batch = await master.bus.read(protocol.AGENT_EVENTS_STREAM, protocol.INGEST_GROUP, "t", count=100, block=None)
    await Ingestor(master).process(batch)


def _relayed(message: protocol.AnyAgentMessage, serial: str) -> protocol.BusEnvelope:
    """``message`` as a relay forwards it from a connection presenting the certificate ``serial``."""
    return protocol.BusEnvelope(relay_id="relay-t", received_at=_now(), message=message, cert_serial=serial)


class TestCertificateHistory:
    async def _renewed(self, world: World, host_id: str, seq: int) -> str:
        """Renew ``host_id``'s certificate; returns the new serial."""
        from master.services.hosts import enrollment
        from shared.crypto import generate_private_key, make_csr

        message = protocol.RenewCertificate(host_id=host_id, seq=seq, ts=_now(),
                                            body=protocol.RenewCertificateBody(csr=make_csr(generate_private_key(), "x").decode()))
        async with world.master.db.session() as session:
            assert await enrollment.renew(world.master, session, envelope(message)) is not None
            host = await session.get(Host, host_id)
        assert host is not None and host.cert_serial is not None
        return host.cert_serial

    async def _serial(self, world: World, host_id: str) -> str:
        async with world.master.db.session() as session:
            host = await session.get(Host, host_id)
        assert host is not None and host.cert_serial is not None
        return host.cert_serial

    async def test_revoking_a_host_refuses_every_certificate_it_was_issued(self, world: World) -> None:
        """Regression (issue 21): only the newest serial was revoked, so a certificate from before a renewal still
        connected. Now the enrolment's and every renewal's serials reach the registry, and are republished."""
        from master.services.hosts import enrollment
        from shared.registry import MemoryRegistry

        host_id = await online_host(world.master, world.provider, [gpu_info(0)])
        first = await self._serial(world, host_id)
        second = await self._renewed(world, host_id, 50)
        third = await self._renewed(world, host_id, 51)
        assert not any([await world.master.registry.is_revoked(s) for s in (first, second, third)])
        await enrollment.revoke_host(world.master, world.provider, host_id)
        assert all([await world.master.registry.is_revoked(s) for s in (first, second, third)])
        world.master.registry = MemoryRegistry()  # a registry that lost its data
        assert await enrollment.publish_revocations(world.master) == 3
        assert await world.master.registry.revoked() == {first, second, third}

    async def test_a_renewed_certificate_in_use_retires_the_ones_before_it(self, world: World) -> None:
        """Regression (issue 21): renewal left the previous certificate valid. It stays valid while the agent still
        connects with it (the new one is not installed yet), and is revoked once a hello comes over a connection
        that presents the new one; the new one stays valid."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        old = await self._serial(world, host_id)
        new = await self._renewed(world, host_id, 50)
        await _ingest(world.master, _relayed(hello(host_id, 51, gpus), old))
        assert not await world.master.registry.is_revoked(old)
        await _ingest(world.master, _relayed(hello(host_id, 52, gpus), new))
        assert await world.master.registry.is_revoked(old)
        assert not await world.master.registry.is_revoked(new)
        from master.models import HostCertificate

        async with world.master.db.session() as session:
            rows = {c.serial: c.revoked_at for c in await session.scalars(select(HostCertificate).where(HostCertificate.host_id == host_id))}
        assert set(rows) == {old, new} and rows[old] is not None and rows[new] is None
        async with world.master.db.session() as session:
            host = await session.get(Host, host_id)
        assert host is not None and host.state == "online" and host.last_hello_seq == 52

    async def test_a_hello_from_a_relay_that_names_no_serial_retires_nothing(self, world: World) -> None:
        """A record without ``cert_serial`` (a relay from before the field) is applied and revokes nothing."""
        gpus = [gpu_info(0)]
        host_id = await online_host(world.master, world.provider, gpus)
        old = await self._serial(world, host_id)
        await self._renewed(world, host_id, 50)
        await _ingest(world.master, envelope(hello(host_id, 51, gpus)))
        assert await world.master.registry.revoked() == frozenset()
        async with world.master.db.session() as session:
            assert (await session.get(Host, host_id)).last_hello_seq == 51  # type: ignore[union-attr]
        assert not await world.master.registry.is_revoked(old)

    async def test_a_renewal_numbered_absurdly_far_ahead_is_refused_and_pins_nothing(self, world: World) -> None:
        """Regression (issue 21): a renewal with seq 2**62 would have set last_renewal_seq for good, refusing every
        later renewal. It is refused, and the next ordinary renewal is signed."""
        host_id = await online_host(world.master, world.provider, [gpu_info(0)])
        from master.services.hosts import enrollment
        from shared.crypto import generate_private_key, make_csr

        csr = make_csr(generate_private_key(), "x").decode()
        message = protocol.RenewCertificate(host_id=host_id, seq=2**62, ts=_now(), body=protocol.RenewCertificateBody(csr=csr))
        async with world.master.db.session() as session:
            assert await enrollment.renew(world.master, session, envelope(message)) is None
        await self._renewed(world, host_id, 60)


class TestRevocation:
    async def test_the_owner_revokes_and_everything_follows(self, world: World) -> None:
        """Revoking fails the host's rentals, frees and hides its GPUs, and publishes its serial to the relays."""
        gpus = [gpu_info(0), gpu_info(1)]
        host_id = await online_host(world.master, world.provider, gpus)
        rental = await world.running_rental(host_id, gpus)
        headers = {"Authorization": f"Bearer {world.provider_key}"}
        async with world.client.post(f"/api/v1/hosts/{host_id}/revoke", headers=headers) as response:
            assert response.status == 200
            assert (await response.json())["state"] == "revoked"
        async with world.client.post(f"/api/v1/hosts/{host_id}/revoke", headers=headers) as response:
            assert response.status == 200  # idempotent
        async with world.master.db.session() as session:
            host = await session.get(Host, host_id)
            again = await session.get(Rental, rental.id)
            offered = await session.scalar(select(func.count()).select_from(Gpu).where(Gpu.host_id == host_id, Gpu.present.is_(True)))
        assert host is not None and again is not None and again.state == "failed" and offered == 0
        assert again.failure_reason == "the host was revoked"
        assert await world.master.registry.is_revoked(host.cert_serial or "")
        _, offers = await world.get("/offers")
        assert all(o["host_id"] != host_id for o in offers["items"])

    async def test_only_the_owner_or_an_admin_may_revoke(self, world: World) -> None:
        """Another provider gets 404 and a renter 403; nothing changes."""
        host_id = await online_host(world.master, world.provider, [gpu_info(0)])
        _, other_key = await create_principal(world.master, "p-other", "provider")
        for key, expected in ((other_key, 404), (world.renter_key, 403)):
            async with world.client.post(f"/api/v1/hosts/{host_id}/revoke", headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == expected
        async with world.master.db.session() as session:
            host = await session.get(Host, host_id)
        assert host is not None and host.state == "online"

    async def test_revocations_are_republished_into_an_empty_registry(self, world: World) -> None:
        """A registry that lost its data (a Redis restart) is refilled from the database."""
        from master.services.hosts import enrollment
        from shared.registry import MemoryRegistry

        host_id = await online_host(world.master, world.provider, [gpu_info(0)])
        await enrollment.revoke_host(world.master, world.provider, host_id)
        world.master.registry = MemoryRegistry()
        assert await enrollment.publish_revocations(world.master) == 1
        async with world.master.db.session() as session:
            serial = (await session.get(Host, host_id)).cert_serial  # type: ignore[union-attr]
        assert await world.master.registry.is_revoked(serial or "")

    async def test_relays_are_listed_for_admins_only(self, world: World) -> None:
        """GET /relays shows live relays with load to an admin and refuses others."""
        from shared.registry import RelayRecord

        await world.master.registry.put_relay(
            RelayRecord(relay_id="eu-1", region="eu", url="wss://eu-1:8443/v1/agent", host="eu-1", port=8443,
                        connections=3, capacity=10, draining=False, updated_at=_now().timestamp()), ttl=30,
        )
        _, admin_key = await create_principal(world.master, "root", "admin")
        status, body = await world.get("/relays", key=admin_key)
        assert status == 200 and [(r["relay_id"], r["spare"], r["status"]) for r in body["items"]] == [("eu-1", 7, "ok")]
        status, _ = await world.get("/relays")
        assert status == 403


class TestHostEvents:
    async def test_every_transition_is_listed_with_cause_and_actor(self, world: World) -> None:
        """GET /hosts/{id}/events lists the host's state changes newest first, paginated; other providers get 404."""
        from master.services.hosts import enrollment

        host_id = await online_host(world.master, world.provider, [gpu_info(0)])
        await enrollment.revoke_host(world.master, world.provider, host_id)
        status, body = await world.get(f"/hosts/{host_id}/events", key=world.provider_key)
        assert status == 200 and body["total"] == 3
        assert [(e["from"], e["to"]) for e in body["items"]] == [("online", "revoked"), ("enrolling", "online"), (None, "enrolling")]
        assert body["items"][0]["actor"] == f"account:{world.provider.account_id}" and "revoked by" in body["items"][0]["cause"]
        status, page = await world.get(f"/hosts/{host_id}/events?limit=1&offset=1", key=world.provider_key)
        assert [e["to"] for e in page["items"]] == ["online"]
        _, other_key = await create_principal(world.master, "p3", "provider")
        status, _ = await world.get(f"/hosts/{host_id}/events", key=other_key)
        assert status == 404
