"""The ingestion loop: this master's consumer of the ``agent-events`` stream.

The consumer itself (``master.telemetry.ingest.Ingestor``: read, claim what a silent master left
pending, apply a batch, acknowledge, back off while the bus or the database fails) is the
ingestion module's; this is the supervisor's entry to it. Every master runs it, no lease: the
``master`` consumer group shares the stream between them.
"""

from __future__ import annotations

from master.context import Master
from master.telemetry.ingest import Ingestor


async def ingest_loop(master: Master) -> None:
    """Apply agent messages from the bus until cancelled.

    Cancelling is safe: messages not yet acknowledged stay pending, and this master (restarted)
    or another one claims them after ``stale_message_idle`` seconds.
    """
    await Ingestor(master).run()
