"""Placing a rental on GPUs: candidates, quotas, preemption, the atomic claim and the start command.

``try_place`` places a new rental (``rentals.create_rental``) or a queued one (``rental_queue``):

1. **Candidates.** Rentable hosts' GPUs (``allocation.load_fleet``) matching the request: the
   offer (``host_id:gpu_name``), or the requirements (offer query language, model words), the
   workload (``isolation.refusal``: a container workload needs a host whose facts list
   ``container`` and whose image policy allows the image, a process workload one that lists
   ``process``; a host of an older agent, with no facts, takes any workload as before), the
   listing's smallest unit (shares need ``milli:<n>`` with n ≤ the share), the bid (an
   interruptible rental's bid must reach the host's minimum), the account's spend quota (hosts
   too dear for what is left of it drop out), and ``avoid_hosts``. One scheduler node per host
   and GPU model. The price each node charges is ``charged_price``: the listing's (or tier's
   default) price, or for an interruptible rental the lower of the bid and that price — so a
   bid is a price between the host's minimum bid and its on-demand price, wherever it lands.
2. **Decide** with the configured placer (``settings.placer``, default ``fgd_net``); the network
   limits are a hard filter inside every placer. The renter's price first (``price_first``,
   ``master/scheduler/price.py``): unless the request names an offer, or a model without a
   ``price_tolerance`` of its own, the placer chooses only among the candidates priced at most
   ``price_tolerance`` (the request's, else the setting's) above the cheapest that can take it.
3. **Preempt** if nothing fits and the request outranks someone: on-demand outranks every
   interruptible rental, an interruptible one every lower bid. Interruptible rentals are
   freed cheapest bid first (newest first among equal bids) until the request fits on one
   node; victims that turn out not to be needed are kept. Victims are only marked
   (``preemption.mark``): their GPUs pass to the new rental, whose ``start_workload`` names them
   (``preempts``, with the ``preemption_grace_s`` grace). Its agent stops them once it has the
   image, and they end ``preempted`` when that start is confirmed; a start that fails before
   gives them their GPUs back and they keep running (``preemption.settle``).
4. **Claim** atomically (``allocation.claim``) in a savepoint; a lost race reads the fleet
   again (up to ``MAX_PLACEMENT_ROUNDS``).

Quotas (``accounts.max_gpus`` / ``max_spend_per_hour``, else the ``default_max_*`` settings)
count the account's active rentals. A placement locks the account's row before it reads them
or the credit, so two concurrent requests cannot both squeeze under a limit; on SQLite, which
has no row locks, callers run ``try_place`` in ``Database.serialised_session`` (``BEGIN
IMMEDIATE``). The claim, the rental's state and events and its start command are written in the
caller's one transaction: they commit together or not at all.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import exists, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from master.context import Master
from master.models import Account, Gpu, Host, Rental, RentalEvent
from master.scheduler import MILLI, Node, Placement, get_placer
from master.scheduler import Request as PlaceRequest
from master.scheduler.price import PriceFirst, effective_tolerance
from master.services import accounts, commands, isolation, market, volumes
from master.services.lifecycle.rentals import ACTIVE_STATES, RentalState, advance
from master.services.market import PRICE_QUANTUM, load_price_bounds, model_matches, money, parse
from master.services.rentals import allocation, preemption
from master.services.rentals.allocation import Hold, HostState
from master.services.rentals.request import RentalRequest
from shared import protocol
from shared.ceilings import UNITS, rental_fraction
from shared.errors import (
    ClientError,
    Conflict,
    InsufficientCapacity,
    NotFound,
    QuotaExceeded,
    ValidationFailed,
)

log = logging.getLogger(__name__)

# Fresh reads of the fleet one placement may take after losing races to concurrent claims.
MAX_PLACEMENT_ROUNDS = 16
_FIRST_FIT = get_placer("first_fit")  # probes one node at a time while looking for rentals to preempt


async def whole_gpus(session: AsyncSession, model: str | None) -> list[tuple[str, str, int]]:
    """``(host id, GPU model, count)`` of the fleet's present whole GPUs matching ``model``, rented or not (a GPU in MIG
    mode is not whole)."""
    mig_mode = Gpu.info["mig_mode"].as_boolean()
    rows = (
        await session.execute(
            select(Gpu.host_id, Gpu.name, func.count())
            .where(Gpu.present.is_(True), or_(mig_mode.is_(None), mig_mode.is_(False)))
            .group_by(Gpu.host_id, Gpu.name)
        )
    ).all()
    return [(host_id, name, count) for host_id, name, count in rows if model_matches(model, name)]


async def _largest_host(session: AsyncSession, model: str | None) -> int:
    """How many matching whole GPUs the biggest host in the fleet has."""
    counts: dict[str, int] = {}
    for host_id, _, count in await whole_gpus(session, model):
        counts[host_id] = counts.get(host_id, 0) + count
    return max(counts.values(), default=0)


async def _fleet_mig_profiles(session: AsyncSession, model: str | None) -> set[str]:
    """The MIG profiles of the instances that the fleet's present GPUs in MIG mode have, rented or not."""
    mig_mode = Gpu.info["mig_mode"].as_boolean()
    rows = (await session.execute(select(Gpu.name, Gpu.info).where(Gpu.present.is_(True), mig_mode.is_(True)))).all()
    return {
        str(instance["profile"])
        for name, info in rows
        if model_matches(model, name)
        for instance in (info or {}).get("mig_instances") or ()
        if instance.get("profile")
    }


async def _beyond_fleet(session: AsyncSession, request: RentalRequest, only_hosts: Sequence[str] | None = None) -> InsufficientCapacity | None:
    """Why no host could ever serve ``request`` (queueing would wait for nothing), or None. ``only_hosts``: its
    volumes' hosts, the only ones it may go to."""
    model = request.gpu_model or "any GPU"
    if only_hosts is not None and request.mig_profile is None and request.gpu_milli == MILLI:
        counts: dict[str, int] = {}
        for host_id, _, count in await whole_gpus(session, request.gpu_model):
            if host_id in only_hosts:
                counts[host_id] = counts.get(host_id, 0) + count
        if max(counts.values(), default=0) < request.gpu_count:
            return InsufficientCapacity(
                f"its volumes tie the rental to host {', '.join(only_hosts)}, which has {max(counts.values(), default=0)} "
                f"whole {model}, not {request.gpu_count}; ask for fewer GPUs or copy the volume to a larger host",
                code="exceeds_fleet",
            )  # fmt: skip
        return None
    if request.mig_profile is not None:
        if request.offer_id is not None:
            return None  # the offer's own check names the profiles it has
        profiles = await _fleet_mig_profiles(session, request.gpu_model)
        if request.mig_profile not in profiles:
            have = f"the fleet has {', '.join(sorted(profiles))}" if profiles else "no GPU of the fleet is in MIG mode"
            return InsufficientCapacity(
                f"no host has a MIG {request.mig_profile} instance of {model}: {have}; ask for another profile",
                code="exceeds_fleet",
            )
    elif request.gpu_milli == MILLI:
        largest = await _largest_host(session, request.gpu_model)
        if largest < request.gpu_count:
            return InsufficientCapacity(
                f"no host has {request.gpu_count} × {model}: the largest host with that model has {largest} whole "
                "(GPUs in MIG mode rent as instances); ask for fewer GPUs or another model",
                code="exceeds_fleet",
            )
    return None


def placer_of(master: Master) -> Any:
    """The master's placer (one per process, so FGD learns the workload from every request)."""
    if master.placer is None:
        master.placer = get_placer(master.settings.placer)
    return master.placer


def price_first(master: Master, request: RentalRequest) -> PriceFirst:
    """The master's placer behind the renter's price first (``master/scheduler/price.py``): among the cheapest
    feasible candidates, within the request's ``price_tolerance`` (or the setting's when it names no model); a named
    offer or model without a tolerance of its own places as before."""
    tolerance = effective_tolerance(request.price_tolerance, master.settings.price_tolerance,
                                    names_model=request.names_model, names_offer=request.offer_id is not None)  # fmt: skip
    return PriceFirst(placer_of(master), tolerance)


@dataclass
class Candidates:
    nodes: list[Node]
    hosts: dict[str, tuple[HostState, str, Decimal]]  # node id → (host, gpu name, price per GPU-hour)
    holds: dict[str, list[Hold]]
    excluded: dict[str, int]  # why nodes were left out: "bid", "unit", "quota", "mig", or an ``isolation.Refusal``
    # For the workload's limits no host could give: field → the most any host left out for it allows.
    limits: dict[str, float] = field(default_factory=dict)


async def check_quota(master: Master, session: AsyncSession, renter_id: str, request: RentalRequest, exclude: str) -> Decimal | None:
    """Check the account's GPU quota; returns the most one GPU-hour may cost under its spend quota (None: no limit).

    Locks the account's row first, quota or not: the account's placements are serialised from here to their commit,
    so what this reads, the credit check and the claim cannot interleave with another placement of the account
    (PostgreSQL; SQLite ignores ``FOR UPDATE``, and placements there run in ``Database.serialised_session``).
    """
    account = await session.scalar(select(Account).where(Account.id == renter_id).with_for_update())
    max_gpus = account.max_gpus if account is not None and account.max_gpus is not None else master.settings.default_max_gpus
    max_spend = (
        account.max_spend_per_hour if account is not None and account.max_spend_per_hour is not None
        else master.settings.default_max_spend_per_hour
    )  # fmt: skip
    if max_gpus is None and max_spend is None:
        return None
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


async def find_candidates(
    master: Master, session: AsyncSession, request: RentalRequest, *, now: datetime, price_cap: Decimal | None,
    only_hosts: Collection[str] | None = None,
) -> Candidates:
    """``only_hosts``: the hosts the rental's volumes tie it to (``volumes.resolve``), none other."""
    bounds = load_price_bounds()
    conditions = await market.row_conditions(session, parse(request.query), bounds=bounds, now=now) if request.query else []
    host_ids, model = None, None
    if request.offer_id is not None:
        host_id, model = request.offer_id.split(":", 1)
        host_ids = [host_id]
        exists = await session.scalar(select(Gpu.id).where(Gpu.host_id == host_id, Gpu.name == model, Gpu.present.is_(True)).limit(1))
        if exists is None:
            raise NotFound(f"no offer {request.offer_id!r}; list offers with GET /api/v1/offers", code="offer_not_found")
    if only_hosts is not None:
        host_ids = [h for h in (host_ids if host_ids is not None else only_hosts) if h in only_hosts]
    fleet = await allocation.load_fleet(session, now=now, bounds=bounds, conditions=conditions, host_ids=host_ids)
    holds = await allocation.active_holds(session, host_ids)
    found = Candidates([], {}, holds, {})
    for host in fleet.values():
        if host.host_id in request.avoid_hosts:
            continue
        fraction = rental_fraction(request.gpu_count * request.share / MILLI, len(host.gpus))
        refused = isolation.refusal(host.isolation, request.workload, fraction=fraction)
        if refused == isolation.Refusal.LIMITS:
            over = isolation.limit_over(host.isolation or {}, request.workload, fraction=fraction)
            if over is not None:
                found.limits[over[0]] = max(found.limits.get(over[0], 0.0), over[2])
        for name in host.models():
            if (model is not None and name != model) or (model is None and not model_matches(request.gpu_model, name)):
                continue
            gpus = [g for g in host.gpus if g.name == name]
            why: str | None = None
            if refused is not None:
                why = refused.value
            elif request.mig_profile is not None and not any(p == request.mig_profile for g in gpus for _, p in g.mig or ()):
                why = "mig"
            elif request.gpu_milli < MILLI and not _unit_allows(host.smallest_unit, request.gpu_milli):
                why = "unit"
            elif request.bid is not None and request.bid < max(g.min_bid for g in gpus):
                why = "bid"
            price = charged_price(request.bid, on_demand=max(g.price for g in gpus))
            if why is None and price_cap is not None and price > price_cap:
                why = "quota"
            if why is not None:
                found.excluded[why] = found.excluded.get(why, 0) + 1
                if request.offer_id is not None:
                    _refuse_offer(why, request, gpus, price_cap, facts=host.isolation, fraction=fraction)
                continue
            node = host.node(name, holds.get(host.host_id, ()))
            found.nodes.append(node)
            found.hosts[node.node_id] = (host, name, price)
    return found


def charged_price(bid: Decimal | None, *, on_demand: Decimal) -> Decimal:
    """What a rental is charged per GPU-hour on GPUs whose on-demand price is ``on_demand``.

    On demand: that price. Interruptible: the bid, but never more than the on-demand price of the
    same GPUs — a renter never pays more for an interruptible GPU than for that GPU on demand. A
    bid above it still ranks as bid (it outranks lower bids when preempting) and pays on-demand.
    """
    return on_demand if bid is None else min(bid, on_demand)


def _unit_allows(unit: str, milli: int) -> bool:
    """Whether a listing's smallest unit admits a share of ``milli``: ``milli:<n>`` with n ≤ milli."""
    if not unit.startswith("milli:"):
        return False
    return int(unit.removeprefix("milli:")) <= milli


def _refuse_offer(
    why: str, request: RentalRequest, gpus: Sequence[allocation.GpuState], price_cap: Decimal | None, *, facts: dict[str, Any] | None,
    fraction: float = 1.0,
) -> None:
    """The renter chose this offer: say exactly why it cannot take the request."""
    reason = f" ({facts['reason']})" if facts and facts.get("reason") else ""
    if why in (isolation.Refusal.CONTAINER, isolation.Refusal.PROCESS):
        raise ValidationFailed(
            f"offer {request.offer_id} is on a host that does not run {why} workloads{reason}; choose an offer whose "
            f"isolation lists {why}", code="workload_kind_unsupported",
        )  # fmt: skip
    if why == isolation.Refusal.LIMITS:
        over = isolation.limit_over(facts or {}, request.workload, fraction=fraction)
        field_name = f"workload.{over[0] if over else 'limits'}"
        raise ValidationFailed(
            f"{field_name}: offer {request.offer_id}'s host cannot give the workload "
            f"{isolation.limits_exceed(facts or {}, request.workload, fraction=fraction)}; ask for less or choose a larger host",
            code="limits_exceed_host", details={"problems": [{"field": field_name, "problem": f"at most {over[2]:g}" if over else "too large"}]},
        )  # fmt: skip
    if why == isolation.Refusal.IMAGE:
        allowed = ", ".join(((facts or {}).get("image_policy") or {}).get("allowed") or ()) or "none"
        raise ValidationFailed(
            f"offer {request.offer_id}'s provider does not allow the image {request.workload.get('image')!r} (allowed: {allowed})",
            code="image_not_allowed",
        )
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
    """Active interruptible rentals the request outranks: id → (bid, created). Not those in a preemption in flight,
    as victims or as takers (a chain of them could not be rolled back)."""
    victim = aliased(Rental)
    query = select(Rental.id, Rental.bid_per_gpu_hour, Rental.created_at).where(
        Rental.kind == "interruptible", Rental.state.in_(ACTIVE_STATES), Rental.host_id.is_not(None), Rental.preempting_by_id.is_(None),
        ~exists().where(victim.preempting_by_id == Rental.id),
    )
    if request.priority is not None:
        query = query.where(Rental.bid_per_gpu_hour < request.priority)
    return {rid: (bid or Decimal(0), created) for rid, bid, created in (await session.execute(query)).all()}


def _find_victims(found: Candidates, wanted: PlaceRequest, outranked: dict[str, tuple[Decimal, datetime]]) -> tuple[list[str], Placement] | None:
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


def _beyond_every_host(found: Candidates) -> ValidationFailed | None:
    """When no host at all could give the workload's limits: 422 naming the field and the most any host allows."""
    if found.nodes or not found.limits or set(found.excluded) != {isolation.Refusal.LIMITS}:
        return None
    name, most = max(found.limits.items())
    unit = UNITS.get(name, "")  # type: ignore[call-overload]
    return ValidationFailed(
        f"workload.{name}: no host can give a rental of this size that much; the most any host allows is {most:g} {unit}; ask for less",
        code="limits_exceed_host", details={"problems": [{"field": f"workload.{name}", "problem": f"at most {most:g}"}], "most": most},
    )


def _no_room(request: RentalRequest, found: Candidates, tied: volumes.Resolved | None = None) -> ClientError:
    reason = _no_room_anywhere(request, found)
    if tied is None or not isinstance(reason, InsufficientCapacity):
        return reason
    # The rental's volumes tie it to their host: say so, so the renter knows why other hosts with room were not asked.
    return InsufficientCapacity(f"the rental's {tied.describe()}, the only host it may go to: {reason.message}")


def _no_room_anywhere(request: RentalRequest, found: Candidates) -> ClientError:
    what = f"{request.gpu_count} × {request.gpu_model or 'any GPU'}"
    if request.mig_profile is not None:
        what = f"a MIG {request.mig_profile} instance"
    elif request.gpu_milli < MILLI:
        what = f"a {request.gpu_milli}-milli share of {request.gpu_model or 'any GPU'}"
    if request.offer_id is not None:
        what += f" on offer {request.offer_id}"
    if (beyond := _beyond_every_host(found)) is not None:
        return beyond
    image = request.workload.get("image")
    notes = {
        "bid": "bids below their minimum", "unit": "not renting shares that small", "quota": "too dear for your spend quota",
        "mig": f"without MIG {request.mig_profile} instances",
        isolation.Refusal.CONTAINER: "not running container workloads", isolation.Refusal.PROCESS: "not running process workloads",
        isolation.Refusal.IMAGE: f"refusing the image {image} by their provider's image policy",
        isolation.Refusal.LIMITS: "smaller than the workload's CPU, memory, pids or disk limits",
    }  # fmt: skip
    left_out = "; ".join(f"{count} left out as {notes[why]}" for why, count in sorted(found.excluded.items()))
    which = "no host"
    if found.excluded.keys() & {isolation.Refusal.CONTAINER, isolation.Refusal.IMAGE}:
        which = f"no host that runs container workloads of {image}"
    elif isolation.Refusal.PROCESS in found.excluded:
        which = "no host that runs process workloads"
    return InsufficientCapacity(
        f"{which} has {what} free right now{f' ({left_out})' if left_out else ''}; try again later, ask for less, "
        "or send queue: true to wait"
    )


async def _volume_hosts_refuse(session: AsyncSession, request: RentalRequest, tied: volumes.Resolved) -> ClientError | None:
    """Why the rental's volumes' hosts cannot take it now (offline, or a lost host it must avoid), or None; raises
    409 ``volume_on_other_host`` for an offer on another host."""
    hosts = tied.hosts
    if request.offer_id is not None and request.offer_id.split(":", 1)[0] not in hosts:
        raise Conflict(f"offer {request.offer_id} is on another host than the rental's {tied.describe()}: choose an offer "
                       "of that host, or leave offer_id out", code="volume_on_other_host")  # fmt: skip
    usable = [h for h in hosts if h not in request.avoid_hosts]
    if not usable:
        return Conflict(f"the rental's {tied.describe()}, which it may not use again (the host was lost)", code="volume_host_offline")
    down = await volumes.hosts_down(session, usable)
    if len(down) < len(usable):
        return None
    states = ", ".join(f"{host} is {state}" for host, state in sorted(down.items()))
    return Conflict(f"the rental's {tied.describe()}, which cannot take it now ({states}); try again when it is back, "
                    "or send queue: true to wait for it", code="volume_host_offline")  # fmt: skip


async def try_place(
    master: Master, session: AsyncSession, rental: Rental, request: RentalRequest, *, now: datetime
) -> tuple[list[str], ClientError | None]:
    """Place ``rental`` (new, or queued and locked); returns its commands to publish, or the reason it cannot be placed now.

    With volumes, only on their host (``volumes.resolve``: raises when they cannot be mounted at all); the reason says
    which volume and why its host cannot take the rental now (offline, no room), and the attachments are written with
    the claim (``volumes.attach``)."""
    price_cap = await check_quota(master, session, rental.renter_id, request, exclude=rental.id)
    tied: volumes.Resolved | None = None
    if request.volumes:
        tied = await volumes.resolve(session, rental.renter_id, request.volumes, rental_id=rental.id,
                                     alternatives=request.service_id is not None)  # fmt: skip
        if (refused := await _volume_hosts_refuse(session, request, tied)) is not None:
            return [], refused
    if (beyond := await _beyond_fleet(session, request, None if tied is None else tied.hosts)) is not None:
        return [], beyond
    wanted = request.place_request()
    placer = price_first(master, request)
    only = None if tied is None else tied.hosts
    found = await find_candidates(master, session, request, now=now, price_cap=price_cap, only_hosts=only)
    for _round in range(MAX_PLACEMENT_ROUNDS):
        victims: list[str] = []
        placement = placer.place_priced(wanted, found.nodes, [found.hosts[node.node_id][2] for node in found.nodes])
        if placement is None:
            chosen = _find_victims(found, wanted, await _preemptible(session, request))
            if chosen is None:
                return [], _no_room(request, found, tied)
            victims, placement = chosen
        host, name, price = found.hosts[placement.node_id]
        if master.settings.require_credit:
            gpus = Decimal(request.gpu_count * request.share) / MILLI
            await master.credit_gate.has_credit_for(session, rental.renter_id, price, gpus, min_period_s=master.settings.billing_min_period_s)
        async with session.begin_nested() as attempt:
            rental.host_id, rental.gpu_model, rental.price_per_gpu_hour = host.host_id, name, price
            rental.gpu_uuids = list(placement.mig_instances or placement.gpu_uuids)
            if request.gpu_milli < MILLI:
                rental.gpu_memory_mib = placement.gpu_memory_mib
            if rental not in session:
                session.add(rental)
            await session.flush()
            grace = master.settings.preemption_grace_s
            preempts = await preemption.mark(session, victims, rental, grace_s=grace, now=now) if victims else []
            claimed = preempts is not None and await allocation.claim(session, rental, placement, host, name, at=now)
            if not claimed:
                log.info("lost a race for GPUs on host %s; reading the fleet again", host.host_id)
                await attempt.rollback()
            elif tied is not None:  # a second writer raises volume_in_use, and this savepoint goes with it
                await volumes.attach(session, rental.id, tied.options[host.host_id], at=now)
        if not claimed:
            found = await find_candidates(master, session, request, now=now, price_cap=price_cap, only_hosts=only)
            continue
        assert preempts is not None
        if master.settings.placement_pause_after_claim_s:  # fault injection: the fault suite kills the master here
            log.warning("placement of rental %s paused %gs after its claim (placement_pause_after_claim_s)", rental.id,
                        master.settings.placement_pause_after_claim_s)  # fmt: skip
            await asyncio.sleep(master.settings.placement_pause_after_claim_s)
        mounts = None if tied is None else list(tied.options[host.host_id])
        return [await _start(session, rental, request, placement, preempts, now=now, mounts=mounts)], None
    return [], _no_room(request, found, tied)


async def _start(
    session: AsyncSession, rental: Rental, request: RentalRequest, placement: Placement, preempts: list[protocol.Preemption], *,
    now: datetime, mounts: list[protocol.VolumeMount] | None = None,
) -> str:
    assert rental.host_id is not None
    if request.replaces:
        cause = f"placed again after rental {request.replaces} lost its host"
    elif rental.queue_until is not None:
        cause = "placed from the queue"
    else:
        cause = "placed"
    session.add(RentalEvent(rental_id=rental.id, from_state=None if rental.queue_until is None else RentalState.PENDING.value,
                            to_state=RentalState.PENDING.value,
                            cause=f"{cause} on host {rental.host_id} ({placement.node_id})"))  # fmt: skip
    share = None
    if request.gpu_milli < MILLI and request.mig_profile is None:
        share = protocol.GpuShare(milli=request.gpu_milli, memory_mib=placement.gpu_memory_mib)
    # The account's row is locked (``check_quota``): a key change waits for this commit and then updates the rental too.
    keys, access_version = await accounts.current_keys(session, rental.renter_id)
    start = protocol.StartWorkload.model_validate(
        {"rental_id": rental.id, "gpu_uuids": rental.gpu_uuids, "workload": rental.workload, "share": share,
         "authorized_keys": keys, "access_version": access_version, "preempts": preempts or None, "volumes": mounts or None,
         "rdma_devices": await _rdma_devices(session, rental)}
    )
    command = commands.new_command(session, host_id=rental.host_id, command=start, rental_id=rental.id)
    command.created_at = now + timedelta(microseconds=1)  # after the commands the rental's placement follows
    advance(session, rental, RentalState.STARTING, f"start command {command.id} sent to host {rental.host_id}")
    log.info("rental %s placed on host %s (%d × %d milli)", rental.id, rental.host_id, request.gpu_count, rental.gpu_milli)
    return command.id


async def _rdma_devices(session: AsyncSession, rental: Rental) -> list[str] | None:
    """A cluster member's container on a host whose declared fabric lets RDMA through (``FabricDeclaration.rdma``):
    the host's RDMA devices, as its hello listed them (docs/clusters.md, "Three paths"); else ``None``."""
    if rental.cluster_id is None or (rental.workload or {}).get("kind") != "container" or rental.host_id is None:
        return None
    host = await session.get(Host, rental.host_id)
    network = (host.facts or {}).get("cluster_network") if host is not None else None
    try:
        facts = protocol.ClusterNetworkFacts.model_validate(network) if network else None
    except ValueError:
        return None
    if facts is None or facts.fabric is None or not facts.fabric.rdma or not facts.rdma_devices:
        return None
    return list(facts.rdma_devices)


async def cancel_commands(session: AsyncSession, rental_id: str, *, at: datetime, reason: str) -> None:
    await commands.cancel_open(session, rental_id, at=at, reason=reason)
