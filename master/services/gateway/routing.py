"""What the gateway knows of a service, read from the database and kept briefly: its route and who may call it.

The hot path queries nothing per request. ``RouteTable`` keeps each service's ``ServiceRoute`` — the
service's own columns the gateway needs and its running replicas with the relay each one's host is on
— for at most ``max_age`` seconds (1 s: a replica made ready, stopped or moved is seen within it);
requests for one service that find its route stale share one reload. Unknown service ids are kept
too (as ``None``), so a stream of requests for one costs one query per period. ``KeyCache`` keeps
valid API keys' owners for ``max_age`` seconds (5 s), by the key's hash: a revoked key stops opening
services within that time. Every other key is read from the database (one indexed read of the hash, what
any API request costs); a key the read refused is kept apart in a small negative table for
``refused_max_age`` seconds (30 s), so a flood repeating the same bad keys reads each once per period, and a
flood of distinct made-up keys never pushes valid keys out of theirs. Requests for one key that is not in
either table share one read. No key is ever held back without being read: a valid key always opens.

Every table is bounded (``max_entries``, ``refused_max_entries``): past it the oldest entries are forgotten.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from sqlalchemy import select

from master.context import Master
from master.models import Host, Rental, Service
from master.services.accounts import authenticate_key
from master.services.lifecycle.rentals import RentalState
from master.services.rentals import connect_url, current_relay_id, live_relays
from shared.errors import Unauthorized
from shared.registry import RelayRecord

ACTIVE = "active"
OPEN_STATES = (ACTIVE, "failing")  # endpoints.core.OPEN_STATES: the service's endpoint answers
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Replica:
    rental_id: str
    host_id: str
    ready: bool
    """The autoscaler's health probe passed (``rentals.ready_at``): it gets requests."""
    relay_url: str | None
    """``wss://<relay>/v1/connect`` of the relay the host is on now; ``None``: on none."""


@dataclass(frozen=True, slots=True)
class ServiceRoute:
    service_id: str
    renter_id: str
    token_hash: str
    active: bool
    port: int
    health_path: str
    wake_requested_at: datetime | None
    replicas: tuple[Replica, ...]
    """The service's running replicas, ready or not, in rental id order."""
    failure: str | None = None
    """``code: message`` of the replicas' start failures in a row (``endpoints/backoff.py``); None: none."""
    failing: bool = False
    """The service is ``failing``: not one of its last attempts started."""
    next_attempt_at: datetime | None = None
    """When the autoscaler may try another replica (None: now, or never while failing for a renter's cause)."""

    @property
    def ready(self) -> tuple[Replica, ...]:
        """The replicas that may take requests: ready, and their host on a live relay."""
        return tuple(r for r in self.replicas if r.ready and r.relay_url is not None)


class _Bounded(Generic[V]):
    """A map of ``max_entries`` at most, with the time each value was stored; the oldest goes first."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def get(self, key: str, *, now: float, max_age: float) -> tuple[V] | None:
        entry = self._entries.get(key)
        if entry is None or now - entry[0] > max_age:
            return None
        return (entry[1],)

    def put(self, key: str, value: V, *, now: float) -> None:
        self._entries.pop(key, None)
        self._entries[key] = (now, value)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, key: str) -> None:
        self._entries.pop(key, None)


async def load_route(master: Master, service_id: str, relays: dict[str, RelayRecord]) -> ServiceRoute | None:
    """The service's route from the database (one short read); ``None`` when there is no such service."""
    async with master.db.session() as session:
        service = await session.get(Service, service_id)
        if service is None:
            return None
        rows = (
            await session.execute(
                select(Rental.id, Rental.host_id, Rental.ready_at, Host.relay_id, Host.state)
                .join(Host, Host.id == Rental.host_id)
                .where(Rental.service_id == service_id, Rental.state == RentalState.RUNNING)
                .order_by(Rental.id)
            )
        ).all()
    replicas = []
    for rental_id, host_id, ready_at, relay_id, host_state in rows:
        live = current_relay_id(relay_id, host_state)
        record = relays.get(live) if live is not None else None
        replicas.append(Replica(rental_id, str(host_id), ready_at is not None, connect_url(record) if record is not None else None))
    return ServiceRoute(
        service_id=service.id, renter_id=service.renter_id, token_hash=service.token_hash, active=service.state in OPEN_STATES,
        port=service.port, health_path=service.health_path, wake_requested_at=service.wake_requested_at,
        replicas=tuple(replicas), failure=_cause(service), failing=service.state == "failing",
        next_attempt_at=service.next_attempt_at,
    )  # fmt: skip


def _cause(service: Service) -> str | None:
    """The streak's cause as ``endpoints.backoff.cause`` words it (the gateway may not import the endpoints package)."""
    if service.failure_code is None:
        return None
    message = service.failure_message or ""
    return message if message.startswith(service.failure_code) else f"{service.failure_code}: {message}".rstrip(": ")


class SingleFlight(Generic[V]):
    """One load per key at a time: requests that want the same key while it loads share that load. Cancelling a
    waiter is safe: the load another request waits on goes on; a load every waiter left has its outcome retrieved
    (nobody else would) and the next request loads again."""

    def __init__(self) -> None:
        self._loading: dict[str, asyncio.Future[V]] = {}

    async def run(self, key: str, load: Callable[[], Awaitable[V]]) -> V:
        loading = self._loading.get(key)
        if loading is None:
            loading = self._loading[key] = asyncio.ensure_future(load())
            loading.add_done_callback(lambda done: self._loaded(key, done))
        return await asyncio.shield(loading)

    def _loaded(self, key: str, done: asyncio.Future[V]) -> None:
        self._loading.pop(key, None)
        if not done.cancelled():
            done.exception()


class RouteTable:
    """Services' routes, each reloaded when older than the age its caller accepts (``get``)."""

    def __init__(self, master: Master, *, max_age: float = 1.0, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.master = master
        self.max_age = max_age
        self.clock = clock
        self.loads = 0
        """Routes read from the database so far (to see the cache work)."""
        self._routes: _Bounded[ServiceRoute | None] = _Bounded(max_entries)
        self._relays: _Bounded[dict[str, RelayRecord]] = _Bounded(1)
        self._loading: SingleFlight[ServiceRoute | None] = SingleFlight()

    async def get(self, service_id: str, *, max_age: float | None = None) -> ServiceRoute | None:
        """The service's route, no older than ``max_age`` (default: the table's). Cancelling is safe (a load
        another request waits on goes on)."""
        now = self.clock()
        cached = self._routes.get(service_id, now=now, max_age=self.max_age if max_age is None else max_age)
        if cached is not None:
            return cached[0]
        return await self._loading.run(service_id, lambda: self._load(service_id))

    def forget(self, service_id: str) -> None:
        """Drop a route (and the relays), so that the next request reads them again (after a failure)."""
        self._routes.forget(service_id)
        self._relays.forget("relays")

    async def _load(self, service_id: str) -> ServiceRoute | None:
        now = self.clock()
        relays = self._relays.get("relays", now=now, max_age=self.max_age)
        if relays is None:
            relays = (await live_relays(self.master),)
            self._relays.put("relays", relays[0], now=now)
        route = await load_route(self.master, service_id, relays[0])
        self.loads += 1
        self._routes.put(service_id, route, now=self.clock())
        return route


class KeyCache:
    """Which account an API key opens: valid keys kept ``max_age`` seconds, refused ones ``refused_max_age``, by the key's hash.

    A key created after it was refused (only if someone sent its secret before it existed: its 256 random bits
    make that a guess no one wins) would open within ``refused_max_age``; no key is ever un-revoked."""

    def __init__(self, master: Master, *, max_age: float = 5.0, max_entries: int = 10_000, refused_max_age: float = 30.0,
                 refused_max_entries: int = 4096, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.master = master
        self.max_age = max_age
        self.refused_max_age = refused_max_age
        self.clock = clock
        self.lookups = 0
        """Keys read from the database so far (to see the tables work)."""
        self._accounts: _Bounded[str] = _Bounded(max_entries)
        self._refused: _Bounded[None] = _Bounded(refused_max_entries)
        self._loading: SingleFlight[str | None] = SingleFlight()

    async def account_of(self, key_hash: str, key: str) -> str | None:
        """The account behind the API key ``key`` (whose ``secret_hash`` is ``key_hash``), or ``None``. Cancelling is
        safe (a read another request waits on goes on)."""
        now = self.clock()
        cached = self._accounts.get(key_hash, now=now, max_age=self.max_age)
        if cached is not None:
            return cached[0]
        if self._refused.get(key_hash, now=now, max_age=self.refused_max_age) is not None:
            return None
        return await self._loading.run(key_hash, lambda: self._load(key_hash, key))

    async def _load(self, key_hash: str, key: str) -> str | None:
        self.lookups += 1
        account = await _lookup(self.master, key)
        if account is None:
            self._accounts.forget(key_hash)
            self._refused.put(key_hash, None, now=self.clock())
        else:
            self._refused.forget(key_hash)
            self._accounts.put(key_hash, account, now=self.clock())
        return account


async def _lookup(master: Master, key: str) -> str | None:
    async with master.db.session() as session:
        try:
            principal, _ = await authenticate_key(session, key)
        except Unauthorized:
            return None
    return principal.account_id

