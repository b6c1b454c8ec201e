"""The master's collaborators, built once at start-up and passed to whoever needs them.

``IngestStats`` are the counters of one master process, read by ``/metrics`` and the ingestion
benchmark: plain attributes on one object owned by ``Master`` (the event loop is single-threaded,
so increments need no lock), counting since this process started (Prometheus counters).

``CreditGate`` is the one question placement asks of billing (does this renter have the credit
for this rental?). Billing sits above the master's services, so they never import it: the
assembly (``master/app.py::open_master``) hands the master billing's implementation.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from master.db import Database
from shared.bus import Bus
from shared.clock import Clock, SystemClock
from shared.crypto import CertificateAuthority
from shared.registry import MemoryRegistry, Registry
from shared.settings import MasterSettings

log = logging.getLogger(__name__)


@dataclass
class IngestStats:
    messages: Counter[str] = field(default_factory=Counter)
    """Bus messages applied, by agent message type."""
    failed: int = 0
    """Attempts to apply a message that raised (the message stays pending and is retried)."""
    dead_lettered: int = 0
    malformed: int = 0
    seq_refused: int = 0
    """Messages dropped for a sequence number absurdly far past their host's newest (``protocol.MAX_SEQ_JUMP``)."""
    samples_stored: int = 0
    samples_duplicate: int = 0
    samples_rejected: int = 0
    """Whole samples refused (a timestamp far in the future)."""
    rejected_fields: Counter[str] = field(default_factory=Counter)
    """Telemetry fields refused as impossible, by field name."""
    batches: int = 0
    batch_seconds: float = 0.0
    """Total time spent writing batches (for the mean batch duration)."""
    batch_seconds_max: float = 0.0
    """The longest batch so far (a database stall shows here, not in the mean)."""
    rollup_passes: int = 0
    rollup_rows: int = 0
    retention_deleted: Counter[str] = field(default_factory=Counter)

    @property
    def processed(self) -> int:
        return sum(self.messages.values())


class CreditGate(Protocol):
    """Whether a renter may start one more rental, or make one more volume (``billing/enforce.py::PrepaidCreditGate``)."""

    async def has_credit_for(
        self, session: AsyncSession, renter_id: str, price_per_gpu_hour: Decimal, gpus: Decimal, *, min_period_s: int
    ) -> None:
        """Raise a ``ClientError`` (402 ``insufficient_credit``) unless the renter can pay the minimum billing period."""

    async def has_credit_for_volume(
        self, session: AsyncSession, renter_id: str, size_gib: int, price_per_gib_hour: Decimal, *, min_period_s: int
    ) -> None:
        """Raise a ``ClientError`` (402 ``insufficient_credit``) unless the renter can pay an hour of the volume's
        storage (docs/volumes.md#billing), on top of the minimum billing period of what it runs and keeps."""


class CommandSecrets(Protocol):
    """What a command carries as it is sent but never at rest in its row (``master/services/commands.py::publish``):
    a start's registry login (``master/services/accounts/registries.py::RegistryLogins``, handed over at assembly)."""

    async def extra_args(self, session: AsyncSession, commands: Sequence[Any], *, now: datetime) -> dict[str, dict[str, Any]]:
        """Per command id, the args to add to what the row holds."""


AUTOSCALER_LEASE = "autoscaler"
"""The lease the autoscaler loop runs under (``master/background/autoscaler.py``); the gateway nudges it to wake a
service at zero replicas."""


@dataclass
class Master:
    settings: MasterSettings
    db: Database
    bus: Bus
    ca: CertificateAuthority
    credit_gate: CreditGate
    """Asked at placement when ``settings.require_credit`` is on."""
    clock: Clock = field(default_factory=SystemClock)
    instance_id: str = "master"
    registry: Registry = field(default_factory=MemoryRegistry)
    stats: IngestStats = field(default_factory=IngestStats)
    # The rental placer (master/services/rentals/placement.py::placer_of builds it from settings.placer on first use).
    placer: Any = None
    # The elastic services' gateway of this process (master/services/gateway/core.py::gateway_of builds it on first use;
    # the app closes it at shutdown).
    gateway: Any = None
    # Secrets added to commands as they are sent, never stored with them (open_master hands the accounts' in).
    command_secrets: CommandSecrets | None = None
    # Per leased loop (by lease name), an event that cuts its wait short (``nudge``; master/background/leases.py).
    nudges: dict[str, asyncio.Event] = field(default_factory=dict)

    def nudge(self, loop: str) -> None:
        """Run leased loop ``loop`` (its lease name) now rather than at the end of its period, if this process runs
        it; a loop on another master runs at its period, as before."""
        self.nudges.setdefault(loop, asyncio.Event()).set()
