"""Alerts and their notifications."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base, _now


class Alert(Base):
    """One occurrence of an alert condition, from raised to resolved.

    ``open_key`` equals ``key`` while the alert fires and is NULL once resolved; its unique
    constraint keeps one open alert per condition (NULLs never collide), which is the dedupe.
    """

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_state_raised", "state", "raised_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    rule: Mapped[str] = mapped_column(String(32), index=True)
    key: Mapped[str] = mapped_column(String(255), index=True)
    open_key: Mapped[str | None] = mapped_column(String(255), unique=True, default=None)
    severity: Mapped[str] = mapped_column(String(16))  # critical | warning | info
    state: Mapped[str] = mapped_column(String(16))  # firing | resolved
    host_id: Mapped[str | None] = mapped_column(ForeignKey("hosts.id", ondelete="CASCADE"), default=None, index=True)
    relay_id: Mapped[str | None] = mapped_column(String(64), default=None)
    summary: Mapped[str] = mapped_column(Text)
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    raised_at: Mapped[datetime] = mapped_column(default=_now)
    last_seen_at: Mapped[datetime] = mapped_column(default=_now)
    resolved_at: Mapped[datetime | None] = mapped_column(default=None)
    occurrences: Mapped[int] = mapped_column(default=1)


class AlertNotification(Base):
    """An outbox row: one alert state change to deliver to the webhook, retried with back-off."""

    __tablename__ = "alert_notifications"
    __table_args__ = (Index("ix_alert_notifications_due", "delivered_at", "next_attempt_at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    alert_id: Mapped[str] = mapped_column(ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(16))  # firing | resolved
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=_now)
    attempts: Mapped[int] = mapped_column(default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=_now)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)
    gave_up_at: Mapped[datetime | None] = mapped_column(default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
