"""Faults: hardware XIDs, ECC errors, vanished GPUs and health checks make hosts faulty and back.

On SQLite and PostgreSQL. GPU events are stored as the ingest handler stores them, with
receive times set by the test, then judged by ``faults.after_gpu_events``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from master.context import Master
from master.models import Command as CommandRow
from master.models import GpuEvent, Host, HostEvent
from master.services.accounts.core import Principal
from master.services.lifecycle.hosts import transition
from master.services.market import faults
from master.services.rentals import core as rentals
from master.services.rentals import request as rental_request
from shared import protocol
from shared.errors import Conflict, NotFound
from tests.factories import create_principal, enroll_host, gpu_info, online_host

WINDOW = timedelta(minutes=60)  # the default fault_window_minutes


class Fleet:
    """A provider with one online two-GPU host, and a clock the test moves."""

    def __init__(self, master: Master, provider: Principal, host_id: str, gpus: list[protocol.GpuInfoModel]) -> None:
        self.master = master
        self.provider = provider
        self.host_id = host_id
        self.gpus = gpus
        self.now = datetime.now(UTC)
        self._seq = 100

    async def report(self, *events: tuple[str, int | None], at: datetime | None = None) -> bool:
        """Store ``events`` (kind, code) on GPU 0 as received at ``at`` (default: now) and judge them."""
        received = at or self.now
        self._seq += 1
        async with self.master.db.session() as session:
            host = await session.get(Host, self.host_id)
            assert host is not None
            rows = [
                GpuEvent(host_id=self.host_id, seq=self._seq, position=i, gpu_uuid=self.gpus[0].uuid, kind=kind,
                         code=code, at=received, received_at=received)
                for i, (kind, code) in enumerate(events)
            ]  # fmt: skip
            session.add_all(rows)
            await session.flush()
            return await faults.after_gpu_events(session, host, rows, settings=self.master.settings, now=self.now)

    async def host(self) -> Host:
        async with self.master.db.session() as session:
            host = await session.get(Host, self.host_id)
            assert host is not None
            return host

    async def state(self) -> str:
        return (await self.host()).state

    async def set_state(self, state: str) -> None:
        async with self.master.db.session() as session:
            host = await session.get(Host, self.host_id)
            assert host is not None
            transition(session, host, state, cause="test", actor="test")

    async def last_event(self) -> HostEvent:
        async with self.master.db.session() as session:
            event = await session.scalar(
                select(HostEvent).where(HostEvent.host_id == self.host_id).order_by(HostEvent.id.desc()).limit(1)
            )
            assert event is not None
            return event

    async def check_result(self, *, ok: bool, healthy: bool | None, detail: str = "", summary: str = "") -> None:
        data = {} if healthy is None else {"healthy": healthy, "summary": summary}
        async with self.master.db.session() as session:
            host = await session.get(Host, self.host_id)
            assert host is not None
            await faults.after_health_check(session, host, ok=ok, detail=detail, data=data, now=self.now)


@pytest.fixture
async def fleet(master: Master) -> Fleet:
    provider, _ = await create_principal(master, "provider-1", "provider")
    gpus = [gpu_info(0), gpu_info(1)]
    return Fleet(master, provider, await online_host(master, provider, gpus), gpus)


XID = "xid"


class TestGpuEventFaults:
    async def test_the_threshold_of_hardware_faults_makes_a_host_faulty(self, fleet: Fleet) -> None:
        """Two hardware XIDs leave the host online; the third within the window makes it faulty, saying why."""
        assert not await fleet.report((XID, 48), (XID, 63))
        assert await fleet.state() == "online"
        assert await fleet.report((XID, 95))
        assert await fleet.state() == "faulty"
        event = await fleet.last_event()
        assert (event.from_state, event.to_state, event.actor) == ("online", "faulty", "faults")
        assert "3 within 60 min (threshold 3)" in event.cause and "XID 95 (uncontained ECC error)" in event.cause

    @pytest.mark.parametrize("code", sorted(faults.FAULT_XIDS))
    def test_every_hardware_xid_counts(self, code: int) -> None:
        """Each XID on the hardware list counts as a fault."""
        assert faults.is_fault("xid", code)

    async def test_application_xids_and_single_bit_ecc_never_count(self, fleet: Fleet) -> None:
        """XIDs 13, 31 and 43 (the program's fault), corrected single-bit ECC and 'other' events count for nothing."""
        assert not await fleet.report((XID, 13), (XID, 31), (XID, 43), ("single_bit_ecc", None), ("other", 8))
        assert not await fleet.report(("single_bit_ecc", None), ("single_bit_ecc", None), ("single_bit_ecc", None))
        assert await fleet.state() == "online"

    async def test_double_bit_ecc_errors_count(self, fleet: Fleet) -> None:
        """Double-bit ECC events are faults: three make the host faulty."""
        assert await fleet.report(("double_bit_ecc", None), ("double_bit_ecc", None), ("double_bit_ecc", None))
        assert await fleet.state() == "faulty"

    async def test_faults_older_than_the_window_do_not_count(self, fleet: Fleet) -> None:
        """Faults received more than fault_window_minutes ago are outside the count."""
        old = fleet.now - WINDOW - timedelta(minutes=1)
        assert not await fleet.report((XID, 48), (XID, 48), at=old)
        assert not await fleet.report((XID, 48))
        assert await fleet.state() == "online"
        assert await fleet.report((XID, 48), (XID, 48), at=fleet.now - WINDOW + timedelta(minutes=1))
        assert await fleet.state() == "faulty"

    async def test_xid_79_makes_a_host_faulty_at_once(self, fleet: Fleet) -> None:
        """A GPU that fell off the bus (XID 79) makes the host faulty without waiting for the threshold."""
        assert await fleet.report((XID, 79))
        assert await fleet.state() == "faulty"
        assert "XID 79 (GPU fell off the bus)" in (await fleet.last_event()).cause

    async def test_a_rented_host_becomes_faulty_and_a_faulty_one_stays(self, fleet: Fleet) -> None:
        """Faults take a rented host out of the market; more faults on a faulty host change nothing."""
        await fleet.set_state("rented")
        assert await fleet.report((XID, 79))
        assert await fleet.state() == "faulty"
        assert not await fleet.report((XID, 79))
        assert await fleet.state() == "faulty"

    async def test_a_host_in_maintenance_is_left_there(self, fleet: Fleet) -> None:
        """A host in maintenance cannot become faulty (the transition table forbids it); the fault is only logged."""
        await fleet.set_state("maintenance")
        assert not await fleet.report((XID, 79))
        assert await fleet.state() == "maintenance"

    async def test_a_harmless_event_does_not_tip_a_host_over_an_old_count(self, fleet: Fleet) -> None:
        """Only a batch with a fault is judged, so a single-bit event after three faults changes nothing."""
        await fleet.set_state("maintenance")
        assert not await fleet.report((XID, 48), (XID, 48), (XID, 48))
        await fleet.set_state("online")
        assert not await fleet.report(("single_bit_ecc", None))
        assert await fleet.state() == "online"
        assert await fleet.report((XID, 48))


class TestVanishedGpus:
    async def test_a_gpu_missing_from_the_hello_makes_the_host_faulty_at_once(self, fleet: Fleet) -> None:
        """One GPU gone from the hello is enough: faulty, with the GPU named."""
        gone = fleet.gpus[1].uuid
        async with fleet.master.db.session() as session:
            host = await session.get(Host, fleet.host_id)
            assert host is not None
            assert not await faults.after_gpus_vanished(session, host, [], now=fleet.now)
            assert await faults.after_gpus_vanished(session, host, [gone], now=fleet.now)
        assert await fleet.state() == "faulty"
        event = await fleet.last_event()
        assert event.cause.startswith(faults.VANISHED_CAUSE) and gone in event.cause

    async def test_an_offline_host_that_comes_back_short_of_a_gpu_is_faulty(self, fleet: Fleet) -> None:
        """The hello of an offline host (before it comes online) can make it faulty directly."""
        await fleet.set_state("offline")
        async with fleet.master.db.session() as session:
            host = await session.get(Host, fleet.host_id)
            assert host is not None
            assert await faults.after_gpus_vanished(session, host, [fleet.gpus[0].uuid], now=fleet.now)
        assert await fleet.state() == "faulty"


class TestHealthChecks:
    async def test_a_passed_check_makes_a_faulty_host_online_and_resets_the_count(self, fleet: Fleet) -> None:
        """Passing moves faulty → online and faults_since to the check; faults before it never count again."""
        assert not await fleet.report((XID, 48), (XID, 48), at=fleet.now - timedelta(minutes=5))
        await fleet.set_state("faulty")
        await fleet.check_result(ok=True, healthy=True, summary="2 GPU(s) healthy")
        host = await fleet.host()
        assert host.state == "online" and host.faults_since == fleet.now
        event = await fleet.last_event()
        assert (event.from_state, event.to_state, event.cause, event.actor) == ("faulty", "online", "health check passed", "faults")
        fleet.now += timedelta(minutes=1)
        assert not await fleet.report((XID, 48), (XID, 48))  # two since the check: below the threshold
        assert await fleet.report((XID, 48))
        assert await fleet.state() == "faulty"

    async def test_a_host_with_active_rentals_goes_back_to_rented(self, fleet: Fleet) -> None:
        """A faulty host whose rentals are still active returns through online to rented."""
        renter, _ = await create_principal(fleet.master, "renter-1", "renter")
        rental, _ = await rentals.create_rental(fleet.master, renter, rental_request.RentalRequest(gpu_count=1), idempotency_key=None)
        assert rental.state == "starting"
        await fleet.set_state("faulty")
        await fleet.check_result(ok=True, healthy=True)
        assert await fleet.state() == "rented"
        async with fleet.master.db.session() as session:
            steps = (
                await session.scalars(
                    select(HostEvent).where(HostEvent.host_id == fleet.host_id).order_by(HostEvent.id.desc()).limit(2)
                )
            ).all()
        assert [(e.from_state, e.to_state) for e in reversed(steps)] == [("faulty", "online"), ("online", "rented")]

    async def test_a_failed_check_makes_a_healthy_host_faulty(self, fleet: Fleet) -> None:
        """An online host whose check finds a problem becomes faulty, with the agent's summary as the cause."""
        await fleet.check_result(ok=True, healthy=False, summary="GPU-x: missing: the GPU backend does not list this GPU")
        assert await fleet.state() == "faulty"
        assert (await fleet.last_event()).cause == "health check failed: GPU-x: missing: the GPU backend does not list this GPU"
        assert (await fleet.host()).faults_since is None

    async def test_a_check_that_cannot_run_counts_as_failed(self, fleet: Fleet) -> None:
        """An agent that answers the command with a failure (too old, no backend) fails the check."""
        await fleet.check_result(ok=False, healthy=None, detail="unknown command kind 'health_check'")
        assert await fleet.state() == "faulty"
        assert "could not run: unknown command kind" in (await fleet.last_event()).cause

    async def test_a_failed_check_keeps_a_faulty_host_faulty(self, fleet: Fleet) -> None:
        """Failing again while faulty changes nothing; a pass is the only way out."""
        await fleet.set_state("faulty")
        await fleet.check_result(ok=True, healthy=False, summary="still broken")
        assert await fleet.state() == "faulty"
        await fleet.check_result(ok=True, healthy=True)
        assert await fleet.state() == "online"

    async def test_a_passed_check_on_an_online_host_only_resets_the_count(self, fleet: Fleet) -> None:
        """Healthy hosts may be checked: a pass keeps them online and moves faults_since."""
        await fleet.check_result(ok=True, healthy=True)
        host = await fleet.host()
        assert host.state == "online" and host.faults_since == fleet.now

    def test_the_verdict_needs_both_a_run_and_a_healthy_answer(self) -> None:
        """ok says the check ran; data.healthy is the verdict; a missing or odd verdict fails."""
        assert faults.check_passed(True, {"healthy": True})
        assert not faults.check_passed(True, {"healthy": False})
        assert not faults.check_passed(True, {})
        assert not faults.check_passed(True, {"healthy": "yes"})
        assert not faults.check_passed(False, {"healthy": True})


class TestRequestingHealthChecks:
    async def _commands(self, master: Master, host_id: str) -> Sequence[CommandRow]:
        async with master.db.session() as session:
            return (
                await session.scalars(select(CommandRow).where(CommandRow.host_id == host_id, CommandRow.kind == "health_check"))
            ).all()

    async def test_the_provider_asks_and_the_command_names_the_present_gpus(self, fleet: Fleet) -> None:
        """The host's provider gets a health_check command for the host's present GPUs, sent to its relay."""
        command_id = await faults.request_health_check(fleet.master, fleet.provider, fleet.host_id)
        (row,) = await self._commands(fleet.master, fleet.host_id)
        assert row.id == command_id and row.state == "sent"
        assert row.args == {"gpu_uuids": [g.uuid for g in fleet.gpus]}

    async def test_a_check_on_its_way_is_not_asked_twice(self, fleet: Fleet) -> None:
        """A second request while the first is unanswered returns the same command."""
        first = await faults.request_health_check(fleet.master, fleet.provider, fleet.host_id)
        assert await faults.request_health_check(fleet.master, fleet.provider, fleet.host_id) == first
        assert len(await self._commands(fleet.master, fleet.host_id)) == 1

    async def test_admins_may_ask_and_others_see_no_such_host(self, fleet: Fleet) -> None:
        """An admin may ask; another provider and a renter get 404, as for a host that does not exist."""
        admin, _ = await create_principal(fleet.master, "admin-1", "admin")
        other, _ = await create_principal(fleet.master, "provider-2", "provider")
        renter, _ = await create_principal(fleet.master, "renter-1", "renter")
        assert await faults.request_health_check(fleet.master, admin, fleet.host_id)
        for who in (other, renter):
            with pytest.raises(NotFound):
                await faults.request_health_check(fleet.master, who, fleet.host_id)
        with pytest.raises(NotFound):
            await faults.request_health_check(fleet.master, admin, "h-nope")

    async def test_hosts_that_cannot_answer_are_refused(self, fleet: Fleet) -> None:
        """Offline, not yet connected and revoked hosts get 409, and no command is written."""
        await fleet.set_state("offline")
        with pytest.raises(Conflict, match="offline"):
            await faults.request_health_check(fleet.master, fleet.provider, fleet.host_id)
        enrolling = await enroll_host(fleet.master, fleet.provider)
        with pytest.raises(Conflict, match="enrolling"):
            await faults.request_health_check(fleet.master, fleet.provider, enrolling)
        await fleet.set_state("revoked")
        with pytest.raises(Conflict, match="revoked") as refused:
            await faults.request_health_check(fleet.master, fleet.provider, fleet.host_id)
        assert refused.value.http_status == 409
        assert await self._commands(fleet.master, fleet.host_id) == []
