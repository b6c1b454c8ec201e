"""GPU verification's flow (docs/verification.md, "The flow"): challenges issued, commitments recorded by the master's
clock, reveals sent, openings verified, and what each verdict does to the GPU, the listing and the host.

A challenge (``GpuVerification``) goes ``issued`` → ``committed`` → ``revealed`` → ``passed`` | ``failed`` (or
``cancelled``): ``issue`` writes it with its ``start_challenge`` command; ``after_result`` applies the agent's answers
(the commitment: its time is the master's clock when the result is applied, checked against ``deadline_at``; then the
openings, checked by ``challenge.verify``); ``verification_pass`` (one master, under ``LEASE``)
fails challenges that got no answer, re-checks idle hosts at random times and keeps listings' ``verified`` true only
while every present GPU passed within ``verification_max_age_h``.

A failure unlists the host: it goes ``faulty`` with ``CAUSE`` (a passing health check does not bring it back; a passing
challenge does), the ``gpu_verification`` alert tells its provider, and from the ``verification_failures``-th failure
of a GPU in a row each one counts against the host's reliability as provider-caused (``gpu_verification_failed``).
With ``verification_required`` a new host stays ``enrolling`` (not rentable) until its enrollment challenge passes.

Every function here runs in the caller's transaction and commits nothing, except ``request`` and
``verification_pass``, which write and publish their commands.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from master.context import Master
from master.models import Command as CommandRow
from master.models import Gpu, GpuVerification, Host, HostEvent, HostListing, Rental
from master.services import commands
from master.services.accounts import Principal
from master.services.hosts import challenge as challenge_protocol
from master.services.hosts.challenge import Reason
from master.services.lifecycle.hosts import transition
from master.services.lifecycle.rentals import ACTIVE_STATES
from shared import protocol
from shared.errors import Conflict, NotFound
from shared.ids import new_id
from shared.settings import MasterSettings

log = logging.getLogger(__name__)

LEASE: Final = "gpu-verification"
ACTOR: Final = "verification"
CAUSE: Final = "gpu verification failed"
PASSED_CAUSE: Final = "gpu verification passed"
KINDS: Final = ("start_challenge", "reveal_challenge", "cancel_challenge")
TRIGGERS: Final = ("enrollment", "idle", "admin")
OPEN_STATES: Final = ("issued", "committed", "revealed")
ISSUED: Final = "gpumarket_verification_commands"  # session.info key: commands written here, published after commit
_FAILURE_STATES: Final = frozenset({"enrolling", "online", "rented", "draining", "offline"})


def issued_commands(info: dict[str, Any]) -> list[str]:
    """The ids of the commands this session's verification hooks wrote (taken: each is published once)."""
    ids: list[str] = info.pop(ISSUED, [])
    return ids


def _dtype(gpus: Sequence[Gpu]) -> str:
    """The precision the tier is sold in: bf16 from Ampere (compute capability 8.0) on, fp16 on Volta and Turing, else
    fp32; one for the whole challenge (the oldest GPU's)."""
    keys = [g.compute_capability_key for g in gpus if g.compute_capability_key is not None]
    oldest = min(keys) if keys else None
    if oldest is None or oldest >= 8000:
        return "bf16"
    return "fp16" if oldest >= 7000 else "fp32"


async def open_challenge(session: AsyncSession, host_id: str) -> GpuVerification | None:
    return await session.scalar(
        select(GpuVerification)
        .where(GpuVerification.host_id == host_id, GpuVerification.state.in_(OPEN_STATES))
        .order_by(GpuVerification.created_at.desc())
        .limit(1)
    )


async def present_gpus(session: AsyncSession, host_id: str) -> list[Gpu]:
    return list((await session.scalars(select(Gpu).where(Gpu.host_id == host_id, Gpu.present.is_(True)).order_by(Gpu.index))).all())


async def issue(
    session: AsyncSession, host: Host, *, trigger: str, settings: MasterSettings, now: datetime,
    requested_by: str | None = None,
) -> GpuVerification | None:
    """Write a challenge for every present GPU of ``host`` with its ``start_challenge`` command (published after the
    commit: the id is in ``session.info[ISSUED]``); the open one instead when there is one; None without GPUs."""
    current = await open_challenge(session, host.id)
    if current is not None:
        return current
    gpus = await present_gpus(session, host.id)
    if not gpus:
        return None
    dtype = _dtype(gpus)
    seed = secrets.token_bytes(32)
    challenge_id = new_id("gv")
    claims = [{"uuid": g.uuid, "model_key": g.model_key or "", "vram_mib": g.memory_total_mib} for g in gpus]
    challenge = challenge_protocol.make_challenge(
        challenge_id=challenge_id, seed=seed, gpus=claims, dtype=dtype, slack=settings.verification_slack,
        simulation=host.gpu_backend == "sim",
    )
    deadline = float(challenge["deadline_s"])
    n = max(int(g["n"]) for g in challenge["gpus"])
    row = GpuVerification(
        id=challenge_id, host_id=host.id, trigger=trigger, state="issued", gpu_uuids=[g.uuid for g in gpus], seed=seed.hex(),
        size=n, dtype=dtype, created_at=now, sent_at=now, deadline_at=now + timedelta(seconds=deadline), requested_by=requested_by,
    )  # fmt: skip
    command = commands.new_command(
        session, host_id=host.id, rental_id=None,
        command=protocol.StartChallenge(challenge_id=row.id, gpu_uuids=row.gpu_uuids, challenge=challenge,
                                        timeout_s=min(24 * 3600.0, deadline + settings.verification_answer_grace_s)),
    )  # fmt: skip
    row.command_id = command.id
    session.add(row)
    session.info.setdefault(ISSUED, []).append(command.id)
    log.info("host %s: %s challenge %s issued (n=%d, %s, %d GPU, deadline %.1fs)", host.id, trigger, row.id, n, dtype, len(gpus), deadline)
    return row


def _refusal(commitment: Mapping[str, Any], *, challenge_id: str, gpu_uuids: Sequence[str]) -> tuple[Reason, str] | None:
    """Why a commitment fails before any reveal (None: it may be opened): another challenge's (replayed), or a GPU the
    program could not commit for (``memory_short``: it could not hold the claimed size)."""
    if commitment.get("challenge_id") != challenge_id:
        return Reason.REPLAYED_COMMITMENT, f"the commitment is for challenge {str(commitment.get('challenge_id'))[:40]!r}, not {challenge_id}"
    gpus = commitment.get("gpus")
    if not isinstance(gpus, dict):
        return Reason.BAD_PROOF, "the commitment names no GPU"
    for uuid in gpu_uuids:
        entry = gpus.get(uuid)
        if not isinstance(entry, dict):
            return Reason.NO_ANSWER, f"no commitment for GPU {uuid}"
        reason = entry.get("reason")
        if reason is not None and reason != Reason.PASSED:
            try:
                code = Reason(str(reason))
            except ValueError:
                code = Reason.WORKLOAD_FAILED
            return code, str(entry.get("message") or reason)[:500]
    return None


async def after_result(
    session: AsyncSession, row: CommandRow, host: Host, *, ok: bool, detail: str, data: Mapping[str, Any], now: datetime,
    settings: MasterSettings, rng: random.Random | None = None,
) -> None:
    """Apply an agent's (first) answer to one of the challenge's commands; ``now`` is the master's clock."""
    challenge_id = row.args.get("challenge_id")
    v = await session.get(GpuVerification, challenge_id, with_for_update=True) if isinstance(challenge_id, str) else None
    if v is None or v.host_id != host.id or v.state not in OPEN_STATES:
        return
    code = data.get("code") if not ok else None
    if code == "challenge_cancelled":
        v.state, v.finished_at, v.reason_code, v.reason = "cancelled", now, "cancelled", detail[:2000] or "cancelled by the host for a rental"
        log.info("challenge %s of host %s cancelled: %s", v.id, host.id, v.reason)
        return
    if row.kind == "start_challenge" and v.state == "issued":
        if not ok:
            await _fail(session, v, host, Reason.WORKLOAD_FAILED, f"the challenge did not run: {detail or 'no reason given'}", now=now, settings=settings)
            return
        await _committed(session, v, host, data, now=now, settings=settings, rng=rng or random.Random())
    elif row.kind == "reveal_challenge" and v.state == "revealed":
        if not ok:
            await _fail(session, v, host, Reason.WORKLOAD_FAILED, f"the openings did not come: {detail or 'no reason given'}", now=now, settings=settings)
            return
        openings = data.get("openings")
        await _verified(session, v, host, openings if isinstance(openings, dict) else {}, now=now, settings=settings)


async def _committed(
    session: AsyncSession, v: GpuVerification, host: Host, data: Mapping[str, Any], *, now: datetime, settings: MasterSettings,
    rng: random.Random,
) -> None:
    commitment = data.get("commitment")
    v.commitment = commitment if isinstance(commitment, dict) else {}
    v.committed_at = now
    v.state = "committed"
    refused = _refusal(v.commitment, challenge_id=v.id, gpu_uuids=list(v.gpu_uuids))
    if refused is not None:
        await _fail(session, v, host, refused[0], refused[1], now=now, settings=settings)
        return
    if v.deadline_at is not None and now > v.deadline_at:
        late = (now - (v.sent_at or v.created_at)).total_seconds()
        allowed = (v.deadline_at - (v.sent_at or v.created_at)).total_seconds()
        await _fail(session, v, host, Reason.TOO_SLOW, f"committed {late:.1f} s after the challenge, past its deadline of {allowed:.1f} s",
                    now=now, settings=settings)  # fmt: skip
        return
    challenge = await _sent_challenge(session, v)
    if challenge is None:
        await _fail(session, v, host, Reason.NO_ANSWER, "the challenge's command is gone", now=now, settings=settings)
        return
    v.reveal = challenge_protocol.choose_reveal(rng, challenge)
    v.state = "revealed"
    command = commands.new_command(
        session, host_id=host.id, rental_id=None, command=protocol.RevealChallenge(challenge_id=v.id, reveal=v.reveal)
    )
    session.info.setdefault(ISSUED, []).append(command.id)


async def _verified(
    session: AsyncSession, v: GpuVerification, host: Host, openings: dict[str, Any], *, now: datetime, settings: MasterSettings
) -> None:
    started = v.sent_at or v.created_at
    committed_after = ((v.committed_at or now) - started).total_seconds()
    challenge = await _sent_challenge(session, v)
    if challenge is None:
        await _fail(session, v, host, Reason.NO_ANSWER, "the challenge's command is gone", now=now, settings=settings)
        return
    seen = await _earlier_roots(session, v)
    verdicts = challenge_protocol.verify(challenge, v.commitment or {}, v.reveal or {}, openings, committed_after_s=committed_after,
                                         seen_roots=seen)  # fmt: skip
    results = {uuid: verdict.as_dict() for uuid, verdict in verdicts.items()}
    for uuid in v.gpu_uuids:
        results.setdefault(uuid, {"outcome": "failed", "reason": str(Reason.NO_ANSWER), "message": "no verdict for this GPU",
                                  "tflops": 0.0, "vram_mib": 0})  # fmt: skip
    await _finish(session, v, host, results, now=now, settings=settings)


async def _sent_challenge(session: AsyncSession, v: GpuVerification) -> dict[str, Any] | None:
    """The challenge as the host got it: its ``start_challenge`` command's (sizes, expected rates, the deadline)."""
    command = await session.get(CommandRow, v.command_id) if v.command_id else None
    challenge = (command.args or {}).get("challenge") if command is not None else None
    return challenge if isinstance(challenge, dict) else None


async def _earlier_roots(session: AsyncSession, v: GpuVerification, *, limit: int = 100) -> set[str]:
    """The roots the host committed to its earlier challenges: one of them again is a replay."""
    rows = (await session.scalars(
        select(GpuVerification.commitment).where(GpuVerification.host_id == v.host_id, GpuVerification.id != v.id,
                                                 GpuVerification.commitment.is_not(None))
        .order_by(GpuVerification.created_at.desc()).limit(limit)
    )).all()  # fmt: skip
    roots: set[str] = set()
    for commitment in rows:
        for entry in ((commitment or {}).get("gpus") or {}).values():
            if isinstance(entry, dict) and isinstance(entry.get("root"), str):
                roots.add(entry["root"])
    return roots


async def _fail(
    session: AsyncSession, v: GpuVerification, host: Host, reason: Reason, message: str, *, now: datetime, settings: MasterSettings
) -> None:
    results = {uuid: {"outcome": "failed", "reason": str(reason), "message": message, "tflops": 0.0, "vram_mib": 0} for uuid in v.gpu_uuids}
    await _finish(session, v, host, results, now=now, settings=settings)


async def _finish(
    session: AsyncSession, v: GpuVerification, host: Host, results: dict[str, dict[str, Any]], *, now: datetime,
    settings: MasterSettings,
) -> None:
    """Write the verdicts onto the challenge and its GPUs, then list or unlist the host."""
    failed = {uuid: r for uuid, r in results.items() if r["outcome"] != "passed"}
    gpus = {g.uuid: g for g in (await session.scalars(select(Gpu).where(Gpu.uuid.in_(list(results))))).all()}
    for uuid, result in results.items():
        gpu = gpus.get(uuid)
        if gpu is None or gpu.host_id != host.id:
            continue
        gpu.verification_outcome = "failed" if uuid in failed else "passed"
        gpu.verification_reason = str(result["reason"])[:64]
        if uuid in failed:
            gpu.verification_failures = (gpu.verification_failures or 0) + 1
            result["counted"] = gpu.verification_failures >= settings.verification_failures  # against reliability
        else:
            gpu.verification_failures = 0
            gpu.verified_at = now
            gpu.verified_tflops = float(result["tflops"])
            gpu.verified_vram_mib = int(result["vram_mib"])
    v.result = results
    v.finished_at = now
    if failed:
        first = failed[min(failed)]
        v.state, v.reason_code, v.reason = "failed", str(first["reason"]), f"GPU {min(failed)}: {first['message']}"[:2000]
        log.warning("host %s failed challenge %s: %s", host.id, v.id, v.reason)
        await _unlist(session, host, f"{CAUSE}: {v.reason_code}: {v.reason}"[:2000], now=now)
    else:
        v.state, v.reason_code, v.reason = "passed", str(Reason.PASSED), None
        log.info("host %s passed challenge %s", host.id, v.id)
        await _relist(session, host, now=now)
    await refresh_listing(session, host.id, now=now, max_age=timedelta(hours=settings.verification_max_age_h))


async def _unlist(session: AsyncSession, host: Host, cause: str, *, now: datetime) -> None:
    if host.state in _FAILURE_STATES:
        if host.state == "enrolling":
            transition(session, host, "online", cause="enrolled; " + cause, actor=ACTOR, at=now)  # the table has no enrolling → faulty
        transition(session, host, "faulty", cause=cause, actor=ACTOR, at=now)


async def _relist(session: AsyncSession, host: Host, *, now: datetime) -> None:
    """A host kept out by verification (enrolling, or faulty for a failed challenge) is rentable again."""
    if host.state == "enrolling":
        transition(session, host, "online", cause=PASSED_CAUSE, actor=ACTOR, at=now)
    elif host.state == "faulty" and await failed_verification(session, host.id) is None:
        last = await _last_faulty_cause(session, host)
        if last is not None and last.startswith(CAUSE):
            active = await session.scalar(
                select(func.count()).select_from(Rental).where(Rental.host_id == host.id, Rental.state.in_(ACTIVE_STATES))
            )
            transition(session, host, "online", cause=PASSED_CAUSE, actor=ACTOR, at=now)
            if active:
                transition(session, host, "rented", cause=f"{PASSED_CAUSE}; {active} rental(s) still active", actor=ACTOR, at=now)


async def _last_faulty_cause(session: AsyncSession, host: Host) -> str | None:
    return await session.scalar(
        select(HostEvent.cause).where(HostEvent.host_id == host.id, HostEvent.to_state == "faulty")
        .order_by(HostEvent.at.desc(), HostEvent.id.desc()).limit(1)
    )  # fmt: skip


async def failed_verification(session: AsyncSession, host_id: str) -> str | None:
    """The uuid of a present GPU of the host whose last challenge failed (None: none): such a host stays unlisted."""
    uuid: str | None = await session.scalar(
        select(Gpu.uuid).where(Gpu.host_id == host_id, Gpu.present.is_(True), Gpu.verification_outcome == "failed").limit(1)
    )
    return uuid


async def refresh_listing(session: AsyncSession, host_id: str, *, now: datetime, max_age: timedelta) -> bool:
    """Set the host's listing ``verified`` to whether every present GPU passed within ``max_age``; returns it."""
    gpus = await present_gpus(session, host_id)
    verified = bool(gpus) and all(
        g.verification_outcome == "passed" and g.verified_at is not None and now - g.verified_at <= max_age for g in gpus
    )
    listing = await session.get(HostListing, host_id)
    if listing is not None and listing.verified != verified:
        listing.verified = verified
        listing.updated_at = now
    return verified


# ---- enrollment, on demand, and the periodic pass -----------------------------------------------------------------


async def at_hello(session: AsyncSession, host: Host, *, settings: MasterSettings, now: datetime) -> bool:
    """Called on a hello before the host comes online: with ``verification_required``, a host that has not passed yet
    (never challenged, or failed) keeps out of the market. Returns True when the host must stay ``enrolling``: its
    enrollment challenge is issued (or already open)."""
    if not settings.verification_required or host.state != "enrolling":
        return False
    await issue(session, host, trigger="enrollment", settings=settings, now=now)
    return True


async def request(master: Master, principal: Principal, host_id: str) -> GpuVerification:
    """An admin's challenge of the host's present GPUs now (the open one when there is one). Published at once."""
    if principal.role != "admin":
        raise NotFound(f"no host {host_id!r}", code="host_not_found")
    now = master.clock.now()
    async with master.db.session() as session:
        host = await session.get(Host, host_id)
        if host is None:
            raise NotFound(f"no host {host_id!r}", code="host_not_found")
        if host.state in ("revoked", "offline") or host.relay_id is None:
            raise Conflict(f"host {host_id} is {host.state}: start its agent and ask again once the host is connected", code="host_not_connected")
        busy = await session.scalar(
            select(func.count()).select_from(Rental).where(Rental.host_id == host.id, Rental.state.in_(ACTIVE_STATES))
        )
        if busy:
            raise Conflict(f"host {host_id} has {busy} active rental(s): a challenge never interrupts one; ask again once it is idle",
                           code="host_busy")  # fmt: skip
        row = await issue(session, host, trigger="admin", settings=master.settings, now=now, requested_by=principal.account_id)
        if row is None:
            raise Conflict(f"host {host_id} reports no GPU to challenge", code="host_has_no_gpus")
        ids = issued_commands(session.info)
    await commands.publish(master, ids)
    return row


async def verification_pass(master: Master, *, rng: random.Random | None = None, now: datetime | None = None) -> int:
    """One pass: challenges without an answer fail (``no_answer``), idle hosts are re-checked at random times and
    listings' ``verified`` follow the GPUs' ages. Returns the challenges issued."""
    settings = master.settings
    rng = rng or random.Random()
    now = now or master.clock.now()
    grace = timedelta(seconds=settings.verification_answer_grace_s)
    issued = 0
    async with master.db.session() as session:
        stale = (await session.scalars(
            select(GpuVerification).where(GpuVerification.state.in_(OPEN_STATES)).with_for_update(skip_locked=True).limit(500)
        )).all()  # fmt: skip
        for v in stale:
            due = (v.deadline_at or v.created_at) + grace
            if now > due:
                host = await session.get(Host, v.host_id)
                if host is not None:
                    await _fail(session, v, host, Reason.NO_ANSWER, f"no answer {grace.total_seconds():g} s past the deadline",
                                now=now, settings=settings)  # fmt: skip
        if settings.verification_required:
            probability = min(1.0, settings.verification_interval / (settings.verification_recheck_h * 3600))
            hosts = (await session.scalars(select(Host).where(Host.state == "online", Host.relay_id.is_not(None)))).all()
            for host in hosts:
                if rng.random() >= probability or await _busy(session, host.id):
                    continue
                if await issue(session, host, trigger="idle", settings=settings, now=now) is not None:
                    issued += 1
        max_age = timedelta(hours=settings.verification_max_age_h)
        listed = (await session.scalars(select(HostListing.host_id).where(HostListing.verified.is_(True)))).all()
        for host_id in listed:
            await refresh_listing(session, host_id, now=now, max_age=max_age)
        ids = issued_commands(session.info)
    await commands.publish(master, ids)
    return issued


async def _busy(session: AsyncSession, host_id: str) -> bool:
    rentals = await session.scalar(
        select(func.count()).select_from(Rental).where(Rental.host_id == host_id, Rental.state.in_(ACTIVE_STATES))
    )
    return bool(rentals) or await open_challenge(session, host_id) is not None


# ---- views ---------------------------------------------------------------------------------------------------------


def verification_view(v: GpuVerification) -> dict[str, Any]:
    """A challenge as the provider and admins see it (never its seed)."""
    return {
        "id": v.id, "host_id": v.host_id, "trigger": v.trigger, "state": v.state, "gpu_uuids": list(v.gpu_uuids),
        "size": v.size, "dtype": v.dtype, "created_at": v.created_at.isoformat(),
        "deadline_at": v.deadline_at.isoformat() if v.deadline_at else None,
        "committed_at": v.committed_at.isoformat() if v.committed_at else None,
        "finished_at": v.finished_at.isoformat() if v.finished_at else None,
        "reason_code": v.reason_code, "reason": v.reason, "result": v.result, "requested_by": v.requested_by,
    }  # fmt: skip


async def list_verifications(master: Master, principal: Principal, host_id: str, *, limit: int = 50) -> list[dict[str, Any]]:
    """The host's newest challenges, for its provider or an admin (anyone else: 404)."""
    async with master.db.session() as session:
        host = await session.get(Host, host_id)
        if host is None or (principal.role != "admin" and host.owner_id != principal.account_id):
            raise NotFound(f"no host {host_id!r} among your hosts", code="host_not_found")
        rows = (await session.scalars(
            select(GpuVerification).where(GpuVerification.host_id == host_id)
            .order_by(GpuVerification.created_at.desc(), GpuVerification.id.desc()).limit(max(1, min(limit, 500)))
        )).all()  # fmt: skip
        return [verification_view(v) for v in rows]

