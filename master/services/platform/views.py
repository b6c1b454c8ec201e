"""What the master says about itself and its edge: whether its database and bus answer (readiness),
and the live relays of the registry.

Imports ``master.context`` and ``shared``; never ``master.api`` or ``billing``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from sqlalchemy import text

from master.context import Master


async def dependency_checks(master: Master) -> dict[str, str]:
    """``"ok"`` or ``"error: <exception type>"`` for the database and the bus; never raises."""
    checks: dict[str, str] = {}
    try:
        async with master.db.session() as session:
            await session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        await master.bus.ping()
        checks["bus"] = "ok"
    except Exception as exc:
        checks["bus"] = f"error: {type(exc).__name__}"
    return checks


async def relay_list(master: Master) -> list[dict[str, Any]]:
    """Every live relay in the registry with its spare capacity, the age of its record and whether it is draining."""
    now = time.time()  # relays stamp their records with the wall clock
    return [
        {**asdict(r), "spare": r.spare, "age_s": round(now - r.updated_at, 3), "status": "draining" if r.draining else "ok"}
        for r in await master.registry.relays()
    ]
