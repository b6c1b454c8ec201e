"""The agent's side of delivery: sequence numbers and the window of unacknowledged frames.

Sans-I/O like ``shared.protocol``, whose envelopes it numbers and encodes: an
``OutboundWindow`` gives each message of one host the next ``seq`` and keeps the frame in a
``FrameStore`` (``MemoryStore`` here, the agent's on-disk ``agent.spool.SqliteSpool``) until
the relay acknowledges it; ``pending()`` yields what to replay after a reconnect.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Protocol

from pydantic import BaseModel

from shared.protocol import (
    AgentEnvelope,
    CommandResult,
    CommandResultBody,
    GpuEvents,
    GpuEventsBody,
    Heartbeat,
    HeartbeatBody,
    Hello,
    HelloBody,
    NetworkReport,
    NetworkReportBody,
    RenewCertificate,
    RenewCertificateBody,
    Telemetry,
    TelemetryBody,
    TunnelUsage,
    TunnelUsageBody,
    WorkloadExited,
    WorkloadExitedBody,
    WorkloadLogs,
    WorkloadLogsBody,
    WorkloadProgress,
    WorkloadProgressBody,
    encode,
)


class FrameStore(Protocol):
    """Where the window keeps unacknowledged frames (in memory, or the agent's on-disk spool).

    A store is bounded; when full it evicts the oldest *evictable* frames (heartbeats,
    then telemetry) and counts them. Other kinds are never evicted.
    """

    def add(self, seq: int, kind: str, frame: str) -> None: ...
    def ack(self, seq: int) -> bool: ...
    def discard_kind(self, kind: str) -> int: ...
    def pending(self) -> Iterator[tuple[int, str]]: ...
    def __len__(self) -> int: ...
    @property
    def evicted(self) -> dict[str, int]: ...


# Kinds a full store may evict, in eviction order. Everything else is kept.
EVICTABLE = ("heartbeat", "telemetry")


class MemoryStore:
    """An in-memory ``FrameStore`` (tests, tools); the agent uses ``agent.spool.SqliteSpool``."""

    def __init__(self, *, max_messages: int = 10_000) -> None:
        self.max_messages = max_messages
        self._frames: dict[int, tuple[str, str]] = {}
        self._evicted: dict[str, int] = {}

    def add(self, seq: int, kind: str, frame: str) -> None:
        while len(self._frames) >= self.max_messages and self._evict_one():
            pass
        self._frames[seq] = (kind, frame)

    def _evict_one(self) -> bool:
        for kind in EVICTABLE:
            for seq in sorted(self._frames):
                if self._frames[seq][0] == kind:
                    del self._frames[seq]
                    self._evicted[kind] = self._evicted.get(kind, 0) + 1
                    return True
        return False

    def ack(self, seq: int) -> bool:
        return self._frames.pop(seq, None) is not None

    def discard_kind(self, kind: str) -> int:
        doomed = [s for s, (k, _) in self._frames.items() if k == kind]
        for seq in doomed:
            del self._frames[seq]
        return len(doomed)

    def pending(self) -> Iterator[tuple[int, str]]:
        return iter([(s, self._frames[s][1]) for s in sorted(self._frames)])

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def evicted(self) -> dict[str, int]:
        return dict(self._evicted)


class OutboundWindow:
    """Sequence numbering and the store of sent-but-unacknowledged messages of one host.

    ``next_seq`` starts where the persisted lease says (see ``agent.state``), so a
    restarted agent never reuses a number. Messages stay in ``store`` until
    acknowledged; ``pending()`` yields them in sequence order for replay after a
    reconnect. A new hello supersedes unacknowledged older ones (they would replay
    stale facts after the new one).
    """

    def __init__(self, host_id: str, *, first_seq: int, store: FrameStore | None = None) -> None:
        self.host_id = host_id
        self.next_seq = first_seq
        self.store: FrameStore = store if store is not None else MemoryStore()

    def __len__(self) -> int:
        return len(self.store)

    def _envelope(self, cls: type[AgentEnvelope], body: BaseModel, ts: datetime | None) -> tuple[int, str]:
        seq = self.next_seq
        self.next_seq += 1
        message = cls(host_id=self.host_id, seq=seq, ts=ts or datetime.now(UTC), body=body)  # type: ignore[call-arg]
        frame = encode(message)
        self.store.add(seq, str(cls.model_fields["type"].default), frame)
        return seq, frame

    def hello(self, body: HelloBody, ts: datetime | None = None) -> tuple[int, str]:
        self.store.discard_kind("hello")
        return self._envelope(Hello, body, ts)

    def heartbeat(self, body: HeartbeatBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(Heartbeat, body, ts)

    def telemetry(self, body: TelemetryBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(Telemetry, body, ts)

    def command_result(self, body: CommandResultBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(CommandResult, body, ts)

    def gpu_events(self, body: GpuEventsBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(GpuEvents, body, ts)

    def network_report(self, body: NetworkReportBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(NetworkReport, body, ts)

    def workload_exited(self, body: WorkloadExitedBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(WorkloadExited, body, ts)

    def workload_logs(self, body: WorkloadLogsBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(WorkloadLogs, body, ts)

    def workload_progress(self, body: WorkloadProgressBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(WorkloadProgress, body, ts)

    def tunnel_usage(self, body: TunnelUsageBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(TunnelUsage, body, ts)

    def renew_certificate(self, body: RenewCertificateBody, ts: datetime | None = None) -> tuple[int, str]:
        return self._envelope(RenewCertificate, body, ts)

    def ack(self, seq: int) -> bool:
        """Forget an acknowledged message; returns whether it was outstanding."""
        return self.store.ack(seq)

    def pending(self) -> Iterator[tuple[int, str]]:
        """Unacknowledged frames in sequence order (a snapshot; safe to ack while iterating)."""
        return iter(list(self.store.pending()))
