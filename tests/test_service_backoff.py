"""A service whose replicas cannot start (issue 39, point 2): back-off per cause, ``failing`` with the cause, one
event per cause, failed replicas folded, the endpoint's 503 at once, and the renter's resume; SQLite and PostgreSQL.

Regression: ``gpumarket service create --template vllm`` offline rented a replica every 5 s for ever (29
``image_pull_failed`` replicas, the service ``active``) and each request to its endpoint was held 300 s, then
answered 503 without saying why. Agents' answers are applied as the ingestor would; the clock is the test's.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from master.models import Rental, Service
from master.services.endpoints.autoscale import AutoscalerMemory, autoscale_pass
from master.services.endpoints.backoff import delay_s, streak_of
from tests.apiclient import Api, bearer
from tests.test_autoscale import MovableClock, Probe, events, live

PULL = "image_pull_failed"
PULL_DETAIL = "image_pull_failed: cannot pull vllm/vllm-openai:latest: lookup registry-1.docker.io: no such host"


@pytest.fixture
def clock(api: Api) -> MovableClock:
    moving = MovableClock(at=api.master.clock.now())
    api.master.clock = moving
    return moving


async def fail_start(api: Api, rental_id: str, *, code: str = PULL, detail: str = PULL_DETAIL) -> None:
    """The agent answers the replica's start: it failed, with ``code``."""
    [command] = await api.commands(rental_id, "start_workload")
    await api.agent_answers(command, ok=False, detail=detail, data={"code": code})


async def service_row(api: Api, service_id: str) -> Service:
    async with api.master.db.session() as session:
        service = await session.get(Service, service_id)
        assert service is not None
        return service


async def new_service(api: Api, **changes: Any) -> tuple[str, str]:
    """A one-replica service; returns its id and token."""
    body = {"name": "chat", "workload": {"kind": "container", "image": "vllm/vllm-openai:latest", "ports": [8000]},
            "port": 8000, "min_replicas": 1, "max_replicas": 1, **changes}  # fmt: skip
    status, service = await api.as_renter("POST", "/services", json=body)
    assert status == 201, service
    return str(service["id"]), str(service["token"])


async def fail_until(api: Api, clock: MovableClock, service_id: str, memory: AutoscalerMemory, *, failures: int,
                     code: str = PULL, detail: str = PULL_DETAIL) -> list[float]:  # fmt: skip
    """Fail each replica the service gets, ``failures`` times, a pass each second (waiting for the first replica if
    none is live); returns the gaps (s) between one failure and the next replica."""
    gaps: list[float] = []
    failed_at = None
    for _ in range(failures):
        for _ in range(10_000):
            if await live(api, service_id):
                break
            clock.at += timedelta(seconds=1)
            await autoscale_pass(api.master, Probe(), memory)
        if failed_at is not None:
            gaps.append((clock.at - failed_at).total_seconds())
        [replica] = await live(api, service_id)
        await fail_start(api, replica.id, code=code, detail=detail)
        failed_at = clock.at
        await autoscale_pass(api.master, Probe(), memory)
    return gaps


class TestRule:
    def test_the_wait_doubles_per_failure_up_to_its_cap(self) -> None:
        assert [delay_s(n, base_s=5, max_s=60) for n in range(1, 7)] == [5, 10, 20, 40, 60, 60]

    def test_a_streak_is_the_newest_failures_that_share_a_code(self) -> None:
        def failed(rid: str, code: str) -> Rental:
            return Rental(id=rid, failure_code=code, failure_owner="provider", failure_reason=f"{code}: x")

        streak = streak_of([failed("r3", PULL), failed("r2", PULL), failed("r1", "host_lost"), failed("r0", PULL)])
        assert streak is not None and (streak.code, streak.count, streak.newest) == (PULL, 2, "r3")
        assert streak_of([]) is None


class TestBackoff:
    async def test_an_image_that_cannot_be_pulled_backs_off_then_fails_with_its_cause(self, api: Api, clock: MovableClock) -> None:
        """The issue's service: waits grow (5, 10 s), the third failure turns it failing, one event per cause."""
        await api.host(1)
        service_id, token = await new_service(api)
        memory = AutoscalerMemory()
        failing_after = api.master.settings.service_failing_after
        assert failing_after == 3
        gaps = await fail_until(api, clock, service_id, memory, failures=failing_after)
        assert gaps == [5.0, 10.0]

        service = await service_row(api, service_id)
        assert (service.state, service.failure_code, service.failure_owner, service.failure_count) == ("failing", PULL, "provider", 3)
        assert service.next_attempt_at == clock.at + timedelta(seconds=api.master.settings.service_backoff_max_s)
        kinds = [kind for kind, _ in await events(api, service_id)]
        assert kinds.count("start_failed") == 1 and kinds.count("failing") == 1 and "replicas" not in kinds

        # No replica before the capped wait: the service does not rent one a pass.
        for _ in range(5):
            clock.at += timedelta(seconds=30)
            await autoscale_pass(api.master, Probe(), memory)
        assert await live(api, service_id) == []

        # The endpoint answers at once with the cause, not after holding the request.
        async with api.client.get(f"/svc/{service_id}/v1/models", headers=bearer(token)) as response:
            assert response.status == 503
            body = await response.json()
            assert int(response.headers["Retry-After"]) > 0
        assert body["code"] == "service_failing" and body["message"].startswith(PULL_DETAIL), body
        assert body["details"]["failure_code"] == PULL

        # Failed replicas are counted, listed on demand.
        status, view = await api.as_renter("GET", f"/services/{service_id}")
        assert status == 200 and view["state"] == "failing", view
        assert view["failure"]["code"] == PULL and view["failure"]["consecutive"] == 3 and view["failure"]["retried"] is True
        assert view["replicas"]["failed"] == 3 and view["replica_rentals"] == [] and view["next_attempt_at"] is not None
        status, full = await api.as_renter("GET", f"/services/{service_id}?failed=true")
        assert status == 200 and [r["failure_code"] for r in full["replica_rentals"]] == [PULL] * 3

        # The renter sets the replicas again: active, and a replica is rented on the next pass.
        clock.at += timedelta(seconds=1)
        status, resumed = await api.as_renter("PUT", f"/services/{service_id}/replicas", json={"min_replicas": 1, "max_replicas": 1})
        assert status == 200 and resumed["state"] == "active" and resumed["failure"] is None, resumed
        await autoscale_pass(api.master, Probe(), memory)
        assert len(await live(api, service_id)) == 1
        assert [kind for kind, _ in await events(api, service_id)][-2:] == ["resumed", "replicas"]

    async def test_a_renter_s_cause_is_not_retried_until_the_renter_resumes(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        service_id, _ = await new_service(api)
        memory = AutoscalerMemory()
        await fail_until(api, clock, service_id, memory, failures=api.master.settings.service_failing_after,
                         code="image_not_found", detail="image_not_found: vllm/vllm-openai:nope: manifest unknown")  # fmt: skip
        service = await service_row(api, service_id)
        assert (service.state, service.failure_owner, service.next_attempt_at) == ("failing", "renter", None)
        clock.at += timedelta(hours=2)
        await autoscale_pass(api.master, Probe(), memory)
        assert await live(api, service_id) == []
        status, _ = await api.as_renter("PUT", f"/services/{service_id}/replicas", json={"max_replicas": 1})
        assert status == 200
        await autoscale_pass(api.master, Probe(), memory)
        assert len(await live(api, service_id)) == 1

    async def test_a_new_cause_starts_its_own_wait_and_a_ready_replica_ends_the_streak(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        service_id, _ = await new_service(api)
        memory = AutoscalerMemory()
        assert await fail_until(api, clock, service_id, memory, failures=2) == [5.0]
        gaps = await fail_until(api, clock, service_id, memory, failures=2, code="workload_start_failed",
                                detail="workload_start_failed: the engine refused the container")  # fmt: skip
        assert gaps == [5.0]  # the first failure of the new cause waited the base again, not 20 s
        service = await service_row(api, service_id)
        assert (service.state, service.failure_code, service.failure_count) == ("active", "workload_start_failed", 2)
        assert [kind for kind, _ in await events(api, service_id)].count("start_failed") == 2

        clock.at += timedelta(seconds=20)
        await autoscale_pass(api.master, Probe(), memory)
        [replica] = await live(api, service_id)
        await api.agent_reports(replica.id, "start_workload")
        await autoscale_pass(api.master, Probe(), memory)  # the probe passes: ready
        service = await service_row(api, service_id)
        assert (service.failure_code, service.failure_count, service.next_attempt_at) == (None, 0, None)
        async with api.master.db.session() as session:
            ready = await session.scalar(select(Rental.ready_at).where(Rental.id == replica.id))
        assert ready is not None

    async def test_replicas_asked_for_together_count_whichever_fails_last(self, api: Api, clock: MovableClock) -> None:
        """Three replicas started at once whose oldest fails after the two newer ones: the third failure still counts."""
        for _ in range(3):
            await api.host(1)
        service_id, _ = await new_service(api, min_replicas=3, max_replicas=3)
        oldest, *newer = sorted(await live(api, service_id), key=lambda r: (r.created_at, r.id))  # the streak's order
        for replica in newer:
            await fail_start(api, replica.id)
        await autoscale_pass(api.master, Probe(), AutoscalerMemory())
        assert (await service_row(api, service_id)).failure_count == 2
        await fail_start(api, oldest.id)
        clock.at += timedelta(seconds=1)
        await autoscale_pass(api.master, Probe(), AutoscalerMemory())
        service = await service_row(api, service_id)
        assert (service.state, service.failure_count) == ("failing", 3)

    async def test_a_service_waiting_between_failures_answers_at_once_too(self, api: Api, clock: MovableClock) -> None:
        await api.host(1)
        service_id, token = await new_service(api)
        await fail_until(api, clock, service_id, AutoscalerMemory(), failures=1)
        async with api.client.get(f"/svc/{service_id}/", headers=bearer(token)) as response:
            assert response.status == 503
            body = await response.json()
            assert response.headers["Retry-After"] == "5"
        assert body["code"] == "service_failing" and body["details"]["failing"] is False, body
        assert body["message"].startswith(PULL_DETAIL) and "no ready replica" in body["message"]

