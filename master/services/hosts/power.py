"""Off-peak power limits (issue 26, part 4; docs/power.md): a provider's opt-in per host, the off-peak rule, and
the pass that tells agents.

**The policy.** A provider opts a host in with a cap: watts, or a fraction of each GPU's default limit. Each present
GPU's target is checked against the range its agent reported (``power_limit_min_w..max_w``) and must be below its
default; a GPU that reports no range is left out. Bad input is 400 ``invalid_power_policy`` saying what to change.

**Off-peak** (``off_peak_until``), from the demand forecast (``master/services/market/forecast.py``): for the host's GPU model
and region, the forecast of the next 24 hours from the current hour (``forecast_models.choose_forecast``, the one
``GET /demand-forecast`` shows); an hour is off-peak when its forecast is
below ``off_peak_threshold`` (default 0.5) × the 24 hours' peak. The window runs from now to the first hour that is not
off-peak. A model and region with no demand at all in the history are off-peak throughout (nobody is expected; a rental
still gets its GPU back at full power before it starts). A host with several models is off-peak only when each is, until
the earliest end.

**The pass** (``power_pass``, every ``power_interval`` under the ``power-policy`` lease): each opted-in host's policy —
targets and window, or nothing when it is off or not off-peak — is sent as ``SetPowerPolicy`` when it differs from what
its agent was last sent (an older unanswered one is superseded). Placement never waits for it: the agent restores a
GPU before any start. Then the agents' energy counters are folded into days (``master/services/hosts/power_savings.py``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Command as CommandRow
from master.models import Gpu, Host, HostPowerPolicy
from master.services import commands, market
from master.services.accounts import Principal
from master.services.hosts import power_savings
from master.services.market import choose_forecast
from shared import protocol
from shared.errors import BadRequest, Conflict, NotFound

log = logging.getLogger(__name__)

POWER_LEASE = "power-policy"
HORIZON_HOURS = 24
HISTORY_DAYS = 14
DEFAULT_THRESHOLD = 0.5
NOTHING: Mapping[str, Any] = {"targets": {}, "off_peak_until": None}  # no GPU lowered
MAX_CAP_WATTS = protocol.MAX_POWER_LIMIT_W


@dataclass(frozen=True)
class PolicyInput:
    """What a provider asks for (``PUT /hosts/{id}/power-policy``), checked by ``put_policy``."""

    enabled: bool = True
    cap_watts: float | None = None
    cap_fraction: float | None = None
    off_peak_threshold: float = DEFAULT_THRESHOLD


def _invalid(message: str, **details: Any) -> BadRequest:
    return BadRequest(message, code="invalid_power_policy", details=details or None)


def check_input(asked: PolicyInput) -> None:
    """The request's own rules (before any GPU is looked at); 400 ``invalid_power_policy`` naming what to change."""
    if not (0 < asked.off_peak_threshold <= 1) or not math.isfinite(asked.off_peak_threshold):
        raise _invalid("off_peak_threshold must be a share of the forecast peak above 0 and at most 1, e.g. 0.5")
    if not asked.enabled:
        return
    if (asked.cap_watts is None) == (asked.cap_fraction is None):
        raise _invalid("give exactly one of cap_watts (e.g. 250) or cap_fraction (of each GPU's default limit, e.g. 0.6)")
    if asked.cap_watts is not None and not (0 < asked.cap_watts <= MAX_CAP_WATTS and math.isfinite(asked.cap_watts)):
        raise _invalid(f"cap_watts must be a number of watts above 0 and at most {MAX_CAP_WATTS:g}, e.g. 250")
    if asked.cap_fraction is not None and not (0 < asked.cap_fraction < 1 and math.isfinite(asked.cap_fraction)):
        raise _invalid("cap_fraction must lie between 0 and 1 (exclusive): the share of each GPU's default limit, e.g. 0.6")


def gpu_targets(
    gpus: Sequence[Gpu], *, cap_watts: float | None, cap_fraction: float | None
) -> tuple[dict[str, float], dict[str, str], list[str]]:
    """Per present GPU: its target watts; the GPUs left out and why; and the problems that make the cap invalid."""
    targets: dict[str, float] = {}
    left_out: dict[str, str] = {}
    problems: list[str] = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        info = gpu.info or {}
        low, high, default = (_watts(info.get(name)) for name in ("power_limit_min_w", "power_limit_max_w", "power_limit_default_w"))
        if low is None or high is None or default is None:
            left_out[gpu.uuid] = "its agent reports no adjustable power-limit range"
            continue
        watts = float(cap_watts) if cap_watts is not None else round(float(cap_fraction or 0) * default, 1)
        if not low <= watts <= high:
            problems.append(f"GPU {gpu.index} ({gpu.name}): {watts:g} W is outside its allowed range {low:g}-{high:g} W")
        elif watts >= default:
            problems.append(f"GPU {gpu.index} ({gpu.name}): {watts:g} W is not below its default limit of {default:g} W")
        else:
            targets[gpu.uuid] = watts
    return targets, left_out, problems


def _watts(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def off_peak_until(ahead: Sequence[float] | None, *, start: datetime, threshold: float) -> datetime | None:
    """The end of the off-peak window that includes the hour starting at ``start`` (``ahead[0]`` is that hour's forecast),
    or ``None`` when that hour is not off-peak. ``None`` for ``ahead``: no demand at all, off-peak for the whole horizon."""
    horizon = HORIZON_HOURS if ahead is None else len(ahead)
    peak = max(ahead, default=0.0) if ahead is not None else 0.0
    if peak <= 0:
        return start + timedelta(hours=horizon)
    below = threshold * peak
    if ahead is not None and ahead[0] >= below:
        return None
    end = next((hour for hour, value in enumerate(ahead or ()) if value >= below), horizon)
    return start + timedelta(hours=end)


def host_window(
    models: Sequence[str], region: str | None, ahead: Mapping[market.Key, Sequence[float]], *, start: datetime, threshold: float
) -> datetime | None:
    """The host's off-peak window: every model's, ending at the earliest; ``None`` when any of them is not off-peak."""
    ends = [off_peak_until(ahead.get((model, region or market.ANY)), start=start, threshold=threshold) for model in models]
    if not ends or any(end is None for end in ends):
        return None
    return min(end for end in ends if end is not None)


# ---- the provider's API -----------------------------------------------------------------


async def _own_host(session: AsyncSession, principal: Principal, host_id: str) -> Host:
    host = await session.get(Host, host_id)
    if host is None or not (principal.role == "admin" or host.owner_id == principal.account_id):
        raise NotFound(f"no host {host_id!r} among your hosts", code="host_not_found")
    return host


async def _present_gpus(session: AsyncSession, host_ids: Sequence[str]) -> list[Gpu]:
    if not host_ids:
        return []
    return list((await session.scalars(select(Gpu).where(Gpu.host_id.in_(host_ids), Gpu.present.is_(True)))).all())


async def put_policy(session: AsyncSession, principal: Principal, host_id: str, asked: PolicyInput, *, now: datetime) -> dict[str, Any]:
    """Opt the host in (or out) with ``asked``; the next pass tells its agent. Answers ``policy_view``."""
    check_input(asked)
    host = await _own_host(session, principal, host_id)
    if host.state == "revoked":
        raise Conflict(f"host {host_id!r} is revoked", code="host_revoked")
    gpus = await _present_gpus(session, [host_id])
    if asked.enabled:
        if not gpus:
            raise _invalid(f"host {host_id!r} has reported no GPUs yet; opt it in once its agent has connected")
        targets, left_out, problems = gpu_targets(gpus, cap_watts=asked.cap_watts, cap_fraction=asked.cap_fraction)
        if problems:
            raise _invalid("the cap does not fit the host's GPUs: " + "; ".join(problems), problems=problems)
        if not targets:
            raise _invalid("none of the host's GPUs lets its power limit be set: " + "; ".join(sorted(set(left_out.values()))))
    policy = await session.get(HostPowerPolicy, host_id, with_for_update=True)
    if policy is None:
        policy = HostPowerPolicy(host_id=host_id)
        session.add(policy)
    policy.enabled = asked.enabled
    policy.cap_watts = asked.cap_watts if asked.enabled else None
    policy.cap_fraction = asked.cap_fraction if asked.enabled else None
    policy.off_peak_threshold = asked.off_peak_threshold
    policy.updated_at = now
    await session.flush()
    return await policy_view(session, host, policy, gpus, now=now)


async def get_policy(session: AsyncSession, principal: Principal, host_id: str, *, now: datetime) -> dict[str, Any]:
    """The host's policy (``enabled: false`` before any opt-in), each GPU's target and energy saved."""
    host = await _own_host(session, principal, host_id)
    policy = await session.get(HostPowerPolicy, host_id)
    return await policy_view(session, host, policy, await _present_gpus(session, [host_id]), now=now)


async def policy_view(
    session: AsyncSession, host: Host, policy: HostPowerPolicy | None, gpus: Sequence[Gpu], *, now: datetime
) -> dict[str, Any]:
    enabled = policy is not None and policy.enabled
    targets, left_out, _ = gpu_targets(gpus, cap_watts=policy.cap_watts, cap_fraction=policy.cap_fraction) if enabled and policy else ({}, {}, [])
    saved = await power_savings.saved_per_gpu(session, [host.id])
    live = {g.get("uuid"): g for g in ((host.latest_telemetry or {}).get("gpus") or []) if isinstance(g, dict)}
    sent = policy.sent if policy is not None else None
    last = await session.get(CommandRow, policy.command_id) if policy is not None and policy.command_id else None
    return {
        "host_id": host.id,
        "enabled": enabled,
        "cap_watts": policy.cap_watts if policy else None,
        "cap_fraction": policy.cap_fraction if policy else None,
        "off_peak_threshold": policy.off_peak_threshold if policy else DEFAULT_THRESHOLD,
        "off_peak_until": (sent or {}).get("off_peak_until"),
        "sent_at": _iso(policy.sent_at) if policy and policy.sent_at else None,
        "agent": None if last is None else {"command_id": last.id, "state": last.state, "result": last.result},
        "energy_saved_wh": round(sum(saved.get(g.uuid, 0.0) for g in gpus), 3),
        "gpus": [{
            "uuid": g.uuid, "index": g.index, "name": g.name,
            "default_w": (g.info or {}).get("power_limit_default_w"), "min_w": (g.info or {}).get("power_limit_min_w"),
            "max_w": (g.info or {}).get("power_limit_max_w"), "target_w": targets.get(g.uuid), "left_out": left_out.get(g.uuid),
            "limit_w": live.get(g.uuid, {}).get("power_limit_w"), "energy_saved_wh": round(saved.get(g.uuid, 0.0), 3),
        } for g in sorted(gpus, key=lambda g: g.index)],
    }  # fmt: skip


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


# ---- the pass ----------------------------------------------------------------------------


def desired_policy(policy: HostPowerPolicy, host: Host, gpus: Sequence[Gpu], ahead: Mapping[market.Key, Sequence[float]],
                   *, start: datetime) -> dict[str, Any]:  # fmt: skip
    """What the host's agent should hold now: ``{"targets": {uuid: watts}, "off_peak_until": ISO | None}``; no targets
    and no window when the policy is off, fits no GPU, or the hour is not off-peak (the agent then restores every GPU)."""
    if not policy.enabled or host.state == "revoked":
        return dict(NOTHING)
    targets, _, problems = gpu_targets(gpus, cap_watts=policy.cap_watts, cap_fraction=policy.cap_fraction)
    if problems:  # a GPU changed since the opt-in: lower only those the cap still fits
        log.info("host %s: power policy leaves out GPUs it no longer fits: %s", host.id, "; ".join(problems))
    models = sorted({g.name for g in gpus if g.uuid in targets})
    until = host_window(models, host.region, ahead, start=start, threshold=policy.off_peak_threshold) if targets else None
    if until is None:
        return dict(NOTHING)
    return {"targets": targets, "off_peak_until": _iso(until)}


async def power_pass(master: Master) -> int:
    """Send each opted-in host's policy where it changed; fold the agents' energy counters. Returns commands sent.
    Cancelling is safe: a command row and its policy's ``sent`` are written in one transaction, published after it."""
    now = master.clock.now()
    start = market.hour_start(now)
    issued: list[str] = []
    async with master.db.session() as session:
        rows = (await session.execute(select(HostPowerPolicy, Host).join(Host, Host.id == HostPowerPolicy.host_id))).all()
        if not rows:
            return 0
        _, history = await market.demand_history(session, now=now, days=HISTORY_DAYS)
        # The forecast the API and the console show: per series the seasonal baseline, or the learned model where it won.
        ahead = {key: choose_forecast(values, horizon=HORIZON_HOURS).forecast for key, values in history.items()}
        gpus_of: dict[str, list[Gpu]] = {}
        for gpu in await _present_gpus(session, [host.id for _, host in rows]):
            gpus_of.setdefault(gpu.host_id, []).append(gpu)
        for policy, host in rows:
            desired = desired_policy(policy, host, gpus_of.get(host.id, []), ahead, start=start)
            if desired == (policy.sent or NOTHING) or host.state == "revoked":  # never sent: as if nothing was
                continue
            until = desired["off_peak_until"]
            command = protocol.SetPowerPolicy(
                targets=[protocol.PowerTarget(gpu_uuid=uuid, watts=watts) for uuid, watts in desired["targets"].items()],
                off_peak_until=None if until is None else datetime.fromisoformat(until),
            )
            # An older policy the agent has not answered yet is superseded (before the new row exists, so not it).
            await session.execute(
                update(CommandRow)
                .where(CommandRow.host_id == host.id, CommandRow.kind == command.kind, CommandRow.state.in_(commands.OPEN_STATES))
                .values(state="failed", completed_at=now, result={"ok": False, "detail": "superseded by a newer power policy"})
            )
            row = commands.new_command(session, host_id=host.id, command=command, rental_id=None)
            policy.sent, policy.sent_at, policy.command_id = desired, now, row.id
            issued.append(row.id)
        await power_savings.fold(session, [host for _, host in rows], now=now)
    await commands.publish(master, issued)
    return len(issued)
