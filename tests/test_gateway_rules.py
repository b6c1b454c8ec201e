"""The gateway's rules without a marketplace: latency histograms, figures per bucket, who may call a service, which
replica takes a request, and the rows written, on SQLite and PostgreSQL. End to end: tests/test_gateway.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update

from master.context import Master
from master.models import ApiKey, Service, ServiceStat
from master.services.gateway import LATENCY_BOUNDS_MS, Gateway, merge_histograms, percentile
from master.services.gateway.routing import KeyCache, Replica, ServiceRoute
from master.services.gateway.stats import GatewayStats, bucket_of, empty_histogram
from shared.errors import NotFound, Unauthorized
from shared.ids import new_id, new_secret, secret_hash
from tests.factories import create_principal


class TestPercentile:
    def test_an_empty_histogram_has_no_percentile(self) -> None:
        assert percentile(empty_histogram(), 0.5) is None

    def test_it_interpolates_within_the_bucket_the_rank_falls_in(self) -> None:
        """Ten requests between 10 and 20 ms: the median is read halfway through that bucket."""
        hist = empty_histogram()
        hist[bucket_of(15)] = 10
        assert LATENCY_BOUNDS_MS[bucket_of(15)] == 20
        assert percentile(hist, 0.5) == pytest.approx(15.0)
        assert percentile(hist, 1.0) == pytest.approx(20.0)

    def test_a_latency_on_a_bound_counts_in_that_bound_and_beyond_the_last_in_the_overflow(self) -> None:
        assert bucket_of(1) == 0 and bucket_of(1.0001) == 1
        hist = empty_histogram()
        hist[bucket_of(10 * LATENCY_BOUNDS_MS[-1])] += 1
        assert hist[-1] == 1 and percentile(hist, 0.99) == LATENCY_BOUNDS_MS[-1]

    def test_rows_of_several_masters_add_up_bucket_by_bucket(self) -> None:
        a, b = empty_histogram(), empty_histogram()
        a[0], b[0], b[3] = 1, 2, 5
        merged = merge_histograms([a, b])
        assert merged[0] == 3 and merged[3] == 5 and sum(merged) == 8


class TestFigures:
    def test_a_bucket_counts_requests_errors_retries_and_the_sampled_in_flight_gauge(self) -> None:
        stats = GatewayStats()
        web = stats.of("svc-web")
        for _ in range(3):
            web.started()
        web.retried()
        web.answered(12.0)
        web.finished(error=True)
        stats.sample()
        stats.sample()
        taken = stats.take_buckets()["svc-web"]
        assert (taken.requests, taken.errors, taken.retries) == (1, 1, 1)
        assert (taken.inflight_sum, taken.inflight_samples, taken.inflight_peak) == (4.0, 2, 3)
        assert sum(taken.latency_hist) == 1 and web.requests == 1

    def test_only_services_with_traffic_or_requests_in_flight_get_a_row(self) -> None:
        stats = GatewayStats()
        stats.of("svc-idle")
        busy = stats.of("svc-busy")
        busy.started()
        assert list(stats.take_buckets()) == ["svc-busy"]
        assert list(stats.take_buckets()) == ["svc-busy"]  # still in flight: the next bucket has it too
        busy.answered(1.0)
        busy.finished(error=False)
        assert list(stats.take_buckets()) == ["svc-busy"]
        assert stats.take_buckets() == {}


async def _service(master: Master, renter_id: str, *, state: str = "active") -> tuple[str, str]:
    service_id, token = new_id("svc"), new_secret("gms")
    async with master.db.session() as session:
        session.add(Service(id=service_id, renter_id=renter_id, name="s", state=state, port=8000, min_replicas=0, max_replicas=1,
                            desired_replicas=0, token_hash=secret_hash(token), token_prefix=token[:12]))  # fmt: skip
    return service_id, token


@pytest.fixture
async def gateway(master: Master) -> AsyncIterator[Gateway]:
    gateway = Gateway(master)
    try:
        yield gateway
    finally:
        await gateway.close()


class TestAuthorize:
    async def test_the_service_token_or_the_renters_key_open_it_and_nothing_else_reveals_it(self, master: Master, gateway: Gateway) -> None:
        renter, renter_key = await create_principal(master, "renter", "renter")
        _, other_key = await create_principal(master, "other", "renter")
        _, admin_key = await create_principal(master, "admin", "admin")
        service_id, token = await _service(master, renter.account_id)
        deleted_id, deleted_token = await _service(master, renter.account_id, state="deleted")
        assert (await gateway.authorize(service_id, token)).service_id == service_id
        assert (await gateway.authorize(service_id, renter_key)).renter_id == renter.account_id
        for key in (other_key, admin_key):
            with pytest.raises(NotFound) as found:
                await gateway.authorize(service_id, key)
            assert found.value.code == "service_not_found"
        for missing in ("svc-0000000000000000", deleted_id):
            with pytest.raises(NotFound):
                await gateway.authorize(missing, renter_key)
        for wrong in ("gmk_not-a-key", deleted_token, token + "x"):
            with pytest.raises(Unauthorized) as refused:
                await gateway.authorize(service_id, wrong)
            assert refused.value.code == "invalid_token"
        with pytest.raises(Unauthorized):  # an unknown key is 401 whether the service exists or not
            await gateway.authorize("svc-0000000000000000", "gmk_not-a-key")

    async def test_routes_and_keys_are_read_once_per_period(self, master: Master, gateway: Gateway) -> None:
        renter, renter_key = await create_principal(master, "renter", "renter")
        service_id, _ = await _service(master, renter.account_id)
        for _ in range(5):
            await gateway.authorize(service_id, renter_key)
        assert gateway.routes.loads == 1


class TestKeyCache:
    async def test_a_refused_key_is_read_once_per_refused_period_and_a_revoked_one_is_refused_after_the_valid_period(
        self, master: Master
    ) -> None:
        """A bad key repeated is read once per ``refused_max_age``; a valid key once per ``max_age``, and once revoked
        it stops opening after that period."""
        now = [0.0]
        keys = KeyCache(master, max_age=5.0, refused_max_age=30.0, clock=lambda: now[0])
        renter, renter_key = await create_principal(master, "renter", "renter")
        bad = new_secret("gmk")
        for _ in range(5):
            assert await keys.account_of(secret_hash(bad), bad) is None
            assert await keys.account_of(secret_hash(renter_key), renter_key) == renter.account_id
        assert keys.lookups == 2
        async with master.db.session() as session:
            await session.execute(update(ApiKey).where(ApiKey.account_id == renter.account_id).values(revoked_at=datetime.now(UTC)))
        now[0] = 6.0
        assert await keys.account_of(secret_hash(renter_key), renter_key) is None
        assert await keys.account_of(secret_hash(bad), bad) is None
        assert keys.lookups == 3
        now[0] = 31.0
        assert await keys.account_of(secret_hash(bad), bad) is None
        assert keys.lookups == 4

    async def test_a_flood_of_made_up_keys_never_pushes_valid_keys_out(self, master: Master) -> None:
        """Refused keys have a table of their own: past its size the oldest refused key goes, never a valid one."""
        keys = KeyCache(master, max_entries=2, refused_max_entries=2, clock=lambda: 0.0)
        renter, renter_key = await create_principal(master, "renter", "renter")
        assert await keys.account_of(secret_hash(renter_key), renter_key) == renter.account_id
        for _ in range(10):
            bad = new_secret("gmk")
            assert await keys.account_of(secret_hash(bad), bad) is None
        lookups = keys.lookups
        assert await keys.account_of(secret_hash(renter_key), renter_key) == renter.account_id
        assert keys.lookups == lookups

    async def test_requests_for_one_unknown_key_share_one_read(self, master: Master) -> None:
        keys = KeyCache(master, clock=lambda: 0.0)
        bad = new_secret("gmk")
        assert await asyncio.gather(*(keys.account_of(secret_hash(bad), bad) for _ in range(5))) == [None] * 5
        assert keys.lookups == 1


def _route(*replicas: Replica) -> ServiceRoute:
    return ServiceRoute(service_id="svc-1", renter_id="acct-1", token_hash="", active=True, port=8000, health_path="/health",
                        wake_requested_at=None, replicas=replicas)  # fmt: skip


def _replica(rental_id: str, *, ready: bool = True, relay: str | None = "wss://relay.test/v1/connect") -> Replica:
    return Replica(rental_id, "h-1", ready, relay)


class TestPick:
    async def test_the_least_busy_ready_replica_takes_it_and_equals_take_turns_by_request(self, gateway: Gateway) -> None:
        route = _route(_replica("r-a"), _replica("r-b"), _replica("r-c", ready=False), _replica("r-d", relay=None))
        firsts = []
        for _ in range(4):
            picked = gateway.pick(route, set())
            assert picked is not None
            firsts.append(picked[0].rental_id)
        assert firsts == ["r-a", "r-b", "r-a", "r-b"]
        gateway.pools["r-a"].inflight = 2
        assert [gateway.pick(route, set())[0].rental_id for _ in range(2)] == ["r-b", "r-b"]  # type: ignore[index]

    async def test_a_retry_goes_to_another_replica_and_does_not_move_the_turn(self, gateway: Gateway) -> None:
        route = _route(_replica("r-a"), _replica("r-b"))
        first = gateway.pick(route, set())
        assert first is not None and first[0].rental_id == "r-a"
        retry = gateway.pick(route, {"r-a"})
        assert retry is not None and retry[0].rental_id == "r-b"
        again = gateway.pick(route, {"r-a", "r-b"})  # all tried: a healthy one again (a fresh connection)
        assert again is not None
        nxt = gateway.pick(route, set())
        assert nxt is not None and nxt[0].rental_id == "r-b"

    async def test_a_replica_whose_stream_failed_sits_out_unless_every_one_did(self, gateway: Gateway) -> None:
        route = _route(_replica("r-a"), _replica("r-b"))
        gateway.pick(route, set())
        gateway.pools["r-a"].failed()
        assert {gateway.pick(route, set())[0].rental_id for _ in range(4)} == {"r-b"}  # type: ignore[index]
        gateway.pools["r-b"].failed()
        assert gateway.pick(route, set()) is not None
        assert gateway.pick(route, {"r-a", "r-b"}) is None
        assert gateway.pick(_route(_replica("r-c", ready=False)), set()) is None


class TestRows:
    async def test_each_bucket_is_one_row_per_service_and_node_written_once(self, master: Master, gateway: Gateway) -> None:
        renter, _ = await create_principal(master, "renter", "renter")
        service_id, _ = await _service(master, renter.account_id)
        figures = gateway.stats.of(service_id)
        figures.started()
        figures.answered(30.0)
        figures.finished(error=False)
        bucket = gateway.bucket_start(datetime(2026, 11, 26, 12, 0, 7, 500_000, tzinfo=UTC))
        assert bucket == datetime(2026, 11, 26, 12, 0, 5, tzinfo=UTC)  # service_stats_bucket_s = 5
        gateway.close_bucket(bucket)
        assert await gateway.flush() == 1
        figures.started()
        figures.finished(error=True)
        gateway.close_bucket(bucket)  # the same bucket again (a restarted master of the same name): the first row stands
        await gateway.flush()
        gateway.close_bucket(bucket + timedelta(seconds=5))
        await gateway.flush()
        async with master.db.session() as session:
            rows = list((await session.scalars(select(ServiceStat).order_by(ServiceStat.bucket_at))).all())
        assert [(r.bucket_at, r.requests, r.errors, r.node) for r in rows] == [(bucket, 1, 0, master.instance_id)]
        assert rows[0].latency_hist[bucket_of(30.0)] == 1
