"""What a host's isolation facts (``shared.protocol.IsolationFacts``, from its hello) allow.

A host stores them as JSON in ``hosts.isolation``; ``None`` is an agent older than container
workloads, which keeps the placement it always had (every workload kind, any image).
``refusal`` says why a host cannot take a workload (placement), ``isolation_view`` is how
host views and offers show the facts.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from shared.imageref import image_allowed, parse_image_reference


class Refusal(StrEnum):
    """Why a host with known facts cannot run a workload."""

    CONTAINER = "container"  # it does not run container workloads (no engine answers)
    PROCESS = "process"  # it does not run process workloads (no per-rental users, not allowed unisolated)
    IMAGE = "image"  # its provider's image policy does not allow the image
    LIMITS = "limits"  # the workload asks for more CPU or memory than the host has


def refusal(facts: dict[str, Any] | None, workload: dict[str, Any]) -> Refusal | None:
    """Why a host with ``facts`` cannot run ``workload`` (a ``WorkloadSpec`` as JSON); None: it can."""
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
    if limits_exceed(facts, workload):
        return Refusal.LIMITS
    return None


def limits_exceed(facts: dict[str, Any], workload: dict[str, Any]) -> str | None:
    """What of ``workload``'s CPU and memory limits the host cannot give (one phrase); None: it fits."""
    cores, memory = facts.get("max_cpu_cores"), facts.get("max_memory_mib")
    asked_cores, asked_memory = workload.get("cpu_cores"), workload.get("memory_mib")
    if isinstance(cores, int | float) and isinstance(asked_cores, int | float) and asked_cores > cores:
        return f"{asked_cores:g} CPU cores (it has {cores:g})"
    if isinstance(memory, int) and isinstance(asked_memory, int) and asked_memory > memory:
        return f"{asked_memory} MiB of memory (it has {memory})"
    return None


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
