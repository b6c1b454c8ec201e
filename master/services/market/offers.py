"""The offer search behind ``GET /api/v1/offers``.

An **offer** is one rentable host's free GPUs of one model: its id is ``host_id:gpu_name``.
A host is offered while it is in a rentable state (online or rented), for its present
GPUs that no rental holds, unless its listing's ``available_until`` has passed or one of
its maintenance windows is open now.

**Price.** A listed host's GPUs cost its listing's ``price_per_gpu_hour``. A host without
a listing is offered too, at the ``default`` price of each GPU's tier from
``master/data/price_bounds.toml`` (``listed: false``), so a host is rentable from its first
hello — the embedded demo's agents never list. A GPU with no tier yet takes the entry
default.

**Work done in SQL.** The search reads ``offer_summary`` (``master.models.OfferSummary``, migration 0018):
one row per host and kind of free GPU, kept by the database's triggers whenever a GPU, its host or its
listing changes, with what the search reads of the host and listing copied in. The query language compiles
to one statement over it (``offer_page``) that filters, groups, sorts, pages and counts: a host's model of
one kind is its one row; models of several kinds on a host are grouped (``GROUP BY host, model``; the
``num_gpus`` condition is its ``HAVING``); the total is a ``count(*) OVER ()``; the page's 50 hosts and
listings are joined after the paging, by key. One statement whatever the fleet's size, none per host (a
page past the end runs a plain count as well), and one more for the page's GPU challenge proofs (each offer's
``verification``: ``master.services.market.proven``). The only filter not written in SQL is the GPU model words
match (``master.services.market.placement.model_matches``): it is evaluated over the distinct model names (a
fourth, small query), and the statement then filters on ``gpu_name IN (...)``. ``compute_capability`` /
``cuda_driver_version`` compare integer version keys, not the info JSON. Placement filters GPU rows with
the same conditions (``row_conditions``), joined to their hosts and listings. At 100,000 GPUs see
``bench/bench_offers.py`` and the README's performance table; ``tests/offers_reference.py`` keeps the search
over GPU rows this replaced, which ``tests/test_offer_summary.py`` checks it against.

**Verified** (the ``verified`` field and filter) means proven by the GPU challenge (``docs/verification.md``): the
listing's flag, which the challenge flow sets, and every present GPU of the host passed within
``OfferSearch.verification_max_age`` (a ``NOT EXISTS`` over the host's GPUs: a stale pass no longer counts, even
before the flow clears the flag).

Conditions come from ``master/services/market/query.py``; unknown values (no reliability score yet,
no network measurement) fail every comparison except ``!=``.

**Sorts** (``sort``, ``order``): ``score`` (the default: best first), ``price`` (cheapest
first), ``price_per_performance`` (price / score, best value first), ``reliability``
(most reliable first). ``order`` reverses the default direction; offers without the sort
value always come last. Ties go by score, then reliability, then offer id, so paging is
stable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Float,
    Integer,
    Numeric,
    Select,
    SQLColumnExpression,
    and_,
    case,
    cast,
    false,
    func,
    literal,
    literal_column,
    not_,
    or_,
    select,
    text,
    union_all,
)
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from master.models import Gpu, GpuAllocation, Host, HostListing, OfferSummary
from master.services.isolation import isolation_view
from master.services.lifecycle.hosts import RENTABLE_STATES
from master.services.market.listings import (
    PriceBounds,
    load_price_bounds,
    money,
    upcoming_windows,
    window_time,
)
from master.services.market.placement import model_matches
from master.services.market.proven import VERIFICATION_MAX_AGE, offer_verifications, unproven_gpu
from master.services.market.query import Condition, Op, Value, Version
from master.services.market.reliability import is_seeded
from master.services.market.storage import storage_view, volume_gib_used
from master.services.market.tiers import Tier

__all__ = ["DEFAULT_ORDER", "OfferPrice", "OfferSearch", "Order", "Sort", "search_offer_prices", "search_offers"]


class Sort(StrEnum):
    SCORE = "score"
    PRICE = "price"
    PRICE_PER_PERFORMANCE = "price_per_performance"
    RELIABILITY = "reliability"


class Order(StrEnum):
    ASC = "asc"
    DESC = "desc"


# The direction each sort takes unless ``order`` says otherwise: best first.
DEFAULT_ORDER = {Sort.SCORE: Order.DESC, Sort.PRICE: Order.ASC, Sort.PRICE_PER_PERFORMANCE: Order.ASC, Sort.RELIABILITY: Order.DESC}

_PRICE = Numeric(12, 6)


@dataclass(frozen=True)
class OfferSearch:
    conditions: Sequence[Condition] = ()
    sort: Sort = Sort.SCORE
    order: Order | None = None  # None: the sort's default direction
    limit: int = 50
    offset: int = 0
    now: datetime | None = None  # when "now" is, for availability and maintenance windows
    verification_max_age: timedelta = VERIFICATION_MAX_AGE  # how long a passed GPU challenge counts as verified
    bounds: PriceBounds | None = field(default=None, compare=False)


# ---- SQL pieces --------------------------------------------------------------------------------


def _default_price(bounds: PriceBounds, tier: SQLColumnExpression[str | None]) -> ColumnElement[Decimal]:
    """The tier default for a GPU of an unlisted host (entry's when the GPU has no tier)."""
    whens = {t.value: literal(bounds[t].default, _PRICE) for t in Tier}
    return case(whens, value=tier, else_=literal(bounds[Tier.ENTRY].default, _PRICE))


def _in_window(dialect: str, windows: str) -> str:
    """SQL: one of the windows of the JSON column ``windows`` is open at ``:maintenance_now`` (fixed-form text)."""
    if dialect == "postgresql":
        return (
            f"EXISTS (SELECT 1 FROM json_array_elements({windows}) AS mw(w) "
            "WHERE mw.w->>'start' <= :maintenance_now AND :maintenance_now < mw.w->>'end')"
        )
    return (
        f"EXISTS (SELECT 1 FROM json_each({windows}) AS mw "
        "WHERE json_extract(mw.value, '$.start') <= :maintenance_now AND :maintenance_now < json_extract(mw.value, '$.end'))"
    )


def unavailable_hosts(dialect: str, now: datetime) -> Select[Any]:
    """Listed hosts not to offer at ``now``: past their end date, or in a maintenance window (placement's filter)."""
    in_window = text(_in_window(dialect, "host_listings.maintenance_windows")).bindparams(maintenance_now=window_time(now))
    return select(HostListing.host_id).where(or_(HostListing.available_until <= now, in_window))


def _compare(expr: SQLColumnExpression[Any], op: Op, values: Sequence[Any]) -> ColumnElement[bool]:
    if op is Op.EQ:
        return expr.in_(values)
    if op is Op.NE:
        # Unknown is "not equal": a host with no region is not in eu-west.
        return or_(expr.is_(None), expr.not_in(values))
    [value] = values
    comparison = {Op.LT: expr.__lt__, Op.LE: expr.__le__, Op.GT: expr.__gt__, Op.GE: expr.__ge__}[op]
    return and_(comparison(value))


@dataclass
class _Columns:
    """The expressions conditions and sorts refer to: of a GPU row joined to its host and listing (placement),
    or of an ``offer_summary`` row (the search)."""

    gpu_name: SQLColumnExpression[str]
    vram_mib: SQLColumnExpression[int]
    compute_capability: SQLColumnExpression[int | None]
    cuda_driver_version: SQLColumnExpression[int | None]
    price: ColumnElement[Decimal]
    region: SQLColumnExpression[str | None]
    tier: SQLColumnExpression[str | None]
    score: SQLColumnExpression[float | None]
    reliability: SQLColumnExpression[float | None]
    download_mbps: SQLColumnExpression[float | None]
    upload_mbps: SQLColumnExpression[float | None]
    verified: SQLColumnExpression[bool]
    isolated: SQLColumnExpression[bool | None]
    model_names: Sequence[str] = ()

    @property
    def price_per_score(self) -> ColumnElement[float]:
        return case((self.score > 0, cast(self.price, Float) / self.score), else_=None)

    def condition(self, c: Condition) -> ColumnElement[bool]:
        values: Sequence[Value] = c.values
        match c.field:
            case "gpu_name":
                wanted = [str(v) for v in values]
                matching = [n for n in self.model_names if any(model_matches(w, n) for w in wanted)]
                if c.op is Op.EQ:
                    return self.gpu_name.in_(matching) if matching else false()
                return self.gpu_name.not_in(matching) if matching else not_(false())
            case "vram":
                return _compare((self.vram_mib + 512) // 1024, c.op, values)
            case "vram_mib":
                return _compare(self.vram_mib, c.op, values)
            case "compute_capability" | "cuda_driver_version":
                keys = [v.key for v in values if isinstance(v, Version)]
                return _compare(getattr(self, c.field), c.op, keys)
            case "price":
                return _compare(self.price, c.op, values)
            case "price_per_score":
                return _compare(self.price_per_score, c.op, values)
            case "tier":
                return _compare(self.tier, c.op, [str(v) for v in values])
            case "region" | "score" | "reliability" | "download_mbps" | "upload_mbps" | "isolated":
                # isolated: NULL (an older agent's host: unknown) fails = either way and passes !=.
                return _compare(getattr(self, c.field), c.op, values)
            case "verified":
                return _compare(self.verified, c.op, values)
        raise ValueError(f"no SQL for offer field {c.field!r}")  # the parser only makes known fields


def _proven(flag: SQLColumnExpression[bool], host_id: SQLColumnExpression[str], cutoff: datetime | None) -> ColumnElement[bool]:
    """``verified``: the listing's flag (set by the GPU challenge) and, with ``cutoff``, no present GPU of the host that
    has not passed since then (a stale pass no longer counts; ``master.services.market.proven``)."""
    if cutoff is None:
        return and_(flag)
    return and_(flag, not_(unproven_gpu(host_id, cutoff)))


def _gpu_columns(bounds: PriceBounds, model_names: Sequence[str] = (), *, cutoff: datetime | None = None) -> _Columns:
    return _Columns(
        Gpu.name, Gpu.memory_total_mib, Gpu.compute_capability_key, Gpu.cuda_version_key, price_expression(bounds),
        Host.region, Gpu.tier, Gpu.score, Host.reliability, Host.latest_network["download_mbps"].as_float(),
        Host.latest_network["upload_mbps"].as_float(), _proven(func.coalesce(HostListing.verified, false()), Host.id, cutoff),
        Host.isolation["isolated"].as_boolean(), model_names,
    )  # fmt: skip


def _summary_columns(bounds: PriceBounds, model_names: Sequence[str] = (), *, cutoff: datetime | None = None) -> _Columns:
    s = OfferSummary
    price = func.coalesce(s.listed_price, _default_price(bounds, s.tier))
    return _Columns(
        s.gpu_name, s.memory_total_mib, s.compute_capability_key, s.cuda_version_key, price, s.region, s.tier,
        s.score, s.reliability, s.download_mbps, s.upload_mbps, _proven(s.verified, s.host_id, cutoff), s.isolated, model_names,
    )  # fmt: skip


async def row_conditions(
    session: AsyncSession, conditions: Sequence[Condition], *, bounds: PriceBounds, now: datetime | None = None,
    verification_max_age: timedelta = VERIFICATION_MAX_AGE,
) -> list[ColumnElement[bool]]:
    """SQL over ``gpus`` joined to ``hosts`` and (outer) ``host_listings`` for every condition but
    ``num_gpus`` (a property of a group of GPUs): what placement filters a rental's requirements by.
    ``verified`` needs every present GPU of the host to have passed since ``now - verification_max_age``
    (``now`` None: the wall clock)."""
    needs_names = any(c.field == "gpu_name" for c in conditions)
    cutoff = (now or datetime.now(UTC)) - verification_max_age
    columns = _gpu_columns(bounds, await _model_names(session) if needs_names else (), cutoff=cutoff)
    return [columns.condition(c) for c in conditions if c.field != "num_gpus"]


def price_expression(bounds: PriceBounds) -> ColumnElement[Decimal]:
    """USD per GPU-hour of a GPU row: its host's listing price, else its tier's default."""
    return func.coalesce(HostListing.price_per_gpu_hour, _default_price(bounds, Gpu.tier))


async def _model_names(session: AsyncSession) -> list[str]:
    """The models of the free GPUs (the summary holds exactly those), for the Python model-words match."""
    return list((await session.scalars(select(OfferSummary.gpu_name).distinct())).all())


def _order_by(sort: Sort, order: Order, sub: Any, per_score: ColumnElement[float], dialect: str = "") -> list[Any]:
    """The page's order: the sort's key (missing values last in either direction), then score and reliability, then
    the offer's id. On PostgreSQL each key is one sort column (``NULLS LAST``, ids in ``COLLATE "C"``: bytes, which for
    UTF-8 is code-point order, not the collation's strcoll): a deep page sorts 1.7× faster than with a separate
    ``IS NULL`` column per key. Elsewhere (SQLite, whose BINARY collation is code-point order already) the portable
    ``x IS NULL, x`` pair."""
    postgres = dialect == "postgresql"

    def key(expr: Any, descending: bool) -> list[Any]:
        directed = expr.desc() if descending else expr.asc()
        return [directed.nulls_last()] if postgres else [expr.is_(None), directed]

    descending = order is Order.DESC
    keys = key({Sort.SCORE: sub.c.score, Sort.PRICE: sub.c.price, Sort.PRICE_PER_PERFORMANCE: per_score,
                Sort.RELIABILITY: sub.c.reliability}[sort], descending)
    # Ties: best score, then most reliable, whatever the direction asked.
    if sort is not Sort.SCORE:
        keys += key(sub.c.score, True)
    if sort is not Sort.RELIABILITY:
        keys += key(sub.c.reliability, True)
    ids = [sub.c.host_id.collate("C"), sub.c.gpu_name.collate("C")] if postgres else [sub.c.host_id, sub.c.gpu_name]
    return [*keys, *ids]


# ---- the search --------------------------------------------------------------------------------


def _groups(search: OfferSearch, *, dialect: str, now: datetime, bounds: PriceBounds, model_names: Sequence[str]) -> Any:
    """Every offer ``search`` matches, unsorted: a subquery over ``offer_summary``.

    A host's model of one kind (``kinds = 1``: nearly every offer) is its one summary row, kept or dropped whole by
    the conditions; only models of several kinds on one host are grouped after filtering (``GROUP BY``).
    The version texts shown are those of the group's free GPUs, whichever conditions picked the group.
    """
    s = OfferSummary
    columns = _summary_columns(bounds, model_names, cutoff=now - search.verification_max_age)
    row_conditions = [columns.condition(c) for c in search.conditions if c.field != "num_gpus"]
    counts = [c for c in search.conditions if c.field == "num_gpus"]
    no_window_open = text(f"NOT {_in_window(dialect, 'offer_summary.maintenance_windows')}")
    offered = (
        s.host_state.in_(RENTABLE_STATES),
        or_(s.available_until.is_(None), s.available_until > now),
        or_(s.maintenance_windows.is_(None), no_window_open.bindparams(maintenance_now=window_time(now))),
        *row_conditions,
    )
    single = select(
        s.host_id.label("host_id"),
        s.gpu_name.label("gpu_name"),
        s.free_gpus.label("num_gpus"),
        s.mig_free.label("mig_free"),
        s.memory_total_mib.label("vram_mib"),
        s.tier.label("tier"),
        s.score.label("score"),
        cast(s.needs_review, Integer).label("needs_review"),
        columns.price.label("price"),
        s.reliability.label("reliability"),
        s.compute_capability.label("compute_capability"),
        s.cuda_driver_version.label("cuda_driver_version"),
    ).where(literal_column("offer_summary.kinds = 1", Boolean), *offered, *(_compare(s.free_gpus, c.op, c.values) for c in counts))
    kinds = aliased(OfferSummary, name="kinds")

    def version(column: Any) -> Any:
        return select(func.max(column)).where(kinds.host_id == s.host_id, kinds.gpu_name == s.gpu_name).scalar_subquery()

    total_gpus = func.sum(s.free_gpus)
    several = (
        select(
            s.host_id,
            s.gpu_name,
            total_gpus,
            func.sum(s.mig_free),
            func.max(s.memory_total_mib),
            func.max(s.tier),  # one model on one host: one classification
            func.max(s.score),
            func.max(cast(s.needs_review, Integer)),
            func.max(columns.price),
            func.max(s.reliability),
            version(kinds.compute_capability),
            version(kinds.cuda_driver_version),
        )
        .where(literal_column("offer_summary.kinds > 1", Boolean), *offered)  # literal: ix_offer_summary_several's predicate
        .group_by(s.host_id, s.gpu_name)
    )
    if counts:
        several = several.having(and_(*(_compare(total_gpus, c.op, c.values) for c in counts)))
    return union_all(single, several).subquery("offer_groups")


def _page(search: OfferSearch, *, dialect: str, now: datetime, bounds: PriceBounds, model_names: Sequence[str]) -> Any:
    """``search``'s offers sorted and paged (a subquery), each with its ``price_per_score`` and the number of matches in
    all (``total``)."""
    sub = _groups(search, dialect=dialect, now=now, bounds=bounds, model_names=model_names)
    per_score = case((sub.c.score > 0, cast(sub.c.price, Float) / sub.c.score), else_=None)
    order = search.order or DEFAULT_ORDER[search.sort]
    return (
        select(sub, per_score.label("price_per_score"), func.count().over().label("total"))
        .order_by(*_order_by(search.sort, order, sub, per_score, dialect))
        .limit(search.limit)
        .offset(search.offset)
        .subquery("page")
    )


def offer_page(search: OfferSearch, *, dialect: str, now: datetime, bounds: PriceBounds, model_names: Sequence[str]) -> Select[Any]:
    """``search``'s page as one statement: its offers sorted and paged, each with the number of matches in all
    (``total``), its host's and its listing's shown values (the page's 50 hosts read by key, after the paging)."""
    page = _page(search, dialect=dialect, now=now, bounds=bounds, model_names=model_names)
    order = search.order or DEFAULT_ORDER[search.sort]
    return (
        select(page, Host.region, Host.state, Host.latest_network, Host.isolation, Host.reliability_inputs, HostListing)
        .join(Host, Host.id == page.c.host_id)
        .outerjoin(HostListing, HostListing.host_id == page.c.host_id)
        .order_by(*_order_by(search.sort, order, page, page.c.price_per_score, dialect))
    )


async def search_offers(session: AsyncSession, search: OfferSearch) -> tuple[list[dict[str, Any]], int]:
    """One page of offers matching every condition, in the asked order, and how many match in all.

    Reads ``offer_summary``, which the database's triggers keep at commit: on PostgreSQL a transaction
    that changed GPUs, hosts or listings sees its own changes here only once it has committed.
    """
    now = search.now or datetime.now(UTC)
    bounds = search.bounds or load_price_bounds()
    dialect = session.get_bind().dialect.name
    names = await _model_names(session) if any(c.field == "gpu_name" for c in search.conditions) else ()
    page = (await session.execute(offer_page(search, dialect=dialect, now=now, bounds=bounds, model_names=names))).all()
    if not page:
        # A page past the end: count the matches on their own.
        if not search.offset:
            return [], 0
        groups = _groups(search, dialect=dialect, now=now, bounds=bounds, model_names=names)
        return [], int(await session.scalar(select(func.count()).select_from(groups)) or 0)
    migs = await mig_free_by_profile(session, [(row.host_id, row.gpu_name) for row in page if row.mig_free])
    proofs = await verification_by_offer(session, page, now=now, max_age=search.verification_max_age)
    used = await volume_gib_used(session, (row.host_id for row in page))
    views = [
        _offer_view(row, row, (row.compute_capability, row.cuda_driver_version), now, migs.get((row.host_id, row.gpu_name), {}),
                    proofs[(row.host_id, row.gpu_name)], volume_gib=used.get(row.host_id, 0))
        for row in page
    ]  # fmt: skip
    return views, int(page[0].total)


async def mig_free_by_profile(session: AsyncSession, offers: Sequence[tuple[str, str]]) -> dict[tuple[str, str], dict[str, int]]:
    """The free MIG instances per profile of each ``(host id, GPU model)`` in ``offers``: the instances its present GPUs
    in MIG mode report (with a uuid and a profile) that no active allocation holds, as placement reads them
    (``master.services.rentals.allocation.load_fleet``). Two statements for a whole page, none when ``offers`` is empty."""
    if not offers:
        return {}
    wanted = set(offers)
    rows = (
        await session.execute(
            select(Gpu.host_id, Gpu.name, Gpu.info).where(
                Gpu.host_id.in_(sorted({host for host, _ in wanted})), Gpu.present.is_(True), Gpu.info["mig_mode"].as_boolean().is_(True)
            )
        )
    ).all()
    instances: list[tuple[tuple[str, str], str, str]] = [
        ((host_id, name), str(m["uuid"]), str(m["profile"]))
        for host_id, name, info in rows
        if (host_id, name) in wanted
        for m in (info or {}).get("mig_instances") or ()
        if isinstance(m, dict) and m.get("uuid") and m.get("profile")
    ]
    taken: set[str | None] = set()
    if instances:
        uuids = sorted({uuid for _, uuid, _ in instances})
        taken = set((await session.scalars(select(GpuAllocation.active_mig).where(GpuAllocation.active_mig.in_(uuids)))).all())
    free: dict[tuple[str, str], dict[str, int]] = {}
    for key, uuid, profile in instances:
        if uuid not in taken:
            profiles = free.setdefault(key, {})
            profiles[profile] = profiles.get(profile, 0) + 1
    return free


async def verification_by_offer(
    session: AsyncSession, page: Sequence[Any], *, now: datetime, max_age: timedelta = VERIFICATION_MAX_AGE
) -> dict[tuple[str, str], dict[str, Any]]:
    """Each offer row's ``verification`` summary (``master.services.market.proven.offer_verification``): one statement
    for the page. A row carries ``host_id``, ``gpu_name`` and its listing (``HostListing``, None when unlisted)."""
    keys = [(row.host_id, row.gpu_name, bool(row.HostListing is not None and row.HostListing.verified)) for row in page]
    return await offer_verifications(session, keys, now=now, max_age=max_age)


@dataclass(frozen=True)
class OfferPrice:
    """An offer reduced to what pricing many offers at once reads: no listing, no view."""

    host_id: str
    gpu_name: str
    num_gpus: int
    price_per_gpu_hour: Decimal
    region: str | None
    reliability: float | None


async def search_offer_prices(session: AsyncSession, search: OfferSearch) -> tuple[list[OfferPrice], int]:
    """``search_offers`` reduced to each offer's host, model, free GPUs, price, region and reliability: the same
    matches, order, page and total, in one statement (``offer_page``'s, without the listings and the views), for a
    caller that reads thousands (``master.services.market.cluster_offers``)."""
    now = search.now or datetime.now(UTC)
    bounds = search.bounds or load_price_bounds()
    dialect = session.get_bind().dialect.name
    names = await _model_names(session) if any(c.field == "gpu_name" for c in search.conditions) else ()
    page = _page(search, dialect=dialect, now=now, bounds=bounds, model_names=names)
    order = search.order or DEFAULT_ORDER[search.sort]
    statement = (
        select(page.c.host_id, page.c.gpu_name, page.c.num_gpus, page.c.price, page.c.reliability, page.c.total, Host.region)
        .join(Host, Host.id == page.c.host_id)
        .order_by(*_order_by(search.sort, order, page, page.c.price_per_score, dialect))
    )
    rows = (await session.execute(statement)).all()
    if not rows:
        if not search.offset:
            return [], 0
        groups = _groups(search, dialect=dialect, now=now, bounds=bounds, model_names=names)
        return [], int(await session.scalar(select(func.count()).select_from(groups)) or 0)
    prices = [OfferPrice(r.host_id, r.gpu_name, int(r.num_gpus), Decimal(r.price), r.region, r.reliability) for r in rows]
    return prices, int(rows[0].total)


def _profile_order(item: tuple[str, int]) -> tuple[int, str]:
    """Largest MIG profile first (``7g.80gb`` before ``1g.10gb``), then by name."""
    slices = item[0].split("g", 1)[0]
    return (-int(slices) if slices.isdigit() else 0, item[0])


def _offer_view(
    row: Any, host: Any, versions: tuple[str | None, str | None], now: datetime, mig: dict[str, int] | None = None,
    verification: dict[str, Any] | None = None, *, volume_gib: int = 0,
) -> dict[str, Any]:
    """One offer as the API shows it; ``volume_gib``: what its host's live volumes take (docs/volumes.md)."""
    network = host.latest_network or {}
    listing: HostListing | None = host.HostListing
    price = Decimal(row.price)
    return {
        "id": f"{row.host_id}:{row.gpu_name}",
        "host_id": row.host_id,
        "gpu_name": row.gpu_name,
        "num_gpus": int(row.num_gpus),
        # GPUs in MIG mode rent only as their instances (``mig_profile``), never whole: counted apart, per profile.
        "mig_instances_free": int(row.mig_free or 0),
        "mig": [{"profile": profile, "free": count} for profile, count in sorted((mig or {}).items(), key=_profile_order)],
        "vram_mib": row.vram_mib,
        "compute_capability": versions[0],
        "cuda_driver_version": versions[1],
        "region": host.region,
        "host_state": host.state,
        "tier": row.tier,
        "performance_score": row.score,
        "needs_review": bool(row.needs_review),
        "reliability": row.reliability,
        "reliability_seeded": is_seeded(host.reliability_inputs),
        "download_mbps": network.get("download_mbps"),
        "upload_mbps": network.get("upload_mbps"),
        "price_per_gpu_hour": money(price),
        "price_per_score": None if row.price_per_score is None else float(row.price_per_score),
        "listed": listing is not None,
        # Proven by the GPU challenge: the listing's flag, and every present GPU of the host passed recently.
        "verified": bool(verification and verification["verified"]),
        "verification": verification,
        "min_bid_per_gpu_hour": None if listing is None or listing.min_bid_per_gpu_hour is None else money(listing.min_bid_per_gpu_hour),
        "smallest_unit": "gpu" if listing is None else listing.smallest_unit,
        "available_until": None if listing is None or listing.available_until is None else listing.available_until.isoformat(),
        "maintenance_windows": [] if listing is None else upcoming_windows(listing.maintenance_windows, now),
        "isolation": isolation_view(host.isolation),
        # Volumes (docs/volumes.md): the storage the host lends, its price per GiB-hour, the GiB still free.
        **storage_view(listing, volume_gib, host.isolation),
    }
