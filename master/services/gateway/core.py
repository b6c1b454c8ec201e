"""The gateway of one master process: services' routes, who may call them, replicas' pools, the balancer.

Policy, in the order a request meets it:

* **Who.** ``Authorization: Bearer <token>`` with the service's own token (its hash compared with
  ``services.token_hash``; no query) or an API key of the service's renter (looked up once per
  ``KeyCache.max_age``). No token: 401 ``missing_token``; a token that is neither: 401
  ``invalid_token``, whether the service exists or not; another account's key (an admin's included),
  an unknown or deleted service: 404 ``service_not_found``. Tokens travel only in that header, never in
  the URL or a cookie, so a browser never opens a service's page on the master's origin by itself.
  The service's token is judged by the route alone; an API key by the key cache, which reads a key it
  does not know from the database whoever sends it (one indexed read; a refused key is then kept
  ``refused_key_max_age`` seconds, so repeating it reads nothing): a valid token always opens.
* **Where.** Among the service's replicas that run, are ready (``rentals.ready_at``) and whose host is
  on a live relay: the one with the fewest requests in flight from this process, ties taken in turn.
  A replica whose relay stream failed (no stream, refused, reset) sits out ``eject_s`` seconds unless
  every ready replica does, or until its health probe passes (``probe``).
* **None ready.** The service is woken (``services.wake_requested_at`` set, if unset; the autoscaler
  starts a replica and clears it) and the request waits, its route read again every ``wake_poll_s``,
  up to ``service_cold_start_timeout_s``; then 503 ``no_ready_replica`` with ``Retry-After``.
* **None ready, and replicas fail to start.** A service whose last replicas failed to start
  (``master/services/endpoints/backoff.py``: ``failing``, or waiting before its next attempt) is not
  held for: 503 ``service_failing`` at once, the message led by the cause (``image_pull_failed: …``),
  ``details`` with its code, and ``Retry-After`` until the next attempt when one is planned. A request
  already waiting gets the same answer as soon as its route shows a failure.

Forwarding itself (bodies, retries, streaming, websockets) is ``master/services/gateway/proxy.py``.

The ``Gateway`` is built on first use (``gateway_of``) and kept on the ``Master``; the stats loop
(``master/background/gateway.py``) calls ``tick`` every second, and the app closes it at shutdown
(``close``: the last bucket of figures written, every pool closed).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import ssl
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from master.context import AUTOSCALER_LEASE, Master
from master.models import Service, ServiceStat
from master.services.gateway.routing import OPEN_STATES, KeyCache, Replica, RouteTable, ServiceRoute
from master.services.gateway.stats import Bucket, GatewayStats
from master.services.gateway.upstream import ReplicaPool, Target
from master.services.rentals import connect_token
from shared.crypto.tokens import SERVICE_KIND
from shared.errors import GpumarketError, NotFound, Unauthorized
from shared.ids import secret_hash

log = logging.getLogger(__name__)

SERVICE_TOKEN_PREFIX = "gms_"  # shared.ids.new_secret("gms"): never an API key, so never looked up as one
NO_READY_RETRY_AFTER_S = 30
MAX_PENDING_ROWS = 10_000


class NoReadyReplica(GpumarketError):
    code = "no_ready_replica"
    http_status = 503

    def __init__(self, message: str, *, retry_after: int = NO_READY_RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ServiceFailing(GpumarketError):
    """No ready replica, and the service's last replicas failed to start: answered at once, with the cause."""

    code = "service_failing"
    http_status = 503

    def __init__(self, route: ServiceRoute, *, now: datetime) -> None:
        cause = route.failure or "unknown"
        retry_after: int | None = None
        if route.next_attempt_at is not None:
            retry_after = max(1, math.ceil((route.next_attempt_at - now).total_seconds()))
        if route.failing and route.next_attempt_at is None:
            then = "it is not retried: fix the cause, then run `gpumarket service resume " + route.service_id + "`"
        else:
            then = (f"the next replica starts in {retry_after} s; " if retry_after else "another replica is starting; ") + \
                f"`gpumarket service show {route.service_id}` says why"
        state = "is failing" if route.failing else "has no ready replica"
        super().__init__(f"{cause} (service {route.service_id} {state}: its replicas failed to start; {then})",
                         details={"service_id": route.service_id, "failure_code": cause.split(":", 1)[0],
                                  "failing": route.failing})  # fmt: skip
        self.retry_after = retry_after


def service_not_found(service_id: str) -> NotFound:
    return NotFound(f"no service {service_id!r} in your account; check the URL and the token", code="service_not_found")


class Gateway:
    """One master process's gateway state. Every limit and period is a keyword argument."""

    def __init__(
        self,
        master: Master,
        *,
        # Timeouts and periods
        route_max_age: float = 1.0,
        key_max_age: float = 5.0,
        refused_key_max_age: float = 30.0,
        eject_s: float = 5.0,
        wake_poll_s: float = 0.25,
        keepalive_s: float = 4.0,
        pool_idle_s: float = 60.0,
        open_timeout: float = 10.0,
        # Sizes
        refused_key_max_entries: int = 4096,
    ) -> None:
        self.master = master
        self.settings = master.settings
        self.clock = master.clock.monotonic
        self.eject_s = eject_s
        self.wake_poll_s = wake_poll_s
        self.keepalive_s = keepalive_s
        self.pool_idle_s = pool_idle_s
        self.open_timeout = open_timeout
        self.stats = GatewayStats()
        self.routes = RouteTable(master, max_age=route_max_age, clock=self.clock)
        self.keys = KeyCache(master, max_age=key_max_age, refused_max_age=refused_key_max_age,
                             refused_max_entries=refused_key_max_entries, clock=self.clock)  # fmt: skip
        self.pools: dict[str, ReplicaPool] = {}
        self.closed = False
        self._turns: dict[str, list[int]] = {}
        self._woken: dict[str, float] = {}
        self._ssl: ssl.SSLContext | None = None
        self._bucket_start: datetime | None = None
        self._pending: list[dict[str, Any]] = []

    # ---- who -------------------------------------------------------------------------------------

    async def authorize(self, service_id: str, token: str) -> ServiceRoute:
        """The service's route if ``token`` opens it; else ``Unauthorized`` or ``NotFound`` (see the module's policy).

        The service's own token is judged by its route alone (read once per ``route_max_age`` for every caller
        of the service); an API key by ``KeyCache`` (read when it knows neither that the key is valid nor that
        it was refused lately). Nothing here refuses a token without judging it: a valid one always opens."""
        route = await self.routes.get(service_id)
        token_hash = secret_hash(token)
        if route is not None and route.active and hmac.compare_digest(token_hash, route.token_hash):
            return route
        account = None if token.startswith(SERVICE_TOKEN_PREFIX) else await self.keys.account_of(token_hash, token)
        if account is None:
            raise Unauthorized("the bearer token is neither a service token nor a valid API key; use the service's "
                               "token or your API key", code="invalid_token")  # fmt: skip
        if route is None or not route.active or route.renter_id != account:
            raise service_not_found(service_id)
        return route

    # ---- where -----------------------------------------------------------------------------------

    def pool(self, route: ServiceRoute, replica: Replica) -> ReplicaPool:
        """The replica's pool, made on first use; its target follows the route (the host may move relays)."""
        target = Target(replica.rental_id, replica.host_id, route.renter_id, route.port, replica.relay_url)
        pool = self.pools.get(replica.rental_id)
        if pool is None:
            pool = self.pools[replica.rental_id] = ReplicaPool(
                target, sign=self._sign, ssl_context=self._relay_ssl(), clock=self.clock,
                limit=self.settings.gateway_connections_per_replica, keepalive_timeout=self.keepalive_s,
                open_timeout=self.open_timeout,
            )  # fmt: skip
        elif pool.target != target:
            pool.target = target
        pool.last_used = self.clock()
        return pool

    def ejected(self, pool: ReplicaPool) -> bool:
        return pool.failed_at is not None and self.clock() - pool.failed_at < self.eject_s

    def pick(self, route: ServiceRoute, tried: set[str]) -> tuple[Replica, ReplicaPool] | None:
        """The replica for the next attempt of a request that already tried ``tried`` (rental ids); ``None``: none left.

        Healthy replicas not tried yet first, then healthy ones again (a stale kept-alive connection is
        worth a fresh one), then ejected ones not tried yet: each group by fewest in flight, ties in turn.
        """
        ready = route.ready
        if not ready:
            return None
        pools = [(replica, self.pool(route, replica)) for replica in ready]
        healthy = [(r, p) for r, p in pools if not self.ejected(p)]
        for group in (
            [(r, p) for r, p in healthy if r.rental_id not in tried],
            healthy,
            [(r, p) for r, p in pools if r.rental_id not in tried],
        ):
            if group:
                return self._least_busy(route.service_id, group, first=not tried)
        return None

    def _least_busy(self, service_id: str, group: list[tuple[Replica, ReplicaPool]], *, first: bool) -> tuple[Replica, ReplicaPool]:
        """The least busy of ``group``; of equals, the next in turn (the turn moves on with each request, not each retry)."""
        turns = self._turns.setdefault(service_id, [0])
        start = turns[0] % len(group)
        if first:
            turns[0] += 1
        rotated = group[start:] + group[:start]
        return min(rotated, key=lambda pair: pair[1].inflight)  # min keeps the first of equals: the turn's

    def _sign(self, target: Target) -> str:
        token, _ = connect_token(self.master, account_id=target.renter_id, rental_id=target.rental_id,
                                 host_id=target.host_id, kind=SERVICE_KIND, port=target.port, now=self.master.clock.now())  # fmt: skip
        return token

    def _relay_ssl(self) -> ssl.SSLContext:
        """Relays are trusted through the platform CA alone (their certificates are the CA's), names checked."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cadata=self.master.ca.cert_pem.decode())
            self._ssl.minimum_version = ssl.TLSVersion.TLSv1_2
        return self._ssl

    # ---- none ready: wake and wait ---------------------------------------------------------------

    async def ready_route(self, route: ServiceRoute) -> ServiceRoute:
        """``route`` if it has a ready replica; else wake the service and wait for one (``NoReadyReplica`` after
        ``service_cold_start_timeout_s``). Cancelling is safe (the wake stays requested)."""
        if route.ready:
            return route
        if route.failure is not None:
            raise ServiceFailing(route, now=self.master.clock.now())
        deadline = self.clock() + self.settings.service_cold_start_timeout_s
        while True:
            await self.wake(route)
            if self.clock() + self.wake_poll_s > deadline:
                raise NoReadyReplica(
                    f"service {route.service_id} has no ready replica (none started within "
                    f"{self.settings.service_cold_start_timeout_s:g} s); retry later, or keep min_replicas above 0",
                )
            await asyncio.sleep(self.wake_poll_s)
            fresh = await self.routes.get(route.service_id, max_age=self.wake_poll_s)
            if fresh is None or not fresh.active:
                raise service_not_found(route.service_id)
            if fresh.ready:
                return fresh
            if fresh.failure is not None:
                raise ServiceFailing(fresh, now=self.master.clock.now())
            route = fresh

    async def wake(self, route: ServiceRoute) -> None:
        """Ask the autoscaler for a replica: ``wake_requested_at`` set where it is unset, and this process's autoscaler
        nudged (``Master.nudge``) so that it starts one, then health-checks it, without waiting for its next pass — once
        a second at most while requests wait."""
        now = self.clock()
        if now - self._woken.get(route.service_id, -1e9) < 1.0:
            return
        self._woken[route.service_id] = now
        if route.wake_requested_at is None:
            async with self.master.db.session() as session:
                await session.execute(
                    update(Service)
                    .where(Service.id == route.service_id, Service.state.in_(OPEN_STATES), Service.wake_requested_at.is_(None))
                    .values(wake_requested_at=self.master.clock.now())
                )
            log.info("service %s: no ready replica; woken", route.service_id)
        self.master.nudge(AUTOSCALER_LEASE)

    # ---- every second: figures and idle pools ----------------------------------------------------

    def bucket_start(self, now: datetime) -> datetime:
        """The start (UTC) of the ``service_stats_bucket_s`` bucket ``now`` falls in."""
        size = self.settings.service_stats_bucket_s
        seconds = now.timestamp() // size * size
        return datetime.fromtimestamp(seconds, UTC)

    async def tick(self) -> None:
        """Sample the in-flight gauges; at a bucket's end write its rows; close pools idle ``pool_idle_s``.

        Cancelling is safe: an unwritten bucket's rows stay pending for the next tick."""
        now = self.master.clock.now()
        self.stats.sample()
        start = self.bucket_start(now)
        if self._bucket_start is None:
            self._bucket_start = start
        elif start > self._bucket_start:
            self.close_bucket(self._bucket_start)
            self._bucket_start = start
        await self.flush()
        await self._close_idle_pools()

    def close_bucket(self, bucket_at: datetime) -> None:
        """End the figures' bucket that began at ``bucket_at``: its rows wait for ``flush``."""
        node = self.master.instance_id[:64]
        buckets: dict[str, Bucket] = self.stats.take_buckets()
        for service_id, bucket in buckets.items():
            self._pending.append({
                "service_id": service_id, "bucket_at": bucket_at, "node": node,
                "requests": bucket.requests, "errors": bucket.errors, "retries": bucket.retries,
                "inflight_sum": bucket.inflight_sum, "inflight_samples": bucket.inflight_samples,
                "inflight_peak": bucket.inflight_peak, "latency_hist": bucket.latency_hist,
            })  # fmt: skip
        if len(self._pending) > MAX_PENDING_ROWS:
            dropped = len(self._pending) - MAX_PENDING_ROWS
            del self._pending[:dropped]
            log.warning("service stats: %d rows dropped (the database has not taken them for a while)", dropped)

    async def flush(self) -> int:
        """Write the pending ``service_stats`` rows (a row already written for its bucket and node is kept as it is).
        Returns how many were written; on a database error they stay pending (logged)."""
        if not self._pending:
            return 0
        rows, self._pending = self._pending, []
        try:
            async with self.master.db.session() as session:
                insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
                await session.execute(
                    insert(ServiceStat).values(rows).on_conflict_do_nothing(index_elements=["service_id", "bucket_at", "node"])
                )
        except Exception as exc:
            self._pending[:0] = rows
            log.warning("service stats: cannot write %d rows (%s); retrying next second", len(rows), exc)
            return 0
        return len(rows)

    async def _close_idle_pools(self) -> None:
        now = self.clock()
        idle = [rental_id for rental_id, pool in self.pools.items()
                if pool.inflight == 0 and pool.connections == 0 and now - pool.last_used > self.pool_idle_s]  # fmt: skip
        for rental_id in idle:
            await self.pools.pop(rental_id).close()

    async def close(self) -> None:
        """Write the figures of the bucket under way, then close every pool (open requests' streams end)."""
        self.closed = True
        if self._bucket_start is not None:
            self.close_bucket(self._bucket_start)
            self._bucket_start = None
        try:
            await self.flush()
        finally:
            pools, self.pools = list(self.pools.values()), {}
            await asyncio.gather(*(pool.close() for pool in pools), return_exceptions=True)


def gateway_of(master: Master) -> Gateway:
    """The master's gateway, built on first use."""
    gateway = master.gateway
    if gateway is None:
        gateway = master.gateway = Gateway(master)
    assert isinstance(gateway, Gateway)
    return gateway


async def close_gateway(master: Master) -> None:
    """Close the master's gateway if it was built (the app's cleanup)."""
    gateway, master.gateway = master.gateway, None
    if isinstance(gateway, Gateway):
        await gateway.close()


