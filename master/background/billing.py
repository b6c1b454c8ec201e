"""Billing in the master: each of ``billing.jobs.JOBS`` run periodically while ``billing_in_process``.

One master at a time per job, under the lease ``billing-<job>``. The jobs themselves are
``billing.jobs``' plain functions of ``(db, settings, now)``, which Celery workers run instead
when ``billing_in_process`` is off.
"""

from __future__ import annotations

from billing.jobs import Job
from master.background import leases
from master.context import Master
from master.services import commands


async def billing_loop(master: Master, job: Job) -> None:
    """Run ``job`` in this master every period, under the lease ``billing-<name>``. Cancel to stop.

    Cancelling is safe: every posting carries an idempotency key, so a job cut short is simply
    run again (and completed) next period, here or on another master.
    """

    async def work() -> None:
        result = await job.run(master.db, master.settings, master.clock.now())
        # Commands the job wrote (a volume deleted at its grace's end), committed: out now, not at the next resend.
        await commands.publish(master, list(result.get("commands", [])))

    await leases.run_leased(master, f"billing-{job.name}", every=job.every(master.settings), work=work)
