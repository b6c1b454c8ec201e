"""The command resender: commands no agent has answered are published again.

Every master runs it (no lease): publishing a command twice is harmless, since agents execute a
command id at most once. The pass itself is ``master.services.commands`` (``due_for_resend``,
``publish``).
"""

from __future__ import annotations

import asyncio
import logging

from master.context import Master
from master.services import commands

log = logging.getLogger(__name__)


async def command_resender(master: Master, *, every: float | None = None) -> None:
    """Resend commands no agent has answered within ``command_retry_interval``. Cancel to stop.

    A failing pass is logged and retried next interval. Cancelling is safe: a command this pass
    did not get out is still unanswered, so the next pass (here or on another master) sends it.
    """
    while True:
        await asyncio.sleep(every or master.settings.command_retry_interval / 2)
        try:
            due = await commands.due_for_resend(master, master.clock.now())
            if due:
                log.info("resending %d unanswered command(s)", len(due))
                await commands.publish(master, due)
        except Exception:
            log.exception("command resend pass failed; retrying next interval")
