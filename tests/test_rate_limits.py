"""Rate limits on the REST API: per address, per key, enrollment and sign-in; shared through Redis; failing open.

Time is a ``ManualClock``: buckets refill only when a test advances it, so nothing sleeps.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from multidict import CIMultiDictProxy

from master.api.base import API
from master.api.openapi import build_openapi
from master.api.ratelimits import RATE_LIMITS, ApiLimits, client_address
from master.api.table import NEVER_LIMITED, ROUTES
from master.app import close_master, open_master
from master.models import Service
from master.services.accounts.core import create_api_key
from master.services.endpoints import core as elastic
from master.services.gateway import gateway_of
from shared.bus import InProcessBus
from shared.errors import ConfigError
from shared.ids import new_secret, secret_hash
from shared.ratelimit import EXPIRY_GRACE_S, Limit, MemoryRateStore, RateStore, RedisRateStore, retry_after
from shared.registry import MemoryRegistry
from shared.settings import MasterSettings
from tests.apiclient import Api, bearer, serve_api
from tests.factories import create_principal, master_settings
from tests.helpers import ManualClock

PROXY = ["127.0.0.0/8"]  # the test client's address: requests come "through a trusted proxy"
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"  # nothing listens on port 1: connections are refused at once


@asynccontextmanager
async def limited_api(folder: Path, clock: ManualClock, **settings: Any) -> AsyncIterator[Api]:
    """The API with rate limits on (tests/factories.py turns them off elsewhere), on SQLite."""
    folder.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {"database_url": f"sqlite:///{folder / 'test.db'}", "rate_limits_enabled": True, **settings}
    master = await open_master(master_settings(folder, **values), bus=InProcessBus(), registry=MemoryRegistry(), clock=clock)
    try:
        async with serve_api(master) as client:
            yield client
    finally:
        await close_master(master)


async def send(
    api: Api, method: str, path: str, *, key: str | None = None, forwarded_for: str | None = None, **kwargs: Any
) -> tuple[int, Any, CIMultiDictProxy[str]]:
    headers = dict(kwargs.pop("headers", {}))
    if key is not None:
        headers.update(bearer(key))
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    async with api.client.request(method, API + path, headers=headers, **kwargs) as response:
        return response.status, await response.json(), response.headers


def assert_limited(status: int, body: Any, headers: CIMultiDictProxy[str], *, retry: int, what: str) -> None:
    assert status == 429, body
    assert body["code"] == "rate_limited"
    assert f"too many {what}; retry in {retry} s" == body["message"]
    assert body["details"] == {"retry_after": retry}
    assert headers["Retry-After"] == str(retry)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


# ---- the client address -----------------------------------------------------------------


class TestClientAddress:
    """Requests count against the peer, or through trusted proxies against the client the nearest proxy saw."""

    TRUSTED = [ipaddress.ip_network("10.0.0.0/8")]

    def test_an_untrusted_peer_counts_whatever_it_forwards(self) -> None:
        """A peer outside trusted_proxies is the client: its X-Forwarded-For is not believed."""
        assert client_address("203.0.113.5", ["198.51.100.1"], self.TRUSTED) == "203.0.113.5"
        assert client_address("10.0.0.1", ["198.51.100.1"], []) == "10.0.0.1"

    def test_the_last_untrusted_hop_counts_through_trusted_proxies(self) -> None:
        """Read from the right past our proxies; what the client wrote to the left of its own address is ignored."""
        header = ["192.0.2.66, 198.51.100.7, 10.0.0.1"]  # spoofed, real client, our first proxy
        assert client_address("10.0.0.2", header, self.TRUSTED) == "198.51.100.7"
        assert client_address("10.0.0.2", ["192.0.2.66", "198.51.100.7"], self.TRUSTED) == "198.51.100.7"

    def test_a_hop_that_is_no_address_stops_at_the_last_trusted_one(self) -> None:
        """Garbage where a proxy should have written an address: count the proxy, not something to its left."""
        assert client_address("10.0.0.2", ["198.51.100.7, not-an-address"], self.TRUSTED) == "10.0.0.2"
        assert client_address("10.0.0.2", [], self.TRUSTED) == "10.0.0.2"

    def test_ipv4_mapped_addresses_are_their_ipv4_address(self) -> None:
        """A dual-stack socket's ::ffff:10.0.0.2 is the trusted proxy 10.0.0.2."""
        assert client_address("::ffff:10.0.0.2", ["198.51.100.7"], self.TRUSTED) == "198.51.100.7"


# ---- the stores: one contract, in memory and in Redis -----------------------------------


@pytest.fixture(params=["memory", "redis"])
def redis_for_store(request: pytest.FixtureRequest) -> tuple[str, str] | None:
    """Each store contract test runs on the in-memory store (None) and on Redis (its URL and a random prefix)."""
    if request.param == "memory":
        return None
    return request.getfixturevalue("redis_url"), request.getfixturevalue("bus_prefix")


@pytest.fixture
async def store(redis_for_store: tuple[str, str] | None, clock: ManualClock) -> AsyncIterator[RateStore]:
    if redis_for_store is None:
        yield MemoryRateStore(clock=clock.monotonic)
        return
    url, prefix = redis_for_store
    redis_store = RedisRateStore.from_url(url, prefix=prefix, clock=lambda: clock.now().timestamp())
    try:
        yield redis_store
    finally:
        assert redis_store.failed_open == 0
        await redis_store.close()


class TestStoreContract:
    """Memory and Redis stores make the same decisions: burst, then rate; refusals take nothing; penalties are debt."""

    async def test_a_bucket_gives_its_burst_then_says_how_long_to_wait(self, store: RateStore, clock: ManualClock) -> None:
        """3 tokens at once, the 4th in 1/rate seconds; a refused take leaves the bucket as it was."""
        limit = Limit(rate=2.0, burst=3)
        assert [await store.take("k", limit) for _ in range(3)] == [0.0, 0.0, 0.0]
        assert await store.take("k", limit) == pytest.approx(0.5, abs=1e-5)
        clock.advance(0.25)
        assert await store.take("k", limit) == pytest.approx(0.25, abs=1e-5)  # the refusal above took nothing
        clock.advance(0.25)
        assert await store.take("k", limit) == 0.0
        assert await store.take("k", limit) > 0

    async def test_keys_and_limits_have_their_own_buckets(self, store: RateStore) -> None:
        """An empty bucket does not touch another key's, nor the same key's under another limit."""
        limit = Limit(rate=1.0, burst=1)
        assert await store.take("a", limit) == 0.0
        assert await store.take("a", limit) > 0
        assert await store.take("b", limit) == 0.0
        assert await store.take("a", Limit(rate=1.0, burst=2)) == 0.0

    async def test_a_charge_puts_the_bucket_into_debt(self, store: RateStore, clock: ManualClock) -> None:
        """A penalty is taken even from an empty bucket; it refills from below zero."""
        limit = Limit(rate=1.0, burst=2)
        assert await store.take("k", limit) == 0.0
        await store.charge("k", limit, cost=3)  # 1 - 3 = -2 tokens
        assert await store.take("k", limit) == pytest.approx(3.0, abs=1e-5)
        clock.advance(3.0)
        assert await store.take("k", limit) == 0.0

    async def test_a_bucket_refills_to_its_burst_and_no_further(self, store: RateStore, clock: ManualClock) -> None:
        """An hour idle gives back the burst, not an hour of tokens."""
        limit = Limit(rate=10.0, burst=2)
        assert await store.take("k", limit, cost=2) == 0.0
        clock.advance(3600)
        assert [await store.take("k", limit) for _ in range(3)][2] > 0


class TestRetryAfter:
    def test_retry_after_is_whole_seconds_at_least_one_never_short(self) -> None:
        """Retry-After rounds up, is at least 1, and ignores float noise past a whole second."""
        assert [retry_after(w) for w in (0.001, 1.0, 1.2, 6.000000000000001, 59.5)] == [1, 1, 2, 6, 60]


class TestRedisStore:
    async def test_keys_live_under_the_prefix_and_expire_when_the_bucket_is_full_again(
        self, redis_url: str, bus_prefix: str, clock: ManualClock
    ) -> None:
        """Two tokens of a 10/s bucket come back in 0.2 s: the key is set to expire EXPIRY_GRACE_S after that."""
        store = RedisRateStore.from_url(redis_url, prefix=bus_prefix, clock=lambda: clock.now().timestamp())
        client = aioredis.Redis.from_url(redis_url)
        try:
            limit = Limit(rate=10.0, burst=5)
            await store.take("address:192.0.2.1", limit, cost=2)
            keys = [k.decode() async for k in client.scan_iter(match=f"{bus_prefix}*")]
            assert keys == [f"{bus_prefix}ratelimit:address:192.0.2.1"] == [store.key("address:192.0.2.1")]
            assert 200 < await client.pttl(keys[0]) <= 200 + EXPIRY_GRACE_S * 1000  # 30 s of slack for a slow machine
        finally:
            await client.delete(*[k async for k in client.scan_iter(match=f"{bus_prefix}*")])
            await client.aclose()
            await store.close()

    async def test_redis_down_lets_requests_through_counts_them_and_warns_once_per_retry_interval(
        self, clock: ManualClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Without Redis every take passes; Redis is retried (and the failure logged) once per retry_interval."""
        store = RedisRateStore.from_url(UNREACHABLE_REDIS, clock=lambda: clock.now().timestamp(), retry_interval=5.0)
        limit = Limit(rate=0.001, burst=1)
        try:
            with caplog.at_level(logging.WARNING, logger="shared.ratelimit"):
                assert [await store.take("k", limit) for _ in range(3)] == [0.0, 0.0, 0.0]
                await store.charge("k", limit, cost=5)
                assert len(caplog.records) == 1
                clock.advance(5.0)
                assert await store.take("k", limit) == 0.0
        finally:
            await store.close()
        assert store.failed_open == 5
        assert len(caplog.records) == 2
        assert "rate limits are off for 5 s" in caplog.records[0].getMessage()


# ---- the API ------------------------------------------------------------------------------


class TestPerKey:
    async def test_a_key_past_its_limit_gets_429_and_another_key_does_not(self, tmp_path: Path, clock: ManualClock) -> None:
        """The renter's 4th request in a burst of 3 is refused for 1 s; the provider's key is not affected."""
        async with limited_api(tmp_path, clock, rate_limit_per_key=1.0, rate_burst_per_key=3) as api:
            for _ in range(3):
                assert (await send(api, "GET", "/account", key=api.renter_key))[0] == 200
            assert_limited(*await send(api, "GET", "/account", key=api.renter_key), retry=1,
                           what="requests with this API key or session")  # fmt: skip
            assert (await send(api, "GET", "/account", key=api.provider_key))[0] == 200
            clock.advance(1.0)
            assert (await send(api, "GET", "/account", key=api.renter_key))[0] == 200
            assert api.client.app[RATE_LIMITS].rejected == {"key": 1}


class TestPerAddress:
    async def test_clients_behind_a_trusted_proxy_have_their_own_buckets(self, tmp_path: Path, clock: ManualClock) -> None:
        """Through a trusted proxy each forwarded client has a bucket; spoofing a hop to its left changes nothing."""
        async with limited_api(tmp_path, clock, trusted_proxies=PROXY, rate_limit_per_address=1.0, rate_burst_per_address=2) as api:
            for _ in range(2):
                assert (await send(api, "GET", "/openapi.json", forwarded_for="198.51.100.7"))[0] == 200
            assert_limited(*await send(api, "GET", "/openapi.json", forwarded_for="198.51.100.7"), retry=1,
                           what="requests from 198.51.100.7")  # fmt: skip
            spoofed = await send(api, "GET", "/openapi.json", forwarded_for="192.0.2.1, 198.51.100.7")
            assert_limited(*spoofed, retry=1, what="requests from 198.51.100.7")
            assert (await send(api, "GET", "/openapi.json", forwarded_for="198.51.100.8"))[0] == 200

    async def test_ipv6_clients_count_per_64(self, tmp_path: Path, clock: ManualClock) -> None:
        """Two addresses in one IPv6 /64 share a bucket (one host can rotate through its prefix)."""
        async with limited_api(tmp_path, clock, trusted_proxies=PROXY, rate_limit_per_address=1.0, rate_burst_per_address=2) as api:
            assert (await send(api, "GET", "/openapi.json", forwarded_for="2001:db8:1:2::1"))[0] == 200
            assert (await send(api, "GET", "/openapi.json", forwarded_for="2001:db8:1:2:ffff::9"))[0] == 200
            assert_limited(*await send(api, "GET", "/openapi.json", forwarded_for="2001:db8:1:2::77"), retry=1,
                           what="requests from 2001:db8:1:2::/64")  # fmt: skip
            assert (await send(api, "GET", "/openapi.json", forwarded_for="2001:db8:1:3::1"))[0] == 200

    async def test_an_untrusted_peers_forwarded_for_is_ignored(self, tmp_path: Path, clock: ManualClock) -> None:
        """With no trusted proxies, a client cannot get fresh buckets by making up X-Forwarded-For."""
        async with limited_api(tmp_path, clock, rate_limit_per_address=1.0, rate_burst_per_address=2) as api:
            assert (await send(api, "GET", "/openapi.json", forwarded_for="198.51.100.1"))[0] == 200
            assert (await send(api, "GET", "/openapi.json", forwarded_for="198.51.100.2"))[0] == 200
            assert_limited(*await send(api, "GET", "/openapi.json", forwarded_for="198.51.100.3"), retry=1,
                           what="requests from 127.0.0.1")  # fmt: skip

    async def test_guessed_keys_are_refused_before_they_are_looked_up(self, tmp_path: Path, clock: ManualClock) -> None:
        """Each made-up key has a fresh key bucket, but the address's bucket stops the guessing with 429, not 401."""
        async with limited_api(tmp_path, clock, rate_limit_per_address=0.5, rate_burst_per_address=3) as api:
            for _ in range(3):
                assert (await send(api, "GET", "/account", key=f"gmk_{secrets.token_hex(16)}"))[0] == 401
            assert_limited(*await send(api, "GET", "/account", key=f"gmk_{secrets.token_hex(16)}"), retry=2,
                           what="requests from 127.0.0.1")  # fmt: skip

    async def test_retry_after_is_when_the_bucket_has_a_token_again(self, tmp_path: Path, clock: ManualClock) -> None:
        """One token per 4 s: refused with Retry-After 4, still refused (Retry-After 1) a second early, then served."""
        async with limited_api(tmp_path, clock, rate_limit_per_address=0.25, rate_burst_per_address=1) as api:
            assert (await send(api, "GET", "/openapi.json"))[0] == 200
            assert_limited(*await send(api, "GET", "/openapi.json"), retry=4, what="requests from 127.0.0.1")
            clock.advance(3.0)
            assert_limited(*await send(api, "GET", "/openapi.json"), retry=1, what="requests from 127.0.0.1")
            clock.advance(1.0)
            assert (await send(api, "GET", "/openapi.json"))[0] == 200

    async def test_health_probes_are_never_limited(self, tmp_path: Path, clock: ManualClock) -> None:
        """With the address's bucket empty, /health and /health/live still answer 200, every time."""
        async with limited_api(tmp_path, clock, rate_limit_per_address=0.001, rate_burst_per_address=1) as api:
            assert (await send(api, "GET", "/openapi.json"))[0] == 200
            assert (await send(api, "GET", "/openapi.json"))[0] == 429
            for _ in range(5):
                assert (await send(api, "GET", "/health"))[0] == 200
                assert (await send(api, "GET", "/health/live"))[0] == 200


def enroll_body() -> dict[str, str]:
    return {"token": "not-a-real-token", "csr": "-----BEGIN CERTIFICATE REQUEST-----" + "A" * 64, "hostname": "h"}


class TestEnrollment:
    async def test_enroll_is_limited_per_address(self, tmp_path: Path, clock: ManualClock) -> None:
        """Past its burst of 2, an address waits 10 s (6 a minute) between enrollment attempts; others do not."""
        async with limited_api(tmp_path, clock, trusted_proxies=PROXY, enrollment_rate_per_minute=6, enrollment_burst=2) as api:
            for _ in range(2):
                status, body, _ = await send(api, "POST", "/enroll", forwarded_for="198.51.100.7", json=enroll_body())
                assert status in (400, 403, 422), body
            assert_limited(*await send(api, "POST", "/enroll", forwarded_for="198.51.100.7", json=enroll_body()), retry=10,
                           what="enrollment attempts from 198.51.100.7")  # fmt: skip
            assert (await send(api, "POST", "/enroll", forwarded_for="198.51.100.8", json=enroll_body()))[0] != 429
            clock.advance(10.0)
            assert (await send(api, "POST", "/enroll", forwarded_for="198.51.100.7", json=enroll_body()))[0] != 429

    async def test_token_checks_are_limited_per_address_in_a_bucket_of_their_own(self, tmp_path: Path, clock: ManualClock) -> None:
        """Token checks (POST /enroll/check, the installer's first question) have enrollment's limits in a bucket of
        their own: an address past their burst still enrolls, and another address still checks."""
        async with limited_api(tmp_path, clock, trusted_proxies=PROXY, enrollment_rate_per_minute=6, enrollment_burst=2) as api:
            check = {"token": "not-a-real-token"}
            for _ in range(2):
                status, body, _ = await send(api, "POST", "/enroll/check", forwarded_for="198.51.100.7", json=check)
                assert status == 403, body
            assert_limited(*await send(api, "POST", "/enroll/check", forwarded_for="198.51.100.7", json=check), retry=10,
                           what="enrollment token checks from 198.51.100.7")  # fmt: skip
            assert (await send(api, "POST", "/enroll", forwarded_for="198.51.100.7", json=enroll_body()))[0] != 429
            assert (await send(api, "POST", "/enroll/check", forwarded_for="198.51.100.8", json=check))[0] == 403
            clock.advance(10.0)
            assert (await send(api, "POST", "/enroll/check", forwarded_for="198.51.100.7", json=check))[0] == 403

    async def test_enrollment_tokens_are_limited_per_account_and_per_address(self, tmp_path: Path, clock: ManualClock) -> None:
        """A provider past its burst is refused from any address; another provider is not, until its address is spent."""
        async with limited_api(tmp_path, clock, trusted_proxies=PROXY, enrollment_rate_per_minute=6, enrollment_burst=2) as api:
            _, other_key = await create_principal(api.master, "provider-2", "provider")
            _, third_key = await create_principal(api.master, "provider-3", "provider")
            assert (await send(api, "POST", "/enrollment-tokens", key=api.provider_key, forwarded_for="198.51.100.1"))[0] == 201
            assert (await send(api, "POST", "/enrollment-tokens", key=api.provider_key, forwarded_for="198.51.100.2"))[0] == 201
            assert_limited(*await send(api, "POST", "/enrollment-tokens", key=api.provider_key, forwarded_for="198.51.100.3"),
                           retry=10, what="enrollment tokens created by this account")  # fmt: skip
            assert (await send(api, "POST", "/enrollment-tokens", key=other_key, forwarded_for="198.51.100.3"))[0] == 201
            assert_limited(*await send(api, "POST", "/enrollment-tokens", key=third_key, forwarded_for="198.51.100.3"),
                           retry=10, what="enrollment tokens created from 198.51.100.3")  # fmt: skip


class TestSignIn:
    async def test_sign_in_is_limited_per_address_and_a_failure_costs_three(self, tmp_path: Path, clock: ManualClock) -> None:
        """Burst 4: a wrong key takes 3, a right one 1, then the address waits; a failure from empty goes into debt."""
        settings = {"sign_in_rate_per_minute": 6, "sign_in_burst": 4, "sign_in_failure_cost": 3}
        async with limited_api(tmp_path, clock, **settings) as api:
            wrong, right = {"api_key": f"gmk_{secrets.token_hex(16)}"}, {"api_key": api.renter_key}
            status, body, _ = await send(api, "POST", "/sessions", json=wrong)
            assert (status, body["code"]) == (401, "invalid_api_key")
            assert (await send(api, "POST", "/sessions", json=right))[0] == 201
            assert_limited(*await send(api, "POST", "/sessions", json=right), retry=10, what="sign-in attempts from 127.0.0.1")
            clock.advance(10.0)
            assert (await send(api, "POST", "/sessions", json=wrong))[0] == 401  # 1 - 3 = -2 tokens
            assert_limited(*await send(api, "POST", "/sessions", json=right), retry=30, what="sign-in attempts from 127.0.0.1")
            clock.advance(30.0)
            assert (await send(api, "POST", "/sessions", json=right))[0] == 201

    async def test_password_guesses_at_one_address_are_limited_whatever_the_client_address(
        self, tmp_path: Path, clock: ManualClock
    ) -> None:
        """The email's bucket (burst 3) counts sign-ins and reset requests for that address from every client address
        (through a trusted proxy here); another address is not affected, and the bucket refills with time."""
        settings = {"account_email_burst": 3, "account_email_rate_per_hour": 60, "trusted_proxies": ["127.0.0.1/32"],
                    "sign_in_burst": 100}
        async with limited_api(tmp_path, clock, **settings) as api:
            guess = {"email": "victim@example.com", "password": "not the password"}
            for n in range(3):
                status, body, _ = await send(api, "POST", "/sessions", json=guess, forwarded_for=f"203.0.113.{n}")
                assert (status, body["code"]) == (401, "invalid_credentials")
            assert_limited(*await send(api, "POST", "/sessions", json=guess, forwarded_for="203.0.113.99"), retry=60,
                           what="sign-ins, password resets and verification mails for this address")  # fmt: skip
            assert_limited(*await send(api, "POST", "/password-resets", json={"email": "VICTIM@example.com"}), retry=60,
                           what="sign-ins, password resets and verification mails for this address")  # fmt: skip
            status, body, _ = await send(api, "POST", "/sessions", json={**guess, "email": "other@example.com"})
            assert (status, body["code"]) == (401, "invalid_credentials")
            clock.advance(60.0)
            status, body, _ = await send(api, "POST", "/sessions", json=guess)
            assert (status, body["code"]) == (401, "invalid_credentials")


# ---- several masters, one budget ----------------------------------------------------------


class TestSharedThroughRedis:
    async def test_two_masters_share_one_budget_per_address(
        self, tmp_path: Path, clock: ManualClock, redis_url: str, bus_prefix: str
    ) -> None:
        """A burst of 3 spent across two masters is spent on both; a token back is one token for both."""
        # A generous Redis timeout: on a loaded machine the default 0.25 s let a check fail open (served, not counted).
        shared = {"redis_url": redis_url, "bus_prefix": bus_prefix, "rate_limit_per_address": 1.0, "rate_burst_per_address": 3,
                  "rate_limit_timeout": 10.0}

        def failed_open() -> list[int]:  # a check past its Redis timeout serves uncounted: say so before the counts
            return [api.client.app[RATE_LIMITS].store.failed_open for api in (a, b)]

        async with limited_api(tmp_path / "a", clock, **shared) as a, limited_api(tmp_path / "b", clock, **shared) as b:
            assert [(await send(api, "GET", "/openapi.json"))[0] for api in (a, b, a)] == [200, 200, 200]
            assert failed_open() == [0, 0]
            assert [(await send(api, "GET", "/openapi.json"))[0] for api in (b, a)] == [429, 429]
            clock.advance(1.0)
            assert [(await send(api, "GET", "/openapi.json"))[0] for api in (b, a)] == [200, 429]
            client = aioredis.Redis.from_url(redis_url)
            try:
                keys = [k async for k in client.scan_iter(match=f"{bus_prefix}ratelimit:*")]
                assert keys == [f"{bus_prefix}ratelimit:address:127.0.0.1".encode()]
                # Gone EXPIRY_GRACE_S after the bucket is full again (3 s from now at most).
                assert 3000 < await client.pttl(keys[0]) <= 3000 + EXPIRY_GRACE_S * 1000
                await client.delete(*keys)
            finally:
                await client.aclose()
            for api in (a, b):
                limits = api.client.app[RATE_LIMITS]
                assert isinstance(limits.store, RedisRateStore) and limits.store.failed_open == 0

    async def test_with_redis_down_the_api_fails_open(
        self, tmp_path: Path, clock: ManualClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Redis unreachable: requests past the limit are served, counted as failed open, and a warning is logged."""
        async with limited_api(tmp_path, clock, redis_url=UNREACHABLE_REDIS, rate_limit_per_address=0.001, rate_burst_per_address=1) as api:
            with caplog.at_level(logging.WARNING, logger="shared.ratelimit"):
                statuses = [(await send(api, "GET", "/account", key=api.renter_key))[0] for _ in range(3)]
            store = api.client.app[RATE_LIMITS].store
        assert statuses == [200, 200, 200]
        assert isinstance(store, RedisRateStore) and store.failed_open == 6  # address and key, three times
        assert [r.levelname for r in caplog.records] == ["WARNING"]


# ---- settings and the documented contract -------------------------------------------------


class TestSettings:
    def test_limits_are_on_by_default_with_production_values(self, tmp_path: Path) -> None:
        """Without configuration (gpumarket up, a new deployment) the limits are on and no proxy is trusted."""
        settings = MasterSettings.load(data_dir=tmp_path)
        assert settings.rate_limits_enabled
        assert ApiLimits.from_settings(settings) == ApiLimits(
            per_address=Limit(50.0, 200), per_key=Limit(20.0, 100), enrollment=Limit.per_minute(10.0, 10),
            sign_in=Limit.per_minute(10.0, 10), sign_in_failure_cost=3, trusted_proxies=(),
            gateway_failures=Limit.per_minute(30.0, 20), per_email=Limit(20.0 / 3600, 10),
        )  # fmt: skip

    def test_a_trusted_proxy_must_be_an_address_or_a_network(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A typo in GPUMARKET_TRUSTED_PROXIES stops the start with a message naming it."""
        monkeypatch.setenv("GPUMARKET_TRUSTED_PROXIES", '["10.0.0.0/8", "10.0.0.0/33"]')
        with pytest.raises(ConfigError, match=r"GPUMARKET_TRUSTED_PROXIES.*'10\.0\.0\.0/33' is not an address or a CIDR"):
            MasterSettings.load()
        monkeypatch.setenv("GPUMARKET_TRUSTED_PROXIES", '["10.1.2.3/8", "::1"]')
        assert MasterSettings.load().trusted_proxies == ["10.0.0.0/8", "::1/128"]




class TestOpenApi:
    def test_every_limited_route_documents_429_with_retry_after(self) -> None:
        """Every route but the health probes lists 429 and its Retry-After header."""
        document = build_openapi(ROUTES)
        for route in ROUTES:
            responses = document["paths"][API + route.path][route.method.lower()]["responses"]
            if API + route.path in NEVER_LIMITED:
                assert "429" not in responses, route.path
            else:
                assert responses["429"]["headers"]["Retry-After"]["schema"] == {"type": "integer", "minimum": 1}, route.path


# ---- service endpoints (/svc/…) -----------------------------------------------------------


async def _svc(api: Api, service_id: str, token: str, *, forwarded_for: str | None = None) -> tuple[int, Any, CIMultiDictProxy[str]]:
    headers = {**bearer(token), **({"X-Forwarded-For": forwarded_for} if forwarded_for else {})}
    async with api.client.request("GET", f"/svc/{service_id}/v1/models", headers=headers) as response:
        return response.status, await response.json(), response.headers


async def _service_of(api: Api) -> tuple[str, str]:
    """A service of the renter's with no replica (its requests are answered 503 at once), and its token."""
    token = new_secret(elastic.TOKEN_PREFIX)
    service = Service(
        id="svc_limits", renter_id=api.renter.account_id, name="limits", state="active", workload={}, port=8000,
        min_replicas=0, max_replicas=1, desired_replicas=0, scaling={}, token_hash=secret_hash(token), token_prefix=token[:10],
    )  # fmt: skip
    async with api.master.db.session() as session:
        session.add(service)
    return service.id, token


class TestServiceEndpoints:
    async def test_refused_tokens_are_limited_per_address_and_accepted_ones_are_not(self, tmp_path: Path, clock: ManualClock) -> None:
        """Burst 3 at 6 a minute. Accepted tokens take nothing, however many; refused ones (401, or 404 for a key that is
        not the service's renter's) do: once the address is in debt its refused requests are 429 until the rate has
        paid the debt off, while its valid tokens go on being served. Another address is not held back."""
        settings = {"trusted_proxies": PROXY, "gateway_auth_failures_per_minute": 6, "gateway_auth_failure_burst": 3,
                    "service_cold_start_timeout_s": 0}  # fmt: skip
        async with limited_api(tmp_path, clock, **settings) as api:
            service_id, token = await _service_of(api)
            _, other_key = await create_principal(api.master, "renter-2", "renter")
            for _ in range(10):
                status, body, _ = await _svc(api, service_id, token, forwarded_for="198.51.100.7")
                assert (status, body["code"]) == (503, "no_ready_replica"), body  # accepted: on to the replicas
            refused = [(f"gms_{secrets.token_hex(16)}", 401), (f"gmk_{secrets.token_hex(16)}", 401), (other_key, 404),
                       (f"gms_{secrets.token_hex(16)}", 401)]  # fmt: skip
            for bad, expected in refused:  # 3, 2, 1, 0 tokens before each: each is still answered
                assert (await _svc(api, service_id, bad, forwarded_for="198.51.100.7"))[0] == expected
            what = "refused tokens at service endpoints from 198.51.100.7"
            assert_limited(*await _svc(api, service_id, f"gms_{secrets.token_hex(16)}", forwarded_for="198.51.100.7"),
                           retry=10, what=what)  # fmt: skip
            assert (await _svc(api, service_id, token, forwarded_for="198.51.100.7"))[0] == 503
            assert (await _svc(api, service_id, f"gms_{secrets.token_hex(16)}", forwarded_for="198.51.100.8"))[0] == 401
            clock.advance(10.0)
            assert (await _svc(api, service_id, f"gms_{secrets.token_hex(16)}", forwarded_for="198.51.100.7"))[0] == 401

    async def test_a_valid_token_is_served_from_an_address_past_the_burst(self, tmp_path: Path, clock: ManualClock) -> None:
        """Regression: after more than the burst of bad tokens from one address, its valid tokens got 429 (first all of
        them, then still an API key this master process had never seen valid). Now the service's token, the renter's
        key and a key made a moment ago, none seen before by this process, get through from that address."""
        settings = {"trusted_proxies": PROXY, "gateway_auth_failures_per_minute": 6, "gateway_auth_failure_burst": 20,
                    "service_cold_start_timeout_s": 0}  # fmt: skip
        async with limited_api(tmp_path, clock, **settings) as api:
            service_id, token = await _service_of(api)
            address = "198.51.100.9"
            for _ in range(25):
                await _svc(api, service_id, f"gmk_{secrets.token_hex(16)}", forwarded_for=address)
            what = f"refused tokens at service endpoints from {address}"
            assert_limited(*await _svc(api, service_id, f"gmk_{secrets.token_hex(16)}", forwarded_for=address),
                           retry=10, what=what)  # fmt: skip
            async with api.master.db.session() as session:
                new_key = await create_api_key(session, api.renter.account_id)
            for valid in (token, api.renter_key, new_key):
                status, body, _ = await _svc(api, service_id, valid, forwarded_for=address)
                assert (status, body["code"]) == (503, "no_ready_replica"), body  # served: on to the replicas

    async def test_a_repeated_bad_key_past_the_budget_is_not_read_each_time(self, tmp_path: Path, clock: ManualClock) -> None:
        """Once refused, a key is kept refused for the refused table's 30 s: sent again and again from an address in
        debt it is 429 with no database read; after 30 s it is read once more, and a key never seen is read once."""
        settings = {"trusted_proxies": PROXY, "gateway_auth_failures_per_minute": 6, "gateway_auth_failure_burst": 2,
                    "service_cold_start_timeout_s": 0}  # fmt: skip
        async with limited_api(tmp_path, clock, **settings) as api:
            service_id, _ = await _service_of(api)
            address, bad = "198.51.100.10", f"gmk_{secrets.token_hex(16)}"
            keys = gateway_of(api.master).keys
            for _ in range(3):  # 2, 1, 0 tokens before each: each is still answered
                assert (await _svc(api, service_id, bad, forwarded_for=address))[0] == 401
            assert keys.lookups == 1
            what = f"refused tokens at service endpoints from {address}"
            for _ in range(5):
                assert_limited(*await _svc(api, service_id, bad, forwarded_for=address), retry=10, what=what)
            clock.advance(6.0)  # past the valid keys' 5 s, within the refused keys' 30 s; the address still in debt
            for _ in range(5):
                assert_limited(*await _svc(api, service_id, bad, forwarded_for=address), retry=4, what=what)
            assert keys.lookups == 1
            clock.advance(31.0)  # past the refused table's 30 s; the address is back within its budget after 10 s
            assert (await _svc(api, service_id, bad, forwarded_for=address))[0] == 401
            assert (await _svc(api, service_id, f"gmk_{secrets.token_hex(16)}", forwarded_for=address))[0] == 401
            assert keys.lookups == 3

    async def test_with_limits_off_refused_tokens_are_only_refused(self, tmp_path: Path, clock: ManualClock) -> None:
        async with limited_api(tmp_path, clock, rate_limits_enabled=False, gateway_auth_failure_burst=1) as api:
            for _ in range(5):
                assert (await _svc(api, "svc_nothing", f"gms_{secrets.token_hex(16)}"))[0] == 401
