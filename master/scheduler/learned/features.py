"""What the learned scorer sees of one candidate placement: ``FEATURES``, a few floats per (node, request).

Each feature is something a heuristic already computes, scaled to about 0..1:

``frag_delta``        FGD's fragmentation change Δ of the best placement on the node, in GPUs, clipped to ±4
``fgd_score``         FGD's integer score of that Δ, / 100
``gpu_free_after``    the node's share of GPU milli left free after the placement
``cpu_free_after``    the node's share of CPU left free after it
``best_fit_leftover`` for a share: the free milli left on the best-fitting GPU, / 1000 (whole GPUs: 0)
``free_share``        ``Node.free_share`` before (0 full … 1 empty)
``node_empty``        1 if nothing runs on the node
``utilization``       the dot-product (Tetris) score of ``utilization``, / 100
``model_pressure``    ``model_pressure`` of the node's GPU model, clipped to 4
``latency_slack``     1 − latency / the renter's limit (no limit: 1); likewise ``jitter_slack``, ``loss_slack``
``latency``           latency to the renter's region / 1 s, capped at 1 (no region: 0)
``request_milli``     the request's milli-GPU per GPU / 1000
``request_gpus``      its GPU count / 8
``request_constrained`` 1 if it accepts only some GPU models

A :class:`FeatureContext` holds what the features need beyond the node, the request and FGD's Δ (which
the caller computes with ``Fgd.frag_delta``): the fleet's normalisers and each model's pressure. The placer
and the training environment build features through the same placer code, so training and inference see
exactly the same numbers. Pure: numpy, ``shared`` and the placement model only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from master.scheduler.fleet import MILLI, Fleet, Node, Request
from master.scheduler.fragmentation import FragModel, fgd_score, model_pressure

FEATURES: tuple[str, ...] = (
    "frag_delta", "fgd_score", "gpu_free_after", "cpu_free_after", "best_fit_leftover", "free_share", "node_empty",
    "utilization", "model_pressure", "latency_slack", "jitter_slack", "loss_slack", "latency", "request_milli",
    "request_gpus", "request_constrained",
)  # fmt: skip
FEATURE_COUNT = len(FEATURES)
# FGD's Δ is clipped to this many GPUs each way; pressure to this much.
MAX_DELTA_GPUS = 4.0
MAX_PRESSURE = 4.0
MAX_LATENCY_MS = 1000.0

FloatArray = npt.NDArray[np.float64]


class FeatureContext:
    """The fleet-wide part of the features: the largest node's CPU and GPU, each GPU model's pressure."""

    __slots__ = ("max_cpu", "max_gpu", "pressure")

    def __init__(self, fleet: Fleet, frag_model: FragModel) -> None:
        self.max_cpu = float(fleet.max_cpu_milli)
        self.max_gpu = float(fleet.max_gpu_milli)
        self.pressure: Mapping[str, float] = model_pressure(frag_model.workload, fleet.capacity_by_model)


def _slack(value: float, limit: float | None) -> float:
    if limit is None:
        return 1.0
    if limit <= 0:
        return 1.0 if value <= 0 else 0.0
    return min(1.0, max(0.0, 1.0 - value / limit))


def node_features(context: FeatureContext, node: Node, request: Request, delta: float) -> FloatArray:
    """``FEATURES`` of placing ``request`` on the feasible ``node`` (not MIG), where FGD's best placement changes
    its fragmentation by ``delta`` (``Fgd.frag_delta``)."""
    capacity = node.gpu_milli_capacity
    gpu_total = request.gpu_milli_total
    gpu_after = (node.free_total - gpu_total) / capacity if capacity else 0.0
    cpu_after = (node.cpu_milli_free - request.cpu_milli) / node.cpu_milli if node.cpu_milli else 0.0
    leftover = 0.0
    if 0 < request.gpu_milli < MILLI:
        fitting = [gpu.milli_free for gpu in node.gpus if node.gpu_takes(request, gpu)]
        if fitting:
            leftover = (min(fitting) - request.gpu_milli) / MILLI
    dot = (node.cpu_milli_free / context.max_cpu) * (request.cpu_milli / context.max_cpu) + (
        node.free_total / context.max_gpu
    ) * (gpu_total / context.max_gpu)
    empty = 1.0 if node.free_total == capacity and node.cpu_milli_free == node.cpu_milli else 0.0
    latency_slack = jitter_slack = loss_slack = 1.0
    latency = 0.0
    network = request.network
    if network is not None:
        link = node.links.get(network.region)
        if link is None:
            latency = 1.0
        else:
            latency = min(link.latency_ms, MAX_LATENCY_MS) / MAX_LATENCY_MS
            latency_slack = _slack(link.latency_ms, network.max_latency_ms)
            jitter_slack = _slack(link.jitter_ms, network.max_jitter_ms)
            loss_slack = _slack(link.loss_pct, network.max_loss_pct)
    values = np.array(
        (
            max(-MAX_DELTA_GPUS, min(MAX_DELTA_GPUS, delta / MILLI)),
            fgd_score(delta) / 100.0,
            gpu_after,
            cpu_after,
            leftover,
            node.free_share,
            empty,
            int(100 * (1 - dot / 2)) / 100.0,
            min(MAX_PRESSURE, context.pressure.get(node.model, 0.0)) if request.num_gpu else 0.0,
            latency_slack,
            jitter_slack,
            loss_slack,
            latency,
            request.gpu_milli / MILLI,
            request.num_gpu / 8.0,
            1.0 if request.gpu_models else 0.0,
        ),
        dtype=np.float64,
    )
    return values


__all__ = ["FEATURES", "FEATURE_COUNT", "FeatureContext", "FloatArray", "node_features"]
