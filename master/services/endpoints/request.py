"""What a renter asks for with ``POST /services``: ``ServiceRequest``, its checks, its fingerprint, and a replica's request.

A service's replicas are rentals; ``replica_request`` is the ``RentalRequest`` each is placed with.
The checks that need more than one field answer 400 and say why (the issue's "bad input"): the
replica bounds, a port the workload does not serve, a scaling rule without a metric.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from master.scheduler.price import tolerance_text
from master.services.rentals import RentalRequest
from master.services.volumes import VolumeAsk, check_asks
from shared.errors import BadRequest

NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
HEALTH_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/?-]{0,254}")
METRICS = ("inflight", "gpu_util")
DEFAULT_UP_COOLDOWN_S = 30.0
DEFAULT_DOWN_COOLDOWN_S = 300.0
DEFAULT_UTIL_PERIOD_S = 300.0


@dataclass(frozen=True)
class ServiceRequest:
    name: str
    port: int
    min_replicas: int = 1
    max_replicas: int = 1
    scaling: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    template: str | None = None
    health_path: str = "/health"
    gpu_count: int = 1
    gpu_model: str | None = None
    query: str = ""  # requirements every replica's host meets, in the offer query language
    kind: str = "on_demand"
    bid: Decimal | None = None
    volumes: tuple[VolumeAsk, ...] = ()  # read-only; entries at one mount point are copies on different hosts
    price_tolerance: Decimal | None = None  # every replica's (RentalRequest.price_tolerance); None: the setting's rule

    def check(self, *, replica_limit: int, max_queue_timeout_s: float) -> ServiceRequest:
        """The request normalised (scaling rule with its defaults, model words, query); BadRequest says what is wrong.

        ``workload`` must be known by now (a template's copied in): the port is checked against it.
        """
        if not NAME.fullmatch(self.name):
            raise BadRequest("name must be 1 to 63 lowercase ASCII letters, digits and inner hyphens, e.g. chat-7b",
                             code="invalid_service_name")  # fmt: skip
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise BadRequest(f"min_replicas ({self.min_replicas}) must be at most max_replicas ({self.max_replicas}), "
                             "and not below 0", code="invalid_replica_bounds")  # fmt: skip
        if not 1 <= self.max_replicas <= replica_limit:
            raise BadRequest(f"max_replicas must be between 1 and {replica_limit}", code="invalid_replica_bounds")
        if self.workload.get("kind") != "container":
            raise BadRequest("a service runs a container: give an image (workload.kind container) or a template with one",
                             code="service_needs_container")  # fmt: skip
        served = [int(p) for p in self.workload.get("ports") or []]
        if self.port not in served:
            listed = ", ".join(str(p) for p in served) or "none"
            raise BadRequest(f"port {self.port} is not a port the workload serves (its ports: {listed}); "
                             "give one of them, or declare it in workload.ports", code="port_not_served")  # fmt: skip
        if not HEALTH_PATH.fullmatch(self.health_path):
            raise BadRequest("health_path must be a URL path starting with /, e.g. /health", code="invalid_health_path")
        check_asks(self.volumes, self.workload, alternatives=True)
        # The rental's own checks (GPU count, model words, kind and bid, the query), on a replica's request.
        replica = replace(self.replica_request("", queue_timeout_s=max_queue_timeout_s), volumes=()).check(
            max_queue_timeout_s=max_queue_timeout_s
        )
        return replace(self, scaling=check_scaling(self.scaling), gpu_model=replica.gpu_model, query=replica.query)

    def fingerprint(self) -> str:
        what: dict[str, Any] = {"w": self.workload} if self.template is None else {"t": self.template}
        fields = {
            "name": self.name, "port": self.port, "min": self.min_replicas, "max": self.max_replicas, "scaling": self.scaling,
            "health": self.health_path, "n": self.gpu_count, "m": self.gpu_model, "q": self.query, "kind": self.kind,
            "bid": str(self.bid) if self.bid is not None else None, **what,
        }  # fmt: skip
        if self.volumes:  # absent otherwise: keys of services made before volumes still match
            fields["vol"] = [ask.to_json() for ask in self.volumes]
        if self.price_tolerance is not None:  # likewise
            fields["tol"] = tolerance_text(self.price_tolerance)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    def replica_request(self, service_id: str, *, queue_timeout_s: float) -> RentalRequest:
        """A replica: the service's workload on ``gpu_count`` whole GPUs, queued when none are free now."""
        return RentalRequest(
            gpu_count=self.gpu_count, gpu_model=self.gpu_model, workload=self.workload, query=self.query, kind=self.kind,
            bid=self.bid, queue=True, queue_timeout_s=queue_timeout_s, template=self.template, service_id=service_id or None,
            volumes=self.volumes, price_tolerance=self.price_tolerance,
        )  # fmt: skip


def check_scaling(rule: dict[str, Any]) -> dict[str, Any]:
    """The scaling rule with its defaults filled in; BadRequest for a rule without a metric or with a bad figure."""
    metric = rule.get("metric")
    if metric is None:
        raise BadRequest("the scaling rule needs a metric: inflight (with target, requests in flight per replica) or "
                         "gpu_util (with threshold_pct and period_s)", code="scaling_metric_missing")  # fmt: skip
    if metric not in METRICS:
        raise BadRequest(f"scaling.metric must be one of {', '.join(METRICS)}", code="invalid_scaling_rule")
    out: dict[str, Any] = {"metric": metric}
    if metric == "inflight":
        out["target"] = _number(rule, "target", None, low=0.1, high=10_000)
    else:
        out["threshold_pct"] = _number(rule, "threshold_pct", None, low=1, high=100)
        out["period_s"] = _number(rule, "period_s", DEFAULT_UTIL_PERIOD_S, low=10, high=86_400)
        out["scale_down_below_pct"] = _number(rule, "scale_down_below_pct", out["threshold_pct"] / 2, low=0, high=out["threshold_pct"])
    out["scale_up_cooldown_s"] = _number(rule, "scale_up_cooldown_s", DEFAULT_UP_COOLDOWN_S, low=0, high=3_600)
    out["scale_down_cooldown_s"] = _number(rule, "scale_down_cooldown_s", DEFAULT_DOWN_COOLDOWN_S, low=0, high=86_400)
    unknown = sorted(set(rule) - set(out))
    if unknown:
        raise BadRequest(f"scaling has no field {unknown[0]!r} for metric {metric}", code="invalid_scaling_rule")
    return out


def _number(rule: dict[str, Any], key: str, default: float | None, *, low: float, high: float) -> float:
    value = rule.get(key, default)
    if value is None:
        raise BadRequest(f"scaling.{key} is needed for metric {rule['metric']}", code="invalid_scaling_rule")
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"scaling.{key} must be a number from {low:g} to {high:g}", code="invalid_scaling_rule")
    return float(value)
