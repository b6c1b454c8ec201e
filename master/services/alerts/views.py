"""Alerts as others see them: their vocabulary, their JSON view, and the queries of the API.

``alert_view`` is the one shape of an alert, shown by ``GET /api/v1/alerts`` and sent in webhook
notifications. A provider sees the alerts of its own hosts; admins see every alert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Alert, Host
from master.services.accounts import Principal
from shared.errors import NotFound

Severity = Literal["critical", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)

RULES = ("xid", "ecc", "temperature", "host_offline", "host_faulty", "ingestion_lag", "relay_dead", "gpu_verification",
         "volume_grace")
ALERT_STATES = ("firing", "resolved")


def alert_view(alert: Alert) -> dict[str, Any]:
    """An alert as the API and the webhook show it."""
    return {
        "id": alert.id,
        "rule": alert.rule,
        "key": alert.key,
        "severity": alert.severity,
        "state": alert.state,
        "host_id": alert.host_id,
        "relay_id": alert.relay_id,
        "summary": alert.summary,
        "details": alert.details,
        "raised_at": alert.raised_at.isoformat(),
        "last_seen_at": alert.last_seen_at.isoformat(),
        "resolved_at": alert.resolved_at.isoformat() if alert.resolved_at else None,
        "occurrences": alert.occurrences,
    }


@dataclass(frozen=True)
class AlertFilter:
    """What ``GET /alerts`` asked for; values are checked by the API before they get here."""

    state: Literal["firing", "resolved", "all"] = "firing"
    severity: str | None = None
    rule: str | None = None
    host_id: str | None = None


def _visible(query: Select[Alert], principal: Principal) -> Select[Alert]:
    """Admins see every alert; a provider sees those on its own hosts (never fleet-wide ones)."""
    principal.require("provider")
    if principal.role == "admin":
        return query
    return query.join(Host, Host.id == Alert.host_id).where(Host.owner_id == principal.account_id)


async def list_alerts(
    session: AsyncSession, principal: Principal, wanted: AlertFilter, *, limit: int, offset: int
) -> tuple[list[dict[str, Any]], int]:
    """Alerts the principal may see that match ``wanted``, newest first, and how many match in all."""
    query = _visible(select(Alert), principal)
    if wanted.state != "all":
        query = query.where(Alert.state == wanted.state)
    if wanted.severity is not None:
        query = query.where(Alert.severity == wanted.severity)
    if wanted.rule is not None:
        query = query.where(Alert.rule == wanted.rule)
    if wanted.host_id is not None:
        query = query.where(Alert.host_id == wanted.host_id)
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = await session.scalars(query.order_by(Alert.raised_at.desc(), Alert.id.desc()).limit(limit).offset(offset))
    return [alert_view(a) for a in rows.all()], total


async def get_alert(session: AsyncSession, principal: Principal, alert_id: str) -> dict[str, Any]:
    """One alert; 404 when it does not exist or is not the principal's to see."""
    alert = await session.scalar(_visible(select(Alert), principal).where(Alert.id == alert_id))
    if alert is None:
        raise NotFound(f"no alert {alert_id!r}", code="alert_not_found")
    return alert_view(alert)

