"""The REST API's rate limits: which buckets a request takes from, and the client address they count.

Each route of the table declares its class (``Route.limit``, a ``RateClass``). Every ``/api/v1``
request but the health probes' (``RateClass.NONE``) takes a token from:

* ``address``: its client address (IPv6: its /64), ``rate_limit_per_address`` /
  ``rate_burst_per_address``;
* ``key``: the API key or console session it carries (a hash of it; checked before the key
  is looked up, so a flood of made-up keys costs no database work), ``rate_limit_per_key`` /
  ``rate_burst_per_key``;
* ``ENROLL`` (``POST /enroll``), ``ENROLL_CHECK`` (``POST /enroll/check``) and ``ENROLLMENT_TOKENS``
  (``POST /enrollment-tokens``): the address's bucket of that route (``enrollment_rate_per_minute`` /
  ``enrollment_burst``), and for token creation also the account's (taken after authentication);
* ``SIGN_IN`` (``POST /sessions``, sign-up, verification and password resets): the address's ``sign-in``
  bucket; a sign-in that fails (unknown or revoked key, wrong password) takes ``sign_in_failure_cost`` tokens
  in all, so guessing there is slow. The handlers also take from the bucket of the email address they act on
  (``for_email``: ``account_email_rate_per_hour`` / ``account_email_burst``), whatever the client address.

A request under ``/api/v1`` that matches no route (404, 405) takes from the default buckets.

An empty bucket answers 429 ``rate_limited`` with ``Retry-After``. The client address is the
peer's, unless the peer is one of ``trusted_proxies``: then ``X-Forwarded-For`` is read from
the right, where each proxy appended the address it saw, and the first hop that is not a
trusted proxy is the client. Hops to its left were written by the client and are ignored.

Buckets live in a ``shared.ratelimit.RateStore``: Redis when the master has one (all masters
share one budget per key; fails open), else this process's memory.
"""

from __future__ import annotations

import collections
import hashlib
import ipaddress
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from aiohttp import web

from master.api.base import RateClass
from master.api.keys import MASTER
from master.context import Master
from master.services import accounts
from shared.errors import RateLimited
from shared.ratelimit import Limit, MemoryRateStore, RateStore, RedisRateStore, retry_after, source_key
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# The bucket each special class takes from besides the address's and the credential's.
_ROUTE_BUCKETS = {
    RateClass.ENROLL: "enroll", RateClass.ENROLL_CHECK: "enroll-check", RateClass.ENROLLMENT_TOKENS: "enrollment-tokens",
    RateClass.SIGN_IN: "sign-in",
}  # fmt: skip
_WHAT = {
    "address": "requests from {address}",
    "key": "requests with this API key or session",
    "enroll": "enrollment attempts from {address}",
    "enroll-check": "enrollment token checks from {address}",
    "enrollment-tokens": "enrollment tokens created from {address}",
    "account-enrollment-tokens": "enrollment tokens created by this account",
    "sign-in": "sign-in attempts from {address}",
    "email": "sign-ins, password resets and verification mails for this address",
    "svc-auth": "refused tokens at service endpoints from {address}",
}


@dataclass(frozen=True)
class ApiLimits:
    per_address: Limit
    per_key: Limit
    enrollment: Limit
    sign_in: Limit
    sign_in_failure_cost: int
    trusted_proxies: tuple[IPNetwork, ...]
    gateway_failures: Limit
    per_email: Limit

    @classmethod
    def from_settings(cls, settings: MasterSettings) -> ApiLimits:
        return cls(
            per_address=Limit(settings.rate_limit_per_address, settings.rate_burst_per_address),
            per_key=Limit(settings.rate_limit_per_key, settings.rate_burst_per_key),
            enrollment=Limit.per_minute(settings.enrollment_rate_per_minute, settings.enrollment_burst),
            sign_in=Limit.per_minute(settings.sign_in_rate_per_minute, settings.sign_in_burst),
            sign_in_failure_cost=settings.sign_in_failure_cost,
            trusted_proxies=tuple(ipaddress.ip_network(p, strict=False) for p in settings.trusted_proxies),
            gateway_failures=Limit.per_minute(settings.gateway_auth_failures_per_minute, settings.gateway_auth_failure_burst),
            per_email=Limit(settings.account_email_rate_per_hour / 3600.0, settings.account_email_burst),
        )


def _address(text: str | None) -> IPAddress | None:
    if not text:
        return None
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_address(peer: str | None, forwarded_for: Iterable[str], trusted: Iterable[IPNetwork]) -> str:
    """The address a request counts against: ``peer``, or through trusted proxies the client they saw.

    ``forwarded_for`` are the ``X-Forwarded-For`` header values in order. Read from the
    right while the current hop is trusted; a hop that is not an address stops the walk at
    the last trusted one (a proxy of ours never writes one).
    """
    networks = tuple(trusted)
    current = _address(peer)
    if current is None:
        return peer or "unknown"
    hops = [hop for value in forwarded_for for hop in value.split(",")]
    while hops and any(current in network for network in networks):
        hop = _address(hops.pop())
        if hop is None:
            break
        current = hop
    return str(current)


def credential_of(request: web.Request) -> str | None:
    """The API key or console session the request authenticates with, as the auth middleware picks it."""
    header = request.headers.get("Authorization")
    if header is not None:
        return header.partition(" ")[2].strip() or header
    return request.cookies.get(accounts.COOKIE) or None


class ApiRateLimits:
    """The buckets of the API's requests, in ``store``; ``rejected`` counts 429s by bucket."""

    def __init__(self, store: RateStore, limits: ApiLimits) -> None:
        self.store = store
        self.limits = limits
        self.rejected: collections.Counter[str] = collections.Counter()

    @classmethod
    def for_master(cls, master: Master) -> ApiRateLimits:
        """Redis when the master has it (every master shares the budget), else in memory."""
        settings = master.settings
        store: RateStore
        if settings.redis_url is None or settings.redis_url.startswith("memory://"):
            store = MemoryRateStore(clock=master.clock.monotonic)
        else:
            # Every master must read the same clock: the wall clock (NTP keeps them within milliseconds).
            store = RedisRateStore.from_url(
                settings.redis_url, prefix=settings.bus_prefix, clock=lambda: master.clock.now().timestamp(),
                timeout=settings.rate_limit_timeout,
            )  # fmt: skip
        return cls(store, ApiLimits.from_settings(settings))


    def address_of(self, request: web.Request) -> str:
        forwarded = request.headers.getall("X-Forwarded-For", [])
        return source_key(client_address(request.remote, forwarded, self.limits.trusted_proxies))

    async def before_auth(self, request: web.Request, address: str, rate_class: RateClass) -> None:
        """Take from the address's, the credential's and the route's buckets; raise ``RateLimited`` on the first empty one."""
        await self._take("address", address, self.limits.per_address, address=address)
        credential = credential_of(request)
        if credential is not None:
            digest = hashlib.sha256(credential.encode()).hexdigest()[:32]  # never the secret itself in Redis
            await self._take("key", digest, self.limits.per_key, address=address)
        bucket = _ROUTE_BUCKETS.get(rate_class)
        if bucket is not None:
            limit = self.limits.sign_in if rate_class is RateClass.SIGN_IN else self.limits.enrollment
            await self._take(bucket, address, limit, address=address)

    async def after_auth(self, account_id: str, rate_class: RateClass) -> None:
        """Take from the account's buckets (enrollment tokens)."""
        if rate_class is RateClass.ENROLLMENT_TOKENS:
            await self._take("account-enrollment-tokens", account_id, self.limits.enrollment, address="")

    async def sign_in_failed(self, address: str, rate_class: RateClass) -> None:
        """A failed sign-in pays the rest of ``sign_in_failure_cost``."""
        if rate_class is RateClass.SIGN_IN and self.limits.sign_in_failure_cost > 1:
            await self.store.charge(f"sign-in:{address}", self.limits.sign_in, cost=self.limits.sign_in_failure_cost - 1)

    async def for_email(self, email: str) -> None:
        """Take from the bucket of an email address (sign-in, password reset, verification mail): guessing one
        account's password, or flooding one inbox, is slow from however many client addresses."""
        digest = hashlib.sha256(email.strip().lower().encode()).hexdigest()[:32]  # no address in Redis
        await self._take("email", digest, self.limits.per_email, address="")

    async def gateway_refused(self, address: str) -> None:
        """A token a service's endpoint (``/svc/…``) judged and refused (401, or 404 for another renter's service):
        ``RateLimited`` (the answer becomes 429) when the address is in debt already, else one from its budget (the
        answer stays). Called only after the token was judged: a valid token's traffic is never limited."""
        await self._take("svc-auth", address, self.limits.gateway_failures, address=address, cost=0.0)
        await self.store.charge(f"svc-auth:{address}", self.limits.gateway_failures, cost=1.0)

    async def _take(self, bucket: str, key: str, limit: Limit, *, address: str, cost: float = 1.0) -> None:
        """Take ``cost`` tokens (0: only check that the bucket is not in debt); ``RateLimited`` when it cannot."""
        wait = await self.store.take(f"{bucket}:{key}", limit, cost=cost)
        if wait > 0:
            self.rejected[bucket] += 1
            seconds = retry_after(wait)
            what = _WHAT[bucket].format(address=address)
            log.debug("429 for %s (%s bucket %s): retry in %d s", what, bucket, key, seconds)
            raise RateLimited(f"too many {what}; retry in {seconds} s", retry_after=seconds)


RATE_LIMITS = web.AppKey("rate_limits", ApiRateLimits)
"""Set on the app, while it runs, when ``rate_limits_enabled``."""


async def rate_limits_ctx(app: web.Application) -> AsyncIterator[None]:
    """The API's rate limiter, when ``rate_limits_enabled``: opened with the app, its store closed with it."""
    master = app[MASTER]
    if not master.settings.rate_limits_enabled:
        yield
        return
    limits = app[RATE_LIMITS] = ApiRateLimits.for_master(master)
    try:
        yield
    finally:
        await limits.store.close()


def request_address(request: web.Request) -> str:
    """The client's address as the rate limits see it (through ``trusted_proxies``), for the audit log."""
    limits = request.app.get(RATE_LIMITS)  # its networks are parsed once; without limits, parse the setting here
    trusted = limits.limits.trusted_proxies if limits is not None else tuple(
        ipaddress.ip_network(p, strict=False) for p in request.app[MASTER].settings.trusted_proxies
    )
    return client_address(request.remote, request.headers.getall("X-Forwarded-For", []), trusted)[:64]


async def limit_email(request: web.Request, email: str) -> None:
    """Take from the email address's bucket, when rate limits are on."""
    limits = request.app.get(RATE_LIMITS)
    if limits is not None:
        await limits.for_email(email)
