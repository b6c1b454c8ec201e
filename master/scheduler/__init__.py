"""The scheduler: placement algorithms and the trace simulator that measures them.

``fleet`` holds the model (nodes, GPUs, requests, placements) and the hard constraints;
``fragmentation`` FGD's math (the target workload, a node's expected fragmentation);
``placers/`` the ``Placer`` protocol, its shared machinery (``placers.base``) and one module
per algorithm, selectable by name through ``registry.get_placer``; ``trace`` reads the
Alibaba GPU cluster trace (v2023) CSVs; ``simulate`` replays a trace through the same
placers, following the FGD paper's protocol. Pure computation: imports ``shared.errors``
only — never the database, the bus or ``master.services``.
"""

from master.scheduler.fleet import (
    MILLI,
    Fleet,
    Gpu,
    LinkStats,
    MigSlot,
    NetworkLimits,
    Node,
    Placement,
    Request,
    fits,
)
from master.scheduler.fragmentation import FragModel, TaskType, Workload, fgd_score, model_pressure
from master.scheduler.placers.base import Placer
from master.scheduler.registry import DEFAULT_PLACER, PLACERS, UnknownPlacer, get_placer

__all__ = [
    "DEFAULT_PLACER", "MILLI", "PLACERS", "Fleet", "FragModel", "Gpu", "LinkStats", "MigSlot", "NetworkLimits", "Node",
    "Placement", "Placer", "Request", "TaskType", "UnknownPlacer", "Workload", "fgd_score", "fits", "get_placer",
    "model_pressure",
]  # fmt: skip
