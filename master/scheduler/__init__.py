"""The scheduler: placement algorithms and the trace simulator that measures them.

``placers`` holds the model (nodes, GPUs, requests, placements), the ``Placer``
protocol and every algorithm, selectable by name through ``get_placer``; ``trace``
reads the Alibaba GPU cluster trace (v2023) CSVs; ``simulate`` replays a trace through
the same placers, following the FGD paper's protocol. Pure computation: imports
``shared.errors`` only — never the database, the bus or ``master.services``.
"""

from master.scheduler.placers import (
    DEFAULT_PLACER,
    MILLI,
    PLACERS,
    Fleet,
    FragModel,
    Gpu,
    LinkStats,
    MigSlot,
    NetworkLimits,
    Node,
    Placement,
    Placer,
    Request,
    TaskType,
    UnknownPlacer,
    Workload,
    fgd_score,
    fits,
    get_placer,
    model_pressure,
)

__all__ = [
    "DEFAULT_PLACER", "MILLI", "PLACERS", "Fleet", "FragModel", "Gpu", "LinkStats", "MigSlot", "NetworkLimits", "Node",
    "Placement", "Placer", "Request", "TaskType", "UnknownPlacer", "Workload", "fgd_score", "fits", "get_placer",
    "model_pressure",
]  # fmt: skip
