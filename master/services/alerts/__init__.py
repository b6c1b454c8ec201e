"""Alerts: rules raise alert records, deduplicated and resolved; a webhook hears of each change.

Owns ``rules`` (conditions, evaluation, reconciling them with the open alerts, which queues
notifications), ``delivery`` (posting the notification outbox to the webhook, with retries and
back-off) and ``views`` (the alert's vocabulary and JSON shape, the API's list and get). May
import ``master.services``, ``master.telemetry``, ``master.models``, ``master.context`` and
``shared``; never ``master.api``, ``master.background``, ``billing`` or ``gpumarket``. The loop
that runs them is ``master.background.alerts``.
"""

from master.services.alerts.delivery import deliver_due
from master.services.alerts.rules import evaluate
from master.services.alerts.views import RULES, SEVERITIES, AlertFilter, get_alert, list_alerts

__all__ = [
    "RULES",
    "SEVERITIES",
    "AlertFilter",
    "deliver_due",
    "evaluate",
    "get_alert",
    "list_alerts",
]
