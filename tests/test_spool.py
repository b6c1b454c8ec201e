"""The agent's on-disk spool: nothing unacknowledged is lost across restarts, and it stays bounded."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from agent.spool import SqliteSpool
from shared import protocol
from shared.outbound import OutboundWindow


def _telemetry_body() -> protocol.TelemetryBody:
    return protocol.TelemetryBody(sampled_at=datetime.now(UTC), gpus=[])


class TestSqliteSpool:
    def test_unacknowledged_frames_survive_a_restart_in_order(self, tmp_path: Path) -> None:
        """Frames not yet acknowledged are there, in sequence order, after reopening the file."""
        path = tmp_path / "spool.db"
        first = OutboundWindow("h-1", first_seq=10, store=SqliteSpool(path))
        sent = [first.telemetry(_telemetry_body()) for _ in range(5)]
        first.ack(sent[1][0])
        first.ack(sent[3][0])
        first.store.close()  # type: ignore[attr-defined]
        reopened = SqliteSpool(path)
        assert list(reopened.pending()) == [sent[0], sent[2], sent[4]]
        assert len(reopened) == 3
        reopened.close()

    def test_eviction_counters_persist(self, tmp_path: Path) -> None:
        """Evicted telemetry is counted, and the count survives a restart."""
        path = tmp_path / "spool.db"
        spool = SqliteSpool(path, max_messages=2)
        window = OutboundWindow("h-1", first_seq=0, store=spool)
        result = protocol.CommandResultBody(command_id="cmd-1", ok=True, finished_at=datetime.now(UTC))
        kept, _ = window.command_result(result)
        for _ in range(4):
            window.telemetry(_telemetry_body())
        assert [seq for seq, _ in spool.pending()] == [kept, 4]  # the result and the newest telemetry
        spool.close()
        again = SqliteSpool(path, max_messages=2)
        assert again.evicted == {"telemetry": 3}
        again.close()

    def test_byte_bound_is_enforced(self, tmp_path: Path) -> None:
        """The spool never holds more evictable bytes than max_bytes."""
        spool = SqliteSpool(tmp_path / "spool.db", max_bytes=2000)
        window = OutboundWindow("h-1", first_seq=0, store=spool)
        for _ in range(50):
            window.telemetry(_telemetry_body())
        assert spool.size_bytes <= 2000 and len(spool) >= 1
        spool.close()

    def test_acks_of_unknown_seqs_are_harmless(self, tmp_path: Path) -> None:
        """Acknowledging something the spool does not hold changes nothing."""
        spool = SqliteSpool(tmp_path / "spool.db")
        spool.add(1, "telemetry", "{}")
        assert not spool.ack(99)
        assert spool.ack(1) and not spool.ack(1) and len(spool) == 0
        spool.close()
