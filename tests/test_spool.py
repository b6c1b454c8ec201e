"""The agent's on-disk spool: nothing unacknowledged is lost across restarts, and it stays bounded."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

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


class TestGroupCommit:
    """The spool's fsyncs run off the event loop, one for every change made before it started."""

    @staticmethod
    def _record_fsyncs(monkeypatch: pytest.MonkeyPatch, wal: Path) -> list[int]:
        calls: list[int] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            assert os.fstat(fd).st_ino == wal.stat().st_ino, "sync fsyncs the spool's WAL"
            calls.append(threading.get_ident())
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        return calls

    async def test_concurrent_syncs_share_one_fsync_in_a_thread(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        spool = SqliteSpool(tmp_path / "spool.db")
        calls = self._record_fsyncs(monkeypatch, tmp_path / "spool.db-wal")
        window = OutboundWindow("h-1", first_seq=0, store=spool)
        for _ in range(20):
            window.telemetry(_telemetry_body())
        assert spool.unsynced == 20
        await asyncio.gather(*(spool.sync() for _ in range(20)))
        assert len(calls) == 1 and calls[0] != threading.get_ident()  # one fsync, not on the loop's thread
        assert spool.unsynced == 0
        await spool.sync()  # nothing new: no fsync
        assert len(calls) == 1
        spool.close()
        spool.close()  # twice: harmless

    async def test_a_change_made_during_an_fsync_waits_for_the_next(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        spool = SqliteSpool(tmp_path / "spool.db")
        started, release = threading.Event(), threading.Event()
        calls: list[int] = []
        real = os.fsync

        def slow_fsync(fd: int) -> None:
            calls.append(fd)
            started.set()
            release.wait(10)
            real(fd)

        monkeypatch.setattr(os, "fsync", slow_fsync)
        spool.add(1, "telemetry", "{}")
        first = asyncio.ensure_future(spool.sync())
        await asyncio.to_thread(started.wait, 10)
        spool.add(2, "command_result", "{}")  # after the fsync began: not covered by it
        second = asyncio.ensure_future(spool.sync())
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done()
        release.set()
        await asyncio.gather(first, second)
        assert len(calls) == 2 and spool.unsynced == 0
        spool.close()

    async def test_cancelling_a_sync_leaves_the_fsync_running(self, tmp_path: Path) -> None:
        spool = SqliteSpool(tmp_path / "spool.db")
        spool.add(1, "telemetry", "{}")
        waiter = asyncio.ensure_future(spool.sync())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await spool.sync()  # harvests the running fsync, or starts one
        assert spool.unsynced == 0 and list(spool.pending()) == [(1, "{}")]
        spool.close()

    def test_synced_frames_survive_the_process_dying(self, tmp_path: Path) -> None:
        """An agent killed without closing its spool (no checkpoint, the WAL left behind) loses nothing it synced."""
        path = tmp_path / "spool.db"
        program = textwrap.dedent(
            f"""
            import asyncio, os, sys
            from datetime import UTC, datetime
            from pathlib import Path
            from agent.spool import SqliteSpool
            from shared import protocol
            from shared.outbound import OutboundWindow

            async def main():
                window = OutboundWindow("h-1", first_seq=0, store=SqliteSpool(Path({str(path)!r})))
                for i in range(50):
                    seq, _ = window.telemetry(protocol.TelemetryBody(sampled_at=datetime.now(UTC), gpus=[]))
                    if i % 7 == 0:
                        window.ack(seq)
                    await window.store.sync()
                print("synced", flush=True)
                os._exit(9)  # no close: as if killed

            asyncio.run(main())
            """
        )
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 9 and "synced" in done.stdout, done.stderr
        assert (tmp_path / "spool.db-wal").exists()
        reopened = SqliteSpool(path)
        assert [seq for seq, _ in reopened.pending()] == [i for i in range(50) if i % 7]
        reopened.close()
