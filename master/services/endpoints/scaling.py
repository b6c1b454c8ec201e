"""How many replicas a service wants: the autoscaler's rule, as one pure function (``decide``).

Inputs are what the gateway and the agents measured (``Load``: ``service_figures.py``) and the
service's rule (``service_request.check_scaling``). The policy, written down:

* **Bounds first.** A target outside ``min_replicas``..``max_replicas`` (the renter just moved them)
  goes to the nearest bound at once.
* **Cold start.** A request waiting at the endpoint of a service with no replica
  (``wake_requested_at``) asks for one at once, whatever the cool-downs say, and while it waits
  no scale-down goes below one (the figures may not show it yet).
* **inflight.** Up to ``ceil(recent in-flight / target)`` when that is above the target count, at
  most once per ``scale_up_cooldown_s``. Down to ``ceil(peak / target)`` — the peak being the
  highest in-flight figure of any bucket over the last ``scale_down_cooldown_s`` — and only once
  no scaling happened for ``scale_down_cooldown_s``: a dip shorter than the cool-down never
  stops a replica, so the count does not flap. No request at all over that window is 0 in
  flight: a service with ``min_replicas`` 0 goes to zero.
* **gpu_util.** One more replica when the ready replicas' GPUs averaged at least
  ``threshold_pct`` over the whole ``period_s`` (and the up cool-down passed); one fewer when they
  averaged below ``scale_down_below_pct`` (half the threshold unless given) over the period and
  the down cool-down passed.
* **Figures lag.** Whatever the cool-down, no scale-down comes sooner after a scale-up (or a cold
  start's replica turning ready) than the figures need to show the traffic it took (three buckets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Load:
    """What was measured for one service (None: not measured, e.g. no gateway figure yet)."""

    inflight_recent: float | None = None  # requests in flight, mean over the last few buckets, all gateway processes
    inflight_peak: float = 0.0  # the highest bucket's mean over the scale-down cool-down (0: no traffic)
    gpu_util: float | None = None  # the ready replicas' GPUs, mean % over period_s (None: too little telemetry)


@dataclass(frozen=True)
class Decision:
    replicas: int
    kind: str  # scale_up | scale_down | hold
    reason: str


def _since(now: datetime, at: datetime | None) -> float:
    return math.inf if at is None else (now - at).total_seconds()


def decide(*, rule: dict[str, Any], min_replicas: int, max_replicas: int, desired: int, load: Load, now: datetime,
           last_up: datetime | None, last_down: datetime | None, waking: bool, min_quiet_s: float = 0.0) -> Decision:  # fmt: skip
    """The replicas wanted now, and why. ``min_quiet_s``: the least time without scaling before a scale-down
    whatever the rule's cool-down (the figures' own delay: traffic a new replica took may not show sooner)."""
    if desired < min_replicas:
        return Decision(min_replicas, "scale_up", f"below min_replicas {min_replicas}")
    if desired > max_replicas:
        return Decision(max_replicas, "scale_down", f"above max_replicas {max_replicas}")
    if waking and desired == 0 and max_replicas > 0:
        return Decision(1, "scale_up", "cold start: a request is waiting for a replica")
    # A request waiting for a replica is demand the figures may not show yet: never below one while it waits.
    floor = max(min_replicas, 1 if waking else 0)
    up_ok = _since(now, last_up) >= rule["scale_up_cooldown_s"]
    quiet = min(_since(now, last_up), _since(now, last_down))
    down_ok = quiet >= max(rule["scale_down_cooldown_s"], min_quiet_s)
    if rule["metric"] == "inflight":
        target = float(rule["target"])
        if load.inflight_recent is not None and up_ok:
            wanted = min(max_replicas, math.ceil(load.inflight_recent / target - 1e-9))
            if wanted > desired:
                return Decision(wanted, "scale_up", f"{load.inflight_recent:.1f} requests in flight, target {target:g} per replica")
        if down_ok:
            wanted = max(floor, math.ceil(load.inflight_peak / target - 1e-9))
            if wanted < desired:
                window = rule["scale_down_cooldown_s"]
                return Decision(wanted, "scale_down", f"at most {load.inflight_peak:.1f} requests in flight over {window:g}s, "
                                                      f"target {target:g} per replica")  # fmt: skip
        return Decision(desired, "hold", "")
    util = load.gpu_util
    if util is not None and util >= rule["threshold_pct"] and up_ok and desired < max_replicas:
        return Decision(desired + 1, "scale_up", f"GPU utilisation {util:.0f}% over {rule['period_s']:g}s, "
                                                 f"threshold {rule['threshold_pct']:g}%")  # fmt: skip
    if util is not None and util < rule["scale_down_below_pct"] and down_ok and desired > floor:
        return Decision(desired - 1, "scale_down", f"GPU utilisation {util:.0f}% over {rule['period_s']:g}s, "
                                                   f"below {rule['scale_down_below_pct']:g}%")  # fmt: skip
    return Decision(desired, "hold", "")
