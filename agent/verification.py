"""The GPU challenge on the agent (docs/verification.md, "The flow"): the challenge program runs as a platform
workload in the container runtime, with the claimed GPUs by UUID, as a renter's container would, and the agent
exchanges files with it in its private ``/workspace``.

``start`` starts the workload (rental id ``verify-<challenge id>``; never reported as a rental), writes
``challenge.json`` and waits for ``commitment.json``; ``reveal`` writes ``reveal.json``, waits for ``openings.json``
and removes the workload and its folder; ``cancel`` and ``yield_gpus`` (a rental's start needs the GPUs) stop it,
and a ``start`` or ``reveal`` waiting on it then fails with ``challenge_cancelled``. The program
(``shared/verification/program.py``, the image's command) waits for its ``challenge.json``, which the agent writes
once the container runs, so the seed is never in the container's spec.

**Never long past its agent.** The program waits for each of its inputs at most the challenge's deadline plus
``reveal_margin_s`` (``GPUMARKET_VERIFY_WAIT_S``, set in the workload's environment): the master reveals as soon as the
commitment comes, and a commitment after the deadline fails anyway, so a program whose agent died (no reveal will
come) exits on its own soon after the deadline; a start that failed (no commitment in time, or the program exited)
removes its workload; and ``remove_orphans``, at the agent's start after the workloads are re-adopted, removes every
challenge workload an earlier life left (its answers cannot reach the master any more: it fails them as
``no_answer``), running or not.

``simulate`` (only for a simulated GPU backend: the agent's settings, never the master's) is added to the challenge
as its ``simulate`` field: how the simulated host behaves (docs/verification.md, "Simulated hosts").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from agent.challenge_image import CPU_IMAGE
from agent.runtimes.manager import WorkloadManager
from shared import protocol
from shared.errors import GpumarketError

log = logging.getLogger(__name__)

DEFAULT_IMAGE: Final = CPU_IMAGE
WAIT_ENV: Final = "GPUMARKET_VERIFY_WAIT_S"  # the program's wait for challenge.json and reveal.json (shared/verification/program.py)
_MAX_ANSWER_BYTES: Final = 32 << 20  # commitment.json or openings.json


class ChallengeError(GpumarketError):
    """The challenge's program did not answer (it exited, or its answer is not JSON)."""

    code = "workload_start_failed"


class Cancelled(GpumarketError):
    """A rental needed the GPUs (or the master cancelled): the challenge stopped."""

    code = "challenge_cancelled"


@dataclass
class _Run:
    challenge_id: str
    gpu_uuids: frozenset[str]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while the workload starts
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    started: bool = False
    commitment: dict[str, Any] | None = None


def workload_id(challenge_id: str) -> str:
    return protocol.CHALLENGE_WORKLOAD_PREFIX + challenge_id


def is_challenge(rental_id: str) -> bool:
    """Whether a workload is a challenge's (never reported to the master as a rental's)."""
    return rental_id.startswith(protocol.CHALLENGE_WORKLOAD_PREFIX)


class ChallengeRunner:
    """Runs the master's GPU challenges on this host's container runtime."""

    def __init__(
        self, workloads: WorkloadManager, *, image: str = DEFAULT_IMAGE, simulate: dict[str, Any] | None = None,
        prepare: Callable[[], Awaitable[str]] | None = None,
        # Timeouts
        poll_interval: float = 0.05, reveal_margin_s: float = 120.0,
    ) -> None:  # fmt: skip
        self.workloads = workloads
        self.image = image
        self.simulate = simulate
        self.prepare = prepare  # makes ``image`` (the CUDA image's build: agent.challenge_image); None: it is there
        self.poll_interval = poll_interval
        self.reveal_margin_s = reveal_margin_s
        self._runs: dict[str, _Run] = {}
        self._cancelled: dict[str, str] = {}  # challenge id → why, for a late start or reveal of it (the newest 1000)

    async def start(self, command: protocol.StartChallenge) -> protocol.ChallengeCommitted:
        """Start the challenge and return its commitment. Idempotent: a resend of a run that committed answers again,
        one that is still running waits for it. Cancelling is safe: the workload is stopped and removed."""
        self._refuse_cancelled(command.challenge_id)
        run = self._runs.get(command.challenge_id)
        if run is not None and run.commitment is not None:
            return protocol.ChallengeCommitted(challenge_id=run.challenge_id, commitment=run.commitment)
        if run is None:
            run = self._runs[command.challenge_id] = _Run(command.challenge_id, frozenset(command.gpu_uuids))
        rental_id = workload_id(command.challenge_id)
        try:
            async with run.lock:
                if run.cancelled.is_set():
                    raise Cancelled(f"challenge {run.challenge_id} cancelled: {run.reason}")
                if not run.started:
                    await self.prepare_image()
                    # Its own command: the program, on /workspace; its waits bounded by the challenge's deadline. A
                    # renter's spec may not set a GPUMARKET_* variable (validation refuses it); the agent, for its
                    # own platform workload, may.
                    spec = protocol.ContainerWorkload(image=self.image).model_copy(
                        update={"env": {WAIT_ENV: f"{self.program_wait_s(command):.0f}"}}
                    )
                    await self.workloads.start(rental_id, list(command.gpu_uuids), spec)
                    run.started = True
                    folder = await self._folder(rental_id)
                    challenge = dict(command.challenge)
                    if self.simulate is not None:
                        challenge["simulate"] = self.simulate
                    _write_json(folder / "challenge.json", challenge)
            folder = await self._folder(rental_id)
            answer = await self._wait_for(run, rental_id, folder / "commitment.json", timeout=command.timeout_s)
        except BaseException as exc:
            # A failed run goes (the master fails it; a resend starts afresh); one whose command was cancelled stays
            # for a resend to wait on.
            if run.cancelled.is_set() or not run.started or isinstance(exc, ChallengeError):
                await self._remove(run)
            raise
        run.commitment = answer
        return protocol.ChallengeCommitted(challenge_id=run.challenge_id, commitment=answer)

    async def prepare_image(self) -> None:
        """Make the challenge's image where it is built on this host (the CUDA image); ``ChallengeError`` when it cannot
        be. The agent calls it once at its start, so the first challenge does not wait for the build."""
        if self.prepare is None:
            return
        try:
            await self.prepare()
        except GpumarketError as exc:
            raise ChallengeError(f"the challenge's image {self.image} is not available: {exc}") from None

    def program_wait_s(self, command: protocol.StartChallenge) -> float:
        """How long the program waits for each of its inputs: the challenge's ``deadline_s`` plus
        ``reveal_margin_s`` (the reveal follows the commitment, which must come before the deadline), at most the
        command's ``timeout_s``, at least 1 s."""
        try:
            deadline = float(command.challenge["deadline_s"])
        except (KeyError, TypeError, ValueError):
            deadline = command.timeout_s
        return max(1.0, min(command.timeout_s, deadline + self.reveal_margin_s))

    async def reveal(self, command: protocol.RevealChallenge) -> protocol.ChallengeOpened:
        """Hand the program the master's reveal and return its openings; the workload and its folder go after."""
        self._refuse_cancelled(command.challenge_id)
        run = self._runs.get(command.challenge_id)
        if run is None or not run.started:
            raise ChallengeError(f"challenge {command.challenge_id} is not running here (the agent restarted?); the master fails it")
        rental_id = workload_id(command.challenge_id)
        try:
            folder = await self._folder(rental_id)
            _write_json(folder / "reveal.json", dict(command.reveal))
            openings = await self._wait_for(run, rental_id, folder / "openings.json", timeout=command.timeout_s)
        finally:
            await self._remove(run)
        return protocol.ChallengeOpened(challenge_id=run.challenge_id, openings=openings)

    async def cancel(self, challenge_id: str, reason: str = "cancelled by the master") -> protocol.ChallengeCancelled:
        run = self._runs.get(challenge_id)
        if run is None:
            return protocol.ChallengeCancelled(challenge_id=challenge_id, stopped=False)
        await self._cancel(run, reason)
        return protocol.ChallengeCancelled(challenge_id=challenge_id, stopped=True)

    async def yield_gpus(self, gpu_uuids: Sequence[str], reason: str = "a rental needs the GPU") -> list[str]:
        """Stop every challenge on any of ``gpu_uuids`` (a rental's start comes first); returns their ids."""
        wanted = set(gpu_uuids)
        runs = [run for run in list(self._runs.values()) if run.gpu_uuids & wanted]
        for run in runs:
            log.info("challenge %s yields its GPUs: %s", run.challenge_id, reason)
            await self._cancel(run, reason)
        return [run.challenge_id for run in runs]

    async def remove_orphans(self) -> list[str]:
        """Stop and remove the challenge workloads no run of this process owns (the agent restarted: their answers are
        lost, and the master fails them as ``no_answer``): running ones, and the folders of those that ended while the
        agent was down. Returns their workload ids. Call it after the workload manager re-adopted its workloads."""
        owned = {workload_id(challenge_id) for challenge_id in self._runs}
        running = [r for r in self.workloads.running() if is_challenge(r) and r not in owned]
        left: list[str] = []
        with contextlib.suppress(OSError):
            left = [p.name for p in self.workloads.work_dir.iterdir() if p.is_dir() and is_challenge(p.name)]
        orphans = sorted({*running, *(name for name in left if name not in owned)})
        for rental_id in orphans:
            log.info("removing the challenge workload %s of an earlier agent", rental_id)
            await self._stop_and_forget(rental_id)
        return orphans

    def _refuse_cancelled(self, challenge_id: str) -> None:
        reason = self._cancelled.get(challenge_id)
        if reason is not None:
            raise Cancelled(f"challenge {challenge_id} cancelled: {reason}")

    async def _cancel(self, run: _Run, reason: str) -> None:
        run.reason = reason
        run.cancelled.set()
        self._cancelled[run.challenge_id] = reason
        while len(self._cancelled) > 1000:
            del self._cancelled[next(iter(self._cancelled))]
        async with run.lock:  # a start half-way finishes first, then its workload goes
            await self._remove(run)

    async def _remove(self, run: _Run) -> None:
        """Stop the challenge's workload and delete its folder; forget the run. Cancelling is safe: it finishes."""
        self._runs.pop(run.challenge_id, None)
        rental_id = workload_id(run.challenge_id)
        task = asyncio.ensure_future(self._stop_and_forget(rental_id))
        await asyncio.shield(task)

    async def _stop_and_forget(self, rental_id: str) -> None:
        with contextlib.suppress(GpumarketError, OSError):
            await self.workloads.stop(rental_id, timeout=1.0, reason="GPU challenge over")
        with contextlib.suppress(GpumarketError, OSError):
            await self.workloads.forget(rental_id)

    async def _folder(self, rental_id: str) -> Path:
        path = await self.workloads.containers.workspace_path(rental_id)
        if path is None:
            raise ChallengeError(f"the challenge's workload {rental_id} has no /workspace")
        return path

    async def _wait_for(self, run: _Run, rental_id: str, path: Path, *, timeout: float) -> dict[str, Any]:
        """The program's answer in ``path`` once it is whole (written to a temporary name, then renamed)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while True:
            if run.cancelled.is_set():
                raise Cancelled(f"challenge {run.challenge_id} cancelled: {run.reason}")
            running = rental_id in self.workloads.running()
            if path.exists():
                try:
                    return _read_json(path)
                except ChallengeError:
                    if not running:
                        raise  # else: still being written; read again next poll
            elif not running:
                raise ChallengeError(f"the challenge program exited without writing {path.name}; its log: {self._tail(rental_id)}")
            if loop.time() > until:
                raise ChallengeError(f"no {path.name} from the challenge program within {timeout:g} s")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await run.cancelled.wait()

    def _tail(self, rental_id: str) -> str:
        try:
            data, _end = self.workloads.read_log(rental_id, offset=0, limit=1 << 20)
        except (GpumarketError, OSError):
            return "(none)"
        return data[-300:].decode(errors="replace").strip() or "(empty)"


def _write_json(path: Path, document: dict[str, Any]) -> None:
    """Write atomically, readable by the container's user (the program polls for the name)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(document, separators=(",", ":")), encoding="utf-8")
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)


def _read_json(path: Path) -> dict[str, Any]:
    if path.stat().st_size > _MAX_ANSWER_BYTES:
        raise ChallengeError(f"{path.name} is larger than {_MAX_ANSWER_BYTES} bytes")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ChallengeError(f"{path.name} is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ChallengeError(f"{path.name} is not a JSON object")
    return document
