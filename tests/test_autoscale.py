"""The autoscaler: its rule (``scaling.decide``) case by case, and its pass over services on SQLite and PostgreSQL.

The pass is driven with a clock the test moves and a health probe the test answers (the real
probe goes through the gateway and a relay: ``test_services_e2e.py`` runs it on ``gpumarket up``);
in-flight figures are written as the gateways write them (``service_stats`` rows); agents'
answers are applied as the ingestor would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from master.models import Rental, Service, ServiceEvent, ServiceStat
from master.services.endpoints.autoscale import AutoscalerMemory, autoscale_pass
from master.services.endpoints.scaling import Load, decide
from tests.apiclient import Api

T0 = datetime(2030, 1, 1, tzinfo=UTC)
INFLIGHT = {"metric": "inflight", "target": 2.0, "scale_up_cooldown_s": 30.0, "scale_down_cooldown_s": 60.0}
UTIL = {"metric": "gpu_util", "threshold_pct": 80.0, "period_s": 300.0, "scale_down_below_pct": 40.0,
        "scale_up_cooldown_s": 30.0, "scale_down_cooldown_s": 60.0}  # fmt: skip


def _decide(rule: dict[str, Any] = INFLIGHT, *, desired: int = 1, low: int = 1, high: int = 3, load: Load | None = None,
            last_up: float | None = None, last_down: float | None = None, waking: bool = False) -> tuple[int, str]:  # fmt: skip
    """``last_up`` / ``last_down``: seconds before T0."""
    decision = decide(rule=rule, min_replicas=low, max_replicas=high, desired=desired, load=load or Load(), now=T0,
                      last_up=None if last_up is None else T0 - timedelta(seconds=last_up),
                      last_down=None if last_down is None else T0 - timedelta(seconds=last_down), waking=waking)  # fmt: skip
    return decision.replicas, decision.kind


class TestRule:
    def test_bounds_come_first(self) -> None:
        assert _decide(desired=0, low=1) == (1, "scale_up")
        assert _decide(desired=5, high=3, load=Load(inflight_recent=100)) == (3, "scale_down")

    def test_inflight_scales_up_to_what_the_target_needs_within_max(self) -> None:
        assert _decide(load=Load(inflight_recent=5.0)) == (3, "scale_up")
        assert _decide(load=Load(inflight_recent=4.0)) == (2, "scale_up")
        assert _decide(load=Load(inflight_recent=40.0), high=4) == (4, "scale_up")
        assert _decide(load=Load(inflight_recent=2.0, inflight_peak=2.0)) == (1, "hold")

    def test_a_scale_up_waits_for_its_cooldown(self) -> None:
        assert _decide(load=Load(inflight_recent=6.0), last_up=10) == (1, "hold")
        assert _decide(load=Load(inflight_recent=6.0), last_up=31) == (3, "scale_up")

    def test_a_scale_down_needs_the_whole_window_low_and_quiet(self) -> None:
        # The window's peak still needs 3: a dip in the recent figure stops nothing.
        assert _decide(desired=3, load=Load(inflight_recent=0.5, inflight_peak=5.0), last_up=120) == (3, "hold")
        # Low over the window, but a scale-up 30 s ago: not yet.
        assert _decide(desired=3, load=Load(inflight_recent=0.5, inflight_peak=1.0), last_up=30) == (3, "hold")
        assert _decide(desired=3, load=Load(inflight_recent=0.5, inflight_peak=1.0), last_up=61) == (1, "scale_down")
        assert _decide(desired=3, load=Load(inflight_peak=3.0), last_up=61) == (2, "scale_down")

    def test_a_scale_down_waits_for_the_figures_whatever_the_cooldown(self) -> None:
        rule = {**INFLIGHT, "scale_down_cooldown_s": 0.0}
        decision = decide(rule=rule, min_replicas=0, max_replicas=3, desired=1, load=Load(), now=T0,
                          last_up=T0 - timedelta(seconds=2), last_down=None, waking=False, min_quiet_s=3.0)  # fmt: skip
        assert decision.kind == "hold"
        decision = decide(rule=rule, min_replicas=0, max_replicas=3, desired=1, load=Load(), now=T0,
                          last_up=T0 - timedelta(seconds=4), last_down=None, waking=False, min_quiet_s=3.0)  # fmt: skip
        assert (decision.replicas, decision.kind) == (0, "scale_down")

    def test_no_traffic_sends_a_min_zero_service_to_sleep_and_a_waiting_request_wakes_it(self) -> None:
        assert _decide(desired=1, low=0, load=Load(), last_up=61) == (0, "scale_down")
        assert _decide(desired=0, low=0, load=Load()) == (0, "hold")
        assert _decide(desired=0, low=0, load=Load(), last_up=1, waking=True) == (1, "scale_up")
        # Its replica starting, the request not in the figures yet: the replica is kept.
        assert _decide(desired=1, low=0, load=Load(), last_up=600, waking=True) == (1, "hold")

    def test_gpu_utilisation_over_the_period_adds_or_removes_one(self) -> None:
        assert _decide(UTIL, load=Load(gpu_util=85.0)) == (2, "scale_up")
        assert _decide(UTIL, load=Load(gpu_util=85.0), desired=3) == (3, "hold")
        assert _decide(UTIL, load=Load(gpu_util=60.0), desired=2, last_up=600) == (2, "hold")
        assert _decide(UTIL, load=Load(gpu_util=20.0), desired=2, last_up=600) == (1, "scale_down")
        assert _decide(UTIL, load=Load(gpu_util=None), desired=2, last_up=600) == (2, "hold")  # too little telemetry


# ---- the pass ---------------------------------------------------------------------------------


@dataclass
class MovableClock:
    at: datetime = T0

    def now(self) -> datetime:
        return self.at

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass
class Probe:
    """Answers health checks as the test says: healthy unless the replica is listed in ``failing``."""

    failing: set[str] = field(default_factory=set)
    asked: list[str] = field(default_factory=list)

    async def __call__(self, service: Service, rental: Rental) -> str | None:
        self.asked.append(rental.id)
        return "connection refused" if rental.id in self.failing else None


@pytest.fixture
def clock(api: Api) -> MovableClock:
    moving = MovableClock(at=api.master.clock.now())
    api.master.clock = moving
    return moving


async def make_service(api: Api, **changes: Any) -> str:
    body = {"name": "chat", "workload": {"kind": "container", "image": "echo:1", "ports": [8000]}, "port": 8000,
            "min_replicas": 1, "max_replicas": 3, "scaling": {**INFLIGHT, "metric": "inflight"}, **changes}  # fmt: skip
    status, service = await api.as_renter("POST", "/services", json=body)
    assert status == 201, service
    return str(service["id"])


async def live(api: Api, service_id: str) -> list[Rental]:
    async with api.master.db.session() as session:
        rows = await session.scalars(select(Rental).where(Rental.service_id == service_id).order_by(Rental.created_at))
        return [r for r in rows.all() if r.state in ("pending", "starting", "running")]


async def start_all(api: Api, service_id: str) -> None:
    for rental in await live(api, service_id):
        if rental.state == "starting":
            await api.agent_reports(rental.id, "start_workload")


async def write_inflight(api: Api, service_id: str, at: datetime, inflight: float) -> None:
    async with api.master.db.session() as session:
        session.add(ServiceStat(service_id=service_id, bucket_at=at, node="test", requests=10, inflight_sum=inflight * 5,
                                inflight_samples=5, inflight_peak=int(inflight), latency_hist=[]))  # fmt: skip


async def events(api: Api, service_id: str) -> list[tuple[str, int]]:
    async with api.master.db.session() as session:
        rows = await session.scalars(select(ServiceEvent).where(ServiceEvent.service_id == service_id).order_by(ServiceEvent.id))
        return [(e.kind, e.replicas) for e in rows.all()]


class TestPass:
    async def test_up_under_load_then_drained_and_down_when_it_stops(self, api: Api, clock: MovableClock) -> None:
        for _ in range(3):
            await api.host(1)
        service_id = await make_service(api)
        memory, probe = AutoscalerMemory(), Probe()
        await start_all(api, service_id)
        await autoscale_pass(api.master, probe, memory)
        [first] = await live(api, service_id)
        assert first.ready_at == clock.at and ("ready", 1) in await events(api, service_id)

        clock.at += timedelta(seconds=5)
        await write_inflight(api, service_id, clock.at - timedelta(seconds=5), 5.0)  # 5 in flight, target 2
        await autoscale_pass(api.master, probe, memory)
        replicas = await live(api, service_id)
        assert len(replicas) == 3 and sorted(r.state for r in replicas) == ["running", "starting", "starting"]
        assert ("scale_up", 3) in await events(api, service_id)
        await start_all(api, service_id)
        clock.at += timedelta(seconds=5)
        await autoscale_pass(api.master, probe, memory)
        assert all(r.ready_at is not None for r in await live(api, service_id))

        # Load over; after the down cool-down, the two newest leave the rotation first, then stop.
        clock.at += timedelta(seconds=70)
        await autoscale_pass(api.master, probe, memory)
        replicas = await live(api, service_id)
        assert len(replicas) == 3 and [r.ready_at is not None for r in replicas] == [True, False, False]
        assert ("scale_down", 1) in await events(api, service_id)
        clock.at += timedelta(seconds=5)
        await autoscale_pass(api.master, probe, memory)
        assert [r.id for r in await live(api, service_id) if r.state != "stopping"] == [first.id]
        async with api.master.db.session() as session:
            service = await session.get(Service, service_id)
            assert service is not None and service.desired_replicas == 1

    async def test_an_ended_replica_is_replaced(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        await api.host(1)
        service_id = await make_service(api)
        await start_all(api, service_id)
        [replica] = await live(api, service_id)
        await api.as_renter("DELETE", f"/rentals/{replica.id}")  # as a preemption or a lost host would end it
        await api.agent_reports(replica.id, "stop_workload")
        await autoscale_pass(api.master, Probe(), AutoscalerMemory())
        [replacement] = await live(api, service_id)
        assert replacement.id != replica.id
        assert (await events(api, service_id))[-1] == ("replicas", 1)

    async def test_a_preempted_interruptible_replica_is_replaced_and_waits_for_gpus(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        service_id = await make_service(api, kind="interruptible", bid="0.30")
        await start_all(api, service_id)
        [replica] = await live(api, service_id)
        status, on_demand = await api.as_renter("POST", "/rentals", json={"gpu_count": 1})  # takes its GPU
        assert status == 201, on_demand
        await api.agent_reports(on_demand["id"], "start_workload")  # which stopped it first
        await autoscale_pass(api.master, Probe(), AutoscalerMemory())
        async with api.master.db.session() as session:
            ended = await session.get(Rental, replica.id)
            assert ended is not None and ended.state == "preempted"
        [replacement] = await live(api, service_id)
        assert replacement.id != replica.id and replacement.kind == "interruptible" and replacement.state == "pending"
        assert replacement.host_id is None  # queued until a GPU frees
        assert (await events(api, service_id))[-1] == ("replicas", 1)

    async def test_a_failing_ready_replica_leaves_the_rotation_until_it_passes(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        service_id = await make_service(api)
        await start_all(api, service_id)
        memory, probe = AutoscalerMemory(), Probe()
        await autoscale_pass(api.master, probe, memory)
        [replica] = await live(api, service_id)
        probe.failing.add(replica.id)
        for _ in range(api.master.settings.service_unhealthy_after):
            assert replica.ready_at is not None
            await autoscale_pass(api.master, probe, memory)
            [replica] = await live(api, service_id)
        assert replica.ready_at is None and (await events(api, service_id))[-1][0] == "unhealthy"
        probe.failing.clear()
        await autoscale_pass(api.master, probe, memory)
        [replica] = await live(api, service_id)
        assert replica.ready_at is not None

    async def test_a_waiting_request_wakes_a_sleeping_service(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        service_id = await make_service(api, min_replicas=0)
        memory, probe = AutoscalerMemory(), Probe()
        await autoscale_pass(api.master, probe, memory)
        assert await live(api, service_id) == []
        async with api.master.db.session() as session:
            service = await session.get(Service, service_id)
            assert service is not None
            service.wake_requested_at = clock.at  # what the gateway writes
        await autoscale_pass(api.master, probe, memory)
        assert len(await live(api, service_id)) == 1
        await start_all(api, service_id)
        clock.at += timedelta(seconds=8)
        await autoscale_pass(api.master, probe, memory)
        async with api.master.db.session() as session:
            service = await session.get(Service, service_id)
            assert service is not None and service.wake_requested_at is None
            cold = await session.scalar(select(ServiceEvent.cause).where(ServiceEvent.kind == "cold_start"))
        assert cold is not None and "8.0s" in cold
        assert service.last_scale_up_at == clock.at  # the cool-downs count from the replica it woke to

    async def test_a_refusal_is_one_event_not_one_per_pass(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        service_id = await make_service(api)
        async with api.master.db.session() as session:
            service = await session.get(Service, service_id)
            assert service is not None
            service.gpu_count = 8  # as if the fleet shrank: no host can ever hold a replica now
        [replica] = await live(api, service_id)
        await api.as_renter("DELETE", f"/rentals/{replica.id}")
        memory = AutoscalerMemory()
        for _ in range(3):
            await autoscale_pass(api.master, Probe(), memory)
        kinds = [kind for kind, _ in await events(api, service_id)]
        assert kinds.count("refused") == 1

    async def test_a_deleted_service_s_replicas_all_stop(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        service_id = await make_service(api)
        await start_all(api, service_id)
        async with api.master.db.session() as session:
            service = await session.get(Service, service_id)
            assert service is not None
            service.state = "deleted"  # a delete interrupted before it stopped anything
        await autoscale_pass(api.master, Probe(), AutoscalerMemory())
        assert [r.state for r in await live(api, service_id)] == []
