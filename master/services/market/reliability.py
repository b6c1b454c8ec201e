"""Reliability: a score per host from its own history, always shown with the numbers behind it.

Over the last 30 days (or since the host enrolled, if later)::

    score = uptime × rentals × faults                     (rounded to 4 places, 0..1)

* **uptime** — time up / time observed, from the host's state changes (``host_events``).
  Up: ``online``, ``rented``, ``draining`` (it still serves its renters). Down: ``offline``,
  ``faulty``. Not observed, so in neither: ``enrolling`` (the agent never connected yet),
  ``maintenance`` (downtime the provider announced) and time before the first recorded
  state.
* **rentals** — rentals that ended on the host in the window, smoothed towards success
  with a prior of ``RENTAL_PRIOR_SUCCESSES`` completed rentals:
  ``(completed + 4) / (completed + failed + 4)``. One failure on a new host costs 20 %, not
  everything; a host that keeps failing converges to its real success rate. Completed:
  ``stopped``. Failed: ``failed`` with ``failure_owner`` ``provider``, the owner its failure code has
  (``master.services.market.failures``: decided from the code, never the reason's text). The
  renter's failures (an image that does not exist, a registry that refused the renter's login, a
  workload that exited non-zero ...) and the platform's (placement, the master) are counted apart
  and never move the score, so a renter cannot ruin a host's score by running broken jobs.
* **faults** — ``0.97 ** faults``, never below 0.5: hardware fault events (the XIDs and ECC
  kinds ``master.services.market.faults`` counts), failed health checks, GPUs that vanished, and failed GPU
  verifications from a GPU's ``verification_failures``-th in a row on (``gpu_verification_failed``, the provider's).

**Seeded history.** ``gpumarket up`` gives its simulated demo hosts a made-up past (state changes
recorded by ``SEEDED_ACTOR`` before the host enrolled) so that a demo has scores to filter on. Such
events count like any others, and may open the window before ``created_at``; the inputs say how
much of the observed time they make (``uptime.seeded_s``) and ``seeded`` is true, shown by
``GET /hosts/{id}`` and as ``reliability_seeded`` on hosts and offers. Real hosts never have any.

A host observed (up + down) for less than ``MIN_OBSERVED`` (1 hour) has no score yet
(``None``): a neutral number would be a guess, and ``master.services.market.tiers.classify`` applies no
reliability penalty to ``None``. Its inputs are still computed and shown.

Each GPU's classification (``master.services.market.tiers.classify``) uses the host's score, its latest
network download and the GPU's PCIe link, and is stored with its reasons and inputs.

``rescore_all`` reads a chunk of hosts and their histories in a few queries, computes
without a session open, and writes hosts and GPUs in two short transactions of their
own, so it never holds host and GPU row locks at once (ingestion takes them in either
order). Imports models, sibling services and ``master.services.market.tiers``; never ``telemetry.hosts``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Command as CommandRow
from master.models import Gpu, GpuEvent, GpuVerification, Host, HostEvent, Rental
from master.services.lifecycle.rentals import RentalState
from master.services.market import faults
from master.services.market.failures import Owner
from master.services.market.tiers import classify
from shared.errors import ValidationFailed

log = logging.getLogger(__name__)

RELIABILITY_WINDOW = timedelta(days=30)
MIN_OBSERVED = timedelta(hours=1)
UP_STATES = frozenset({"online", "rented", "draining"})
DOWN_STATES = frozenset({"offline", "faulty"})
UNKNOWN_STATE = "unknown"  # before the first state change the window holds
RENTAL_PRIOR_SUCCESSES = 4
FAULT_FACTOR = 0.97
FAULT_FACTOR_FLOOR = 0.5
FORMULA = "score = uptime.fraction × rentals.factor × faults.factor"
SEEDED_ACTOR = "demo-seed"  # the actor of made-up state changes (gpumarket up's demo hosts); see above

SCORING_CHUNK = 200

@dataclass
class HostHistory:
    """What one host's score is computed from, for one window."""

    state_before: str | None = None  # the state when the window opened (None: nothing recorded before it)
    state_before_seeded: bool = False  # whether a seeded event set it
    events: list[tuple[datetime, str, str, str]] = field(default_factory=list)  # (at, to_state, cause, actor), in order
    completed_rentals: int = 0
    host_failed_rentals: int = 0
    renter_failed_rentals: int = 0
    platform_failed_rentals: int = 0
    fault_events: int = 0
    failed_health_checks: int = 0
    failed_verifications: int = 0  # counted ones: a GPU's ``verification_failures``-th failed challenge in a row or later


async def load_histories(
    session: AsyncSession, host_ids: Sequence[str], *, since: datetime, now: datetime
) -> dict[str, HostHistory]:
    """The histories of ``host_ids`` over ``[since, now]``, in five queries whatever their number."""
    histories = {host_id: HostHistory() for host_id in host_ids}
    if not host_ids:
        return histories
    ids = list(host_ids)
    newest_first = func.row_number().over(
        partition_by=HostEvent.host_id, order_by=(HostEvent.at.desc(), HostEvent.id.desc())
    )
    before = (
        select(HostEvent.host_id, HostEvent.to_state, HostEvent.actor, newest_first.label("rank"))
        .where(HostEvent.host_id.in_(ids), HostEvent.at < since)
        .subquery()
    )
    rows = await session.execute(select(before.c.host_id, before.c.to_state, before.c.actor).where(before.c.rank == 1))
    for host_id, state, actor in rows.all():
        histories[host_id].state_before = state
        histories[host_id].state_before_seeded = actor == SEEDED_ACTOR
    events = await session.execute(
        select(HostEvent.host_id, HostEvent.at, HostEvent.to_state, HostEvent.cause, HostEvent.actor)
        .where(HostEvent.host_id.in_(ids), HostEvent.at >= since, HostEvent.at <= now)
        .order_by(HostEvent.host_id, HostEvent.at, HostEvent.id)
    )
    for host_id, at, to_state, cause, actor in events.all():
        histories[host_id].events.append((at, to_state, cause, actor))
    ended = await session.execute(
        select(Rental.host_id, Rental.state, Rental.failure_owner).where(
            Rental.host_id.in_(ids), Rental.state.in_((RentalState.STOPPED, RentalState.FAILED)), Rental.stopped_at >= since, Rental.stopped_at <= now
        )
    )
    for host_id, state, owner in ended.all():
        if host_id is None:
            continue
        history = histories[host_id]
        if state == RentalState.STOPPED:
            history.completed_rentals += 1
        elif owner == Owner.RENTER:
            history.renter_failed_rentals += 1
        elif owner == Owner.PLATFORM:
            history.platform_failed_rentals += 1
        else:  # the provider's (0030 gave every failed rental an owner; a NULL would be a bug: counted as before)
            history.host_failed_rentals += 1
    counted = await session.execute(
        select(GpuEvent.host_id, func.count())
        .where(GpuEvent.host_id.in_(ids), GpuEvent.received_at >= since, GpuEvent.received_at <= now, faults.fault_condition())
        .group_by(GpuEvent.host_id)
    )
    for host_id, n in counted.all():
        histories[host_id].fault_events = int(n)
    checks = await session.execute(
        select(CommandRow.host_id, CommandRow.result).where(
            CommandRow.host_id.in_(ids),
            CommandRow.kind == faults.HEALTH_CHECK,
            CommandRow.completed_at >= since,
            CommandRow.completed_at <= now,
        )
    )
    for host_id, result in checks.all():
        result = result or {}
        if not faults.check_passed(bool(result.get("ok")), result.get("data") or {}):
            histories[host_id].failed_health_checks += 1
    verifications = await session.execute(
        select(GpuVerification.host_id, GpuVerification.result).where(
            GpuVerification.host_id.in_(ids), GpuVerification.state == "failed",
            GpuVerification.finished_at >= since, GpuVerification.finished_at <= now,
        )
    )  # fmt: skip
    for host_id, result in verifications.all():
        # master/services/hosts/verification.py marks a GPU's verdict "counted" from its verification_failures-th failure on.
        if any(isinstance(verdict, dict) and verdict.get("counted") for verdict in (result or {}).values()):
            histories[host_id].failed_verifications += 1
    return histories


def _seconds(value: float) -> float:
    return round(value, 3)


def score_history(
    history: HostHistory, *, created_at: datetime, now: datetime, window: timedelta = RELIABILITY_WINDOW
) -> tuple[float | None, dict[str, Any]]:
    """The score and the inputs it came from (a pure function: every number is in the inputs)."""
    seeded_at = [at for at, _state, _cause, actor in history.events if actor == SEEDED_ACTOR]
    # A state recorded before the window means the host (or its seeded past) was there when it opened.
    start = now - window if history.state_before is not None else max(min([created_at, *seeded_at]), now - window)
    by_state: dict[str, float] = defaultdict(float)
    seeded_s = 0.0  # observed time whose state a seeded event set
    state, state_seeded = history.state_before or UNKNOWN_STATE, history.state_before_seeded
    cursor = start
    for at, to_state, _cause, actor in history.events:
        at = min(at, now)
        if at > cursor:
            by_state[state] += (at - cursor).total_seconds()
            if state_seeded and state in UP_STATES | DOWN_STATES:
                seeded_s += (at - cursor).total_seconds()
            cursor = at
        state, state_seeded = to_state, actor == SEEDED_ACTOR
    if now > cursor:
        by_state[state] += (now - cursor).total_seconds()
        if state_seeded and state in UP_STATES | DOWN_STATES:
            seeded_s += (now - cursor).total_seconds()
    up_s = sum(s for name, s in by_state.items() if name in UP_STATES)
    down_s = sum(s for name, s in by_state.items() if name in DOWN_STATES)
    observed_s = up_s + down_s
    uptime = up_s / observed_s if observed_s > 0 else None

    completed, failed = history.completed_rentals, history.host_failed_rentals
    rental_factor = (completed + RENTAL_PRIOR_SUCCESSES) / (completed + failed + RENTAL_PRIOR_SUCCESSES)

    vanished = sum(
        1
        for _at, to_state, cause, actor in history.events
        if to_state == "faulty" and actor == faults.ACTOR and cause.startswith(faults.VANISHED_CAUSE)
    )
    fault_count = history.fault_events + history.failed_health_checks + history.failed_verifications + vanished
    fault_factor = max(FAULT_FACTOR_FLOOR, FAULT_FACTOR**fault_count)

    score: float | None = None
    if uptime is not None and observed_s >= MIN_OBSERVED.total_seconds():
        score = round(uptime * rental_factor * fault_factor, 4)
    inputs: dict[str, Any] = {
        "window_days": round(window.total_seconds() / 86400, 3),
        "window": {"start": start.isoformat(), "end": now.isoformat()},
        "uptime": {
            "observed_s": _seconds(observed_s),
            "up_s": _seconds(up_s),
            "down_s": _seconds(down_s),
            "fraction": round(uptime, 4) if uptime is not None else None,
            "seeded_s": _seconds(seeded_s),
            "by_state_s": {name: _seconds(s) for name, s in sorted(by_state.items())},
            "up_states": sorted(UP_STATES),
            "down_states": sorted(DOWN_STATES),
        },
        "rentals": {
            "completed": completed,
            "failed": failed,  # the provider's: the only ones the factor counts
            "failed_by_provider": failed,
            "failed_by_renter": history.renter_failed_rentals,
            "failed_by_platform": history.platform_failed_rentals,
            "prior_successes": RENTAL_PRIOR_SUCCESSES,
            "factor": round(rental_factor, 4),
            "formula": f"(completed + {RENTAL_PRIOR_SUCCESSES}) / (completed + failed + {RENTAL_PRIOR_SUCCESSES})",
        },
        "faults": {
            "gpu_events": history.fault_events,
            "failed_health_checks": history.failed_health_checks,
            "failed_verifications": history.failed_verifications,  # provider-caused: gpu_verification_failed
            "vanished_gpus": vanished,
            "count": fault_count,
            "factor": round(fault_factor, 4),
            "formula": f"max({FAULT_FACTOR_FLOOR}, {FAULT_FACTOR} ** count)",
        },
        "formula": FORMULA,
        "score": score,
        "seeded": seeded_s > 0,
    }
    if seeded_s > 0:
        inputs["seeded_note"] = (
            f"{_seconds(seeded_s)} s of the observed time is seeded demo history (gpumarket up), not measured"
        )
    if score is None:
        inputs["note"] = (
            f"no score yet: {_seconds(observed_s)} s observed, {MIN_OBSERVED.total_seconds():g} s needed"
        )
    return score, inputs


async def compute_reliability(
    session: AsyncSession, host: Host, *, now: datetime, window: timedelta = RELIABILITY_WINDOW
) -> tuple[float | None, dict[str, Any]]:
    """``host``'s score over ``window`` up to ``now``, and its inputs (``None`` until 1 h observed)."""
    histories = await load_histories(session, [host.id], since=now - window, now=now)
    return score_history(histories[host.id], created_at=host.created_at, now=now, window=window)


# ---- classification ------------------------------------------------------------------


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _whole(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def network_down_mbps(host: Host) -> float | None:
    """The download speed of the host's latest network test (None if it failed or never ran)."""
    network = host.latest_network or {}
    return None if network.get("error") else _number(network.get("download_mbps"))


def gpu_classification(gpu: Gpu, *, network_down_mbps: float | None, reliability: float | None) -> dict[str, Any]:
    """The classification columns of ``gpu`` (tier, score, model_key, needs_review, classification)."""
    info: Mapping[str, Any] = gpu.info or {}
    inputs: dict[str, Any] = {
        "name": gpu.name,
        "memory_mib": gpu.memory_total_mib,
        "max_sm_clock_mhz": _number(info.get("max_sm_clock_mhz")),
        "pcie_gen": _whole(info.get("pcie_gen_max")),
        "pcie_width": _whole(info.get("pcie_width_max")),
        "network_down_mbps": network_down_mbps,
        "reliability": reliability,
    }
    try:
        result = classify(
            gpu.name,
            gpu.memory_total_mib,
            max_sm_clock_mhz=inputs["max_sm_clock_mhz"],
            pcie_gen=inputs["pcie_gen"],
            pcie_width=inputs["pcie_width"],
            network_down_mbps=network_down_mbps,
            reliability=reliability,
        )
    except ValidationFailed as exc:
        # Impossible readings from the agent: list the GPU for a person to look at, unranked.
        return {
            "tier": None, "score": None, "model_key": None, "needs_review": True,
            "classification": {"reasons": [f"not classified: {exc}"], "inputs": inputs},
        }  # fmt: skip
    return {
        "tier": str(result.tier),
        "score": result.score,
        "model_key": result.model_key,
        "needs_review": result.needs_review,
        "classification": {"reasons": list(result.reasons), "inputs": inputs},
    }


def _differs(gpu: Gpu, values: Mapping[str, Any]) -> bool:
    return any(getattr(gpu, name) != value for name, value in values.items())


def classify_host_gpus(host: Host, gpus: Iterable[Gpu]) -> int:
    """Classify the present ``gpus`` of ``host`` in place (inside the caller's transaction); returns how many changed.

    For the ingest handlers too: a new GPU is ranked at its first hello, and a host's
    GPUs again after a new network measurement, without waiting for the next pass.
    """
    down = network_down_mbps(host)
    changed = 0
    for gpu in gpus:
        if not gpu.present:
            continue
        values = gpu_classification(gpu, network_down_mbps=down, reliability=host.reliability)
        if _differs(gpu, values):
            for name, value in values.items():
                setattr(gpu, name, value)
            changed += 1
    return changed


async def rescore_host(session: AsyncSession, host: Host, *, now: datetime) -> None:
    """Recompute ``host``'s score and classify its present GPUs, inside the caller's transaction."""
    score, inputs = await compute_reliability(session, host, now=now)
    host.reliability, host.reliability_inputs, host.reliability_at = score, inputs, now
    gpus = (await session.scalars(select(Gpu).where(Gpu.host_id == host.id, Gpu.present.is_(True)))).all()
    classify_host_gpus(host, gpus)


async def rescore_all(master: Master, *, now: datetime | None = None, chunk: int = SCORING_CHUNK) -> int:
    """Re-score every host that is not revoked, ``chunk`` hosts at a time; returns how many.

    Per chunk: one read transaction (hosts, histories, GPUs: seven queries), then one write
    transaction for the hosts and one for the GPUs whose classification changed. Cancelling
    is safe: every chunk written stays written, the rest waits for the next pass.
    """
    now = now or master.clock.now()
    since = now - RELIABILITY_WINDOW
    after = ""
    scored = 0
    while True:
        async with master.db.session() as session:
            hosts = (
                await session.scalars(
                    select(Host).where(Host.state != "revoked", Host.id > after).order_by(Host.id).limit(chunk)
                )
            ).all()
            if not hosts:
                break
            ids = [h.id for h in hosts]
            histories = await load_histories(session, ids, since=since, now=now)
            gpus = (
                await session.scalars(select(Gpu).where(Gpu.host_id.in_(ids), Gpu.present.is_(True)).order_by(Gpu.id))
            ).all()
        gpus_by_host: dict[str, list[Gpu]] = defaultdict(list)
        for gpu in gpus:
            gpus_by_host[gpu.host_id].append(gpu)
        host_rows: list[dict[str, Any]] = []
        gpu_rows: list[dict[str, Any]] = []
        for host in hosts:
            score, inputs = score_history(histories[host.id], created_at=host.created_at, now=now)
            host_rows.append({"id": host.id, "reliability": score, "reliability_inputs": inputs, "reliability_at": now})
            down = network_down_mbps(host)
            for gpu in gpus_by_host[host.id]:
                values = gpu_classification(gpu, network_down_mbps=down, reliability=score)
                if _differs(gpu, values):
                    gpu_rows.append({"id": gpu.id, **values})
        # Hosts and GPUs in separate transactions: never both kinds of row lock at once.
        async with master.db.session() as session:
            await session.execute(update(Host), host_rows)
        if gpu_rows:
            async with master.db.session() as session:
                await session.execute(update(Gpu), gpu_rows)
        scored += len(hosts)
        after = hosts[-1].id
        if len(hosts) < chunk:
            break
    return scored


# ---- views ---------------------------------------------------------------------------


def reliability_view(host: Host) -> dict[str, Any]:
    """The host's score for GET /hosts/{id}, with how it was computed."""
    return {
        "score": host.reliability,
        "computed_at": host.reliability_at.isoformat() if host.reliability_at else None,
        "inputs": host.reliability_inputs,
        "seeded": is_seeded(host.reliability_inputs),
        "failed_rentals": failed_rentals(host.reliability_inputs),
    }


def failed_rentals(inputs: Mapping[str, Any] | None) -> dict[str, int]:
    """The rentals that failed on the host in the score's window, by owner (only the provider's lower the score)."""
    rentals = (inputs or {}).get("rentals") or {}
    return {
        Owner.PROVIDER.value: int(rentals.get("failed_by_provider", rentals.get("failed", 0)) or 0),
        Owner.RENTER.value: int(rentals.get("failed_by_renter", 0) or 0),
        Owner.PLATFORM.value: int(rentals.get("failed_by_platform", 0) or 0),
    }


def is_seeded(inputs: Mapping[str, Any] | None) -> bool:
    """Whether a score's inputs (``Host.reliability_inputs``) include seeded demo history."""
    return bool((inputs or {}).get("seeded"))


def classification_view(gpu: Gpu) -> dict[str, Any]:
    """A GPU's tier and why, for the host and offer views."""
    return {
        "tier": gpu.tier,
        "score": gpu.score,
        "model_key": gpu.model_key,
        "needs_review": gpu.needs_review,
        "reasons": (gpu.classification or {}).get("reasons", []),
    }
