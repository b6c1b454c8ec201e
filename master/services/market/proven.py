"""What each GPU proved by computation (issue 40, ``docs/verification.md``), as the market shows it.

The challenge flow (``master.services.hosts.verification``) writes the ``Gpu`` columns ``verified_at``,
``verified_tflops``, ``verified_vram_mib``, ``verification_outcome``, ``verification_reason`` and
``verification_failures``, and sets ``HostListing.verified``. This module reads them:

* ``gpu_verification`` — one GPU's figures for the host views: the outcome, when, the measured throughput beside the
  expectation for its model (``expected_tflops``), the memory it proved, the reason of a failure, the failures in a row,
  and whether the pass is still fresh.
* ``offer_verification`` — an offer's summary over its host's present GPUs of its model: ``verified`` (every present
  GPU of the host passed within ``max_age``, and the listing carries the flag), the measured throughput's minimum and
  median, and the expectation.
* ``unproven_gpu`` — the SQL the offer search and placement filter ``verified`` by: a present GPU of the host that has
  not passed within ``max_age``.

**Fresh.** A pass counts for ``VERIFICATION_MAX_AGE`` (the flow re-checks idle GPUs well within it); a GPU whose last
pass is older is *stale*: its figures are still shown, but its host is not ``verified`` until it passes again.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import ColumnElement, Exists, SQLColumnExpression, or_, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from master.models import Gpu
from master.services.market.tiers import Architecture, load_models

__all__ = [
    "SUSTAINED",
    "VERIFICATION_MAX_AGE",
    "expected_tflops",
    "gpu_verification",
    "host_verified",
    "offer_verification",
    "offer_verifications",
    "sustained_tflops",
    "unproven_gpu",
]

VERIFICATION_MAX_AGE = timedelta(days=7)
PASSED = "passed"
SUSTAINED: Final = {"bf16": 0.6, "fp16": 0.6, "fp8": 0.6, "tf32": 0.6, "fp32": 0.8}
"""Sustained share of the datasheet rate at a 90 %-memory product (one H200, docs/verification-measurements.md:
bf16 587–627 of 989, fp8 1160–1175 of 1979, tf32 307–319 of 494, fp32 53 of 67)."""
_TENSOR_ARCHITECTURES: Final = frozenset({Architecture.AMPERE, Architecture.ADA_LOVELACE, Architecture.HOPPER,
                                          Architecture.BLACKWELL})  # bf16, tf32  # fmt: skip
_FP8_ARCHITECTURES: Final = frozenset({Architecture.ADA_LOVELACE, Architecture.HOPPER, Architecture.BLACKWELL})


def sustained_tflops(model_key: str, dtype: str) -> float | None:
    """The sustained rate a ``model_key`` GPU should reach in the challenge's ``dtype`` (TFLOP/s, unrounded): its
    datasheet figure in the model table times ``SUSTAINED``; ``None`` for an unknown model or a precision it has no
    tensor path for. The challenge's deadline (``master.services.hosts.challenge``) is set from it."""
    model = load_models().get(model_key)
    if model is None or dtype not in SUSTAINED:
        return None
    tensor, architecture = model.tensor_fp16_tflops, model.architecture
    if dtype == "fp32":
        peak = model.fp32_tflops
    elif dtype == "fp16":
        peak = tensor or model.fp32_tflops
    elif dtype == "bf16" and architecture in _TENSOR_ARCHITECTURES:
        peak = tensor
    elif dtype == "tf32" and architecture in _TENSOR_ARCHITECTURES:
        peak = tensor / 2
    elif dtype == "fp8" and architecture in _FP8_ARCHITECTURES:
        peak = tensor * 2
    else:
        return None
    return peak * SUSTAINED[dtype]

def expected_tflops(model_key: str | None, dtype: str | None = None) -> float | None:
    """The sustained TFLOP/s a GPU of ``model_key`` is expected to reach in the challenge (None: unknown model): the
    challenge's own expectation (``sustained_tflops``), in ``dtype`` or, None, in the
    precision the model is sold for (bf16 where it has it, fp16 on tensor cores without bf16, else fp32)."""
    model = load_models().get(model_key) if model_key else None
    if model is None or model_key is None:
        return None
    tried = (dtype,) if dtype is not None else ("bf16", "fp16" if model.tensor_fp16_tflops > 0 else "fp32", "fp32")
    for precision in tried:
        if (rate := sustained_tflops(model_key, precision)) is not None:
            return round(rate, 1)
    return None


def _fresh(gpu: Any, now: datetime, max_age: timedelta) -> bool:
    at: datetime | None = gpu.verified_at
    return gpu.verification_outcome == PASSED and at is not None and at >= now - max_age


def gpu_verification(gpu: Gpu, *, now: datetime, max_age: timedelta = VERIFICATION_MAX_AGE) -> dict[str, Any]:
    """One GPU's figures (its host view's ``verification``); ``outcome`` None: never challenged."""
    return {
        "outcome": gpu.verification_outcome,
        "verified_at": gpu.verified_at.isoformat() if gpu.verified_at else None,
        "fresh": _fresh(gpu, now, max_age),
        "tflops": gpu.verified_tflops,
        "tflops_expected": expected_tflops(gpu.model_key),
        "vram_mib": gpu.verified_vram_mib,
        "reason": gpu.verification_reason,
        "failures_in_a_row": gpu.verification_failures,
    }


def host_verified(gpus: Iterable[Any], *, now: datetime, max_age: timedelta = VERIFICATION_MAX_AGE) -> bool:
    """Every present GPU passed within ``max_age`` (a host without present GPUs is not verified)."""
    present = [g for g in gpus if g.present]
    return bool(present) and all(_fresh(g, now, max_age) for g in present)


def offer_verification(
    gpus: Sequence[Any], *, flagged: bool, host_ok: bool, model_key: str | None
) -> dict[str, Any]:
    """An offer's summary: ``gpus`` its host's present GPUs of its model, ``flagged`` its listing's ``verified``,
    ``host_ok`` every present GPU of the host fresh (``host_verified``)."""
    measured = sorted(g.verified_tflops for g in gpus if g.verification_outcome == PASSED and g.verified_tflops is not None)
    return {
        "verified": flagged and host_ok,
        "gpus_passed": sum(1 for g in gpus if g.verification_outcome == PASSED),
        "gpus_failed": sum(1 for g in gpus if g.verification_outcome == "failed"),
        "tflops_min": measured[0] if measured else None,
        "tflops_median": statistics.median(measured) if measured else None,
        "tflops_expected": expected_tflops(model_key),
        "verified_at": min((g.verified_at for g in gpus if g.verified_at is not None), default=None),
    }


async def offer_verifications(
    session: AsyncSession, offers: Sequence[tuple[str, str, bool]], *, now: datetime, max_age: timedelta = VERIFICATION_MAX_AGE
) -> dict[tuple[str, str], dict[str, Any]]:
    """The summary of each ``(host id, GPU model, listing flag)`` in ``offers``: one statement for a whole page."""
    if not offers:
        return {}
    rows = (
        await session.execute(
            select(Gpu.host_id, Gpu.name, Gpu.model_key, Gpu.present, Gpu.verification_outcome, Gpu.verified_at, Gpu.verified_tflops)
            .where(Gpu.host_id.in_(sorted({host for host, _, _ in offers})), Gpu.present.is_(True))
        )
    ).all()
    by_host: dict[str, list[Any]] = {}
    for row in rows:
        by_host.setdefault(row.host_id, []).append(row)
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for host_id, name, flagged in offers:
        host = by_host.get(host_id, [])
        model = [g for g in host if g.name == name]
        view = offer_verification(
            model, flagged=flagged, host_ok=host_verified(host, now=now, max_age=max_age),
            model_key=next((g.model_key for g in model if g.model_key), None),
        )  # fmt: skip
        at = view["verified_at"]
        view["verified_at"] = at.isoformat() if at is not None else None
        found[(host_id, name)] = view
    return found


def unproven_gpu(host_id: SQLColumnExpression[str], cutoff: datetime) -> Exists:
    """SQL: the host of ``host_id`` has a present GPU that has not passed its challenge since ``cutoff``."""
    g = aliased(Gpu, name="unproven")
    not_passed: ColumnElement[bool] = or_(
        g.verification_outcome.is_(None), g.verification_outcome != PASSED, g.verified_at.is_(None), g.verified_at < cutoff
    )
    return select(g.id).where(g.host_id == host_id, g.present.is_(True), not_passed).exists()
