"""Alert delivery: the ``alert_notifications`` outbox POSTed to ``alert_webhook_url``.

A pass claims the notifications that are due (oldest first, each alert's in order), posts them
with no database session open, and records each outcome: delivered, retried after a back-off,
or given up after ``alert_webhook_max_attempts``. The rules (``rules``) fill the outbox; the loop
that calls ``deliver_due`` every ``alert_interval`` with one HTTP session is
``master.background.alerts``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import aiohttp
from sqlalchemy import exists, select
from sqlalchemy.orm import aliased

from master.context import Master
from master.models import AlertNotification

log = logging.getLogger(__name__)

# Bytes of a refusing webhook's answer kept in ``last_error``.
_ERROR_BODY_BYTES = 200
# Longest wait between two delivery attempts of one notification, in seconds.
MAX_BACKOFF_S = 300.0


def backoff(attempts: int) -> float:
    """Seconds before the next try after ``attempts`` failed ones: 2, 4, 8, … capped at 5 minutes.

    No jitter: only the lease holder delivers, so there is no herd of senders to spread out.
    """
    return min(2.0 ** attempts, MAX_BACKOFF_S)


@dataclass(frozen=True)
class _Due:
    id: int
    payload: dict[str, Any]

    @property
    def idempotency_key(self) -> str:
        return f"alert-notification-{self.id}"


async def _claim_due(master: Master, *, now: datetime, batch: int, hold: timedelta) -> list[_Due]:
    """Take up to ``batch`` due notifications, oldest first, and push their next attempt past ``hold``.

    A notification waits while an older one of the same alert is still undelivered, so a
    receiver gets each alert's events in order (never ``resolved`` before its ``firing``). The
    claim is what keeps a second master from posting the same rows meanwhile; should this
    process die mid-delivery, they become due again after ``hold``.
    """
    older = aliased(AlertNotification)
    older_pending = exists().where(
        older.alert_id == AlertNotification.alert_id,
        older.id < AlertNotification.id,
        older.delivered_at.is_(None),
        older.gave_up_at.is_(None),
    )
    async with master.db.session() as session:
        rows = (
            await session.scalars(
                select(AlertNotification)
                .where(
                    AlertNotification.delivered_at.is_(None),
                    AlertNotification.gave_up_at.is_(None),
                    AlertNotification.next_attempt_at <= now,
                    ~older_pending,
                )
                .order_by(AlertNotification.id)
                .limit(batch)
                .with_for_update(skip_locked=True)
            )
        ).all()
        for row in rows:
            row.next_attempt_at = now + hold
        return [_Due(id=row.id, payload=dict(row.payload)) for row in rows]


async def _post(http: aiohttp.ClientSession, url: str, due: _Due, *, timeout: float) -> str | None:
    """POST one notification; returns None when the webhook took it (2xx), else what went wrong."""
    try:
        async with http.post(
            url,
            json=due.payload,
            headers={"Idempotency-Key": due.idempotency_key},
            timeout=aiohttp.ClientTimeout(total=timeout),
            allow_redirects=False,
        ) as response:
            if 200 <= response.status < 300:
                return None
            text = (await response.content.read(_ERROR_BODY_BYTES)).decode("utf-8", "replace").strip()
            return f"HTTP {response.status}" + (f": {text}" if text else "")
    except TimeoutError:
        return f"no response within {timeout:g}s"
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}: {exc}"


async def deliver_due(
    master: Master,
    http: aiohttp.ClientSession,
    *,
    now: datetime | None = None,
    batch: int = 100,
    concurrency: int = 8,
) -> int:
    """POST due notifications to ``alert_webhook_url``; returns how many the webhook accepted.

    Each is sent as JSON ``{"event": ..., "alert": {...}}`` with ``Idempotency-Key:
    alert-notification-<id>`` (a retry after a lost answer repeats the key, so the receiver can
    drop the duplicate), at most ``concurrency`` at a time, each within
    ``alert_webhook_timeout``. A failure is retried after ``backoff(attempts)`` seconds, and
    given up (logged as an error) after ``alert_webhook_max_attempts`` tries. No database
    session is open while posting. Cancelling is safe: claimed notifications are retried once
    their claim runs out (possibly a second time for the receiver, under the same key).
    """
    settings = master.settings
    url = settings.alert_webhook_url
    if url is None:
        return 0
    started = now or master.clock.now()
    timeout = settings.alert_webhook_timeout
    hold = timedelta(seconds=timeout * (math.ceil(batch / concurrency) + 1))
    claimed = await _claim_due(master, now=started, batch=batch, hold=hold)
    if not claimed:
        return 0
    limiter = asyncio.Semaphore(concurrency)

    async def send(due: _Due) -> str | None:
        async with limiter:
            return await _post(http, url, due, timeout=timeout)

    errors = await asyncio.gather(*(send(due) for due in claimed))
    return await _record_attempts(master, list(zip(claimed, errors, strict=True)), at=now or master.clock.now())


async def _record_attempts(master: Master, outcomes: Sequence[tuple[_Due, str | None]], *, at: datetime) -> int:
    max_attempts = master.settings.alert_webhook_max_attempts
    delivered = 0
    async with master.db.session() as session:
        ids = [due.id for due, _ in outcomes]
        rows = {r.id: r for r in (await session.scalars(select(AlertNotification).where(AlertNotification.id.in_(ids)))).all()}
        for due, error in outcomes:
            row = rows.get(due.id)
            if row is None or row.delivered_at is not None or row.gave_up_at is not None:
                continue  # deleted with its host meanwhile, or settled by another master after our claim ran out
            row.attempts += 1
            if error is None:
                row.delivered_at, row.last_error = at, None
                delivered += 1
                continue
            row.last_error = error[:1000]
            if row.attempts >= max_attempts:
                row.gave_up_at = at
                log.error("alert webhook: gave up on notification %d (%s of alert %s) after %d attempts; last error: %s",
                          row.id, row.event, row.alert_id, row.attempts, error)
            else:
                row.next_attempt_at = at + timedelta(seconds=backoff(row.attempts))
                log.warning("alert webhook: notification %d failed (attempt %d of %d, next in %gs): %s",
                            row.id, row.attempts, max_attempts, backoff(row.attempts), error)
    return delivered

