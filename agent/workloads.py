"""Running renters' workloads on this host, idempotently by rental id.

A workload sees only its GPUs: ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES``
name the allocated UUIDs. Kinds: ``hold`` (reserve the GPUs, run nothing) and
``process`` (a program with arguments, in its own session and folder, output to
``output.log``). Stopping sends SIGTERM to the process group, then SIGKILL after
``stop_timeout``. (Containers and cgroup limits come with the agent issue.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.gpu.base import GpuBackend
from agent.gpu.sim import SimulatedBackend
from shared.errors import BadRequest

log = logging.getLogger(__name__)

SAFE_ENV = ("PATH", "LANG", "LC_ALL", "HOME", "TZ")


@dataclass
class Workload:
    rental_id: str
    gpu_uuids: list[str]
    kind: str
    process: asyncio.subprocess.Process | None = None


class WorkloadManager:
    def __init__(self, work_dir: Path, backend: GpuBackend, *, stop_timeout: float = 10.0) -> None:
        self.work_dir = work_dir
        self.backend = backend
        self.stop_timeout = stop_timeout
        self.workloads: dict[str, Workload] = {}

    def running(self) -> list[str]:
        return sorted(self.workloads)

    async def start(self, rental_id: str, gpu_uuids: list[str], spec: dict[str, Any]) -> dict[str, Any]:
        """Start the workload unless it already runs (then report it again)."""
        if rental_id in self.workloads:
            return {"already_running": True}
        known = {g.uuid for g in self.backend.gpus()}
        missing = [u for u in gpu_uuids if u not in known]
        if missing:
            raise BadRequest(f"GPU(s) {', '.join(missing)} are not on this host")
        kind = str(spec.get("kind", "hold"))
        workload = Workload(rental_id=rental_id, gpu_uuids=list(gpu_uuids), kind=kind)
        if kind == "process":
            workload.process = await self._spawn(rental_id, gpu_uuids, spec)
        elif kind != "hold":
            raise BadRequest(f"unknown workload kind {kind!r}; expected 'hold' or 'process'")
        self.workloads[rental_id] = workload
        if isinstance(self.backend, SimulatedBackend):
            self.backend.set_busy(gpu_uuids, True)
        log.info("rental %s started (%s on %d GPU)", rental_id, kind, len(gpu_uuids))
        return {"pid": workload.process.pid if workload.process else None}

    async def _spawn(self, rental_id: str, gpu_uuids: list[str], spec: dict[str, Any]) -> asyncio.subprocess.Process:
        argv = spec.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise BadRequest("a process workload needs 'argv', a non-empty list of strings")
        folder = self.work_dir / rental_id
        folder.mkdir(parents=True, exist_ok=True)
        env = {k: os.environ[k] for k in SAFE_ENV if k in os.environ}
        env.update({str(k): str(v) for k, v in dict(spec.get("env") or {}).items()})
        visible = ",".join(gpu_uuids)
        env.update(CUDA_VISIBLE_DEVICES=visible, NVIDIA_VISIBLE_DEVICES=visible, GPUMARKET_RENTAL_ID=rental_id)
        with open(folder / "output.log", "ab") as log_file:
            try:
                return await asyncio.create_subprocess_exec(
                    *argv, cwd=folder, env=env, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
                )
            except OSError as exc:
                raise BadRequest(f"cannot start {argv[0]!r}: {exc.strerror}") from None

    async def stop(self, rental_id: str) -> dict[str, Any]:
        """Stop the workload; stopping one that does not run succeeds (idempotent)."""
        workload = self.workloads.pop(rental_id, None)
        if workload is None:
            return {"already_stopped": True}
        exit_code = await self._terminate(workload)
        if isinstance(self.backend, SimulatedBackend):
            self.backend.set_busy(workload.gpu_uuids, False)
        log.info("rental %s stopped", rental_id)
        return {"exit_code": exit_code}

    async def _terminate(self, workload: Workload) -> int | None:
        process = workload.process
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(self.stop_timeout):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        return process.returncode

    async def close(self) -> None:
        """Stop every workload (the agent is going away with its host)."""
        for rental_id in list(self.workloads):
            await self.stop(rental_id)
