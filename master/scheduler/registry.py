"""The placement algorithms by name: ``PLACERS``, ``DEFAULT_PLACER`` and ``get_placer``."""

from __future__ import annotations

from master.scheduler.fragmentation import Workload
from master.scheduler.placers.base import Placer, PlacerFactory
from master.scheduler.placers.best_fit import BestFit
from master.scheduler.placers.fgd import Fgd
from master.scheduler.placers.fgd_net import FgdNet
from master.scheduler.placers.fgd_plus import FgdPlus
from master.scheduler.placers.first_fit import FirstFit
from master.scheduler.placers.gpu_clustering import GpuClustering
from master.scheduler.placers.gpu_packing import GpuPacking
from master.scheduler.placers.learned import LearnedDdpg, LearnedDdpgTrace, LearnedPpo, LearnedPpoTrace
from master.scheduler.placers.pwr_fgd import PwrFgd
from master.scheduler.placers.random_fit import RandomFit
from master.scheduler.placers.utilization import Utilization
from shared.errors import ConfigError


class UnknownPlacer(ConfigError):
    code = "unknown_placer"


PLACERS: dict[str, PlacerFactory] = {
    "first_fit": FirstFit,
    "best_fit": BestFit,
    "random": RandomFit,
    "utilization": Utilization,
    "gpu_packing": GpuPacking,
    "gpu_clustering": GpuClustering,
    "fgd": Fgd,
    "fgd_net": FgdNet,
    # FGD + model scarcity + a power term (issue 43): docs/power.md, "Power-aware placement".
    "pwr_fgd": PwrFgd,
    "fgd_plus": FgdPlus,
    # Trained by reinforcement learning (issue 26): a shipped numpy policy each, loaded when built.
    "learned_ppo": LearnedPpo,
    "learned_ddpg": LearnedDdpg,
    "learned_ppo_trace": LearnedPpoTrace,
    "learned_ddpg_trace": LearnedDdpgTrace,
}
DEFAULT_PLACER = "fgd_net"


def get_placer(name: str, *, seed: int = 0, workload: Workload | None = None) -> Placer:
    """A new placer of algorithm ``name`` (see ``PLACERS``); ``workload`` matters to ``fgd``, ``fgd_net``, ``fgd_plus`` and the
    ``learned_*`` placers only. A ``learned_*`` placer whose policy file is missing or damaged raises ``PolicyError``."""
    factory = PLACERS.get(name)
    if factory is None:
        raise UnknownPlacer(f"unknown placement algorithm {name!r}; choose one of: {', '.join(PLACERS)}")
    return factory(seed=seed, workload=workload)


__all__ = ["DEFAULT_PLACER", "PLACERS", "UnknownPlacer", "get_placer"]
