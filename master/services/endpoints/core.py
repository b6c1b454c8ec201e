"""Elastic services as a renter sees them: creating one (idempotently), reading, listing, scaling its bounds, deleting.

A service is replicas of one container workload behind one endpoint (``/svc/<id>/`` on the
master's origin, ``master/services/gateway/``). Each replica is a rental (``rentals.service_id``),
placed, started, billed and stopped as any rental is; the autoscaler (``autoscale.py``) keeps their
number at ``desired_replicas``, between ``min_replicas`` and ``max_replicas``. The service token
(``gms_…``) is shown once, when the service is made or its token replaced; only its hash is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import AUTOSCALER_LEASE, Master
from master.models import Rental, Service, ServiceEvent
from master.scheduler.price import tolerance_text
from master.services import idempotency, rentals
from master.services.accounts import Principal
from master.services.endpoints import backoff
from master.services.endpoints.request import ServiceRequest
from master.services.lifecycle.rentals import UNSTOPPED_STATES, RentalState
from master.services.market import money
from master.services.rentals import workload_of
from master.services.volumes import asks_of
from shared.errors import BadRequest, ClientError, Conflict, NotFound
from shared.ids import new_id, new_secret, secret_hash

log = logging.getLogger(__name__)

TOKEN_PREFIX = "gms"
ACTIVE, DELETED = "active", "deleted"
OPEN_STATES = (ACTIVE, backoff.FAILING)  # not deleted: its endpoint answers, its bounds and token may change
ENDPOINT_PATH = "/svc/{id}/"


def endpoint_path(service_id: str) -> str:
    return ENDPOINT_PATH.format(id=service_id)


async def create_service(master: Master, renter: Principal, request: ServiceRequest, *,
                         idempotency_key: str | None) -> tuple[Service, str | None]:  # fmt: skip
    """Make a service and start its first ``min_replicas`` replicas; returns ``(service, token)``.

    ``token`` is None for a repeat of an ``Idempotency-Key`` (the first answer showed it). A first
    replica the fleet can never hold (409 ``exceeds_fleet``) or the renter cannot pay for (402)
    undoes the service; one that waits for GPUs stays queued.
    """
    if request.template is not None and not request.workload:
        async with master.db.session() as session:
            request = replace(request, workload=await workload_of(session, request.template))
    settings = master.settings
    request = request.check(replica_limit=settings.max_service_replicas, max_queue_timeout_s=settings.max_queue_timeout_s)
    now = master.clock.now()

    async def insert() -> tuple[Service, str]:
        token = new_secret(TOKEN_PREFIX)
        service = Service(
            id=new_id("svc"), renter_id=renter.account_id, name=request.name, state=ACTIVE, workload=request.workload,
            template=request.template, port=request.port, health_path=request.health_path, gpu_count=request.gpu_count,
            gpu_model=request.gpu_model, query=request.query, kind=request.kind, bid_per_gpu_hour=request.bid,
            min_replicas=request.min_replicas, max_replicas=request.max_replicas, desired_replicas=request.min_replicas,
            scaling=request.scaling, token_hash=secret_hash(token), token_prefix=token[:10], idempotency_key=idempotency_key,
            request_fingerprint=request.fingerprint(), created_at=now,
            volumes=[ask.to_json() for ask in request.volumes] or None, price_tolerance=request.price_tolerance,
        )  # fmt: skip
        async with master.db.session() as session:
            session.add(service)
            session.add(ServiceEvent(service_id=service.id, at=now, kind="created", replicas=request.min_replicas,
                                     cause=f"created with {request.min_replicas} to {request.max_replicas} replicas"))  # fmt: skip
        return service, token

    service, token = await idempotency.create_once(
        master, Service, renter.account_id, idempotency_key, request.fingerprint(), what="service", create=insert
    )
    if token is None:
        return service, None
    try:
        await add_replicas(master, service, request.min_replicas)
    except ClientError:
        async with master.db.session() as session:
            await session.execute(update(Service).where(Service.id == service.id).values(state=DELETED, deleted_at=now))
        raise
    log.info("service %s (%s) created for %s", service.id, service.name, renter.account_id)
    return service, token


def request_of(service: Service) -> ServiceRequest:
    """What a replica of ``service`` is placed with (its workload as copied when the service was made)."""
    return ServiceRequest(
        name=service.name, port=service.port, min_replicas=service.min_replicas, max_replicas=service.max_replicas,
        scaling=service.scaling, workload=service.workload, template=service.template, health_path=service.health_path,
        gpu_count=service.gpu_count, gpu_model=service.gpu_model, query=service.query, kind=service.kind,
        bid=service.bid_per_gpu_hour, volumes=asks_of({"volumes": service.volumes}), price_tolerance=service.price_tolerance,
    )  # fmt: skip


def _tolerance(value: Decimal | None) -> str | None:
    """A kept price tolerance as the API writes it ("0.05"); None: the platform's rule."""
    return None if value is None else tolerance_text(value)


def owner_of(service: Service) -> Principal:
    """Who replicas are rented and stopped as: the service's renter, named for its events."""
    return Principal(account_id=service.renter_id, name=f"the autoscaler of service {service.name}", role="renter")


async def add_replicas(master: Master, service: Service, count: int) -> list[Rental]:
    """Rent ``count`` more replicas (each placed now, or queued for ``service_replica_queue_s``)."""
    made = []
    wanted = request_of(service).replica_request(service.id, queue_timeout_s=master.settings.service_replica_queue_s)
    for _ in range(count):
        rental, _created = await rentals.create_rental(master, owner_of(service), wanted, idempotency_key=None)
        made.append(rental)
    return made


# ---- reading ----------------------------------------------------------------------------------


async def get_service(session: AsyncSession, principal: Principal, service_id: str, *, for_update: bool = False) -> Service:
    service = await session.get(Service, service_id, with_for_update=for_update)
    if service is None or (principal.role != "admin" and service.renter_id != principal.account_id):
        raise NotFound(f"no service {service_id!r} in your account", code="service_not_found")
    return service


async def replicas_of(session: AsyncSession, service_ids: Sequence[str], *, live_only: bool = False) -> dict[str, list[Rental]]:
    """Each service's replicas, oldest first (``live_only``: those not ended)."""
    query = select(Rental).where(Rental.service_id.in_(list(service_ids)))
    if live_only:
        query = query.where(Rental.state.in_([s.value for s in UNSTOPPED_STATES]))
    found: dict[str, list[Rental]] = {sid: [] for sid in service_ids}
    for row in (await session.scalars(query.order_by(Rental.created_at, Rental.id))).all():
        assert row.service_id is not None
        found[row.service_id].append(row)
    return found


async def replica_ids(session: AsyncSession, service_ids: Sequence[str]) -> dict[str, list[str]]:
    """Every replica rental each service ever had (ended ones too: what it cost counts them)."""
    found: dict[str, list[str]] = {sid: [] for sid in service_ids}
    rows = await session.execute(select(Rental.service_id, Rental.id).where(Rental.service_id.in_(list(service_ids))))
    for service_id, rental_id in rows:
        found[str(service_id)].append(rental_id)
    return found


async def list_services(session: AsyncSession, principal: Principal, *, limit: int, offset: int,
                        include_deleted: bool = False) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """A page of services (the caller's; an admin's: all), newest first, with their live replicas."""
    query = select(Service)
    if principal.role != "admin":
        query = query.where(Service.renter_id == principal.account_id)
    if not include_deleted:
        query = query.where(Service.state.in_(OPEN_STATES))
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = (await session.scalars(query.order_by(Service.created_at.desc(), Service.id).limit(limit).offset(offset))).all()
    replicas = await replicas_of(session, [s.id for s in rows], live_only=True)
    return [service_view(s, replicas[s.id]) for s in rows], total


async def service_detail(session: AsyncSession, principal: Principal, service_id: str, *, events: int = 50,
                         failed: bool = False) -> dict[str, Any]:  # fmt: skip
    """One service with its replicas (``failed``: the failed ones listed too, not only counted) and latest events."""
    service = await get_service(session, principal, service_id)
    recent = (await session.scalars(
        select(ServiceEvent).where(ServiceEvent.service_id == service.id).order_by(ServiceEvent.id.desc()).limit(events)
    )).all()  # fmt: skip
    replicas = (await replicas_of(session, [service.id]))[service.id]
    return service_view(service, replicas, list(reversed(recent)), failed=failed)


def replica_view(rental: Rental) -> dict[str, Any]:
    return {
        "rental_id": rental.id, "state": rental.state, "host_id": rental.host_id, "gpu_model": rental.gpu_model,
        "kind": rental.kind, "ready": rental.state == RentalState.RUNNING and rental.ready_at is not None,
        "created_at": _iso(rental.created_at), "ready_at": _iso(rental.ready_at), "stopped_at": _iso(rental.stopped_at),
        "price_per_gpu_hour": money(rental.price_per_gpu_hour) if rental.price_per_gpu_hour is not None else None,
        "failure_code": rental.failure_code, "failure_reason": rental.failure_reason,
    }  # fmt: skip


def service_view(service: Service, replicas: Sequence[Rental], events: Sequence[ServiceEvent] | None = None, *,
                 failed: bool = False) -> dict[str, Any]:  # fmt: skip
    """The service as the API shows it; with ``events``, its replica rentals too: failed ones folded into
    ``replicas.failed`` unless ``failed`` (a service whose replicas cannot start would list them by the dozen)."""
    live = [r for r in replicas if r.state in UNSTOPPED_STATES]
    view: dict[str, Any] = {
        "id": service.id, "name": service.name, "state": service.state, "endpoint_path": endpoint_path(service.id),
        "port": service.port, "health_path": service.health_path, "template": service.template,
        "image": service.workload.get("image"), "workload": service.workload, "gpu_count": service.gpu_count,
        "gpu_model": service.gpu_model, "requirements": service.query or None, "kind": service.kind,
        "bid_per_gpu_hour": money(service.bid_per_gpu_hour) if service.bid_per_gpu_hour is not None else None,
        "price_tolerance": _tolerance(service.price_tolerance),
        "min_replicas": service.min_replicas, "max_replicas": service.max_replicas,
        "desired_replicas": service.desired_replicas, "scaling": service.scaling, "volumes": service.volumes or [],
        "replicas": {"live": len(live), "ready": sum(1 for r in live if r.state == RentalState.RUNNING and r.ready_at is not None),
                     "starting": sum(1 for r in live if r.state == RentalState.STARTING or (r.state == RentalState.RUNNING and r.ready_at is None)),
                     "queued": sum(1 for r in live if r.state == RentalState.PENDING),
                     "failed": sum(1 for r in replicas if r.state == RentalState.FAILED)},
        "token_prefix": service.token_prefix, "created_at": _iso(service.created_at), "deleted_at": _iso(service.deleted_at),
        "waking": service.wake_requested_at is not None,
        "failure": backoff.failure_view(service), "next_attempt_at": _iso(service.next_attempt_at),
    }  # fmt: skip
    if events is not None:
        view["replica_rentals"] = [replica_view(r) for r in replicas if failed or r.state != RentalState.FAILED]
        view["events"] = [{"at": _iso(e.at), "kind": e.kind, "replicas": e.replicas, "cause": e.cause} for e in events]
    return view


def _iso(at: datetime | None) -> str | None:
    return at.isoformat().replace("+00:00", "Z") if at is not None else None


# ---- changing ---------------------------------------------------------------------------------


async def scale_service(master: Master, principal: Principal, service_id: str, *,
                        min_replicas: int | None, max_replicas: int | None) -> Service:  # fmt: skip
    """New replica bounds; the autoscaler's target moves into them at once, and this process's autoscaler is nudged to add or
    stop replicas now (another master's at its next pass)."""
    now = master.clock.now()
    async with master.db.session() as session:
        service = await get_service(session, principal, service_id, for_update=True)
        if service.state not in OPEN_STATES:
            raise Conflict(f"service {service_id} is deleted; make a new one", code="service_deleted")
        backoff.resume(session, service, now=now, by=principal.name)  # setting the replicas is asking again
        low = service.min_replicas if min_replicas is None else min_replicas
        high = service.max_replicas if max_replicas is None else max_replicas
        if not 0 <= low <= high:
            raise BadRequest(f"min_replicas ({low}) must be at most max_replicas ({high}), and not below 0", code="invalid_replica_bounds")
        if not 1 <= high <= master.settings.max_service_replicas:
            raise BadRequest(f"max_replicas must be between 1 and {master.settings.max_service_replicas}", code="invalid_replica_bounds")
        moved = (low, high) != (service.min_replicas, service.max_replicas)
        if moved:
            desired = min(max(service.desired_replicas, low), high)
            service.min_replicas, service.max_replicas = low, high
            kind = "scale_up" if desired > service.desired_replicas else "scale_down" if desired < service.desired_replicas else "bounds"
            service.desired_replicas = desired
            session.add(ServiceEvent(service_id=service.id, at=now, kind=kind, replicas=desired,
                                     cause=f"bounds set to {low}..{high} by {principal.name}"))  # fmt: skip
    if moved:
        master.nudge(AUTOSCALER_LEASE)  # this process's autoscaler adds or stops replicas now, not at its next pass
    return service


async def rotate_token(master: Master, principal: Principal, service_id: str) -> tuple[Service, str]:
    """A new service token; the old one stops working at once."""
    token = new_secret(TOKEN_PREFIX)
    async with master.db.session() as session:
        service = await get_service(session, principal, service_id, for_update=True)
        if service.state not in OPEN_STATES:
            raise Conflict(f"service {service_id} is deleted; make a new one", code="service_deleted")
        service.token_hash, service.token_prefix = secret_hash(token), token[:10]
        session.add(ServiceEvent(service_id=service.id, at=master.clock.now(), kind="token", replicas=service.desired_replicas,
                                 cause=f"token replaced by {principal.name}"))  # fmt: skip
    return service, token


async def delete_service(master: Master, principal: Principal, service_id: str) -> Service:
    """Stop every replica and close the endpoint; idempotent (a repeat stops what an interrupted one left)."""
    now = master.clock.now()
    async with master.db.session() as session:
        service = await get_service(session, principal, service_id, for_update=True)
        if service.state in OPEN_STATES:
            service.state, service.deleted_at, service.desired_replicas = DELETED, now, 0
            session.add(ServiceEvent(service_id=service.id, at=now, kind="deleted", replicas=0, cause=f"deleted by {principal.name}"))
        live = (await replicas_of(session, [service.id], live_only=True))[service.id]
    for rental in live:
        await rentals.stop_rental(master, owner_of(service), rental.id)
    return service
