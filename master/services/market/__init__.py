"""The market: what hosts offer and how renters find it.

* ``listings.py``: a host's listing (price, available until, maintenance windows) and the money grammar's helpers.
* ``tiers.py``: every GPU's tier from its model; ``placement.py``: GPU model names as renters write them, matched
  against NVML's.
* ``offers.py``, ``query.py``: the offers renters search (the summary table, the filter language);
  ``cluster_offers.py``: the offers for a cluster (hosts near each other, by measured links).
* ``proven.py``: what each GPU proved by the GPU challenge (issue 40), as host views, offers and the ``verified``
  filter read it, and the sustained rate the challenge expects of each model (``sustained_tflops``).
* ``failures.py``: every code a rental fails with and its owner (renter, provider, platform), from the code alone;
  ``faults.py``: hardware faults; ``reliability.py``: each host's reliability from the failures the provider owns.
* ``storage.py``: hosts' storage terms for volumes (the GiB lent, its price, what live volumes take).
* ``forecast.py``, ``forecast_models.py``: the demand forecast (the console's chart, the power policy's off-peak).

Imports ``master.services.accounts``, ``master.services.lifecycle`` and the top-level modules of
``master.services`` (``commands``, ``host_links``, ``isolation``); never rentals, clusters, endpoints or hosts, which
build on it.
"""

from master.services.market.cluster_offers import MAX_OFFERS_CONSIDERED, find_cluster_offers, node_condition
from master.services.market.failures import (
    AGENT_STOP_CODES,
    AGENT_STOPPED_PREFIX,
    OWNERS,
    FailureCode,
    Owner,
    UnknownFailureCode,
    agent_failure_code,
    owner_of,
    record_failure,
)
from master.services.market.faults import (
    FAULT_XIDS,
    HEALTH_CHECK,
    after_gpu_events,
    after_gpus_vanished,
    after_health_check,
    request_health_check,
)
from master.services.market.forecast import ANY, Key, demand_forecast, demand_history, hour_start
from master.services.market.forecast_models import choose_forecast
from master.services.market.listings import (
    MAX_MAINTENANCE_WINDOWS,
    PRICE_QUANTUM,
    ListingTerms,
    MaintenanceWindow,
    PriceBounds,
    add_window,
    best_tier,
    clear_window,
    get_listing,
    listing_view,
    load_price_bounds,
    money,
    price_of,
    put_listing,
)
from master.services.market.offers import (
    DEFAULT_ORDER,
    OfferSearch,
    Order,
    Sort,
    price_expression,
    row_conditions,
    search_offers,
    unavailable_hosts,
)
from master.services.market.placement import model_filter_problem, model_matches, normalise_name
from master.services.market.proven import (
    VERIFICATION_MAX_AGE,
    expected_tflops,
    gpu_verification,
    host_verified,
    sustained_tflops,
)
from master.services.market.query import MAX_QUERY_LENGTH, Condition, Op, format_query, parse, parse_value
from master.services.market.reliability import (
    SEEDED_ACTOR,
    classification_view,
    classify_host_gpus,
    is_seeded,
    reliability_view,
    rescore_all,
    rescore_host,
)
from master.services.market.storage import (
    MAX_STORAGE_PRICE,
    check_storage_terms,
    storage_view,
    volume_gib_free,
    volume_gib_used,
    volumes_kept,
)
from master.services.market.tiers import Tier

__all__ = [
    "AGENT_STOPPED_PREFIX",
    "AGENT_STOP_CODES",
    "ANY",
    "DEFAULT_ORDER",
    "FAULT_XIDS",
    "HEALTH_CHECK",
    "MAX_MAINTENANCE_WINDOWS",
    "MAX_OFFERS_CONSIDERED",
    "MAX_QUERY_LENGTH",
    "MAX_STORAGE_PRICE",
    "OWNERS",
    "PRICE_QUANTUM",
    "SEEDED_ACTOR",
    "VERIFICATION_MAX_AGE",
    "Condition",
    "FailureCode",
    "Key",
    "ListingTerms",
    "MaintenanceWindow",
    "OfferSearch",
    "Op",
    "Order",
    "Owner",
    "PriceBounds",
    "Sort",
    "Tier",
    "UnknownFailureCode",
    "add_window",
    "after_gpu_events",
    "after_gpus_vanished",
    "after_health_check",
    "agent_failure_code",
    "best_tier",
    "check_storage_terms",
    "choose_forecast",
    "classification_view",
    "classify_host_gpus",
    "clear_window",
    "demand_forecast",
    "demand_history",
    "expected_tflops",
    "find_cluster_offers",
    "format_query",
    "get_listing",
    "gpu_verification",
    "host_verified",
    "hour_start",
    "is_seeded",
    "listing_view",
    "load_price_bounds",
    "model_filter_problem",
    "model_matches",
    "money",
    "node_condition",
    "normalise_name",
    "owner_of",
    "parse",
    "parse_value",
    "price_expression",
    "price_of",
    "put_listing",
    "record_failure",
    "reliability_view",
    "request_health_check",
    "rescore_all",
    "rescore_host",
    "row_conditions",
    "search_offers",
    "storage_view",
    "sustained_tflops",
    "unavailable_hosts",
    "volume_gib_free",
    "volume_gib_used",
    "volumes_kept",
]
