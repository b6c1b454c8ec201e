"""Ingestion: a consumer-group reader of the ``agent-events`` stream.

Load → process → ack: each bus message is applied in its own transaction and
acknowledged only after that commits, so a master killed mid-batch loses nothing;
another master (or this one restarted) claims what was left pending for longer than
``stale_message_idle`` seconds. Handlers are idempotent, so redelivery is harmless.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from master.context import Master
from master.services import commands, enrollment, hosts, leases
from shared import protocol
from shared.bus import BusMessage
from shared.errors import BusError, ProtocolError

log = logging.getLogger(__name__)

GROUP = "master"
DEAD_LETTERS_STREAM = "agent-events:dead"


class Ingestor:
    def __init__(
        self,
        master: Master,
        *,
        batch: int = 200,
        block: float = 1.0,
        claim_every: float = 5.0,
        max_deliveries: int = 5,
        error_backoff: float = 1.0,
    ) -> None:
        self.master = master
        self.batch = batch
        self.block = block
        self.claim_every = claim_every
        self.max_deliveries = max_deliveries
        self.error_backoff = error_backoff
        self.consumer = master.instance_id
        self.processed = 0
        self.failed = 0
        self.dead_lettered = 0

    async def run(self) -> None:
        """Consume until cancelled. Cancelling is safe: unacknowledged messages stay pending."""
        bus = self.master.bus
        await bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        last_claim = -self.claim_every
        backoff = 0.5
        loop = asyncio.get_running_loop()
        while True:
            try:
                if loop.time() - last_claim >= self.claim_every:
                    last_claim = loop.time()
                    stale = await bus.claim_stale(
                        protocol.AGENT_EVENTS_STREAM, GROUP, self.consumer, min_idle=self.master.settings.stale_message_idle
                    )
                    if stale:
                        log.info("took over %d pending message(s) from a silent consumer", len(stale))
                        await self.process(stale)
                batch = await bus.read(protocol.AGENT_EVENTS_STREAM, GROUP, self.consumer, count=self.batch, block=self.block)
                await self.process(batch)
                backoff = 0.5
            except BusError as exc:
                log.warning("bus unavailable (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def process(self, messages: list[BusMessage]) -> None:
        """Apply and acknowledge each message; one that fails stays pending and is retried.

        A database outage fails every message: they stay pending on the bus and are claimed
        again after ``stale_message_idle``. A message that keeps failing (a poison message)
        is moved to the dead-letter stream after ``max_deliveries`` attempts, so it cannot
        block ingestion forever, and is logged for an operator.
        """
        for message in messages:
            try:
                await self._apply_one(message)
            except Exception:
                self.failed += 1
                if message.deliveries >= self.max_deliveries:
                    log.exception("giving up on bus message %s after %d deliveries; moved to %s",
                                  message.id, message.deliveries, DEAD_LETTERS_STREAM)
                    await self.master.bus.publish(DEAD_LETTERS_STREAM, message.payload)
                    await self.master.bus.ack(message.stream, GROUP, [message.id])
                    self.dead_lettered += 1
                    continue
                log.exception("applying bus message %s failed (delivery %d); it stays pending for a retry",
                              message.id, message.deliveries)
                await asyncio.sleep(self.error_backoff)
                continue
            await self.master.bus.ack(message.stream, GROUP, [message.id])
            self.processed += 1

    async def _apply_one(self, message: BusMessage) -> None:
        try:
            envelope = protocol.decode_bus_envelope(message.payload)
        except ProtocolError as exc:
            log.error("dropping malformed bus record %s: %s", message.id, exc)
            return
        resend: list[str] = []
        try:
            async with self.master.db.session() as session:
                match envelope.message:
                    case protocol.Hello():
                        resend = await hosts.handle_hello(session, envelope)
                    case protocol.Heartbeat():
                        await hosts.handle_heartbeat(session, envelope)
                    case protocol.Telemetry():
                        await hosts.handle_telemetry(session, envelope)
                    case protocol.CommandResult():
                        await hosts.handle_command_result(session, envelope)
                    case protocol.GpuEvents():
                        await hosts.handle_gpu_events(session, envelope)
                    case protocol.NetworkReport():
                        await hosts.handle_network_report(session, envelope)
                    case protocol.WorkloadExited():
                        await hosts.handle_workload_exited(session, envelope)
                    case protocol.WorkloadLogs():
                        await hosts.handle_workload_logs(session, envelope)
                    case protocol.RenewCertificate():
                        command_id = await enrollment.renew(self.master, session, envelope)
                        resend = [command_id] if command_id else []
        except hosts.UnknownHost:
            log.warning("message from unknown host %s via %s dropped", envelope.message.host_id, envelope.relay_id)
            return
        if resend:
            await commands.publish(self.master, resend)


SWEEPER_LEASE = "heartbeat-sweeper"


async def heartbeat_monitor(master: Master, *, every: float | None = None) -> None:
    """Mark hosts offline after ``missed_heartbeats_offline`` silent intervals. Cancel to stop.

    Several masters may run this; the ``heartbeat-sweeper`` lease makes one sweep at a time.
    """
    settings = master.settings
    deadline = settings.heartbeat_interval * settings.missed_heartbeats_offline

    async def sweep() -> None:
        async with master.db.session() as session:
            gone = await hosts.mark_silent_hosts_offline(session, now=master.clock.now(), deadline=timedelta(seconds=deadline))
        if gone:
            log.warning("hosts offline after %gs of silence: %s", deadline, ", ".join(gone))

    await leases.run_leased(master, SWEEPER_LEASE, every=every or settings.heartbeat_interval / 2, work=sweep)


async def revocation_publisher(master: Master, *, every: float = 30.0) -> None:
    """Re-publish revoked certificate serials from the database to the registry. Cancel to stop."""
    while True:
        try:
            await enrollment.publish_revocations(master)
        except Exception:
            log.exception("publishing revocations failed; retrying next interval")
        await asyncio.sleep(every)


async def command_resender(master: Master, *, every: float | None = None) -> None:
    """Resend commands no agent has answered within ``command_retry_interval``. Cancel to stop."""
    while True:
        await asyncio.sleep(every or master.settings.command_retry_interval / 2)
        try:
            due = await commands.due_for_resend(master, master.clock.now())
            if due:
                log.info("resending %d unanswered command(s)", len(due))
                await commands.publish(master, due)
        except Exception:
            log.exception("command resend pass failed; retrying next interval")
