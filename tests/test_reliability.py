"""Reliability scores from known histories, and GPU classification stored per GPU.

On SQLite and PostgreSQL. Histories are written as rows with chosen timestamps (state
changes, rentals, GPU events, health checks); ``now`` is passed in, never waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from master.background.scoring import scoring_loop
from master.context import Master
from master.models import Command as CommandRow
from master.models import Gpu, GpuEvent, Host, HostEvent, Rental
from master.services.accounts.core import Principal
from master.services.market import FailureCode, faults, record_failure, reliability
from shared.ids import new_id
from tests.factories import MS, create_principal, gpu_info, online_host
from tests.helpers import eventually

NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


class History:
    """Writes one host's past as rows: its state changes, rentals, GPU events and health checks."""

    def __init__(self, master: Master, owner: Principal, renter: Principal) -> None:
        self.master = master
        self.owner = owner
        self.renter = renter
        self._seq = 0

    async def host(self, created: datetime, states: list[tuple[datetime, str]], *, gpus: int = 0,
                   network: dict[str, Any] | None = None) -> str:
        """A host created at ``created`` that went through ``states`` [(at, state), ...] in order."""
        host_id = new_id("h")
        async with self.master.db.session() as session:
            session.add(Host(id=host_id, owner_id=self.owner.account_id, state=states[-1][1], created_at=created,
                             state_changed_at=states[-1][0], latest_network=network))  # fmt: skip
            await session.flush()
            previous = None
            for at, state in states:
                session.add(HostEvent(host_id=host_id, at=at, from_state=previous, to_state=state, cause="test", actor="test"))
                previous = state
            for index in range(gpus):
                info = gpu_info(index)
                session.add(Gpu(id=new_id("gpu"), host_id=host_id, index=index, uuid=info.uuid, name=info.name,
                                memory_total_mib=info.memory_total_mib, info=info.model_dump(mode="json")))  # fmt: skip
        return host_id

    async def rental(self, host_id: str, state: str, stopped_at: datetime, code: FailureCode | None = None, reason: str = "") -> None:
        async with self.master.db.session() as session:
            rental = Rental(id=new_id("r"), renter_id=self.renter.account_id, host_id=host_id, gpu_count=1, state=state,
                            created_at=stopped_at - timedelta(hours=1), stopped_at=stopped_at)  # fmt: skip
            if code is not None:
                record_failure(rental, code, reason or code.value)
            session.add(rental)

    async def gpu_event(self, host_id: str, kind: str, code: int | None, received_at: datetime) -> None:
        self._seq += 1
        async with self.master.db.session() as session:
            session.add(GpuEvent(host_id=host_id, seq=self._seq, position=0, gpu_uuid="GPU-x", kind=kind, code=code,
                                 at=received_at, received_at=received_at))  # fmt: skip

    async def health_check(self, host_id: str, completed_at: datetime, *, healthy: bool) -> None:
        async with self.master.db.session() as session:
            session.add(CommandRow(id=new_id("cmd"), host_id=host_id, kind="health_check", args={}, state="succeeded",
                                   created_at=completed_at, completed_at=completed_at,
                                   result={"ok": True, "detail": "", "data": {"healthy": healthy}}))  # fmt: skip

    async def score(self, host_id: str, now: datetime = NOW) -> tuple[float | None, dict[str, Any]]:
        async with self.master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None
            return await reliability.compute_reliability(session, host, now=now)


@pytest.fixture
async def history(master: Master) -> History:
    owner, _ = await create_principal(master, "provider-1", "provider")
    renter, _ = await create_principal(master, "renter-1", "renter")
    return History(master, owner, renter)


def _always_online(created: datetime = NOW - 40 * DAY) -> list[tuple[datetime, str]]:
    return [(created, "enrolling"), (created + timedelta(minutes=1), "online")]


class TestUptime:
    async def test_27_of_30_days_up_scores_0_9(self, history: History) -> None:
        """Three days offline in the last thirty, and nothing else, give uptime and score 0.9."""
        created = NOW - 40 * DAY
        host_id = await history.host(created, [
            (created, "enrolling"), (created + DAY, "online"), (NOW - 10 * DAY, "offline"), (NOW - 7 * DAY, "online"),
        ])  # fmt: skip
        score, inputs = await history.score(host_id)
        assert score == 0.9
        assert inputs["uptime"]["observed_s"] == 30 * 86400 and inputs["uptime"]["up_s"] == 27 * 86400
        assert inputs["uptime"]["down_s"] == 3 * 86400 and inputs["uptime"]["fraction"] == 0.9
        assert inputs["rentals"]["factor"] == 1.0 and inputs["faults"]["factor"] == 1.0
        assert inputs["window_days"] == 30 and inputs["formula"] == reliability.FORMULA and inputs["score"] == 0.9

    async def test_enrolling_and_maintenance_are_not_observed(self, history: History) -> None:
        """Time enrolling or in maintenance is left out of the denominator; faulty time is down."""
        created = NOW - 20 * DAY
        host_id = await history.host(created, [
            (created, "enrolling"), (created + DAY, "online"), (NOW - 10 * DAY, "maintenance"),
            (NOW - 5 * DAY, "online"), (NOW - 2 * DAY, "rented"), (NOW - DAY, "faulty"),
        ])  # fmt: skip
        score, inputs = await history.score(host_id)
        uptime = inputs["uptime"]
        assert uptime["observed_s"] == 14 * 86400 and uptime["up_s"] == 13 * 86400
        assert uptime["by_state_s"] == {
            "enrolling": 86400, "maintenance": 5 * 86400, "online": 12 * 86400, "rented": 86400, "faulty": 86400,
        }  # fmt: skip
        assert score == round(13 / 14, 4)

    async def test_a_host_created_within_the_window_is_judged_since_it_enrolled(self, history: History) -> None:
        """The window starts when the host was created if that is later than thirty days ago."""
        created = NOW - 10 * DAY
        host_id = await history.host(created, [(created, "online"), (NOW - DAY, "offline")])
        score, inputs = await history.score(host_id)
        assert inputs["window"]["start"] == created.isoformat()
        assert score == 0.9


class TestNewHosts:
    async def test_a_host_observed_for_less_than_an_hour_has_no_score_yet(self, history: History) -> None:
        """Under an hour of observed time the score is None, and the inputs say why."""
        created = NOW - timedelta(minutes=50)
        host_id = await history.host(created, [(created, "enrolling"), (created + timedelta(minutes=5), "online")])
        score, inputs = await history.score(host_id)
        assert score is None and inputs["score"] is None
        assert inputs["uptime"]["observed_s"] == 45 * 60 and "no score yet" in inputs["note"]

    async def test_a_host_with_an_hour_of_history_starts_at_full_score(self, history: History) -> None:
        """A new host that stayed up its first hour scores 1.0 (no rentals, no faults: neutral factors)."""
        created = NOW - timedelta(minutes=70)
        host_id = await history.host(created, [(created, "enrolling"), (created + timedelta(minutes=5), "online")])
        score, inputs = await history.score(host_id)
        assert score == 1.0 and "note" not in inputs


class TestSeededHistory:
    """Made-up history (gpumarket up's demo hosts) counts, opens the window before enrollment, and says so."""

    async def test_seeded_days_before_enrollment_score_a_new_host_and_are_marked(self, history: History) -> None:
        """A host enrolled a minute ago with 10 seeded days, 1 of them down, scores 0.9 and says 10 days are seeded."""
        created = NOW - timedelta(minutes=1)
        host_id = await history.host(created, _always_online(created))
        async with history.master.db.session() as session:
            for at, state in ((created - 10 * DAY, "online"), (created - 5 * DAY, "offline"), (created - 4 * DAY, "online")):
                session.add(HostEvent(host_id=host_id, at=at, to_state=state, cause="seeded", actor=reliability.SEEDED_ACTOR))
        score, inputs = await history.score(host_id)
        assert score == pytest.approx(0.9, abs=1e-4)
        assert inputs["seeded"] is True and inputs["window"]["start"] == (created - 10 * DAY).isoformat()
        assert inputs["uptime"]["seeded_s"] == 10 * 86400 and "seeded demo history" in inputs["seeded_note"]

    async def test_without_seeded_events_nothing_says_seeded_and_the_window_starts_at_enrollment(self, history: History) -> None:
        """A real host's window opens at its enrollment and its inputs say seeded false."""
        created = NOW - 2 * DAY
        host_id = await history.host(created, _always_online(created))
        _, inputs = await history.score(host_id)
        assert inputs["seeded"] is False and inputs["uptime"]["seeded_s"] == 0
        assert inputs["window"]["start"] == created.isoformat()

    async def test_a_seeded_past_older_than_the_window_still_fills_it(self, history: History) -> None:
        """Once the seeded start slides out of the 30 days, the state it set still counts, as seeded, from the window's start."""
        created = NOW - 5 * DAY
        host_id = await history.host(created, _always_online(created))
        async with history.master.db.session() as session:
            session.add(HostEvent(host_id=host_id, at=created - 30 * DAY, to_state="online", cause="seeded", actor=reliability.SEEDED_ACTOR))
        score, inputs = await history.score(host_id)
        assert score == 1.0 and inputs["window"]["start"] == (NOW - reliability.RELIABILITY_WINDOW).isoformat()
        assert inputs["uptime"]["observed_s"] == pytest.approx(30 * 86400 - 60, abs=1)
        assert inputs["seeded"] is True and inputs["uptime"]["seeded_s"] == 25 * 86400


class TestRentals:
    async def test_failures_the_host_caused_lower_the_score_and_the_renters_do_not(self, history: History) -> None:
        """Completed and host-caused failures in the window count, smoothed by four prior successes."""
        host_id = await history.host(NOW - 40 * DAY, _always_online())
        for day in range(1, 7):
            await history.rental(host_id, "stopped", NOW - day * DAY)
        await history.rental(host_id, "stopped", NOW - 31 * DAY)  # before the window
        await history.rental(host_id, "failed", NOW - 2 * DAY, FailureCode.HOST_LOST)
        await history.rental(host_id, "failed", NOW - 3 * DAY, FailureCode.CONTAINER_RUNTIME_UNAVAILABLE)
        await history.rental(host_id, "failed", NOW - 4 * DAY, FailureCode.WORKLOAD_EXITED)
        await history.rental(host_id, "failed", NOW - 5 * DAY, FailureCode.PROGRAM_NOT_EXECUTABLE)
        # The platform's doing (a registry login sealed to a key the host does not hold): not the host's either.
        await history.rental(host_id, "failed", NOW - 6 * DAY, FailureCode.REGISTRY_AUTH_UNREADABLE)
        score, inputs = await history.score(host_id)
        assert inputs["rentals"] == {
            "completed": 6, "failed": 2, "failed_by_provider": 2, "failed_by_renter": 2, "failed_by_platform": 1,
            "prior_successes": 4, "factor": round(10 / 12, 4), "formula": "(completed + 4) / (completed + failed + 4)",
        }  # fmt: skip
        assert score == round(10 / 12, 4)

    async def test_the_owner_decides_whatever_the_reason_says(self, history: History) -> None:
        """Regression (issue 39): attribution was a prefix match on the reason's text; now only the stored owner counts."""
        host_id = await history.host(NOW - 40 * DAY, _always_online())
        # Words that the old prefixes read as the renter's, on a provider's code, and the other way round.
        await history.rental(host_id, "failed", NOW - DAY, FailureCode.HOST_LOST, "workload exited with code 1")
        await history.rental(host_id, "failed", NOW - 2 * DAY, FailureCode.IMAGE_NOT_FOUND, "host h-1 lost: silent since ...")
        _, inputs = await history.score(host_id)
        assert (inputs["rentals"]["failed"], inputs["rentals"]["failed_by_renter"]) == (1, 1)


class TestFaults:
    async def test_fault_events_failed_checks_and_vanished_gpus_each_count(self, history: History) -> None:
        """Hardware faults, failed health checks and vanished GPUs in the window each cost a factor 0.97."""
        created = NOW - 40 * DAY
        host_id = await history.host(created, [(created, "online")])
        async with history.master.db.session() as session:
            session.add(HostEvent(host_id=host_id, at=NOW - 3 * DAY, from_state="online", to_state="faulty",
                                  cause=f"{faults.VANISHED_CAUSE}: GPU-1 missing", actor=faults.ACTOR))  # fmt: skip
            session.add(HostEvent(host_id=host_id, at=NOW - 2 * DAY, from_state="faulty", to_state="online",
                                  cause=faults.CHECK_PASSED_CAUSE, actor=faults.ACTOR))  # fmt: skip
        await history.gpu_event(host_id, "xid", 79, NOW - 3 * DAY)
        await history.gpu_event(host_id, "double_bit_ecc", None, NOW - 5 * DAY)
        await history.gpu_event(host_id, "xid", 48, NOW - 35 * DAY)  # before the window
        await history.gpu_event(host_id, "xid", 13, NOW - DAY)  # the application's fault
        await history.gpu_event(host_id, "single_bit_ecc", None, NOW - DAY)
        await history.health_check(host_id, NOW - 4 * DAY, healthy=False)
        await history.health_check(host_id, NOW - 2 * DAY, healthy=True)
        score, inputs = await history.score(host_id)
        assert inputs["faults"] == {
            "gpu_events": 2, "failed_health_checks": 1, "failed_verifications": 0, "vanished_gpus": 1, "count": 4, "factor": round(0.97**4, 4),
            "formula": "max(0.5, 0.97 ** count)",
        }  # fmt: skip
        assert inputs["uptime"]["fraction"] == round(29 / 30, 4)
        assert score == round(29 / 30 * 0.97**4, 4)

    async def test_the_fault_factor_has_a_floor(self, history: History) -> None:
        """However many faults, the fault factor stays at 0.5 or above."""
        host_id = await history.host(NOW - 40 * DAY, _always_online())
        for hour in range(40):
            await history.gpu_event(host_id, "xid", 48, NOW - timedelta(hours=hour + 1))
        score, inputs = await history.score(host_id)
        assert inputs["faults"]["count"] == 40 and inputs["faults"]["factor"] == 0.5 and score == 0.5


class TestClassification:
    async def _rescored(self, master: Master, host_id: str, now: datetime, **host_values: Any) -> tuple[Host, list[Gpu]]:
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None
            for name, value in host_values.items():
                setattr(host, name, value)
            await reliability.rescore_host(session, host, now=now)
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            gpus = (await session.scalars(select(Gpu).where(Gpu.host_id == host_id).order_by(Gpu.index))).all()
            assert host is not None
            return host, list(gpus)

    async def test_an_rtx_4090_host_is_prosumer_with_its_reasons_and_inputs(self, master: Master) -> None:
        """Re-scoring stores the host's score and each GPU's tier, score, model and why."""
        provider, _ = await create_principal(master, "provider-1", "provider")
        host_id = await online_host(master, provider, [gpu_info(0), gpu_info(1)])
        now = datetime.now(UTC) + timedelta(hours=2)
        host, gpus = await self._rescored(master, host_id, now, latest_network={"download_mbps": 900.0})
        assert host.reliability == 1.0 and host.reliability_at == now
        assert reliability.reliability_view(host) == {
            "score": 1.0, "computed_at": now.isoformat(), "inputs": host.reliability_inputs, "seeded": False,
            "failed_rentals": {"renter": 0, "provider": 0, "platform": 0},
        }  # fmt: skip
        assert host.reliability_inputs is not None and host.reliability_inputs["score"] == 1.0
        for gpu in gpus:
            assert (gpu.tier, gpu.model_key, gpu.needs_review, gpu.score) == ("prosumer", "rtx-4090", False, 45.4)
            assert gpu.classification is not None
            assert gpu.classification["inputs"]["network_down_mbps"] == 900.0
            assert gpu.classification["inputs"]["reliability"] == 1.0
            assert any("matched rtx-4090" in r for r in gpu.classification["reasons"])
        assert reliability.classification_view(gpus[0])["tier"] == "prosumer"

    async def test_a_slow_network_lowers_the_score(self, master: Master) -> None:
        """Under 100 Mbps download the GPU's score is multiplied by 0.75, and the reasons say so."""
        provider, _ = await create_principal(master, "provider-1", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        now = datetime.now(UTC) + timedelta(hours=2)
        _, (fast,) = await self._rescored(master, host_id, now, latest_network={"download_mbps": 900.0})
        _, (slow,) = await self._rescored(master, host_id, now, latest_network={"download_mbps": 50.0})
        _, (failed,) = await self._rescored(master, host_id, now, latest_network={"download_mbps": None, "error": "timeout"})
        assert fast.score is not None and slow.score is not None
        assert slow.score < fast.score and slow.score == round(45.4 * 0.75, 1)
        assert slow.classification is not None and any("network download 50 Mbps" in r for r in slow.classification["reasons"])
        assert failed.score == fast.score  # a failed test is no measurement: no penalty

    async def test_an_unknown_model_is_flagged_for_review(self, master: Master) -> None:
        """A GPU no table entry matches is estimated, listed, and flagged needs_review."""
        provider, _ = await create_principal(master, "provider-1", "provider")
        host_id = await online_host(master, provider, [gpu_info(0, name="NVIDIA Mystery 9000", memory=16384)])
        _, (gpu,) = await self._rescored(master, host_id, datetime.now(UTC) + timedelta(hours=2))
        assert gpu.needs_review and gpu.model_key is None and gpu.tier == "consumer"

    async def test_low_reliability_lowers_the_gpu_score(self, history: History) -> None:
        """A host scoring under 0.9 has its GPUs' scores multiplied by 0.7."""
        created = NOW - 40 * DAY
        host_id = await history.host(created, [(created, "online"), (NOW - 15 * DAY, "offline")], gpus=1)
        host, (gpu,) = await self._rescored(history.master, host_id, NOW)
        assert host.reliability == 0.5
        assert gpu.score == round(45.4 * 0.7, 1) and gpu.classification is not None
        assert gpu.classification["inputs"]["reliability"] == 0.5

    async def test_impossible_readings_leave_the_gpu_unranked_for_review(self, history: History) -> None:
        """A GPU reporting an impossible PCIe link is not ranked but flagged, with the reason kept."""
        host_id = await history.host(NOW - 40 * DAY, _always_online(), gpus=1)
        async with history.master.db.session() as session:
            gpu = await session.scalar(select(Gpu).where(Gpu.host_id == host_id))
            assert gpu is not None
            gpu.info = {**gpu.info, "pcie_gen_max": 0, "pcie_width_max": 16}
        _, (gpu,) = await self._rescored(history.master, host_id, NOW)
        assert gpu.tier is None and gpu.score is None and gpu.needs_review
        assert gpu.classification is not None and "not classified" in gpu.classification["reasons"][0]


class TestRescoringTheFleet:
    async def test_every_host_but_revoked_ones_is_scored_in_chunks(self, history: History) -> None:
        """rescore_all scores each non-revoked host as compute_reliability does, and classifies their GPUs."""
        created = NOW - 40 * DAY
        ids = [
            await history.host(created, [(created, "online")], gpus=1),
            await history.host(created, [(created, "online"), (NOW - 3 * DAY, "offline")], gpus=2),
            await history.host(created, [(created, "online"), (NOW - 6 * DAY, "faulty")]),
        ]
        revoked = await history.host(created, [(created, "online"), (NOW - DAY, "revoked")], gpus=1)
        await history.rental(ids[0], "failed", NOW - DAY, FailureCode.HOST_LOST)
        await history.gpu_event(ids[1], "xid", 79, NOW - 3 * DAY)
        assert await reliability.rescore_all(history.master, now=NOW, chunk=2) == 3
        async with history.master.db.session() as session:
            hosts = {h.id: h for h in (await session.scalars(select(Host))).all()}
            gpus = (await session.scalars(select(Gpu))).all()
        for host_id in ids:
            expected, inputs = await history.score(host_id)
            assert (hosts[host_id].reliability, hosts[host_id].reliability_inputs) == (expected, inputs)
            assert hosts[host_id].reliability_at == NOW
        assert [hosts[i].reliability for i in ids] == [0.8, round(0.9 * 0.97, 4), 0.8]
        assert hosts[revoked].reliability is None and hosts[revoked].reliability_at is None
        for gpu in gpus:
            assert (gpu.tier is None) == (gpu.host_id == revoked)

    async def test_the_scoring_loop_rescores_under_its_lease(self, master: Master) -> None:
        """scoring_loop scores hosts each interval while this master holds the host-scoring lease."""
        provider, _ = await create_principal(master, "provider-1", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])

        async def scored() -> bool:
            async with master.db.session() as session:
                host = await session.get(Host, host_id)
                return host is not None and host.reliability_at is not None

        task = asyncio.create_task(scoring_loop(master, every=20 * MS))
        try:
            await eventually(scored, what="the host to be scored")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with master.db.session() as session:
            gpu = await session.scalar(select(Gpu).where(Gpu.host_id == host_id))
            assert gpu is not None and gpu.tier == "prosumer"
