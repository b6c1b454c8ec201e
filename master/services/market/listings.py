"""Host listings: a provider's terms for renting a host, and the platform's price bounds.

Rules (``PUT /api/v1/hosts/{id}/listing``; ``docs/marketplace.md`` says them for users)
====================================================================================

1. **Who.** The host's provider or an admin. Anyone else gets 404 ``host_not_found`` (a
   provider does not learn which host ids exist). A revoked host cannot be listed (409).
2. **Price bounds.** ``price_per_gpu_hour`` (USD, > 0, at most 6 decimal places) must lie
   within ``[min, max]`` of the host's **best GPU tier** — the highest tier among its
   present GPUs, in the order flagship > datacenter > prosumer > consumer > entry — from
   ``master/data/price_bounds.toml``. One price covers every GPU of the host, so a host
   mixing an H100 with an RTX 4090 is priced as a flagship host. A host whose GPUs are not
   classified yet (before its first hello) cannot be listed (409 ``host_not_classified``).
   Bounds are checked when the listing is written; a later re-tiering does not rewrite it.
3. **Minimum bid** for interruptible use: optional, > 0 and ≤ the price.
4. **Smallest unit:** ``gpu`` (whole GPUs), ``mig:<profile>`` (``mig:1g.10gb``; needs a
   MIG-capable GPU on the host) or ``milli:<n>`` (fractional shares, n thousandths of a GPU,
   1–999).
5. **Availability:** ``available_until`` (optional) must be in the future; after it the host
   is no longer offered. ``maintenance_windows`` (at most 32) each need ``start < end``, an
   end in the future, and no two may overlap (touching is fine). During a window the host is
   not offered. Times are stored to the second (start rounded down, end rounded up).
   ``POST /api/v1/hosts/{id}/maintenance-windows`` adds one window to a listed host and
   ``DELETE …/maintenance-windows/{start}`` clears one (``add_window``, ``clear_window``),
   the other terms unchanged; windows already over are dropped as either writes.
6. **Storage for volumes** (docs/volumes.md): ``storage_price_per_gib_hour`` (USD per GiB-hour, more than 0, at
   most 6 decimals and ``MAX_STORAGE_PRICE``) and ``volume_gib`` (how much of the host's disk it lends to renters'
   volumes, 0 by default: none), both optional; GiB lent need a price (422 ``storage_price_needed``). Lowering either
   leaves the volumes already made as they are (each keeps the price it was made at); new ones see the new terms.
7. **Verified** means *proven by the GPU challenge* (issue 40, ``docs/verification.md``): the
   challenge flow sets it when every present GPU of the host has passed, and clears it when one
   fails. Nobody sets it by hand: a PUT that names ``verified`` is refused (a provider's: 403
   ``forbidden``; an admin's: 422 ``verified_by_challenge``, pointing to
   ``POST /api/v1/admin/hosts/{id}/verify``); a PUT without it leaves the flag as it is.

A PUT replaces the whole listing (optional fields left out go back to their defaults) and
is idempotent: repeating it changes nothing, not even ``updated_at``.

Hosts without a listing are still offered, at the ``default`` price of each GPU's tier
(``master/services/market/offers.py``): the embedded demo's agents never list, and a new host is
rentable from its first hello.
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Gpu, Host, HostListing
from master.services.accounts import Principal
from master.services.market.storage import check_storage_terms
from master.services.market.tiers import Tier
from shared.errors import ConfigError, Conflict, Forbidden, NotFound, ValidationFailed
from shared.money import MAX_PRICE, PRICE_PLACES, amount_problem, parse_amount

__all__ = [
    "MAX_MAINTENANCE_WINDOWS",
    "PRICE_QUANTUM",
    "TIER_ORDER",
    "ListingTerms",
    "MaintenanceWindow",
    "PriceBounds",
    "TierPrice",
    "add_window",
    "best_tier",
    "clear_window",
    "get_listing",
    "listing_view",
    "load_price_bounds",
    "money",
    "parse_price_bounds",
    "price_of",
    "put_listing",
    "upcoming_windows",
    "window_time",
]

PRICE_QUANTUM = Decimal("0.000001")  # Numeric(12, 6): six decimal places
MAX_MAINTENANCE_WINDOWS = 32
# Best first: a host's listing is bounded by the first of these among its GPUs.
TIER_ORDER: tuple[Tier, ...] = (Tier.FLAGSHIP, Tier.DATACENTER, Tier.PROSUMER, Tier.CONSUMER, Tier.ENTRY)
WINDOW_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # fixed width, so stored windows compare correctly as text

_MIG_UNIT = re.compile(r"mig:([1-7]g\.[0-9]{1,3}gb(?:\+me)?)")
_MILLI_UNIT = re.compile(r"milli:([0-9]{1,3})")


# ---- price bounds --------------------------------------------------------------------------


@dataclass(frozen=True)
class TierPrice:
    tier: Tier
    min: Decimal
    default: Decimal
    max: Decimal

    def view(self) -> dict[str, str]:
        return {"tier": self.tier.value, "min": money(self.min), "default": money(self.default), "max": money(self.max)}


@dataclass(frozen=True)
class PriceBounds:
    """USD per GPU-hour per tier; every tier has bounds."""

    tiers: Mapping[Tier, TierPrice]

    def __getitem__(self, tier: Tier) -> TierPrice:
        return self.tiers[tier]

    def view(self) -> list[dict[str, str]]:
        return [self.tiers[t].view() for t in TIER_ORDER]


def _amount(raw: object, where: str) -> Decimal:
    if not isinstance(raw, str):
        raise ConfigError(f"{where} must be a decimal string such as \"0.40\" (never a float), got {raw!r}")
    problem, value = amount_problem(raw, places=PRICE_PLACES, maximum=MAX_PRICE, positive=True)
    if value is None:
        raise ConfigError(f"{where} {problem}")
    return value


def price_of(raw: object, *, field: str, code: str) -> Decimal:
    """A price in USD per GPU-hour as a client sent it (``shared/money.py``'s grammar, 6 decimals, more than 0);
    ValidationFailed with ``code`` says what to write."""
    return parse_amount(raw, places=PRICE_PLACES, maximum=MAX_PRICE, positive=True, field=field, code=code)


def parse_price_bounds(document: Mapping[str, object]) -> PriceBounds:
    """Bounds from a parsed TOML document with a ``[tier.<name>]`` table per tier; ConfigError names the problem."""
    section = document.get("tier")
    if not isinstance(section, Mapping):
        raise ConfigError("the price bounds need a [tier.<name>] table for every tier")
    unknown = sorted(set(section) - {t.value for t in Tier})
    if unknown:
        raise ConfigError(f"price bounds name unknown tiers: {', '.join(unknown)}")
    tiers: dict[Tier, TierPrice] = {}
    for tier in Tier:
        entry = section.get(tier.value)
        if not isinstance(entry, Mapping):
            raise ConfigError(f"price bounds lack [tier.{tier.value}]")
        low, default, high = (_amount(entry.get(k), f"tier.{tier.value}.{k}") for k in ("min", "default", "max"))
        if not low <= default <= high:
            raise ConfigError(f"tier.{tier.value} needs min <= default <= max; got {low}, {default}, {high}")
        tiers[tier] = TierPrice(tier, low, default, high)
    return PriceBounds(tiers)


@functools.cache
def load_price_bounds() -> PriceBounds:
    """The packaged bounds, read from ``master/data/price_bounds.toml`` on first use."""
    resource = importlib.resources.files("master").joinpath("data/price_bounds.toml")
    return parse_price_bounds(tomllib.loads(resource.read_text(encoding="utf-8")))


def money(amount: Decimal) -> str:
    """An amount as the API shows it: a string with six decimal places (``"0.450000"``)."""
    return str(amount.quantize(PRICE_QUANTUM))


def best_tier(tiers: Iterable[str | None]) -> Tier | None:
    """The best of ``tiers`` in TIER_ORDER; None when none is a known tier."""
    known = {t for t in tiers if t is not None}
    return next((t for t in TIER_ORDER if t.value in known), None)


# ---- terms and their checks ------------------------------------------------------------------


@dataclass(frozen=True)
class MaintenanceWindow:
    start: datetime
    end: datetime


@dataclass(frozen=True)
class ListingTerms:
    """What a PUT asks for; ``verified`` must be None (the GPU challenge sets the flag): any other value is refused."""

    price_per_gpu_hour: Decimal
    min_bid_per_gpu_hour: Decimal | None = None
    smallest_unit: str = "gpu"
    available_until: datetime | None = None
    maintenance_windows: Sequence[MaintenanceWindow] = ()
    verified: bool | None = None
    storage_price_per_gib_hour: Decimal | None = None
    volume_gib: int = 0


def window_time(moment: datetime, *, round_up: bool = False) -> str:
    """``moment`` in the stored fixed form, to the second (rounded down, or up for a window's end)."""
    if moment.tzinfo is None:
        raise ValueError("naive datetime given as a maintenance window time")
    moment = moment.astimezone(UTC)
    if round_up and moment.microsecond:
        moment += timedelta(microseconds=1_000_000 - moment.microsecond)
    return moment.strftime(WINDOW_FORMAT)


def _check_price(price: Decimal, name: str, code: str, *, unit: str = "GPU-hour") -> None:
    if not price.is_finite() or price <= 0:
        raise ValidationFailed(f"{name} must be more than 0 USD per {unit}; got {price}", code=code)
    if price > MAX_PRICE or price != price.quantize(PRICE_QUANTUM):  # in this order: quantize needs a bounded value
        raise ValidationFailed(f"{name} takes at most 6 decimal places and at most {MAX_PRICE}; got {price}", code=code)


def _smallest_unit(unit: str, gpus: Sequence[Gpu]) -> str:
    if unit == "gpu":
        return unit
    if mig := _MIG_UNIT.fullmatch(unit):
        if not any(g.info.get("mig_mode") is not None for g in gpus):
            raise ValidationFailed(
                f"smallest_unit {unit!r} needs a MIG-capable GPU and this host has none; use 'gpu' or 'milli:<n>'",
                code="invalid_smallest_unit",
            )
        return f"mig:{mig.group(1)}"
    if (milli := _MILLI_UNIT.fullmatch(unit)) and 1 <= int(milli.group(1)) <= 999:
        return f"milli:{int(milli.group(1))}"
    raise ValidationFailed(
        f"smallest_unit must be 'gpu', 'mig:<profile>' (e.g. mig:1g.10gb) or 'milli:<n>' with n from 1 to 999; got {unit[:64]!r}",
        code="invalid_smallest_unit",
    )


def _windows(windows: Sequence[MaintenanceWindow], now: datetime) -> list[dict[str, str]]:
    if len(windows) > MAX_MAINTENANCE_WINDOWS:
        raise ValidationFailed(f"at most {MAX_MAINTENANCE_WINDOWS} maintenance windows; got {len(windows)}", code="invalid_maintenance_window")
    stored = []
    for number, window in enumerate(windows, start=1):
        if window.start.tzinfo is None or window.end.tzinfo is None:
            raise ValidationFailed(f"maintenance window {number} needs times with a timezone", code="invalid_maintenance_window")
        if window.end <= window.start:
            raise ValidationFailed(f"maintenance window {number} ends before it starts", code="invalid_maintenance_window")
        if window.end <= now:
            raise ValidationFailed(f"maintenance window {number} is already over", code="invalid_maintenance_window")
        stored.append({"start": window_time(window.start), "end": window_time(window.end, round_up=True)})
    stored.sort(key=lambda w: (w["start"], w["end"]))
    for earlier, later in itertools.pairwise(stored):
        if later["start"] < earlier["end"]:
            raise ValidationFailed(
                f"maintenance windows overlap: {earlier['start']}–{earlier['end']} and {later['start']}–{later['end']}",
                code="invalid_maintenance_window",
            )
    return stored


def _checked(terms: ListingTerms, tier: Tier, bounds: PriceBounds, gpus: Sequence[Gpu], now: datetime) -> dict[str, Any]:
    """The columns to store for ``terms``, or ValidationFailed naming the first broken rule."""
    price = terms.price_per_gpu_hour
    _check_price(price, "price_per_gpu_hour", "invalid_price")
    limits = bounds[tier]
    if not limits.min <= price <= limits.max:
        raise ValidationFailed(
            f"price_per_gpu_hour must be between {money(limits.min)} and {money(limits.max)} USD for a {tier.value} host "
            f"(its best GPU's tier); got {price}",
            code="price_out_of_bounds",
            details={"tier": tier.value, "min": money(limits.min), "max": money(limits.max)},
        )
    min_bid = terms.min_bid_per_gpu_hour
    if min_bid is not None:
        _check_price(min_bid, "min_bid_per_gpu_hour", "invalid_min_bid")
        if min_bid > price:
            raise ValidationFailed(
                f"min_bid_per_gpu_hour ({min_bid}) must not exceed price_per_gpu_hour ({price})", code="invalid_min_bid"
            )
    until = terms.available_until
    if until is not None:
        if until.tzinfo is None:
            raise ValidationFailed("available_until needs a timezone (e.g. 2027-01-01T00:00:00Z)", code="invalid_available_until")
        if until <= now:
            raise ValidationFailed(f"available_until must be in the future; got {until.isoformat()}", code="invalid_available_until")
    storage = terms.storage_price_per_gib_hour
    if storage is not None:
        _check_price(storage, "storage_price_per_gib_hour", "invalid_storage_price", unit="GiB-hour")
    check_storage_terms(storage, terms.volume_gib)
    return {
        "price_per_gpu_hour": price.quantize(PRICE_QUANTUM),
        "min_bid_per_gpu_hour": None if min_bid is None else min_bid.quantize(PRICE_QUANTUM),
        "smallest_unit": _smallest_unit(terms.smallest_unit, gpus),
        "available_until": None if until is None else until.astimezone(UTC),
        "maintenance_windows": _windows(terms.maintenance_windows, now),
        "storage_price_per_gib_hour": None if storage is None else storage.quantize(PRICE_QUANTUM),
        "volume_gib": terms.volume_gib,
    }


# ---- the service -------------------------------------------------------------------------


async def _present_gpus(session: AsyncSession, host_id: str) -> list[Gpu]:
    return list((await session.scalars(select(Gpu).where(Gpu.host_id == host_id, Gpu.present.is_(True)))).all())


async def put_listing(
    session: AsyncSession, principal: Principal, host_id: str, terms: ListingTerms, *, now: datetime,
    bounds: PriceBounds | None = None,
) -> tuple[HostListing, bool, Tier]:
    """Create or replace the host's listing; returns it, whether it was created, and the tier that bounded its price.

    Nothing is written when a rule is broken. Cancelling it is safe: it runs inside the
    caller's transaction, which then rolls back.
    """
    host = await session.get(Host, host_id)
    if host is None or (principal.role != "admin" and host.owner_id != principal.account_id):
        raise NotFound(f"no host {host_id!r} among your hosts", code="host_not_found")
    if host.state == "revoked":
        raise Conflict(f"host {host_id!r} is revoked and cannot be listed", code="host_revoked")
    if terms.verified is not None:
        if principal.role != "admin":
            raise Forbidden("verified is proven by the platform's GPU challenge, never set by a provider; leave it out")
        raise ValidationFailed(
            f"verified is set by the GPU challenge, not by hand; leave it out and run POST /api/v1/admin/hosts/{host_id}/verify",
            code="verified_by_challenge",
        )
    gpus = await _present_gpus(session, host_id)
    tier = best_tier(g.tier for g in gpus)
    if tier is None:
        raise Conflict(
            f"host {host_id!r} has no classified GPUs yet; list it after its agent has connected",
            code="host_not_classified",
        )
    columns = _checked(terms, tier, bounds or load_price_bounds(), gpus, now)
    listing = await session.get(HostListing, host_id, with_for_update=True)
    if listing is None:
        listing = HostListing(host_id=host_id, verified=False, created_at=now, updated_at=now, **columns)
        try:
            async with session.begin_nested():
                session.add(listing)
                await session.flush()
            return listing, True, tier
        except IntegrityError:
            # A concurrent PUT created it first: replace that one like any other.
            found = await session.get(HostListing, host_id, with_for_update=True, populate_existing=True)
            if found is None:  # pragma: no cover - the row that collided is there
                raise
            listing = found
    changed = False
    for name, value in columns.items():
        if getattr(listing, name) != value:
            setattr(listing, name, value)
            changed = True
    if changed:
        listing.updated_at = now
        await session.flush()
    return listing, False, tier


async def get_listing(session: AsyncSession, principal: Principal, host_id: str) -> tuple[HostListing, Tier | None]:
    """The host's listing and its best GPU tier; renters and admins see any host's, providers their own."""
    host = await session.get(Host, host_id)
    if host is None or not (principal.role in ("admin", "renter") or host.owner_id == principal.account_id):
        raise NotFound(f"no host {host_id!r}", code="host_not_found")
    listing = await session.get(HostListing, host_id)
    if listing is None:
        raise NotFound(
            f"host {host_id!r} has no listing; its GPUs are offered at their tier's default price until its provider "
            f"sets one with PUT /api/v1/hosts/{host_id}/listing",
            code="listing_not_found",
        )
    return listing, best_tier(g.tier for g in await _present_gpus(session, host_id))


def upcoming_windows(stored: Sequence[Any], now: datetime) -> list[dict[str, str]]:
    """The stored windows that have not ended by ``now``, in order."""
    current = window_time(now)
    return [dict(w) for w in stored if isinstance(w, dict) and str(w.get("end", "")) > current]


def listing_view(listing: HostListing, *, tier: Tier | None, now: datetime, bounds: PriceBounds | None = None) -> dict[str, Any]:
    limits = (bounds or load_price_bounds())[tier].view() if tier is not None else None
    return {
        "host_id": listing.host_id,
        "price_per_gpu_hour": money(listing.price_per_gpu_hour),
        "min_bid_per_gpu_hour": None if listing.min_bid_per_gpu_hour is None else money(listing.min_bid_per_gpu_hour),
        "smallest_unit": listing.smallest_unit,
        "available_until": None if listing.available_until is None else listing.available_until.isoformat(),
        "maintenance_windows": upcoming_windows(listing.maintenance_windows, now),
        "verified": listing.verified,
        "storage_price_per_gib_hour": None if listing.storage_price_per_gib_hour is None else money(listing.storage_price_per_gib_hour),
        "volume_gib": listing.volume_gib,
        "tier": None if tier is None else tier.value,
        "price_bounds": limits,
        "created_at": listing.created_at.isoformat(),
        "updated_at": listing.updated_at.isoformat(),
    }


# ---- one maintenance window at a time ------------------------------------------------------


async def _listing_to_change(session: AsyncSession, principal: Principal, host_id: str) -> tuple[HostListing, Tier | None]:
    """The host's listing, locked, when ``principal`` may change it (as ``put_listing`` decides)."""
    host = await session.get(Host, host_id)
    if host is None or (principal.role != "admin" and host.owner_id != principal.account_id):
        raise NotFound(f"no host {host_id!r} among your hosts", code="host_not_found")
    if host.state == "revoked":
        raise Conflict(f"host {host_id!r} is revoked and cannot be listed", code="host_revoked")
    listing = await session.get(HostListing, host_id, with_for_update=True)
    if listing is None:
        raise NotFound(
            f"host {host_id!r} has no listing; set its price (PUT /api/v1/hosts/{host_id}/listing) before its maintenance windows",
            code="listing_not_found",
        )
    return listing, best_tier(g.tier for g in await _present_gpus(session, host_id))


def _store_windows(listing: HostListing, windows: list[dict[str, str]], now: datetime) -> None:
    if windows != listing.maintenance_windows:
        listing.maintenance_windows = windows  # a new list: the JSON column sees the change
        listing.updated_at = now


async def add_window(
    session: AsyncSession, principal: Principal, host_id: str, window: MaintenanceWindow, *, now: datetime
) -> tuple[HostListing, Tier | None]:
    """Add one maintenance window to the host's listing; the other terms stay as they are.

    422 ``invalid_maintenance_window`` when it ends before it starts, is already over, overlaps
    one of the listing's windows (touching is fine) or would be one too many. Cancelling it is
    safe: it runs inside the caller's transaction.
    """
    listing, tier = await _listing_to_change(session, principal, host_id)
    if window.start.tzinfo is None or window.end.tzinfo is None:
        raise ValidationFailed("a maintenance window needs times with a timezone", code="invalid_maintenance_window")
    if window.end <= window.start:
        raise ValidationFailed("the maintenance window ends before it starts: its end must come after its start", code="invalid_maintenance_window")
    if window.end <= now:
        raise ValidationFailed(f"the maintenance window is already over: it ended at {window_time(window.end)}", code="invalid_maintenance_window")
    new = {"start": window_time(window.start), "end": window_time(window.end, round_up=True)}
    windows = upcoming_windows(listing.maintenance_windows, now)
    for other in windows:
        if new["start"] < other["end"] and other["start"] < new["end"]:
            raise ValidationFailed(
                f"the maintenance window overlaps the one from {other['start']} to {other['end']}; clear that one or pick other times",
                code="invalid_maintenance_window",
            )
    if len(windows) >= MAX_MAINTENANCE_WINDOWS:
        raise ValidationFailed(f"at most {MAX_MAINTENANCE_WINDOWS} maintenance windows; clear one first", code="invalid_maintenance_window")
    _store_windows(listing, sorted([*windows, new], key=lambda w: (w["start"], w["end"])), now)
    await session.flush()
    return listing, tier


async def clear_window(
    session: AsyncSession, principal: Principal, host_id: str, start: datetime, *, now: datetime
) -> tuple[HostListing, Tier | None]:
    """Remove the listing's upcoming window that starts at ``start`` (to the second), even one open now.

    404 ``maintenance_window_not_found`` when none starts then. Cancelling it is safe, as ``add_window``.
    """
    listing, tier = await _listing_to_change(session, principal, host_id)
    key = window_time(start)
    windows = upcoming_windows(listing.maintenance_windows, now)
    kept = [w for w in windows if w.get("start") != key]
    if len(kept) == len(windows):
        raise NotFound(f"host {host_id!r} has no upcoming maintenance window starting at {key}", code="maintenance_window_not_found")
    _store_windows(listing, kept, now)
    await session.flush()
    return listing, tier
