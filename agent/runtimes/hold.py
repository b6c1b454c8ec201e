"""The ``hold`` runtime: the rental's GPUs are reserved and nothing runs."""

from __future__ import annotations

from typing import Any

from agent.runtimes.base import Workload, now_iso
from shared.protocol import GpuShare, HoldWorkload


class HoldRuntime:
    """Records the hold; there is no process to watch and nothing to remove."""

    async def prepare(self, spec: HoldWorkload) -> None:
        """Nothing to wait for."""

    def start(self, rental_id: str, gpus: list[str], spec: HoldWorkload, share: GpuShare | None) -> tuple[Workload, dict[str, Any]]:
        return Workload(rental_id, "hold", gpus, now_iso()), {"kind": "hold", "pid": None}

    async def remove(self, workload: Workload) -> None:
        """Nothing was made."""
