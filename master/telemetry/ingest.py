"""Ingestion: a consumer-group reader of the ``agent-events`` stream.

Load → process → ack: messages are acknowledged only after the transaction that applied
them commits, so a master killed mid-batch loses nothing; another master (or this one
restarted) claims what was left pending for longer than ``stale_message_idle`` seconds.
Heartbeats and telemetry (nearly all traffic) are decoded by ``shared.protocol.fastbus`` (msgspec;
what it leaves goes to ``decode_bus_envelope``) and applied a whole read at a time in one transaction
(``master.telemetry.batch``: on PostgreSQL one ``INSERT … SELECT FROM unnest`` for the samples and one
``UPDATE … FROM unnest`` for the hosts); other messages one per transaction. Handlers are
idempotent and samples are de-duplicated by ``(host, seq)``, so redelivery is harmless.
A message that keeps failing on a database that answers is parked in ``agent-events:dead``;
while the database does not answer nothing is parked, however often it is delivered.
``master.background.ingest`` runs the consumer in every master process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy import text

from master.context import Master
from master.services import commands
from master.services.hosts import renew, retire_superseded, verification_commands
from master.services.lifecycle import clusters as clusterstate
from master.telemetry import batch as batches
from master.telemetry import hosts
from shared import protocol
from shared.bus import BusMessage
from shared.errors import BusError, ProtocolError, SequenceJump
from shared.protocol import fastbus

log = logging.getLogger(__name__)

DEAD_LETTERS_STREAM = "agent-events:dead"


class Ingestor:
    def __init__(
        self,
        master: Master,
        *,
        batch: int | None = None,
        block: float = 1.0,
        claim_every: float = 5.0,
        max_deliveries: int = 5,
        error_backoff: float = 1.0,
        batched: bool = True,
        read_ahead: bool = True,
    ) -> None:
        self.master = master
        self.batched = batched
        self.read_ahead = read_ahead and batched
        self.batch = batch or master.settings.ingest_batch
        self.block = block
        self.claim_every = claim_every
        self.max_deliveries = max_deliveries
        self.error_backoff = error_backoff
        self.consumer = master.instance_id
        # The fast decodings of the batch ``process`` is handed next, by message id (filled by the read-ahead).
        self._decoded: dict[str, fastbus.BusReport] = {}

    async def run(self) -> None:
        """Consume until cancelled. Cancelling is safe: unacknowledged messages stay pending.

        With ``read_ahead`` (batched only), the next read is taken off the bus and decoded while this one is
        applied: the database writes one batch on one core while this loop reads and decodes the next on
        another. Read ahead or not, a batch is applied only once the one before it has been, and a batch read
        ahead but not yet applied when the loop is cancelled stays pending (``claim_stale`` takes it over).
        """
        bus = self.master.bus
        await bus.ensure_group(protocol.AGENT_EVENTS_STREAM, protocol.INGEST_GROUP)
        last_claim = -self.claim_every
        backoff = 0.5
        loop = asyncio.get_running_loop()
        ahead: asyncio.Task[tuple[list[BusMessage], dict[str, fastbus.BusReport]]] | None = None
        try:
            while True:
                try:
                    if loop.time() - last_claim >= self.claim_every:
                        last_claim = loop.time()
                        stale = await bus.claim_stale(
                            protocol.AGENT_EVENTS_STREAM, protocol.INGEST_GROUP, self.consumer,
                            min_idle=self.master.settings.stale_message_idle,
                        )
                        if stale:
                            log.info("took over %d pending message(s) from a silent consumer", len(stale))
                            await self.process(stale)
                    task, ahead = ahead, None
                    batch, decoded = await (task if task is not None else self._read_decoded())
                    if batch and self.read_ahead:
                        ahead = asyncio.create_task(self._read_decoded(), name=f"ingest-read-ahead-{self.consumer}")
                    self._decoded = decoded
                    await self.process(batch)
                    backoff = 0.5
                except BusError as exc:
                    log.warning("bus unavailable (%s); retrying in %.1fs", exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
                except Exception:
                    # E.g. the database failing between a batch's commit and publishing its commands: whatever was
                    # not acknowledged stays pending. The loop must outlive it, or this master silently stops ingesting.
                    log.exception("ingestion pass failed; retrying in %.1fs", backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 30.0)
        finally:
            if ahead is not None:  # read but not applied: it stays pending, and claim_stale takes it over
                ahead.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await ahead

    async def _read_decoded(self) -> tuple[list[BusMessage], dict[str, fastbus.BusReport]]:
        """The next read, and the fast decoding of what the fast decoder takes, by message id."""
        batch = await self.master.bus.read(
            protocol.AGENT_EVENTS_STREAM, protocol.INGEST_GROUP, self.consumer, count=self.batch, block=self.block
        )
        return batch, {m.id: report for m in batch if (report := fastbus.decode_bus_report(m.payload)) is not None}

    @property
    def processed(self) -> int:
        return self.master.stats.processed

    @property
    def failed(self) -> int:
        return self.master.stats.failed

    @property
    def dead_lettered(self) -> int:
        return self.master.stats.dead_lettered

    async def process(self, messages: list[BusMessage]) -> None:
        """Apply and acknowledge ``messages``; one that fails stays pending and is retried.

        Batched (the default): heartbeats and telemetry — nearly all of the traffic — are
        applied together in one transaction and acknowledged together once it commits; every
        other message gets its own transaction, first, in arrival order. If the batch's
        transaction fails, its messages are applied one by one instead, so one bad message
        cannot hold back the others.
        """
        if not self.batched:
            for message in messages:
                await self._process_one(message)
            return
        read_ahead, self._decoded = self._decoded, {}
        fast: list[tuple[BusMessage, batches.Report]] = []
        for message in messages:
            report = read_ahead.get(message.id) or fastbus.decode_bus_report(message.payload)
            if report is not None:
                fast.append((message, report))
                continue
            envelope = self._decode(message)
            if envelope is None:
                await self.master.bus.ack(message.stream, protocol.INGEST_GROUP, [message.id])
            elif isinstance(envelope.message, protocol.Heartbeat | protocol.Telemetry):
                fast.append((message, envelope))
            else:
                await self._process_one(message, envelope)
        if fast and not await self._apply_batch(fast):
            for message, decoded in fast:
                await self._process_one(message, decoded if isinstance(decoded, protocol.BusEnvelope) else None)

    async def _apply_batch(self, batch: list[tuple[BusMessage, batches.Report]]) -> bool:
        stats = self.master.stats
        started = asyncio.get_running_loop().time()
        try:
            async with self.master.db.session() as session:
                outcome = await batches.apply_batch(
                    session, [report for _, report in batch], now=self.master.clock.now(),
                    max_future_s=self.master.settings.telemetry_max_future_s, stats=stats,
                )
        except Exception:
            stats.failed += 1
            log.exception("applying a batch of %d heartbeats and samples failed; applying them one by one", len(batch))
            return False
        stats.batches += 1
        took = asyncio.get_running_loop().time() - started
        stats.batch_seconds += took
        stats.batch_seconds_max = max(stats.batch_seconds_max, took)
        for host_id in sorted(outcome.unknown_hosts):
            log.warning("messages from unknown host %s dropped", host_id)
        if outcome.commands:
            await commands.publish(self.master, outcome.commands)
        stats.messages.update(report.message.type for _, report in batch)
        await self.master.bus.ack(batch[0][0].stream, protocol.INGEST_GROUP, [m.id for m, _ in batch])
        return True

    def _decode(self, message: BusMessage) -> protocol.BusEnvelope | None:
        try:
            return protocol.decode_bus_envelope(message.payload)
        except ProtocolError as exc:
            log.error("dropping malformed bus record %s: %s", message.id, exc)
            self.master.stats.malformed += 1
            return None

    async def _process_one(self, message: BusMessage, envelope: protocol.BusEnvelope | None = None) -> None:
        """Apply one message in its own transaction; after ``max_deliveries`` failures, dead-letter it."""
        stats = self.master.stats
        if envelope is None:
            envelope = self._decode(message)
            if envelope is None:
                await self.master.bus.ack(message.stream, protocol.INGEST_GROUP, [message.id])
                return
        try:
            await self._apply_one(envelope)
        except Exception:
            stats.failed += 1
            # Give a message up only when it fails on a database that answers: in an outage every message
            # fails, however often it is delivered, and parking them would lose what relays acknowledged.
            if message.deliveries >= self.max_deliveries and await self._database_answers():
                log.exception("giving up on bus message %s after %d deliveries; moved to %s",
                              message.id, message.deliveries, DEAD_LETTERS_STREAM)
                await self.master.bus.publish(DEAD_LETTERS_STREAM, message.payload)
                await self.master.bus.ack(message.stream, protocol.INGEST_GROUP, [message.id])
                stats.dead_lettered += 1
                return
            log.exception("applying bus message %s failed (delivery %d); it stays pending for a retry",
                          message.id, message.deliveries)
            await asyncio.sleep(self.error_backoff)
            return
        await self.master.bus.ack(message.stream, protocol.INGEST_GROUP, [message.id])
        stats.messages[envelope.message.type] += 1

    async def _database_answers(self) -> bool:
        """Whether the database takes a trivial query now (bounded by ``error_backoff`` + 5 s)."""
        try:
            async with asyncio.timeout(self.error_backoff + 5.0), self.master.db.session() as session:
                await session.execute(text("SELECT 1"))
        except Exception:
            return False
        return True

    async def _apply_one(self, envelope: protocol.BusEnvelope) -> None:
        resend: list[str] = []
        master = self.master
        try:
            async with master.db.session() as session:
                match envelope.message:
                    case protocol.Hello():
                        resend = await hosts.handle_hello(session, envelope, settings=master.settings, now=master.clock.now())
                    case protocol.Heartbeat():
                        resend = await hosts.handle_heartbeat(session, envelope)
                    case protocol.Telemetry():
                        await hosts.handle_telemetry(
                            session, envelope, now=master.clock.now(),
                            max_future_s=master.settings.telemetry_max_future_s, stats=master.stats,
                        )
                    case protocol.CommandResult():
                        await hosts.handle_command_result(
                            session, envelope, sign=master.ca.sign_connect_token, settings=master.settings, now=master.clock.now()
                        )
                    case protocol.GpuEvents():
                        await hosts.handle_gpu_events(session, envelope, settings=master.settings)
                    case protocol.NetworkReport():
                        await hosts.handle_network_report(session, envelope)
                    case protocol.WorkloadExited():
                        await hosts.handle_workload_exited(session, envelope, settings=master.settings)
                    case protocol.WorkloadLogs():
                        await hosts.handle_workload_logs(session, envelope)
                    case protocol.WorkloadProgress():
                        await hosts.handle_workload_progress(session, envelope)
                    case protocol.TunnelUsage():
                        await hosts.handle_tunnel_usage(session, envelope)
                    case protocol.RenewCertificate():
                        command_id = await renew(master, session, envelope)
                        resend = [command_id] if command_id else []
        except hosts.UnknownHost:
            log.warning("message from unknown host %s via %s dropped", envelope.message.host_id, envelope.relay_id)
            return
        except SequenceJump as exc:
            log.warning("%s via %s dropped: %s", envelope.message.type, envelope.relay_id, exc)
            master.stats.seq_refused += 1
            return
        if isinstance(envelope.message, protocol.Hello):
            # Every connection begins with a hello: a renewed certificate in use retires the ones before it.
            await retire_superseded(master, envelope.message.host_id, envelope.cert_serial)
        # What the clusters' hooks wrote meanwhile (a member's stop, the private network's next round): out at once.
        resend += clusterstate.issued_commands(session.info)
        resend += verification_commands(session.info)  # a challenge's start or reveal
        if resend:
            await commands.publish(master, resend)

