"""Request bodies of the marketplace routes (``master/api/routes_market.py``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from master.api.times import UtcTime
from master.services.market import MAX_MAINTENANCE_WINDOWS
from shared.money import MAX_PRICE, AmountText

# Read by master.services.market.listings.price_of: outside the grammar of shared/money.py is 422 invalid_price / invalid_min_bid.
Price = Annotated[str | int, AmountText(maximum=MAX_PRICE)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MaintenanceWindowBody(_Body):
    start: UtcTime = Field(description="Start, ISO 8601 with a timezone.")
    end: UtcTime = Field(description="End (exclusive), ISO 8601 with a timezone.")


class ListingPut(_Body):
    """A host's terms on the marketplace; a PUT replaces them all (see docs/marketplace.md)."""

    price_per_gpu_hour: Price = Field(
        description="Asking price in USD per GPU-hour as a string (\"0.45\"; at most 6 decimals), within the bounds of the "
        "host's best GPU tier (GET /price-bounds). It is also the most an interruptible rental of the host pays."
    )
    min_bid_per_gpu_hour: Price | None = Field(None, description="Lowest bid for interruptible use, USD per GPU-hour; at most the price.")
    smallest_unit: str = Field(
        "gpu", max_length=64, description="gpu (whole GPUs), mig:<profile> (mig:1g.10gb) or milli:<n> (n/1000 of a GPU)."
    )
    available_until: UtcTime | None = Field(None, description="The host is offered until then (in the future).")
    maintenance_windows: list[MaintenanceWindowBody] = Field(
        default_factory=list, max_length=MAX_MAINTENANCE_WINDOWS, description="Times the host is not offered; no overlaps."
    )
    storage_price_per_gib_hour: Price | None = Field(
        None, description="USD per GiB-hour renters pay for a volume on this host (\"0.0002\"; at most 6 decimals); "
        "needed to lend volume_gib (docs/volumes.md)."
    )
    volume_gib: int = Field(0, ge=0, le=1 << 20, description="GiB of the host's disk lent to renters' volumes (0: none).")
    verified: bool | None = Field(
        None, description="Leave it out: verified is proven by the GPU challenge (docs/verification.md), never set by hand. "
        "A provider naming it gets 403, an admin 422 verified_by_challenge: run POST /api/v1/admin/hosts/{id}/verify instead."
    )
