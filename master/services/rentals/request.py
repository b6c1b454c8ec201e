"""What a renter asks for: ``RentalRequest`` (``POST /rentals``, or a queued or lost rental's request again).

Its checks (``check``), its fingerprint for idempotency, and the scheduler request it becomes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any

from master.models import Rental
from master.scheduler import MILLI, NetworkLimits
from master.scheduler import Request as PlaceRequest
from master.scheduler.price import tolerance_text
from master.services.market import (
    PRICE_QUANTUM,
    Op,
    format_query,
    model_filter_problem,
    normalise_name,
    parse,
)
from master.services.rentals.allocation import mig_milli
from master.services.volumes import VolumeAsk, asks_of, check_asks
from shared.errors import BadRequest, ValidationFailed

KINDS = ("on_demand", "interruptible")
MAX_GPUS_PER_RENTAL = 64
MIN_FAILOVER_AFTER_S = 10
"""No rental fails over sooner: a link that drops for under 10 s (an agent moving to another relay, a relay's
restart) never re-places anything (``failover.py``)."""
MAX_FAILOVER_AFTER_S = 86400
MIG_PROFILE = re.compile(r"[1-7]g\.[0-9]{1,3}gb(?:\+me)?")


@dataclass(frozen=True)
class RentalRequest:
    """What a renter asks for (``POST /rentals``), or what a queued or lost rental asked for."""

    gpu_count: int = 1
    gpu_model: str | None = None
    workload: dict[str, Any] = field(default_factory=dict)
    restart_on_failure: bool = False
    failover_after_s: int | None = None
    """Seconds its host may stay unreachable before it fails over (None: the master's ``failover_after_s``)."""
    gpu_milli: int = MILLI  # per GPU; below 1000: a fractional share of one GPU
    gpu_memory_mib: int = 0  # of a share; 0: in proportion to gpu_milli
    mig_profile: str | None = None
    offer_id: str | None = None  # host_id:gpu_name, as GET /offers lists them
    query: str = ""  # requirements in the offer query language
    kind: str = "on_demand"
    bid: Decimal | None = None  # USD per GPU-hour, interruptible only
    network: dict[str, Any] | None = None  # {"region", "max_latency_ms", "max_jitter_ms", "max_loss_pct"}
    queue: bool = False
    queue_timeout_s: float = 600.0
    avoid_hosts: frozenset[str] = frozenset()
    """Hosts not to place on (a re-placement avoids the host that was lost)."""
    replaces: str | None = None
    template: str | None = None
    """The template the workload comes from (``workload`` empty until ``rentals.create_rental`` copies it in)."""
    service_id: str | None = None
    """The elastic service this rental is a replica of (``master/services/endpoints/core.py``)."""
    volumes: tuple[VolumeAsk, ...] = ()
    """The renter's volumes its container mounts: placement then goes only to their host (docs/volumes.md). A service's
    replica (``service_id``): entries at one mount point are copies on different hosts, read-only."""
    price_tolerance: Decimal | None = None
    """How far above the cheapest feasible offer the placer may choose (0.05 = 5 %; ``master/scheduler/price.py``);
    None: the ``price_tolerance`` setting when no model is named, else the placer's own choice."""

    def check(self, *, max_queue_timeout_s: float) -> RentalRequest:
        """The request with its query normalised; ValidationFailed says what is wrong."""
        if not 1 <= self.gpu_count <= MAX_GPUS_PER_RENTAL:
            raise ValidationFailed(f"gpu_count must be between 1 and {MAX_GPUS_PER_RENTAL}", code="invalid_gpu_count")
        if not 1 <= self.gpu_milli <= MILLI:
            raise ValidationFailed(f"gpu_milli must be between 1 and {MILLI} (thousandths of one GPU)", code="invalid_share")
        if self.gpu_milli < MILLI and self.gpu_count != 1:
            raise ValidationFailed("a fractional share is a share of one GPU: gpu_count must be 1", code="invalid_share")
        if self.gpu_memory_mib < 0 or (self.gpu_memory_mib and self.gpu_milli == MILLI):
            raise ValidationFailed("gpu_memory_mib is the GPU memory of a fractional share (gpu_milli below 1000)", code="invalid_share")
        if self.mig_profile is not None:
            if not MIG_PROFILE.fullmatch(self.mig_profile):
                raise ValidationFailed(f"mig_profile must look like 1g.10gb or 3g.40gb, not {self.mig_profile[:40]!r}", code="invalid_mig_profile")
            if self.gpu_count != 1 or self.gpu_milli != MILLI:
                raise ValidationFailed("a MIG rental is one instance: leave gpu_count at 1 and gpu_milli unset", code="invalid_mig_profile")
        if self.kind not in KINDS:
            raise ValidationFailed(f"kind must be one of {', '.join(KINDS)}", code="invalid_kind")
        if self.kind == "interruptible":
            if self.bid is None or not self.bid.is_finite() or self.bid <= 0:
                raise ValidationFailed("an interruptible rental needs a bid above 0 (USD per GPU-hour)", code="invalid_bid")
            if self.bid != self.bid.quantize(PRICE_QUANTUM):
                raise ValidationFailed("a bid has at most 6 decimal places", code="invalid_bid")
        elif self.bid is not None:
            raise ValidationFailed("only interruptible rentals bid; leave bid out for on_demand", code="invalid_bid")
        gpu_model = self.gpu_model
        if gpu_model is not None:
            gpu_model = normalise_name(gpu_model)
            problem = model_filter_problem(gpu_model)
            if problem is not None:
                raise BadRequest(f"gpu_model {gpu_model[:40]!r} {problem}", code="invalid_gpu_model",
                                 details={"problems": [{"field": "gpu_model", "problem": problem}]})  # fmt: skip
        if self.offer_id is not None and (":" not in self.offer_id or self.query or self.gpu_model):
            raise ValidationFailed(
                "offer_id is an offer's id from GET /offers (host_id:gpu_name), and excludes requirements and gpu_model",
                code="invalid_offer",
            )
        if self.failover_after_s is not None and not MIN_FAILOVER_AFTER_S <= self.failover_after_s <= MAX_FAILOVER_AFTER_S:
            raise ValidationFailed(f"failover_after_s must be whole seconds between {MIN_FAILOVER_AFTER_S} and {MAX_FAILOVER_AFTER_S}",
                                   code="invalid_failover_after")
        if self.queue and not 1 <= self.queue_timeout_s <= max_queue_timeout_s:
            raise ValidationFailed(f"queue_timeout_s must be between 1 and {max_queue_timeout_s:g} seconds", code="invalid_queue_timeout")
        query = format_query(parse(self.query)) if self.query else ""
        if self.volumes and self.template is None:  # a template's workload is checked once copied in (create_rental)
            check_asks(self.volumes, self.workload, alternatives=self.service_id is not None)
        return replace(self, query=query, gpu_model=gpu_model)

    @property
    def share(self) -> int:
        """Thousandths of a GPU each of the rental's GPUs gives it."""
        return mig_milli(self.mig_profile) if self.mig_profile is not None else self.gpu_milli

    @property
    def priority(self) -> Decimal | None:
        """What the request outranks: interruptible rentals bidding less. None: on-demand (outranks all of them)."""
        return self.bid if self.kind == "interruptible" else None

    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "offer_id": self.offer_id, "query": self.query, "gpu_model": self.gpu_model, "network": self.network,
            "queue": self.queue, "queue_timeout_s": self.queue_timeout_s, "template": self.template,
        }  # fmt: skip
        if self.volumes:  # absent otherwise: specs written before volumes read the same
            spec["volumes"] = [ask.to_json() for ask in self.volumes]
        if self.price_tolerance is not None:  # absent otherwise, likewise
            spec["price_tolerance"] = tolerance_text(self.price_tolerance)
        return spec

    @classmethod
    def from_rental(cls, rental: Rental, **changes: Any) -> RentalRequest:
        spec = rental.spec or {}
        request = cls(
            gpu_count=rental.gpu_count, gpu_model=spec.get("gpu_model", rental.gpu_model), workload=rental.workload,
            restart_on_failure=rental.restart_on_failure, gpu_milli=rental.gpu_milli if rental.mig_profile is None else MILLI,
            gpu_memory_mib=rental.gpu_memory_mib if rental.gpu_milli < MILLI and rental.mig_profile is None else 0,
            mig_profile=rental.mig_profile, offer_id=spec.get("offer_id"), query=spec.get("query") or "", kind=rental.kind,
            bid=rental.bid_per_gpu_hour, network=spec.get("network"), queue=bool(spec.get("queue")),
            queue_timeout_s=float(spec.get("queue_timeout_s") or 600.0), replaces=rental.replaces_id,
            template=spec.get("template"), service_id=rental.service_id, volumes=asks_of(spec),
            price_tolerance=Decimal(spec["price_tolerance"]) if spec.get("price_tolerance") is not None else None,
            failover_after_s=rental.failover_after_s,
        )  # fmt: skip
        return replace(request, **changes)

    def fingerprint(self) -> str:
        # A template's name, not its workload: a repeat is the same request even if the template changed since.
        what: dict[str, Any] = {"w": self.workload} if self.template is None else {"t": self.template}
        fields: dict[str, Any] = {"n": self.gpu_count, "m": self.gpu_model, **what}
        if self.restart_on_failure:
            fields["r"] = True
        extra = {
            "milli": self.gpu_milli if self.gpu_milli != MILLI else None, "mem": self.gpu_memory_mib or None,
            "mig": self.mig_profile, "offer": self.offer_id, "q": self.query or None,
            "kind": self.kind if self.kind != "on_demand" else None, "bid": str(self.bid) if self.bid is not None else None,
            "net": self.network, "queue": [self.queue, self.queue_timeout_s] if self.queue else None,
            "vol": [ask.to_json() for ask in self.volumes] or None, "fo": self.failover_after_s,
            "tol": tolerance_text(self.price_tolerance) if self.price_tolerance is not None else None,
        }  # fmt: skip
        fields.update({key: value for key, value in extra.items() if value is not None})
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def names_model(self) -> bool:
        """Whether the renter named a GPU model (``gpu_model``, or ``gpu_name=`` in the requirements)."""
        if self.gpu_model is not None:
            return True
        return bool(self.query) and any(c.field == "gpu_name" and c.op == Op.EQ for c in parse(self.query))

    def place_request(self) -> PlaceRequest:
        network = None
        if self.network:
            network = NetworkLimits(
                region=str(self.network["region"]), max_latency_ms=self.network.get("max_latency_ms"),
                max_jitter_ms=self.network.get("max_jitter_ms"), max_loss_pct=self.network.get("max_loss_pct"),
            )  # fmt: skip
        return PlaceRequest(
            num_gpu=self.gpu_count, gpu_milli=self.gpu_milli, gpu_memory_mib=self.gpu_memory_mib,
            mig_profile=self.mig_profile, network=network,
        )  # fmt: skip
