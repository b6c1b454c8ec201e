"""What a host's isolation facts (``shared.protocol.IsolationFacts``, from its hello) allow.

A host stores them as JSON in ``hosts.isolation``; ``None`` is an agent older than container
workloads, which keeps the placement it always had (every workload kind, any image).
``refusal`` says why a host cannot take a workload (placement), ``isolation_view`` is how
host views and offers show the facts.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from shared.ceilings import UNITS, CeilingField, HostSize, exceeded
from shared.imageref import image_allowed, parse_image_reference


class Refusal(StrEnum):
    """Why a host with known facts cannot run a workload."""

    CONTAINER = "container"  # it does not run container workloads (no engine answers)
    PROCESS = "process"  # it does not run process workloads (no per-rental users, not allowed unisolated)
    IMAGE = "image"  # its provider's image policy does not allow the image
    LIMITS = "limits"  # the workload asks for more CPU, memory, pids or disk than the host gives a rental of its size


def refusal(facts: dict[str, Any] | None, workload: dict[str, Any], *, fraction: float = 1.0) -> Refusal | None:
    """Why a host with ``facts`` cannot run ``workload`` (a ``WorkloadSpec`` as JSON) for a rental of ``fraction``
    of its GPUs (``shared.ceilings.rental_fraction``); None: it can."""
    if facts is None:
        return None
    kind = workload.get("kind") or "hold"
    if kind == "hold":
        return None  # GPUs reserved, nothing run: every agent does that
    if kind not in (facts.get("kinds") or ()):
        return Refusal.CONTAINER if kind == "container" else Refusal.PROCESS
    if kind == "container":
        policy = facts.get("image_policy") or {}
        try:
            reference = parse_image_reference(str(workload.get("image", "")))
        except ValueError:
            return Refusal.IMAGE  # the API validated it; a stored workload that no longer parses runs nowhere
        if not image_allowed(reference, list(policy.get("allowed") or ())):
            return Refusal.IMAGE
    if limit_over(facts, workload, fraction=fraction) is not None:
        return Refusal.LIMITS
    return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def limit_over(facts: dict[str, Any], workload: dict[str, Any], *, fraction: float = 1.0) -> tuple[CeilingField, float, float] | None:
    """The first of ``workload``'s limits the host cannot give a rental of ``fraction``: (field, asked, the most it
    allows); None: they fit. CPU and memory against the host's size; pids against the rental's share of the
    host's ``pid_max`` less its reserve; disk against its largest quota (0 where it sets none). What an older agent does not
    report bounds nothing."""
    cores, memory, pid_max = _number(facts.get("max_cpu_cores")), _number(facts.get("max_memory_mib")), _number(facts.get("pid_max"))
    host = HostSize(
        cpu_cores=cores or 0.0, memory_mib=int(memory or 0), pid_max=int(pid_max or 0),
        reserved_cpu_cores=_number(facts.get("reserved_cpu_cores")) or 0.0,
        reserved_memory_mib=int(_number(facts.get("reserved_memory_mib")) or 0), reserved_pids=int(_number(facts.get("reserved_pids")) or 0),
        max_disk_gib=int(_number(facts.get("max_disk_gib")) or 0) if facts.get("disk_quota") is not None else None,
    )  # fmt: skip
    asked = {name: _number(workload.get(name)) for name in ("cpu_cores", "memory_mib", "pids_limit", "disk_gib")}
    over = exceeded(
        host, fraction, cpu_cores=asked["cpu_cores"] if cores else None, memory_mib=int(asked["memory_mib"] or 0) if memory and asked["memory_mib"] else None,
        pids_limit=int(asked["pids_limit"] or 0) if pid_max and asked["pids_limit"] else None,
        disk_gib=int(asked["disk_gib"] or 0) if asked["disk_gib"] else None,
    )  # fmt: skip
    return over


def limits_exceed(facts: dict[str, Any], workload: dict[str, Any], *, fraction: float = 1.0) -> str | None:
    """What of ``workload``'s limits the host cannot give (one phrase: ``8 CPU cores (it has 4)``); None: it fits."""
    over = limit_over(facts, workload, fraction=fraction)
    if over is None:
        return None
    name, asked, most = over
    has = {"cpu_cores": facts.get("max_cpu_cores"), "memory_mib": facts.get("max_memory_mib"), "pids_limit": facts.get("pid_max")}.get(name)
    total = f"it has {has:g}" if isinstance(has, int | float) else "it allows no more"
    if name == "pids_limit":
        total = f"its pid_max is {has:g}; a rental of this size may run {most:g}"
    elif name == "disk_gib":
        total = f"its largest disk quota is {most:g} GiB" if most else "it sets no disk quota"
    return f"{asked:g} {UNITS[name]} ({total})"


def isolation_view(facts: dict[str, Any] | None) -> dict[str, Any] | None:
    """``{"isolated", "kinds", "container_engine", "process_isolation", "reason", "image_policy", "network"}``; None: unknown.

    ``network`` is the rentals' network as the agent proved it at start: ``guarded`` (its guard's rules in place;
    ``None`` from agents older than the guard's report), ``egress_allow`` (the private ranges its provider lets
    rentals reach; none by default) and ``self_test`` (the start-up test's line)."""
    if facts is None:
        return None
    policy = facts.get("image_policy") or {}
    return {
        "isolated": bool(facts.get("isolated", True)),
        "kinds": list(facts.get("kinds") or ["hold"]),
        "container_engine": facts.get("container_engine"),
        "process_isolation": facts.get("process_isolation") or "none",
        "reason": facts.get("reason") or "",
        "image_policy": {"allowed": list(policy.get("allowed") or []), "max_image_mib": policy.get("max_image_mib")},
        "network": {
            "guarded": facts.get("network_guard"),
            "egress_allow": list(facts.get("egress_allow") or []),
            "self_test": facts.get("network_check") or "",
        },
    }
