"""A discrete-time simulation of the rental queue under contention: fair share (``FairQueue``) against FIFO.

A fixed pool of GPUs; each account has an endless queue of jobs (``sizes`` GPUs each, lengths uniform in
``1..max_length`` steps, drawn when a job starts), submitted at time 0 in round-robin order, so FIFO serves
the accounts in turn. Each step the jobs that ended free their GPUs, then the queue pass walks the queued jobs
in the policy's order and starts each that fits (no head-of-line blocking), as ``process_queue`` does; every
running job then counts its GPUs for one step. ``simulate`` returns each account's share of the GPU-time.
Deterministic in ``seed``. docs/placement.md ("Fair queues") quotes its figures.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Literal

from master.scheduler import MILLI
from master.scheduler.fairshare import FairQueue, QueuedItem

Policy = Literal["fair", "fifo"]
_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class SimResult:
    steps: int
    gpu_steps: dict[str, int]
    # (step, {account: share of the GPU-time so far}) at each checkpoint asked for
    checkpoints: list[tuple[int, dict[str, float]]] = field(default_factory=list)

    @property
    def shares(self) -> dict[str, float]:
        total = sum(self.gpu_steps.values()) or 1
        return {account: used / total for account, used in self.gpu_steps.items()}


def simulate(weights: Mapping[str, int], *, policy: Policy = "fair", gpus: int = 24, steps: int = 20_000, max_length: int = 20,
             sizes: Sequence[int] = (1,), seed: int = 42, checkpoints: Sequence[int] = ()) -> SimResult:  # fmt: skip
    """Run the queue for ``steps`` steps over ``gpus`` GPUs; each account's GPU-time under ``policy``."""
    rng = random.Random(seed)
    accounts = list(weights)
    made = dict.fromkeys(accounts, 0)  # jobs of each account taken off its endless queue so far
    queued: dict[str, dict[str, QueuedItem]] = {a: {} for a in accounts}  # its jobs now in the queue, by key
    running: list[tuple[int, str, int]] = []  # (ends at step, account, GPUs)
    held = dict.fromkeys(accounts, 0)
    result = SimResult(steps, dict.fromkeys(accounts, 0))
    marks = set(checkpoints)
    for step in range(steps):
        for job in [job for job in running if job[0] <= step]:
            running.remove(job)
            held[job[1]] -= job[2]
        free = gpus - sum(held.values())
        if free > 0:
            for index, account in enumerate(accounts):
                while len(queued[account]) < gpus:  # enough of the endless queue to fill the pool
                    seq = made[account] * len(accounts) + index  # round-robin submission order
                    made[account] += 1
                    item = QueuedItem(f"{account}-{seq}", account, "on_demand", _EPOCH + timedelta(seconds=seq), f"{seq:012d}",
                                      rng.choice(sizes) * MILLI)  # fmt: skip
                    queued[account][item.key] = item
            items = [item for jobs in queued.values() for item in jobs.values()]
            fair = FairQueue(items, held={a: g * MILLI for a, g in held.items()}, weights=weights) if policy == "fair" else None
            for item in fair if fair is not None else sorted(items, key=lambda i: i.age_key):
                size = item.milli // MILLI
                if size > free:
                    continue  # passed over, not waited for
                free -= size
                held[item.account_id] += size
                del queued[item.account_id][item.key]
                running.append((step + rng.randint(1, max_length), item.account_id, size))
                if fair is not None:
                    fair.placed(item)
                if free == 0:
                    break
        for account, gpus_held in held.items():
            result.gpu_steps[account] += gpus_held
        if step + 1 in marks:
            result.checkpoints.append((step + 1, result.shares))
    return result
