"""``/api/v1/alerts``: open and resolved alerts (see ``master/alerts.py``)."""

from __future__ import annotations

from master.api.base import Route

ROUTES: tuple[Route, ...] = ()
