"""GPU allocation in the database: the fleet as the scheduler sees it, and atomic claims.

**Reading.** ``load_fleet`` reads the rentable hosts' present GPUs — what each has free, its
MIG instances and which are taken, the host's listing terms and network — and which
interruptible rentals hold what (for preemption). ``HostState.nodes`` turns that into the
scheduler's ``Node``\\ s, one per host and GPU model (node id ``host_id:gpu_name``, the offer id),
optionally as if some rentals had let go.

**Claiming.** A decision is only a proposal until ``claim`` makes it true with conditional
statements that fail when another master got there first:

* whole GPUs: ``UPDATE gpus SET rental_id = :r, milli_used = 1000 … WHERE rental_id IS NULL AND
  milli_used = 0`` — every GPU or none (the caller's savepoint);
* a share: ``UPDATE gpus SET milli_used = milli_used + :m, memory_used_mib = memory_used_mib + :mem
  WHERE rental_id IS NULL AND milli_used + :m <= 1000 AND memory_used_mib + :mem <= memory_total_mib``;
* a MIG instance: a ``gpu_allocations`` row whose ``active_mig`` is unique.

PostgreSQL re-checks a conditional UPDATE's WHERE against the row a concurrent transaction
committed, so two masters can never both succeed. Every claim also writes a
``gpu_allocations`` row; ``release`` gives back exactly what those rows hold, once.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import ColumnElement, case, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Gpu, GpuAllocation, Host, HostListing, Rental
from master.scheduler import MILLI, LinkStats, MigSlot, Node, Placement
from master.scheduler import Gpu as SchedGpu
from master.services.lifecycle.hosts import RENTABLE_STATES
from master.services.market import PriceBounds, Tier, price_expression, unavailable_hosts

log = logging.getLogger(__name__)

# A MIG slice's share of its GPU: an A100/H100 has seven compute slices ("3g.40gb" = 3/7).
MIG_SLICES = 7
_TIERS = frozenset(t.value for t in Tier)


def mig_milli(profile: str) -> int:
    """Thousandths of a GPU a MIG profile's compute is (``"1g.10gb"`` → 142)."""
    slices = int(profile.split("g", 1)[0])
    return max(1, slices * MILLI // MIG_SLICES)


@dataclass
class GpuState:
    id: str
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    holder: str | None  # the rental holding all of it
    milli_used: int
    memory_used_mib: int
    mig: list[tuple[str, str]] | None  # (instance uuid, profile) when MIG mode is on
    price: Decimal
    min_bid: Decimal


@dataclass
class Hold:
    """An active allocation: what one rental holds of one GPU."""

    rental_id: str
    gpu_id: str
    milli: int
    memory_mib: int
    whole: bool
    mig_uuid: str | None


@dataclass
class HostState:
    host_id: str
    region: str | None
    links: dict[str, LinkStats]
    smallest_unit: str  # from the listing; "gpu" when unlisted
    gpus: list[GpuState] = field(default_factory=list)
    isolation: dict[str, Any] | None = None  # the host's isolation facts (None: an older agent, unknown)

    def models(self) -> list[str]:
        return sorted({gpu.name for gpu in self.gpus})

    def node(self, name: str, holds: Sequence[Hold] = (), *, freed: Collection[str] = ()) -> Node:
        """The host's GPUs of model ``name`` as a scheduler node; ``freed``: rentals to count as gone."""
        taken_mig = {h.mig_uuid for h in holds if h.mig_uuid is not None and h.rental_id not in freed}
        given_back: dict[str, tuple[int, int, bool]] = {}
        for hold in holds:
            if hold.rental_id in freed and hold.mig_uuid is None:
                milli, memory, whole = given_back.get(hold.gpu_id, (0, 0, False))
                given_back[hold.gpu_id] = (milli + hold.milli, memory + hold.memory_mib, whole or hold.whole)
        gpus = []
        for gpu in self.gpus:
            if gpu.name != name:
                continue
            if gpu.mig is not None:
                slots = [MigSlot(instance, profile, free=instance not in taken_mig) for instance, profile in gpu.mig]
                gpus.append(SchedGpu(gpu.index, uuid=gpu.uuid, milli_free=0, mig=slots))
                continue
            milli_back, memory_back, whole_back = given_back.get(gpu.id, (0, 0, False))
            if gpu.holder is not None and not whole_back:
                milli_free, memory_free = 0, 0
            elif gpu.holder is not None:
                milli_free, memory_free = MILLI, gpu.memory_total_mib
            else:
                milli_free = min(MILLI, MILLI - gpu.milli_used + milli_back)
                memory_free = min(gpu.memory_total_mib, gpu.memory_total_mib - gpu.memory_used_mib + memory_back)
            gpus.append(
                SchedGpu(gpu.index, uuid=gpu.uuid, milli_free=max(0, milli_free), memory_mib=gpu.memory_total_mib,
                         memory_free_mib=max(0, memory_free))
            )  # fmt: skip
        return Node(f"{self.host_id}:{name}", name, gpus, cpu_milli=0, memory_mib=0, links=self.links)

    def gpu_by_index(self, name: str, index: int) -> GpuState:
        return next(g for g in self.gpus if g.name == name and g.index == index)


def _links(region: str | None, network: dict[str, Any] | None) -> dict[str, LinkStats]:
    """The host's measured network, filed under its region (the agent measures to its region's relay)."""
    network = network or {}
    latency = network.get("latency_ms")
    if region is None or latency is None or network.get("error"):
        return {}
    loss = float(network.get("loss") or 0.0) * 100.0
    return {region: LinkStats(float(latency), float(network.get("jitter_ms") or 0.0), loss)}


async def load_fleet(
    session: AsyncSession,
    *,
    now: datetime,
    bounds: PriceBounds,
    conditions: Iterable[ColumnElement[bool]] = (),
    host_ids: Collection[str] | None = None,
) -> dict[str, HostState]:
    """Rentable hosts (online or rented, listed terms in force) and their present GPUs matching ``conditions``.

    Plain columns, not ORM objects (a large fleet is read for every placement); a GPU's
    info JSON is read only where MIG mode is on.
    """
    dialect = session.get_bind().dialect.name
    mig_mode = Gpu.info["mig_mode"].as_boolean()
    query = (
        select(
            Gpu.id, Gpu.host_id, Gpu.index, Gpu.uuid, Gpu.name, Gpu.memory_total_mib, Gpu.rental_id, Gpu.milli_used,
            Gpu.memory_used_mib, Gpu.tier, mig_mode, case((mig_mode.is_(True), Gpu.info), else_=None),
            Host.region, Host.latest_network, HostListing.smallest_unit, HostListing.min_bid_per_gpu_hour,
            price_expression(bounds), Host.isolation,
        )
        .join(Host, Host.id == Gpu.host_id)
        .outerjoin(HostListing, HostListing.host_id == Gpu.host_id)
        .where(
            Host.state.in_(RENTABLE_STATES), Gpu.present.is_(True), Gpu.host_id.not_in(unavailable_hosts(dialect, now)),
            *conditions,
        )
        .order_by(Gpu.host_id, Gpu.index)
    )  # fmt: skip
    if host_ids is not None:
        query = query.where(Gpu.host_id.in_(list(host_ids)))
    fleet: dict[str, HostState] = {}
    for (gpu_id, host_id, index, uuid, name, memory, holder, milli_used, memory_used, tier_name, mig_on, info, region,
         network, unit, listed_min_bid, price, isolation) in (await session.execute(query)).all():  # fmt: skip
        state = fleet.get(host_id)
        if state is None:
            state = fleet[host_id] = HostState(host_id, region, _links(region, network), unit or "gpu", isolation=isolation)
        tier = Tier(tier_name) if tier_name in _TIERS else Tier.ENTRY
        min_bid = listed_min_bid if listed_min_bid else bounds[tier].min
        mig = None
        if mig_on:
            mig = [(str(m["uuid"]), str(m["profile"])) for m in (info or {}).get("mig_instances") or () if m.get("uuid") and m.get("profile")]
        state.gpus.append(
            GpuState(gpu_id, index, uuid, name, memory, holder, milli_used, memory_used, mig, Decimal(price), Decimal(min_bid))
        )
    return fleet


async def active_holds(session: AsyncSession, host_ids: Collection[str] | None = None) -> dict[str, list[Hold]]:
    """Active allocations (on these hosts; None: everywhere), by host."""
    query = select(GpuAllocation, Gpu.host_id).join(Gpu, Gpu.id == GpuAllocation.gpu_id).where(GpuAllocation.released_at.is_(None))
    if host_ids is not None:
        query = query.where(Gpu.host_id.in_(list(host_ids)))
    rows = (await session.execute(query)).all()
    holds: dict[str, list[Hold]] = {}
    for allocation, host_id in rows:
        holds.setdefault(host_id, []).append(
            Hold(allocation.rental_id, allocation.gpu_id, allocation.milli, allocation.memory_mib, allocation.whole,
                 allocation.mig_uuid)
        )  # fmt: skip
    return holds


async def claim(session: AsyncSession, rental: Rental, placement: Placement, host: HostState, name: str, *, at: datetime) -> bool:
    """Take what ``placement`` gives for ``rental``; False when another rental took part of it first.

    Run inside a savepoint: a False leaves earlier statements of this claim to be rolled back.
    """
    if placement.mig_instances:
        gpu = host.gpu_by_index(name, placement.gpu_indices[0])
        taken = await session.scalar(
            select(GpuAllocation.id).where(GpuAllocation.active_mig.in_(list(placement.mig_instances)))
        )
        if taken is not None:
            return False
        for instance in placement.mig_instances:
            session.add(GpuAllocation(rental_id=rental.id, gpu_id=gpu.id, milli=rental.gpu_milli, memory_mib=0,
                                      mig_uuid=instance, active_mig=instance, created_at=at))  # fmt: skip
        await session.flush()  # a concurrent claim of the same instance fails here (unique active_mig)
        return True
    gpus = [host.gpu_by_index(name, index) for index in placement.gpu_indices]
    if placement.gpu_milli >= MILLI:
        result = await session.execute(
            update(Gpu)
            .where(Gpu.id.in_([g.id for g in gpus]), Gpu.rental_id.is_(None), Gpu.milli_used == 0)
            .values(rental_id=rental.id, milli_used=MILLI, memory_used_mib=Gpu.memory_total_mib)
        )
        if result.rowcount != len(gpus):  # type: ignore[attr-defined]
            return False
        for gpu in gpus:
            session.add(GpuAllocation(rental_id=rental.id, gpu_id=gpu.id, milli=MILLI, memory_mib=gpu.memory_total_mib,
                                      whole=True, created_at=at))  # fmt: skip
        return True
    milli, memory = placement.gpu_milli, placement.gpu_memory_mib
    for gpu in gpus:
        result = await session.execute(
            update(Gpu)
            .where(
                Gpu.id == gpu.id, Gpu.rental_id.is_(None), Gpu.milli_used + milli <= MILLI,
                Gpu.memory_used_mib + memory <= Gpu.memory_total_mib,
            )
            .values(milli_used=Gpu.milli_used + milli, memory_used_mib=Gpu.memory_used_mib + memory)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            return False
        session.add(GpuAllocation(rental_id=rental.id, gpu_id=gpu.id, milli=milli, memory_mib=memory, created_at=at))
    return True


async def release(session: AsyncSession, rental_id: str, *, at: datetime) -> int:
    """Give back everything ``rental_id`` holds; idempotent (each allocation is released once). Returns how many."""
    allocations = (
        await session.scalars(
            select(GpuAllocation).where(GpuAllocation.rental_id == rental_id, GpuAllocation.released_at.is_(None))
        )
    ).all()
    released = 0
    for allocation in allocations:
        done = await session.execute(
            update(GpuAllocation)
            .where(GpuAllocation.id == allocation.id, GpuAllocation.released_at.is_(None))
            .values(released_at=at, active_mig=None)
            .execution_options(synchronize_session="fetch")
        )
        if done.rowcount != 1:  # type: ignore[attr-defined]
            continue  # another transaction released it meanwhile
        released += 1
        if allocation.mig_uuid is not None:
            continue
        if allocation.whole:
            await session.execute(
                update(Gpu).where(Gpu.id == allocation.gpu_id, Gpu.rental_id == rental_id).values(rental_id=None, milli_used=0, memory_used_mib=0)
            )
        else:
            await session.execute(
                update(Gpu)
                .where(Gpu.id == allocation.gpu_id)
                .values(milli_used=Gpu.milli_used - allocation.milli, memory_used_mib=Gpu.memory_used_mib - allocation.memory_mib)
            )
    return released



async def reclaim(session: AsyncSession, rental_id: str, *, at: datetime) -> bool:
    """Take back what ``rental_id`` held when it was last released (a preemption rolled back: ``preemption.settle``);
    False when part of it is taken (the caller's savepoint undoes the rest). Same conditional statements as ``claim``."""
    last = await session.scalar(
        select(GpuAllocation.released_at).where(GpuAllocation.rental_id == rental_id, GpuAllocation.released_at.is_not(None))
        .order_by(GpuAllocation.released_at.desc()).limit(1)
    )  # fmt: skip
    if last is None:
        return False
    held = (
        await session.scalars(select(GpuAllocation).where(GpuAllocation.rental_id == rental_id, GpuAllocation.released_at == last))
    ).all()
    for old in held:
        if old.mig_uuid is not None:
            taken = await session.scalar(select(GpuAllocation.id).where(GpuAllocation.active_mig == old.mig_uuid))
            if taken is not None:
                return False
        elif old.whole:
            result = await session.execute(
                update(Gpu)
                .where(Gpu.id == old.gpu_id, Gpu.rental_id.is_(None), Gpu.milli_used == 0)
                .values(rental_id=rental_id, milli_used=MILLI, memory_used_mib=Gpu.memory_total_mib)
            )
            if result.rowcount != 1:  # type: ignore[attr-defined]
                return False
        else:
            result = await session.execute(
                update(Gpu)
                .where(
                    Gpu.id == old.gpu_id, Gpu.rental_id.is_(None), Gpu.milli_used + old.milli <= MILLI,
                    Gpu.memory_used_mib + old.memory_mib <= Gpu.memory_total_mib,
                )
                .values(milli_used=Gpu.milli_used + old.milli, memory_used_mib=Gpu.memory_used_mib + old.memory_mib)
            )  # fmt: skip
            if result.rowcount != 1:  # type: ignore[attr-defined]
                return False
        session.add(GpuAllocation(rental_id=rental_id, gpu_id=old.gpu_id, milli=old.milli, memory_mib=old.memory_mib, whole=old.whole,
                                  mig_uuid=old.mig_uuid, active_mig=old.mig_uuid, created_at=at))  # fmt: skip
    await session.flush()  # a concurrent claim of the same MIG instance fails here (unique active_mig)
    return bool(held)
