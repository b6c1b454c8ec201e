"""The offer search as it was before ``offer_summary`` (migration 0018): the reference the summary is checked against.

It groups the GPU rows themselves (``gpus`` joined to ``hosts`` and ``host_listings``) in one SQL query, as
``master.services.market.offers.search_offers`` did until 2026-11-26, and shows each offer with the same view; since
migration 0031 a GPU in MIG mode counts its free instances (``mig_free``), never as a free whole GPU. The
property test (``tests/test_offer_summary.py``) and ``bench/bench_offers.py`` (its same-run baseline) use it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Float, Integer, and_, case, cast, func, literal, not_, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Gpu, GpuAllocation, Host, HostListing
from master.services.lifecycle.hosts import RENTABLE_STATES
from master.services.market import offers, proven
from master.services.market.listings import load_price_bounds
from master.services.market.offers import DEFAULT_ORDER, OfferSearch

__all__ = ["reference_search"]


async def reference_search(session: AsyncSession, search: OfferSearch) -> tuple[list[dict[str, Any]], int]:
    """``search``'s page and total, evaluated over the GPU rows."""
    now = search.now or datetime.now(UTC)
    bounds = search.bounds or load_price_bounds()
    dialect = session.get_bind().dialect.name
    # Free: a GPU outside MIG mode that no rental holds and no share uses (it rents whole), or one in MIG mode with a
    # free instance (it rents as instances: counted in ``mig_free``, never in ``num_gpus``).
    mig_mode = func.coalesce(Gpu.info["mig_mode"].as_boolean(), False).is_(True)
    mig_counts = await _free_mig_instances(session)
    whole = and_(Gpu.present.is_(True), not_(mig_mode), Gpu.rental_id.is_(None), Gpu.milli_used == 0)
    free = (or_(whole, Gpu.id.in_(sorted(mig_counts))),)
    needs_names = any(c.field == "gpu_name" for c in search.conditions)
    names = list((await session.scalars(select(Gpu.name).where(*free).distinct())).all()) if needs_names else []
    columns = offers._gpu_columns(bounds, names, cutoff=now - search.verification_max_age)
    count = func.sum(case((whole, 1), else_=0))
    mig_free = func.sum(case(mig_counts, value=Gpu.id, else_=0)) if mig_counts else literal(0)
    grouped = (
        select(
            Gpu.host_id.label("host_id"), Gpu.name.label("gpu_name"), count.label("num_gpus"), mig_free.label("mig_free"),
            func.max(Gpu.memory_total_mib).label("vram_mib"), func.max(Gpu.tier).label("tier"),
            func.max(Gpu.score).label("score"), func.max(cast(Gpu.needs_review, Integer)).label("needs_review"),
            func.max(columns.price).label("price"), func.max(Host.reliability).label("reliability"),
        )
        .select_from(Gpu)
        .join(Host, Host.id == Gpu.host_id)
        .outerjoin(HostListing, HostListing.host_id == Gpu.host_id)
        .where(
            Host.state.in_(RENTABLE_STATES), *free, Gpu.host_id.not_in(offers.unavailable_hosts(dialect, now)),
            *(columns.condition(c) for c in search.conditions if c.field != "num_gpus"),
        )
        .group_by(Gpu.host_id, Gpu.name)
    )  # fmt: skip
    group_conditions = [offers._compare(count, c.op, c.values) for c in search.conditions if c.field == "num_gpus"]
    if group_conditions:
        grouped = grouped.having(and_(*group_conditions))
    sub = grouped.subquery("offer_groups")
    per_score = case((sub.c.score > 0, cast(sub.c.price, Float) / sub.c.score), else_=None)
    order = search.order or DEFAULT_ORDER[search.sort]
    page = (
        await session.execute(
            select(sub, per_score.label("price_per_score"), func.count().over().label("total"))
            .order_by(*offers._order_by(search.sort, order, sub, per_score))
            .limit(search.limit)
            .offset(search.offset)
        )
    ).all()
    if not page:
        total = int(await session.scalar(select(func.count()).select_from(sub)) or 0) if search.offset else 0
        return [], total
    host_ids = sorted({row.host_id for row in page})
    hosts = {
        row.id: row
        for row in (
            await session.execute(
                select(Host.id, Host.region, Host.state, Host.latest_network, Host.isolation, Host.reliability_inputs, HostListing)
                .outerjoin(HostListing, HostListing.host_id == Host.id)
                .where(Host.id.in_(host_ids))
            )
        ).all()
    }
    versions: dict[tuple[str, str], tuple[str | None, str | None]] = {}
    for gpu_host, gpu_name, capability, cuda in (
        await session.execute(
            select(Gpu.host_id, Gpu.name, Gpu.info["compute_capability"].as_string(), Gpu.info["cuda_driver_version"].as_string())
            .where(Gpu.host_id.in_(host_ids), *free)
        )
    ).all():
        known = versions.get((gpu_host, gpu_name), (None, None))
        versions[(gpu_host, gpu_name)] = (known[0] or capability, known[1] or cuda)
    migs = await offers.mig_free_by_profile(session, [(row.host_id, row.gpu_name) for row in page if row.mig_free])
    flags = [(row.host_id, row.gpu_name, bool(hosts[row.host_id].HostListing and hosts[row.host_id].HostListing.verified)) for row in page]
    proofs = await proven.offer_verifications(session, flags, now=now, max_age=search.verification_max_age)
    views = [
        offers._offer_view(row, hosts[row.host_id], versions.get((row.host_id, row.gpu_name), (None, None)), now,
                           migs.get((row.host_id, row.gpu_name), {}), proofs[(row.host_id, row.gpu_name)])
        for row in page
    ]  # fmt: skip
    return views, int(page[0].total)


async def _free_mig_instances(session: AsyncSession) -> dict[str, int]:
    """GPU id → free MIG instances, of the present GPUs in MIG mode that have one (read in Python, from the rows)."""
    in_mig_mode = Gpu.info["mig_mode"].as_boolean().is_(True)
    rows = (await session.execute(select(Gpu.id, Gpu.info).where(Gpu.present.is_(True), in_mig_mode))).all()
    taken = set((await session.scalars(select(GpuAllocation.active_mig).where(GpuAllocation.active_mig.is_not(None)))).all())
    counts: dict[str, int] = {}
    for gpu_id, info in rows:
        free = [m for m in info.get("mig_instances") or () if isinstance(m, dict) and m.get("uuid") and m.get("profile")
                and str(m["uuid"]) not in taken]  # fmt: skip
        if free:
            counts[gpu_id] = len(free)
    return counts
