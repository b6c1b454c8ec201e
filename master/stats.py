"""Counters of one master process, read by ``/metrics`` and the ingestion benchmark.

Plain attributes on one object owned by ``Master``: the event loop is single-threaded, so
increments need no lock. They count since this process started (Prometheus counters).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class IngestStats:
    messages: Counter[str] = field(default_factory=Counter)
    """Bus messages applied, by agent message type."""
    failed: int = 0
    """Attempts to apply a message that raised (the message stays pending and is retried)."""
    dead_lettered: int = 0
    malformed: int = 0
    samples_stored: int = 0
    samples_duplicate: int = 0
    samples_rejected: int = 0
    """Whole samples refused (a timestamp far in the future)."""
    rejected_fields: Counter[str] = field(default_factory=Counter)
    """Telemetry fields refused as impossible, by field name."""
    batches: int = 0
    batch_seconds: float = 0.0
    """Total time spent writing batches (for the mean batch duration)."""
    rollup_passes: int = 0
    rollup_rows: int = 0
    retention_deleted: Counter[str] = field(default_factory=Counter)

    @property
    def processed(self) -> int:
        return sum(self.messages.values())
