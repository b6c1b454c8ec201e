"""Rentals: placing a request on GPUs, queueing it, preempting for it, starting and stopping it.

States: ``pending → starting → running → stopping → stopped | failed | preempted``, each change
in ``rental_events``. A queued rental is ``pending`` with no host until the queue places it
(or its ``queue_until`` passes: failed). Placement (``_try_place``):

1. **Candidates.** Rentable hosts' GPUs (``allocation.load_fleet``) matching the request: the
   offer (``host_id:gpu_name``), or the requirements (offer query language, model words), the
   listing's smallest unit (shares need ``milli:<n>`` with n ≤ the share), the bid (an
   interruptible rental's bid must reach the host's minimum), the account's spend quota (hosts
   too dear for what is left of it drop out), and ``avoid_hosts``. One scheduler node per host
   and GPU model.
2. **Decide** with the configured placer (``settings.placer``, default ``fgd_net``); the network
   limits are a hard filter inside every placer.
3. **Preempt** if nothing fits and the request outranks someone: on-demand outranks every
   interruptible rental, an interruptible one every lower bid. Interruptible rentals are
   freed cheapest bid first (newest first among equal bids) until the request fits on one
   node; victims that turn out not to be needed are kept. Victims end ``preempted`` at once
   (billing stops then), their GPUs pass to the new rental, and their workloads get
   ``stop_workload`` with a grace period (SIGTERM, SIGKILL after ``preemption_grace_s``),
   sent before the new rental's start so the agent runs them in that order.
4. **Claim** atomically (``allocation.claim``) in a savepoint; a lost race reads the fleet
   again (up to ``MAX_PLACEMENT_ROUNDS``).

Quotas (``accounts.max_gpus`` / ``max_spend_per_hour``, else the ``default_max_*`` settings)
count the account's active rentals, and lock the account row while a placement checks them,
so two concurrent requests cannot both squeeze under the limit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from billing.enforce import has_credit_for
from master.context import Master
from master.models import Account, Gpu, Host, Rental, RentalEvent, RentalLogChunk
from master.models import Command as CommandRow
from master.scheduler import MILLI, NetworkLimits, Node, Placement, get_placer
from master.scheduler import Request as PlaceRequest
from master.services import allocation, commands, offers
from master.services.accounts import Principal
from master.services.allocation import Hold, HostState, mig_milli
from master.services.hoststate import transition
from master.services.listings import PRICE_QUANTUM, load_price_bounds, money
from master.services.offerquery import format_query, parse
from master.services.placement import model_matches
from shared import protocol
from shared.errors import (
    ClientError,
    Conflict,
    InsufficientCapacity,
    NotFound,
    QuotaExceeded,
    ValidationFailed,
)
from shared.ids import new_id

log = logging.getLogger(__name__)

RENTAL_STATES = ("pending", "starting", "running", "stopping", "stopped", "failed", "preempted")
ACTIVE_STATES = ("pending", "starting", "running", "stopping")
RENTAL_TRANSITIONS: dict[str, frozenset[str]] = {
    "pending": frozenset({"starting", "stopping", "stopped", "failed", "preempted"}),
    "starting": frozenset({"running", "stopping", "failed", "preempted"}),
    "running": frozenset({"stopping", "stopped", "failed", "preempted"}),
    "stopping": frozenset({"stopped", "failed"}),
    "stopped": frozenset(),
    "failed": frozenset(),
    "preempted": frozenset(),
}
KINDS = ("on_demand", "interruptible")
MAX_GPUS_PER_RENTAL = 64
# Fresh reads of the fleet one placement may take after losing races to concurrent claims.
MAX_PLACEMENT_ROUNDS = 16
# Queued rentals one queue pass tries to place.
QUEUE_BATCH = 200
MIG_PROFILE = re.compile(r"[1-7]g\.[0-9]{1,3}gb(?:\+me)?")
_FIRST_FIT = get_placer("first_fit")  # probes one node at a time while looking for rentals to preempt


@dataclass(frozen=True)
class RentalRequest:
    """What a renter asks for (``POST /rentals``), or what a queued or lost rental asked for."""

    gpu_count: int = 1
    gpu_model: str | None = None
    workload: dict[str, Any] = field(default_factory=dict)
    restart_on_failure: bool = False
    gpu_milli: int = MILLI  # per GPU; below 1000: a fractional share of one GPU
    gpu_memory_mib: int = 0  # of a share; 0: in proportion to gpu_milli
    mig_profile: str | None = None
    offer_id: str | None = None  # host_id:gpu_name, as GET /offers lists them
    query: str = ""  # requirements in the offer query language
    kind: str = "on_demand"
    bid: Decimal | None = None  # USD per GPU-hour, interruptible only
    network: dict[str, Any] | None = None  # {"region", "max_latency_ms", "max_jitter_ms", "max_loss_pct"}
    queue: bool = False
    queue_timeout_s: float = 600.0
    avoid_hosts: frozenset[str] = frozenset()
    """Hosts not to place on (a re-placement avoids the host that was lost)."""
    replaces: str | None = None

    def check(self, *, max_queue_timeout_s: float) -> RentalRequest:
        """The request with its query normalised; ValidationFailed says what is wrong."""
        if not 1 <= self.gpu_count <= MAX_GPUS_PER_RENTAL:
            raise ValidationFailed(f"gpu_count must be between 1 and {MAX_GPUS_PER_RENTAL}", code="invalid_gpu_count")
        if not 1 <= self.gpu_milli <= MILLI:
            raise ValidationFailed(f"gpu_milli must be between 1 and {MILLI} (thousandths of one GPU)", code="invalid_share")
        if self.gpu_milli < MILLI and self.gpu_count != 1:
            raise ValidationFailed("a fractional share is a share of one GPU: gpu_count must be 1", code="invalid_share")
        if self.gpu_memory_mib < 0 or (self.gpu_memory_mib and self.gpu_milli == MILLI):
            raise ValidationFailed("gpu_memory_mib is the GPU memory of a fractional share (gpu_milli below 1000)", code="invalid_share")
        if self.mig_profile is not None:
            if not MIG_PROFILE.fullmatch(self.mig_profile):
                raise ValidationFailed(f"mig_profile must look like 1g.10gb or 3g.40gb, not {self.mig_profile[:40]!r}", code="invalid_mig_profile")
            if self.gpu_count != 1 or self.gpu_milli != MILLI:
                raise ValidationFailed("a MIG rental is one instance: leave gpu_count at 1 and gpu_milli unset", code="invalid_mig_profile")
        if self.kind not in KINDS:
            raise ValidationFailed(f"kind must be one of {', '.join(KINDS)}", code="invalid_kind")
        if self.kind == "interruptible":
            if self.bid is None or not self.bid.is_finite() or self.bid <= 0:
                raise ValidationFailed("an interruptible rental needs a bid above 0 (USD per GPU-hour)", code="invalid_bid")
            if self.bid != self.bid.quantize(PRICE_QUANTUM):
                raise ValidationFailed("a bid has at most 6 decimal places", code="invalid_bid")
        elif self.bid is not None:
            raise ValidationFailed("only interruptible rentals bid; leave bid out for on_demand", code="invalid_bid")
        if self.offer_id is not None and (":" not in self.offer_id or self.query or self.gpu_model):
            raise ValidationFailed(
                "offer_id is an offer's id from GET /offers (host_id:gpu_name), and excludes requirements and gpu_model",
                code="invalid_offer",
            )
        if self.queue and not 1 <= self.queue_timeout_s <= max_queue_timeout_s:
            raise ValidationFailed(f"queue_timeout_s must be between 1 and {max_queue_timeout_s:g} seconds", code="invalid_queue_timeout")
        query = format_query(parse(self.query)) if self.query else ""
        return replace(self, query=query)

    @property
    def share(self) -> int:
        """Thousandths of a GPU each of the rental's GPUs gives it."""
        return mig_milli(self.mig_profile) if self.mig_profile is not None else self.gpu_milli

    @property
    def priority(self) -> Decimal | None:
        """What the request outranks: interruptible rentals bidding less. None: on-demand (outranks all of them)."""
        return self.bid if self.kind == "interruptible" else None

    def spec(self) -> dict[str, Any]:
        return {
            "offer_id": self.offer_id, "query": self.query, "gpu_model": self.gpu_model, "network": self.network,
            "queue": self.queue, "queue_timeout_s": self.queue_timeout_s,
        }  # fmt: skip

    @classmethod
    def from_rental(cls, rental: Rental, **changes: Any) -> RentalRequest:
        spec = rental.spec or {}
        request = cls(
            gpu_count=rental.gpu_count, gpu_model=spec.get("gpu_model", rental.gpu_model), workload=rental.workload,
            restart_on_failure=rental.restart_on_failure, gpu_milli=rental.gpu_milli if rental.mig_profile is None else MILLI,
            gpu_memory_mib=rental.gpu_memory_mib if rental.gpu_milli < MILLI and rental.mig_profile is None else 0,
            mig_profile=rental.mig_profile, offer_id=spec.get("offer_id"), query=spec.get("query") or "", kind=rental.kind,
            bid=rental.bid_per_gpu_hour, network=spec.get("network"), queue=bool(spec.get("queue")),
            queue_timeout_s=float(spec.get("queue_timeout_s") or 600.0), replaces=rental.replaces_id,
        )  # fmt: skip
        return replace(request, **changes)

    def fingerprint(self) -> str:
        fields: dict[str, Any] = {"n": self.gpu_count, "m": self.gpu_model, "w": self.workload}
        if self.restart_on_failure:
            fields["r"] = True
        extra = {
            "milli": self.gpu_milli if self.gpu_milli != MILLI else None, "mem": self.gpu_memory_mib or None,
            "mig": self.mig_profile, "offer": self.offer_id, "q": self.query or None,
            "kind": self.kind if self.kind != "on_demand" else None, "bid": str(self.bid) if self.bid is not None else None,
            "net": self.network, "queue": [self.queue, self.queue_timeout_s] if self.queue else None,
        }  # fmt: skip
        fields.update({key: value for key, value in extra.items() if value is not None})
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def place_request(self) -> PlaceRequest:
        network = None
        if self.network:
            network = NetworkLimits(
                region=str(self.network["region"]), max_latency_ms=self.network.get("max_latency_ms"),
                max_jitter_ms=self.network.get("max_jitter_ms"), max_loss_pct=self.network.get("max_loss_pct"),
            )  # fmt: skip
        return PlaceRequest(
            num_gpu=self.gpu_count, gpu_milli=self.gpu_milli, gpu_memory_mib=self.gpu_memory_mib,
            mig_profile=self.mig_profile, network=network,
        )  # fmt: skip


def _set_state(session: AsyncSession, rental: Rental, to_state: str, cause: str, *, at: datetime | None = None) -> bool:
    if rental.state == to_state:
        return False
    if to_state not in RENTAL_TRANSITIONS[rental.state]:
        log.warning("ignored rental transition %s: %s → %s (%s)", rental.id, rental.state, to_state, cause)
        return False
    event = RentalEvent(rental_id=rental.id, from_state=rental.state, to_state=to_state, cause=cause)
    if at is not None:
        event.at = at
    session.add(event)
    rental.state = to_state
    return True


async def _largest_host(session: AsyncSession, model: str | None) -> int:
    """How many matching GPUs the biggest host in the fleet has, rented or not."""
    rows = (
        await session.execute(
            select(Gpu.host_id, Gpu.name, func.count()).where(Gpu.present.is_(True)).group_by(Gpu.host_id, Gpu.name)
        )
    ).all()
    counts: dict[str, int] = {}
    for host_id, name, count in rows:
        if model_matches(model, name):
            counts[host_id] = counts.get(host_id, 0) + count
    return max(counts.values(), default=0)


def placer_of(master: Master) -> Any:
    """The master's placer (one per process, so FGD learns the workload from every request)."""
    if master.placer is None:
        master.placer = get_placer(master.settings.placer)
    return master.placer


# ---- creating ---------------------------------------------------------------------------------


async def create_rental(master: Master, renter: Principal, request: RentalRequest, *, idempotency_key: str | None) -> tuple[Rental, bool]:
    """Place and start a rental (or queue it); returns ``(rental, created)``.

    With an ``idempotency_key``, a repeat of the same request returns the first
    rental (``created`` False); the same key with a different request is a conflict.
    Runs to completion once called: callers must not cancel it half-way.
    """
    request = request.check(max_queue_timeout_s=master.settings.max_queue_timeout_s)
    if idempotency_key is not None:
        existing = await _by_idempotency_key(master, renter.account_id, idempotency_key)
        if existing is not None:
            return _check_replay(existing, request), False
    try:
        rental, command_ids = await _create(master, renter, request, idempotency_key)
    except IntegrityError:
        # A concurrent request with the same key won the race: return its rental.
        if idempotency_key is None:
            raise
        existing = await _by_idempotency_key(master, renter.account_id, idempotency_key)
        if existing is None:
            raise
        return _check_replay(existing, request), False
    await commands.publish(master, command_ids)
    return rental, True


def _check_replay(existing: Rental, request: RentalRequest) -> Rental:
    if existing.request_fingerprint != request.fingerprint():
        raise Conflict(
            "this Idempotency-Key was already used for a different rental request; use a new key",
            code="idempotency_key_reused",
        )
    return existing


async def _by_idempotency_key(master: Master, renter_id: str, key: str) -> Rental | None:
    async with master.db.session() as session:
        return await session.scalar(select(Rental).where(Rental.renter_id == renter_id, Rental.idempotency_key == key))


async def _create(master: Master, renter: Principal, request: RentalRequest, idempotency_key: str | None) -> tuple[Rental, list[str]]:
    now = master.clock.now()
    rental = Rental(
        id=new_id("r"), renter_id=renter.account_id, host_id=None, gpu_model=request.gpu_model, gpu_count=request.gpu_count,
        gpu_uuids=[], state="pending", workload=request.workload, idempotency_key=idempotency_key,
        request_fingerprint=request.fingerprint(), restart_on_failure=request.restart_on_failure,
        replaces_id=request.replaces, kind=request.kind, gpu_milli=request.share, gpu_memory_mib=request.gpu_memory_mib,
        mig_profile=request.mig_profile, bid_per_gpu_hour=request.bid, spec=request.spec(), created_at=now,
    )  # fmt: skip
    async with master.db.session() as session:
        command_ids, reason = await _try_place(master, session, rental, request, now=now)
        if command_ids:
            return rental, command_ids
        assert reason is not None
        if not request.queue or reason.code == "exceeds_fleet":
            raise reason
        rental.queue_until = now + timedelta(seconds=request.queue_timeout_s)
        session.add(rental)
        await session.flush()
        cause = f"queued for up to {request.queue_timeout_s:g}s: {reason}"
        session.add(RentalEvent(rental_id=rental.id, from_state=None, to_state="pending", cause=cause))
        log.info("rental %s queued: %s", rental.id, reason)
    return rental, []


# ---- placing ----------------------------------------------------------------------------------


@dataclass
class _Candidates:
    nodes: list[Node]
    hosts: dict[str, tuple[HostState, str, Decimal]]  # node id → (host, gpu name, price per GPU-hour)
    holds: dict[str, list[Hold]]
    excluded: dict[str, int]  # why nodes were left out: "bid", "unit", "quota", "mig"


async def _quota(master: Master, session: AsyncSession, renter_id: str, request: RentalRequest, exclude: str) -> Decimal | None:
    """Check the account's GPU quota; returns the most one GPU-hour may cost under its spend quota (None: no limit)."""
    account = await session.scalar(select(Account).where(Account.id == renter_id))
    max_gpus = account.max_gpus if account is not None and account.max_gpus is not None else master.settings.default_max_gpus
    max_spend = (
        account.max_spend_per_hour if account is not None and account.max_spend_per_hour is not None
        else master.settings.default_max_spend_per_hour
    )  # fmt: skip
    if max_gpus is None and max_spend is None:
        return None
    # Serialise this account's placements while its usage is read and the new rental added.
    await session.execute(select(Account.id).where(Account.id == renter_id).with_for_update())
    used_gpus, used_spend = await account_usage(session, renter_id, exclude=exclude)
    wanted = Decimal(request.gpu_count * request.share) / MILLI
    if max_gpus is not None and used_gpus + wanted > max_gpus:
        raise QuotaExceeded(
            f"your quota is {max_gpus.normalize():f} GPUs at once; you hold {used_gpus.normalize():f} and ask for "
            f"{wanted.normalize():f}: stop a rental or ask support to raise the quota"
        )
    if max_spend is None:
        return None
    left = max_spend - used_spend
    if left <= 0:
        raise QuotaExceeded(
            f"your quota is {money(max_spend)} USD/hour of rentals at once and your active rentals cost {money(used_spend)}: "
            "stop a rental or ask support to raise the quota"
        )
    return left / wanted


async def account_usage(session: AsyncSession, account_id: str, *, exclude: str | None = None) -> tuple[Decimal, Decimal]:
    """GPUs (fractions count) the account's active placed rentals hold, and what they cost per hour."""
    used_gpus, used_spend = Decimal(0), Decimal(0)
    query = select(Rental.gpu_count, Rental.gpu_milli, Rental.price_per_gpu_hour).where(
        Rental.renter_id == account_id, Rental.state.in_(ACTIVE_STATES), Rental.host_id.is_not(None)
    )
    if exclude is not None:
        query = query.where(Rental.id != exclude)
    for count, milli, price in (await session.execute(query)).all():
        gpus = Decimal(count * milli) / MILLI
        used_gpus += gpus
        used_spend += gpus * (price or Decimal(0))
    return used_gpus, used_spend


async def quota_view(master: Master, session: AsyncSession, account: Account) -> dict[str, Any]:
    """The account's quotas (its own or the platform's defaults) and what its active rentals use of them."""
    max_gpus = account.max_gpus if account.max_gpus is not None else master.settings.default_max_gpus
    max_spend = account.max_spend_per_hour if account.max_spend_per_hour is not None else master.settings.default_max_spend_per_hour
    used_gpus, used_spend = await account_usage(session, account.id)
    return {
        "max_gpus": f"{max_gpus.normalize():f}" if max_gpus is not None else None,
        "max_spend_per_hour": money(max_spend) if max_spend is not None else None,
        "own": {"max_gpus": account.max_gpus is not None, "max_spend_per_hour": account.max_spend_per_hour is not None},
        "used_gpus": f"{used_gpus.normalize():f}",
        "spend_per_hour": money(used_spend.quantize(PRICE_QUANTUM)),
    }


async def _candidates(
    master: Master, session: AsyncSession, request: RentalRequest, *, now: datetime, price_cap: Decimal | None
) -> _Candidates:
    bounds = load_price_bounds()
    conditions = await offers.row_conditions(session, parse(request.query), bounds=bounds) if request.query else []
    host_ids, model = None, None
    if request.offer_id is not None:
        host_id, model = request.offer_id.split(":", 1)
        host_ids = [host_id]
        exists = await session.scalar(select(Gpu.id).where(Gpu.host_id == host_id, Gpu.name == model, Gpu.present.is_(True)).limit(1))
        if exists is None:
            raise NotFound(f"no offer {request.offer_id!r}; list offers with GET /api/v1/offers", code="offer_not_found")
    fleet = await allocation.load_fleet(session, now=now, bounds=bounds, conditions=conditions, host_ids=host_ids)
    holds = await allocation.active_holds(session, host_ids)
    found = _Candidates([], {}, holds, {})
    for host in fleet.values():
        if host.host_id in request.avoid_hosts:
            continue
        for name in host.models():
            if (model is not None and name != model) or (model is None and not model_matches(request.gpu_model, name)):
                continue
            gpus = [g for g in host.gpus if g.name == name]
            why = None
            if request.mig_profile is not None and not any(p == request.mig_profile for g in gpus for _, p in g.mig or ()):
                why = "mig"
            elif request.gpu_milli < MILLI and not _unit_allows(host.smallest_unit, request.gpu_milli):
                why = "unit"
            elif request.bid is not None and request.bid < max(g.min_bid for g in gpus):
                why = "bid"
            price = request.bid if request.bid is not None else max(g.price for g in gpus)
            if why is None and price_cap is not None and price > price_cap:
                why = "quota"
            if why is not None:
                found.excluded[why] = found.excluded.get(why, 0) + 1
                if request.offer_id is not None:
                    _refuse_offer(why, request, gpus, price_cap)
                continue
            node = host.node(name, holds.get(host.host_id, ()))
            found.nodes.append(node)
            found.hosts[node.node_id] = (host, name, price)
    return found


def _unit_allows(unit: str, milli: int) -> bool:
    """Whether a listing's smallest unit admits a share of ``milli``: ``milli:<n>`` with n ≤ milli."""
    if not unit.startswith("milli:"):
        return False
    return int(unit.removeprefix("milli:")) <= milli


def _refuse_offer(why: str, request: RentalRequest, gpus: Sequence[allocation.GpuState], price_cap: Decimal | None) -> None:
    """The renter chose this offer: say exactly why it cannot take the request."""
    if why == "mig":
        profiles = sorted({p for g in gpus for _, p in g.mig or ()})
        have = f"it has {', '.join(profiles)}" if profiles else "its GPUs are not in MIG mode"
        raise ValidationFailed(f"offer {request.offer_id} has no MIG profile {request.mig_profile}: {have}", code="mig_profile_unavailable")
    if why == "unit":
        raise ValidationFailed(f"offer {request.offer_id} does not rent fractional shares of {request.gpu_milli} milli", code="share_unavailable")
    if why == "bid":
        minimum = max(g.min_bid for g in gpus)
        raise ValidationFailed(
            f"your bid {money(request.bid or Decimal(0))} is below the minimum bid of offer {request.offer_id}: {money(minimum)} USD per GPU-hour",
            code="bid_below_minimum",
        )
    raise QuotaExceeded(
        f"offer {request.offer_id} costs more than your spend quota leaves ({money(price_cap or Decimal(0))} USD per GPU-hour)"
    )


async def _preemptible(session: AsyncSession, request: RentalRequest) -> dict[str, tuple[Decimal, datetime]]:
    """Active interruptible rentals the request outranks: id → (bid, created)."""
    query = select(Rental.id, Rental.bid_per_gpu_hour, Rental.created_at).where(
        Rental.kind == "interruptible", Rental.state.in_(ACTIVE_STATES), Rental.host_id.is_not(None)
    )
    if request.priority is not None:
        query = query.where(Rental.bid_per_gpu_hour < request.priority)
    return {rid: (bid or Decimal(0), created) for rid, bid, created in (await session.execute(query)).all()}


def _find_victims(found: _Candidates, wanted: PlaceRequest, outranked: dict[str, tuple[Decimal, datetime]]) -> tuple[list[str], Placement] | None:
    """The cheapest interruptible rentals whose GPUs make room for ``wanted`` on one node, and the placement."""
    if not outranked:
        return None
    # Cheapest bid first; among equal bids the newest (it has run least).
    order = sorted(outranked, key=lambda rid: (outranked[rid][0], -outranked[rid][1].timestamp(), rid))
    node_of_rental: dict[str, list[str]] = {}
    for node_id, (host, name, _) in found.hosts.items():
        gpu_ids = {g.id for g in host.gpus if g.name == name}
        for hold in found.holds.get(host.host_id, ()):
            if hold.rental_id in outranked and hold.gpu_id in gpu_ids:
                node_of_rental.setdefault(hold.rental_id, []).append(node_id)
    freed: dict[str, list[str]] = {}
    for rental_id in order:
        for node_id in dict.fromkeys(node_of_rental.get(rental_id, ())):
            freed.setdefault(node_id, []).append(rental_id)
            host, name, _ = found.hosts[node_id]
            holds = found.holds.get(host.host_id, ())
            if _FIRST_FIT.place(wanted, [host.node(name, holds, freed=freed[node_id])]) is None:
                continue
            victims = list(freed[node_id])
            for candidate in reversed(list(victims)):  # keep the dearest ones that are not needed
                trial = [v for v in victims if v != candidate]
                if _FIRST_FIT.place(wanted, [host.node(name, holds, freed=trial)]) is not None:
                    victims = trial
            placement = _FIRST_FIT.place(wanted, [host.node(name, holds, freed=victims)])
            assert placement is not None
            return victims, replace(placement, node_id=node_id)
    return None


def _no_room(request: RentalRequest, found: _Candidates) -> InsufficientCapacity:
    what = f"{request.gpu_count} × {request.gpu_model or 'any GPU'}"
    if request.mig_profile is not None:
        what = f"a MIG {request.mig_profile} instance"
    elif request.gpu_milli < MILLI:
        what = f"a {request.gpu_milli}-milli share of {request.gpu_model or 'any GPU'}"
    if request.offer_id is not None:
        what += f" on offer {request.offer_id}"
    notes = {
        "bid": "bids below their minimum", "unit": "not renting shares that small", "quota": "too dear for your spend quota",
        "mig": f"without MIG {request.mig_profile} instances",
    }  # fmt: skip
    left_out = "; ".join(f"{count} left out as {notes[why]}" for why, count in sorted(found.excluded.items()))
    return InsufficientCapacity(
        f"no host has {what} free right now{f' ({left_out})' if left_out else ''}; try again later, ask for less, "
        "or send queue: true to wait"
    )


async def _try_place(
    master: Master, session: AsyncSession, rental: Rental, request: RentalRequest, *, now: datetime
) -> tuple[list[str], ClientError | None]:
    """Place ``rental`` (new, or queued and locked); returns its commands to publish, or the reason it cannot be placed now."""
    price_cap = await _quota(master, session, rental.renter_id, request, exclude=rental.id)
    if request.gpu_milli == MILLI and request.mig_profile is None:
        largest = await _largest_host(session, request.gpu_model)
        if largest < request.gpu_count:
            return [], InsufficientCapacity(
                f"no host has {request.gpu_count} × {request.gpu_model or 'any GPU'}: the largest host with that model has "
                f"{largest}; ask for fewer GPUs or another model",
                code="exceeds_fleet",
            )
    wanted = request.place_request()
    placer = placer_of(master)
    found = await _candidates(master, session, request, now=now, price_cap=price_cap)
    for _round in range(MAX_PLACEMENT_ROUNDS):
        victims: list[str] = []
        placement = placer.place(wanted, found.nodes)
        if placement is None:
            chosen = _find_victims(found, wanted, await _preemptible(session, request))
            if chosen is None:
                return [], _no_room(request, found)
            victims, placement = chosen
        host, name, price = found.hosts[placement.node_id]
        if master.settings.require_credit:
            gpus = Decimal(request.gpu_count * request.share) / MILLI
            await has_credit_for(session, rental.renter_id, price, gpus, min_period_s=master.settings.billing_min_period_s)
        async with session.begin_nested() as attempt:
            rental.host_id, rental.gpu_model, rental.price_per_gpu_hour = host.host_id, name, price
            rental.gpu_uuids = list(placement.mig_instances or placement.gpu_uuids)
            if request.gpu_milli < MILLI:
                rental.gpu_memory_mib = placement.gpu_memory_mib
            if rental not in session:
                session.add(rental)
            await session.flush()
            stops = await _preempt(master, session, victims, rental, now=now) if victims else []
            claimed = stops is not None and await allocation.claim(session, rental, placement, host, name, at=now)
            if not claimed:
                log.info("lost a race for GPUs on host %s; reading the fleet again", host.host_id)
                await attempt.rollback()
        if not claimed:
            found = await _candidates(master, session, request, now=now, price_cap=price_cap)
            continue
        assert stops is not None
        return [*stops, _start(session, rental, request, placement, now=now)], None
    return [], _no_room(request, found)


async def _preempt(master: Master, session: AsyncSession, victims: Sequence[str], by: Rental, *, now: datetime) -> list[str] | None:
    """End ``victims`` as preempted by ``by`` and free their GPUs; None if one of them is no longer preemptible."""
    rows = (
        await session.scalars(select(Rental).where(Rental.id.in_(list(victims))).order_by(Rental.id).with_for_update())
    ).all()
    if len(rows) != len(victims) or any(r.state not in ACTIVE_STATES or r.kind != "interruptible" for r in rows):
        return None
    grace = master.settings.preemption_grace_s
    stop_ids = []
    for victim in rows:
        what = "an on-demand rental" if by.kind == "on_demand" else f"a higher bid ({money(by.bid_per_gpu_hour or Decimal(0))})"
        _set_state(session, victim, "preempted", f"preempted by {what}, rental {by.id}; workload given {grace:g}s to stop", at=now)
        victim.stopped_at = now  # billing ends here, not when the workload has stopped
        victim.preempted_by_id = by.id
        victim.failure_reason = f"preempted by rental {by.id}"
        await allocation.release(session, victim.id, at=now)
        await _cancel_commands(session, victim.id, at=now, reason="the rental was preempted")
        assert victim.host_id is not None
        command = commands.new_command(
            session, host_id=victim.host_id, rental_id=victim.id,
            command=protocol.StopWorkload(rental_id=victim.id, grace_s=grace, reason=f"preempted by rental {by.id}"),
        )  # fmt: skip
        command.created_at = now
        stop_ids.append(command.id)
        log.info("rental %s preempted by %s on host %s", victim.id, by.id, victim.host_id)
    return stop_ids


def _start(session: AsyncSession, rental: Rental, request: RentalRequest, placement: Placement, *, now: datetime) -> str:
    assert rental.host_id is not None
    if request.replaces:
        cause = f"placed again after rental {request.replaces} lost its host"
    elif rental.queue_until is not None:
        cause = "placed from the queue"
    else:
        cause = "placed"
    session.add(RentalEvent(rental_id=rental.id, from_state=None if rental.queue_until is None else "pending", to_state="pending",
                            cause=f"{cause} on host {rental.host_id} ({placement.node_id})"))  # fmt: skip
    share = None
    if request.gpu_milli < MILLI and request.mig_profile is None:
        share = protocol.GpuShare(milli=request.gpu_milli, memory_mib=placement.gpu_memory_mib)
    start = protocol.StartWorkload.model_validate({"rental_id": rental.id, "gpu_uuids": rental.gpu_uuids, "workload": rental.workload, "share": share})
    command = commands.new_command(session, host_id=rental.host_id, command=start, rental_id=rental.id)
    command.created_at = now + timedelta(microseconds=1)  # after any preempted workload's stop, which the agent runs first
    _set_state(session, rental, "starting", f"start command {command.id} sent to host {rental.host_id}")
    log.info("rental %s placed on host %s (%d × %d milli)", rental.id, rental.host_id, request.gpu_count, rental.gpu_milli)
    return command.id


async def _cancel_commands(session: AsyncSession, rental_id: str, *, at: datetime, reason: str) -> None:
    await session.execute(
        update(CommandRow)
        .where(CommandRow.rental_id == rental_id, CommandRow.state.in_(commands.OPEN_STATES))
        .values(state="failed", completed_at=at, result={"ok": False, "detail": f"cancelled: {reason}"})
    )


# ---- the queue --------------------------------------------------------------------------------


async def process_queue(master: Master) -> int:
    """Expire queued rentals past their ``queue_until``, then place what can be placed, oldest first; returns how many."""
    now = master.clock.now()
    async with master.db.session() as session:
        expired = (
            await session.scalars(
                select(Rental)
                .where(Rental.state == "pending", Rental.host_id.is_(None), Rental.queue_until <= now)
                .with_for_update(skip_locked=True)
            )
        ).all()
        for gone in expired:
            waited = (now - gone.created_at).total_seconds()
            if _set_state(session, gone, "failed", f"not placed within its queue timeout ({waited:.0f}s queued)"):
                gone.failure_reason, gone.stopped_at = "queue timeout", now
        queued = (
            await session.scalars(
                select(Rental.id).where(Rental.state == "pending", Rental.host_id.is_(None)).order_by(Rental.created_at).limit(QUEUE_BATCH)
            )
        ).all()
    placed = 0
    for rental_id in queued:
        command_ids: list[str] = []
        async with master.db.session() as session:
            rental = await session.scalar(select(Rental).where(Rental.id == rental_id).with_for_update(skip_locked=True))
            if rental is None or rental.state != "pending" or rental.host_id is not None:
                continue
            try:
                command_ids, _reason = await _try_place(master, session, rental, RentalRequest.from_rental(rental), now=now)
            except ClientError as exc:  # the offer is gone, the quota shrank below one GPU...
                if _set_state(session, rental, "failed", f"cannot be placed from the queue: {exc}"):
                    rental.failure_reason, rental.stopped_at = str(exc), now
        if command_ids:
            placed += 1
            await commands.publish(master, command_ids)
    return placed


async def queue_loop(master: Master) -> None:
    """Place queued rentals every ``queue_interval`` (one master at a time, under the ``rental-queue`` lease)."""
    from master.services.leases import run_leased

    async def work() -> None:
        await process_queue(master)

    await run_leased(master, "rental-queue", every=master.settings.queue_interval, work=work)


# ---- reading and ending -----------------------------------------------------------------------


async def get_rental(session: AsyncSession, principal: Principal, rental_id: str, *, for_update: bool = False) -> Rental:
    rental = await session.get(Rental, rental_id, with_for_update=for_update)
    if rental is None or (principal.role != "admin" and rental.renter_id != principal.account_id):
        raise NotFound(f"no rental {rental_id!r} in your account", code="rental_not_found")
    return rental


async def list_rentals(session: AsyncSession, principal: Principal, *, limit: int, offset: int) -> tuple[list[Rental], int]:
    query = select(Rental)
    if principal.role != "admin":
        query = query.where(Rental.renter_id == principal.account_id)
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = (await session.scalars(query.order_by(Rental.created_at.desc()).limit(limit).offset(offset))).all()
    return list(rows), total


async def rental_events(session: AsyncSession, rental_id: str) -> Sequence[RentalEvent]:
    return (await session.scalars(select(RentalEvent).where(RentalEvent.rental_id == rental_id).order_by(RentalEvent.id))).all()


async def stop_rental(master: Master, principal: Principal, rental_id: str) -> Rental:
    """Ask the agent to stop the workload; idempotent (stopping a stopped rental returns it)."""
    command_id: str | None = None
    async with master.db.session() as session:
        rental = await get_rental(session, principal, rental_id, for_update=True)
        if rental.state == "pending" and rental.host_id is None:  # queued: nothing runs anywhere
            if _set_state(session, rental, "stopped", f"cancelled while queued, by {principal.name}"):
                rental.stopped_at = master.clock.now()
        elif rental.state in ("pending", "starting", "running"):
            assert rental.host_id is not None
            command = commands.new_command(
                session, host_id=rental.host_id, command=protocol.StopWorkload(rental_id=rental.id), rental_id=rental.id
            )
            command_id = command.id
            _set_state(session, rental, "stopping", f"stop requested by {principal.name}")
    if command_id is not None:
        await commands.publish(master, [command_id])
    return rental


async def apply_command_result(session: AsyncSession, command: CommandRow, *, ok: bool, detail: str, at: datetime) -> None:
    """What an agent's confirmation means for the rental it concerns."""
    if command.rental_id is None:
        return
    rental = await session.get(Rental, command.rental_id, with_for_update=True)
    if rental is None or rental.state == "preempted":
        return  # a preempted rental ended when it was preempted; its stop's result adds nothing
    if command.kind == "start_workload":
        if ok:
            if _set_state(session, rental, "running", "agent confirmed the workload started"):
                rental.started_at = at
                host = await session.get(Host, rental.host_id)
                if host is not None and host.state == "online":
                    transition(session, host, "rented", cause=f"rental {rental.id} running", actor="master")
        else:
            if _set_state(session, rental, "failed", f"workload failed to start: {detail}"):
                rental.failure_reason = detail
                rental.stopped_at = at
                await _release(session, rental, at=at)
    elif command.kind == "stop_workload" and ok:
        if _set_state(session, rental, "stopped", "agent confirmed the workload stopped"):
            rental.stopped_at = at
            await _release(session, rental, at=at)


async def apply_workload_exit(
    session: AsyncSession, host_id: str, rental_id: str, *, exit_code: int | None, reason: str, at: datetime
) -> None:
    """A workload ended on its own: exit 0 completes the rental, anything else fails it. GPUs are freed."""
    rental = await session.get(Rental, rental_id, with_for_update=True)
    if rental is None or rental.host_id != host_id:
        log.warning("host %s reported the exit of rental %s it does not run", host_id, rental_id)
        return
    if rental.state not in ("starting", "running"):
        return  # already stopping/stopped by request, or failed: nothing to add
    what = f"workload exited with code {exit_code}" if exit_code is not None else f"workload ended ({reason or 'unknown'})"
    target = "stopped" if exit_code == 0 else "failed"
    if rental.state == "starting" and target == "stopped":
        target = "failed"  # never confirmed running: treat as a failed start
    if _set_state(session, rental, target, what):
        rental.stopped_at = at
        if target == "failed":
            rental.failure_reason = what
        await _release(session, rental, at=at)


async def fail_rental(session: AsyncSession, rental: Rental, *, reason: str, at: datetime) -> None:
    """End an active rental as failed (its host is gone or untrusted) and free its GPUs.

    Its unanswered commands are cancelled, so a host that comes back is not told to start it.
    """
    if _set_state(session, rental, "failed", reason):
        rental.failure_reason = reason
        rental.stopped_at = at
        await allocation.release(session, rental.id, at=at)
        await _cancel_commands(session, rental.id, at=at, reason=reason)


async def fail_rentals_of_lost_hosts(session: AsyncSession, *, now: datetime, grace: timedelta) -> list[str]:
    """Fail the active rentals of hosts offline for longer than ``grace``; returns their ids.

    Billing stops at ``host_lost_at``, the last time the host was heard from, not at the
    moment the grace period ran out. A host back within the grace period resumes its rentals.
    """
    rows = (
        await session.execute(
            select(Rental, Host.last_seen_at)
            .join(Host, Host.id == Rental.host_id)
            .where(Host.state == "offline", Host.state_changed_at <= now - grace, Rental.state.in_(ACTIVE_STATES))
            .with_for_update(of=Rental, skip_locked=True)
        )
    ).all()
    for rental, last_seen in rows:
        lost_at = last_seen or now
        rental.host_lost_at = lost_at
        await fail_rental(
            session, rental, at=lost_at,
            reason=f"host {rental.host_id} lost: silent since {lost_at:%Y-%m-%dT%H:%M:%SZ}, past the {grace.total_seconds():g}s grace period",
        )
        log.warning("rental %s failed: host %s lost", rental.id, rental.host_id)
    return [rental.id for rental, _ in rows]


async def replace_lost(master: Master, rental_id: str) -> Rental | None:
    """Start a rental lost with its host again elsewhere, if it asked for that; returns the new one.

    Idempotent: the new rental's idempotency key is derived from the old one, so a retried
    call returns the same re-placement. The renter reads what happened in both rentals' events.
    """
    async with master.db.session() as session:
        old = await session.get(Rental, rental_id)
    if old is None or not old.restart_on_failure or old.state != "failed" or old.host_lost_at is None:
        return None
    renter = Principal(account_id=old.renter_id, name="master", role="renter")
    # The same request anywhere but on the lost host (an offer named that host: keep its model instead).
    pinned = (old.spec or {}).get("offer_id") is not None
    request = RentalRequest.from_rental(
        old, avoid_hosts=frozenset({old.host_id} if old.host_id else ()), replaces=old.id, queue=False, offer_id=None,
        gpu_model=old.gpu_model if pinned else (old.spec or {}).get("gpu_model", old.gpu_model),
    )  # fmt: skip
    new: Rental | None = None
    try:
        new, created = await create_rental(master, renter, request, idempotency_key=f"replace:{old.id}")
        note = f"placed again as rental {new.id} on host {new.host_id}"
    except ClientError as exc:
        note, created = f"could not be placed again: {exc}", True
    if created:
        async with master.db.session() as session:
            session.add(RentalEvent(rental_id=old.id, from_state="failed", to_state="failed", cause=note))
        log.info("rental %s %s", old.id, note)
    return new


async def stop_strays(session: AsyncSession, host_id: str, reported: Sequence[str]) -> list[str]:
    """Stop workloads a host says it runs that are not active rentals of that host.

    (A rental failed while its host was away, or ended by anyone while a stop got lost.)
    Returns the ids of new ``stop_workload`` commands to publish; one open stop per rental.
    """
    if not reported:
        return []
    wanted = set(reported)
    active = set(
        (
            await session.scalars(
                select(Rental.id).where(Rental.id.in_(wanted), Rental.host_id == host_id, Rental.state.in_(("pending", "starting", "running")))
            )
        ).all()
    )
    stopping = set(
        (
            await session.scalars(
                select(CommandRow.rental_id).where(
                    CommandRow.host_id == host_id, CommandRow.kind == "stop_workload",
                    CommandRow.rental_id.in_(wanted), CommandRow.state.in_(commands.OPEN_STATES),
                )
            )
        ).all()
    )
    known = set((await session.scalars(select(Rental.id).where(Rental.id.in_(wanted)))).all())
    ids = []
    for rental_id in sorted(wanted - active - stopping):
        log.warning("host %s runs workload %s, which is not an active rental there; stopping it", host_id, rental_id)
        command = commands.new_command(
            session, host_id=host_id, command=protocol.StopWorkload(rental_id=rental_id),
            rental_id=rental_id if rental_id in known else None,
        )
        ids.append(command.id)
    return ids


async def _release(session: AsyncSession, rental: Rental, *, at: datetime) -> None:
    await allocation.release(session, rental.id, at=at)
    if rental.host_id is None:
        return
    host = await session.get(Host, rental.host_id)
    if host is None or host.state != "rented":
        return
    still = await session.scalar(
        select(func.count()).select_from(Rental).where(
            Rental.host_id == host.id, Rental.state.in_(ACTIVE_STATES), Rental.id != rental.id
        )
    )
    if not still:
        transition(session, host, "online", cause=f"rental {rental.id} ended; no rentals left", actor="master")


async def rental_logs(session: AsyncSession, principal: Principal, rental_id: str, *, offset: int, limit: int) -> dict[str, Any]:
    """The workload's output from byte ``offset`` (as far as the agent has shipped it)."""
    rental = await get_rental(session, principal, rental_id)
    chunks = (
        await session.scalars(
            select(RentalLogChunk)
            .where(RentalLogChunk.rental_id == rental.id, RentalLogChunk.offset + RentalLogChunk.length > offset)
            .order_by(RentalLogChunk.offset)
        )
    ).all()
    # Chunks are whole slices of the agent's log; one that starts before ``offset`` is cut
    # by bytes (exact for valid UTF-8, approximate where the agent replaced invalid bytes).
    parts: list[str] = []
    start = chunks[0].offset if chunks and chunks[0].offset > offset else offset  # older bytes were pruned
    position = start
    for chunk in chunks:
        if chunk.offset > position or position - start >= limit:
            break  # a gap (not shipped yet), or enough
        skip = position - chunk.offset
        text = chunk.data.encode()[skip:].decode(errors="replace") if skip else chunk.data
        parts.append(text)
        position = chunk.offset + chunk.length
    data = "".join(parts)
    return {
        "rental_id": rental.id,
        "offset": start,
        "next_offset": position,
        "data": data,
        "state": rental.state,
    }


def rental_view(rental: Rental, events: Sequence[RentalEvent] | None = None) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": rental.id,
        "state": rental.state,
        "host_id": rental.host_id,
        "gpu_model": rental.gpu_model,
        "gpu_count": rental.gpu_count,
        "gpu_uuids": rental.gpu_uuids,
        "workload": rental.workload,
        "failure_reason": rental.failure_reason,
        "created_at": rental.created_at.isoformat(),
        "started_at": rental.started_at.isoformat() if rental.started_at else None,
        "stopped_at": rental.stopped_at.isoformat() if rental.stopped_at else None,
        "host_lost_at": rental.host_lost_at.isoformat() if rental.host_lost_at else None,
        "restart_on_failure": rental.restart_on_failure,
        "replaces": rental.replaces_id,
        "kind": rental.kind,
        "bid_per_gpu_hour": money(rental.bid_per_gpu_hour) if rental.bid_per_gpu_hour is not None else None,
        "price_per_gpu_hour": money(rental.price_per_gpu_hour) if rental.price_per_gpu_hour is not None else None,
        "gpu_milli": rental.gpu_milli,
        "gpu_memory_mib": rental.gpu_memory_mib,
        "mig_profile": rental.mig_profile,
        "offer_id": (rental.spec or {}).get("offer_id"),
        "requirements": (rental.spec or {}).get("query") or None,
        "network": (rental.spec or {}).get("network"),
        "queued": rental.state == "pending" and rental.host_id is None,
        "queue_until": rental.queue_until.isoformat() if rental.queue_until else None,
        "preempted_by": rental.preempted_by_id,
    }
    if events is not None:
        view["events"] = [
            {"at": e.at.isoformat(), "from": e.from_state, "to": e.to_state, "cause": e.cause} for e in events
        ]
    return view
