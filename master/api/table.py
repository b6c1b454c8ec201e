"""The route table: every HTTP route of the master's API, each declared once as a ``Route``.

``ROUTES`` are the ``/api/v1`` routes (documented in OpenAPI); ``UNVERSIONED`` the master's
routes outside it (the Prometheus scrape, the agent downloads), public and never rate-limited.
Each route module exports its own part; this module only puts them together. The router
(``master/api/router.py``) registers the table, the middlewares enforce it and
``master/api/openapi.py`` documents it; none of them is imported here.
"""

from __future__ import annotations

from master.api import (
    routes,
    routes_accounts,
    routes_alerts,
    routes_billing,
    routes_charts,
    routes_clusters,
    routes_connect,
    routes_console,
    routes_docs,
    routes_downloads,
    routes_forecast,
    routes_invoices,
    routes_keys,
    routes_maintenance,
    routes_market,
    routes_metrics,
    routes_passkeys,
    routes_payments,
    routes_power,
    routes_regions,
    routes_registries,
    routes_services,
    routes_ssh_keys,
    routes_teams,
    routes_templates,
    routes_verification,
    routes_volume_files,
    routes_volumes,
)
from master.api.base import API, RateClass, Route

ROUTES: tuple[Route, ...] = (
    routes.ROUTES + routes_market.ROUTES + routes_alerts.ROUTES + routes_metrics.ROUTES + routes_billing.ROUTES
    + routes_invoices.ROUTES + routes_console.ROUTES + routes_templates.ROUTES + routes_ssh_keys.ROUTES + routes_connect.ROUTES + routes_regions.ROUTES
    + routes_payments.ROUTES
    + routes_charts.ROUTES
    + routes_maintenance.ROUTES
    + routes_clusters.ROUTES
    + routes_services.ROUTES
    + routes_forecast.ROUTES
    + routes_power.ROUTES
    + routes_accounts.ROUTES
    + routes_keys.ROUTES
    + routes_passkeys.ROUTES
    + routes_teams.ROUTES
    + routes_registries.ROUTES
    + routes_verification.ROUTES
    + routes_volumes.ROUTES
    + routes_volume_files.ROUTES
)  # fmt: skip

UNVERSIONED: tuple[Route, ...] = routes_metrics.UNVERSIONED + routes_downloads.UNVERSIONED + routes_docs.UNVERSIONED

NEVER_LIMITED = frozenset(API + route.path for route in ROUTES if route.limit is RateClass.NONE)
"""Paths of the probes: a load balancer or kubelet asking often must never be refused."""
