"""The master's collaborators, built once at start-up and passed to whoever needs them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from master.db import Database
from master.stats import IngestStats
from shared.bus import Bus
from shared.clock import Clock, SystemClock
from shared.crypto import CertificateAuthority
from shared.registry import MemoryRegistry, Registry
from shared.settings import MasterSettings

log = logging.getLogger(__name__)


@dataclass
class Master:
    settings: MasterSettings
    db: Database
    bus: Bus
    ca: CertificateAuthority
    clock: Clock = field(default_factory=SystemClock)
    instance_id: str = "master"
    registry: Registry = field(default_factory=MemoryRegistry)
    stats: IngestStats = field(default_factory=IngestStats)
    # The rental placer (master/services/rentals.py::placer_of builds it from settings.placer on first use).
    placer: Any = None
