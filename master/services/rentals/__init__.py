"""Rentals: a renter's GPUs on one host, from the request to the release.

* ``core.py``: create (idempotent), read, list and stop a rental, its logs and its view; ``request.py``: the typed
  request.
* ``placement.py``: choosing the GPUs (quotas, fair use, the placer), ``allocation.py``: holding them (GPU
  allocations, shares); ``quotas.py``: an admin's quota and fair-share writes.
* ``lifecycle.py``: what happens to rentals when their host goes silent, comes back or fails; ``failover.py``: the
  fail-over of rentals whose host's agent link closed and stayed closed (``failover_after_s``).
* ``connect.py``: the renter's way in (connect tokens for SSH, ports, web ports).
* ``templates.py``: the workload templates a rental may name.

The rental state machine itself is ``master.services.lifecycle.rentals`` (every aggregate moves it). Imports
``master.services.accounts``, ``master.services.market``, ``master.services.lifecycle`` and the top-level modules;
never clusters, endpoints or hosts, which build on it.
"""

from master.services.rentals.allocation import release
from master.services.rentals.connect import connect, connect_token, connect_url, current_relay_id, live_relays
from master.services.rentals.core import (
    create_rental,
    get_rental,
    list_rentals,
    release_expired_workspaces,
    rental_events,
    rental_logs,
    rental_view,
    stop_rental,
)
from master.services.rentals.failover import (
    MAX_FAILOVER_AFTER_S,
    MIN_FAILOVER_AFTER_S,
    fail_rentals_of_closed_links,
    failover_after,
    mark_unlinked_hosts_offline,
)
from master.services.rentals.lifecycle import (
    apply_command_result,
    apply_workload_exit,
    apply_workload_progress,
    fail_rental,
    fail_rentals_of_lost_hosts,
    failure_code,
    note_host_back,
    note_host_unreachable,
    replace_lost,
    stop_strays,
)
from master.services.rentals.placement import check_quota, find_candidates, quota_view, try_place, whole_gpus
from master.services.rentals.quotas import set_fair_share, set_quota
from master.services.rentals.request import RentalRequest
from master.services.rentals.templates import (
    MAX_DESCRIPTION_CHARS,
    NAME_PATTERN,
    check_name,
    delete_template,
    get_template,
    list_templates,
    put_template,
    template_view,
    workload_of,
)

__all__ = [
    "MAX_DESCRIPTION_CHARS",
    "MAX_FAILOVER_AFTER_S",
    "MIN_FAILOVER_AFTER_S",
    "NAME_PATTERN",
    "RentalRequest",
    "apply_command_result",
    "apply_workload_exit",
    "apply_workload_progress",
    "check_name",
    "check_quota",
    "connect",
    "connect_token",
    "connect_url",
    "create_rental",
    "current_relay_id",
    "delete_template",
    "fail_rental",
    "fail_rentals_of_closed_links",
    "fail_rentals_of_lost_hosts",
    "failover_after",
    "failure_code",
    "find_candidates",
    "get_rental",
    "get_template",
    "list_rentals",
    "list_templates",
    "live_relays",
    "mark_unlinked_hosts_offline",
    "note_host_back",
    "note_host_unreachable",
    "put_template",
    "quota_view",
    "release",
    "release_expired_workspaces",
    "rental_events",
    "rental_logs",
    "rental_view",
    "replace_lost",
    "set_fair_share",
    "set_quota",
    "stop_rental",
    "stop_strays",
    "template_view",
    "try_place",
    "whole_gpus",
    "workload_of",
]
