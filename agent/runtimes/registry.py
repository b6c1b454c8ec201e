"""The on-disk registry ``work_dir/workloads.json``: what a restarted agent must adopt or report.

Rewritten atomically on every change: each workload's record (``Workload.to_record``: its
pid and kernel start time, cgroups, container, share) and the exits ``on_exit`` has not
taken yet. A damaged file is moved aside (``workloads.json.unreadable``) rather than
stopping the agent; a damaged record is skipped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from agent.runtimes.base import Workload
from agent.runtimes.pids import process_start_time, reap_if_ours
from agent.state import atomic_write
from shared.errors import GpumarketError

log = logging.getLogger(__name__)

REGISTRY_NAME: Final = "workloads.json"


class Registry:
    def __init__(self, work_dir: Path) -> None:
        self.path = work_dir / REGISTRY_NAME

    def load(self) -> tuple[list[Workload], dict[str, int | None]] | None:
        """The recorded workloads and unreported exits; ``None`` when there is no registry yet."""
        try:
            raw = json.loads(self.path.read_text())
            records = raw["workloads"]
            unreported = raw.get("unreported_exits", {})
            if not isinstance(records, list) or not isinstance(unreported, dict):
                raise ValueError("unexpected layout")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            aside = self.path.with_name(f"{REGISTRY_NAME}.unreadable")
            log.error("workload registry %s is unreadable (%s); moved to %s — the workloads it listed are not adopted", self.path, exc, aside)
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            return [], {}
        workloads = []
        for record in records:
            try:
                workloads.append(Workload.from_record(record))
            except (KeyError, TypeError, ValueError, GpumarketError) as exc:
                log.error("skipping unreadable workload record %r: %s", record, exc)
        exits = {r: c for r, c in unreported.items() if isinstance(r, str) and isinstance(c, int | None)}
        return workloads, exits

    def adopt(self) -> tuple[list[Workload], list[tuple[Workload, int | None]], dict[str, int | None]] | None:
        """What ``load`` found, split: the workloads still alive and genuinely the same (a pid-less one, a hold or a
        container, always), those that ended while the agent was down or whose pid now names another process, with
        their exit code where this agent can still reap it, and the unreported exits (each workload logged at INFO). ``None``: no
        registry yet."""
        loaded = self.load()
        if loaded is None:
            return None
        workloads, unreported = loaded
        alive: list[Workload] = []
        dead: list[tuple[Workload, int | None]] = []
        for workload in workloads:
            if workload.pid is None or (workload.start_time is not None and process_start_time(workload.pid) == workload.start_time):
                alive.append(workload)
                log.info("rental %s: adopted its %s workload (pid %s)", workload.rental_id, workload.kind, workload.pid)
            else:
                dead.append((workload, reap_if_ours(workload.pid, workload.start_time)))
                log.info("rental %s: its workload (pid %s) ended while the agent was down", workload.rental_id, workload.pid)
        return alive, dead, unreported

    def save(self, workloads: Mapping[str, Workload], unreported: Mapping[str, int | None]) -> None:
        body = {
            "version": 1,
            "workloads": [workloads[r].to_record() for r in sorted(workloads)],
            "unreported_exits": dict(unreported),
        }
        try:
            atomic_write(self.path, json.dumps(body, indent=2, sort_keys=True).encode(), mode=0o600)
        except OSError as exc:
            # The workloads themselves are fine; only an agent restart would lose track of them.
            log.error("cannot write %s (%s); an agent restart would orphan the workloads", self.path, exc.strerror)
