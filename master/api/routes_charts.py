"""Read-only series for the console's charts: spend, earnings, occupancy, the marketplace over time.

Each is computed from the ledger (``billing/series.py``) or the fleet's records
(``master/services/platform/fleet.py``) when asked; days are UTC days, money decimal strings.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from aiohttp import web
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession

from billing import series
from master.api.base import QueryParam, Route, int_query
from master.api.keys import MASTER
from master.api.middleware import principal
from master.services import platform

# ---- response bodies (for the OpenAPI document) ----------------------------------------------


class _Window(BaseModel):
    from_: str = Field(alias="from", description="The window's start: the first day's 00:00 UTC.")
    to: str = Field(description="The window's end (exclusive): tomorrow's 00:00 UTC.")


class DayAmount(BaseModel):
    day: str = Field(description="YYYY-MM-DD (UTC).")
    amount: str = Field(description="USD, six places.")


class RentalSpend(BaseModel):
    rental_id: str | None
    gpu_model: str | None
    gpu_count: int | None
    gpu_milli: int | None
    started_at: str | None
    stopped_at: str | None
    amount: str


class Spend(_Window):
    currency: str
    days: list[DayAmount]
    rentals: list[RentalSpend] = Field(description="Per rental, the largest first.")
    total: str


class HostEarnings(BaseModel):
    host_id: str | None
    name: str | None
    amount: str
    days: list[DayAmount]


class Earnings(_Window):
    currency: str
    days: list[DayAmount]
    hosts: list[HostEarnings] = Field(description="Per host, the largest first.")
    total: str


class GpuOccupancy(BaseModel):
    gpu_id: str
    uuid: str
    index: int
    name: str
    host_id: str
    host_name: str
    occupancy: list[float] = Field(description="Per day of ``days``: the share of the day held, 0–1.")
    average: float


class Occupancy(_Window):
    days: list[str]
    gpus: list[GpuOccupancy]


class MarketDay(BaseModel):
    day: str
    gmv: str = Field(description="USD renters were charged (top-ups excluded).")
    fees: str = Field(description="USD of it the platform kept.")
    occupancy: float = Field(description="Share of all GPUs held, 0–1.")
    hosts_online: float = Field(description="Mean number of hosts online, rented or draining over the day.")
    hosts_online_max: int = Field(description="The most hosts online, rented or draining at once that day.")


class Marketplace(_Window):
    currency: str
    days: list[MarketDay]
    total_gmv: str
    total_fees: str


MONEY_DAYS = 366
OCCUPANCY_DAYS = 31


SeriesOf = Callable[[AsyncSession, str, int, datetime], Awaitable[dict[str, Any]]]


def _series(
    compute: SeriesOf, default_days: int, max_days: int
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A handler answering ``compute(session, the caller's account, days, now)`` for ``?days=`` (1 to ``max_days``)."""

    async def handler(request: web.Request) -> web.Response:
        master = request.app[MASTER]
        days = int_query(request, "days", default_days, minimum=1, maximum=max_days)
        async with master.db.session() as session:
            return web.json_response(
                await compute(session, principal(request).account_id, days, master.clock.now())
            )

    return handler


get_spend = _series(
    lambda s, account, days, now: series.spend(s, account, days=days, now=now), 30, MONEY_DAYS
)
get_earnings = _series(
    lambda s, account, days, now: series.earnings(s, account, days=days, now=now), 30, MONEY_DAYS
)
get_occupancy = _series(
    lambda s, account, days, now: platform.gpu_occupancy(s, account, days=days, now=now),
    7,
    OCCUPANCY_DAYS,
)
get_marketplace = _series(
    lambda s, _account, days, now: series.marketplace(s, days=days, now=now), 30, MONEY_DAYS
)


def _days_param(default: int, maximum: int) -> QueryParam:
    return QueryParam("days", "integer", f"Whole UTC days ending today (default {default}).", 1, maximum)


ROUTES: tuple[Route, ...] = (
    Route("GET", "/account/spend", get_spend, "Your charges per UTC day and per rental (USD strings; top-ups excluded).",
          roles=("renter",), response=Spend, query=(_days_param(30, MONEY_DAYS),), scope="billing"),
    Route("GET", "/provider/earnings", get_earnings, "Your earnings per UTC day, in total and per host (USD strings; payouts excluded).",
          roles=("provider",), response=Earnings, query=(_days_param(30, MONEY_DAYS),), scope="billing"),
    Route("GET", "/provider/occupancy", get_occupancy, "Each of your GPUs' occupancy per UTC day (0–1: the share of the day held).",
          roles=("provider",), response=Occupancy, query=(_days_param(7, OCCUPANCY_DAYS),)),
    Route("GET", "/admin/marketplace", get_marketplace, "Per UTC day: GMV, platform fees, GPU occupancy and mean hosts online (admins).",
          roles=("admin",), response=Marketplace, query=(_days_param(30, MONEY_DAYS),)),
)  # fmt: skip
