"""The agent's log shipper: cursors saved off the event loop, never ahead of what was sent."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from agent import logship, state
from agent.logship import LogShipper
from shared import protocol


class Logs:
    """A stand-in for the workload manager's ``read_log``: one growing log per rental."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def read_log(self, rental_id: str, *, offset: int, limit: int) -> tuple[bytes, int]:
        chunk = self.data.get(rental_id, b"")[offset:offset + limit]
        return chunk, offset + len(chunk)


def _shipper(tmp_path: Path, logs: Logs, sent: list[protocol.WorkloadLogsBody]) -> LogShipper:
    async def send(body: protocol.WorkloadLogsBody) -> None:
        sent.append(body)

    return LogShipper(tmp_path, logs, send)  # type: ignore[arg-type]


def _saved(tmp_path: Path) -> dict[str, Any]:
    return dict(json.loads((tmp_path / "log_cursors.json").read_text()))


async def test_the_cursor_is_written_in_a_thread_after_the_chunks_are_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs, sent = Logs(), list[protocol.WorkloadLogsBody]()
    shipper = _shipper(tmp_path, logs, sent)
    writers: list[int] = []
    real = state.atomic_write

    def recording(path: Path, data: bytes) -> None:
        writers.append(threading.get_ident())
        real(path, data)

    monkeypatch.setattr(logship, "atomic_write", recording)
    shipper.follow("r-1")
    logs.data["r-1"] = b"one\ntwo\n"
    assert await shipper.ship() == 8
    assert writers and threading.get_ident() not in writers
    assert _saved(tmp_path) == {"r-1": {"offset": 8, "exited": False}}
    assert [(b.offset, b.data) for b in sent] == [(0, "one\ntwo\n")]
    writers.clear()
    assert await shipper.ship() == 0
    assert not writers  # nothing new: no write


async def test_a_cursor_is_never_saved_ahead_of_what_was_sent(tmp_path: Path) -> None:
    """If sending fails midway (the spool could not take it), the saved cursor stays where it was."""
    logs = Logs()
    sent: list[protocol.WorkloadLogsBody] = []
    shipper = _shipper(tmp_path, logs, sent)
    shipper.follow("r-1")
    logs.data["r-1"] = b"a" * 10
    await shipper.ship()

    async def broken(body: protocol.WorkloadLogsBody) -> None:
        raise OSError("disk full")

    shipper.send = broken
    logs.data["r-1"] += b"b" * 10
    with pytest.raises(OSError):
        await shipper.ship()
    assert _saved(tmp_path)["r-1"]["offset"] == 10
    # A restarted agent ships again from the saved cursor: at least once (the master keeps the longer chunk).
    again: list[protocol.WorkloadLogsBody] = []
    restarted = _shipper(tmp_path, logs, again)
    await restarted.ship()
    assert [(b.offset, b.length) for b in again] == [(10, 10)]


def test_an_older_snapshot_finishing_late_does_not_overwrite_a_newer_one(tmp_path: Path) -> None:
    shipper = _shipper(tmp_path, Logs(), [])
    shipper.follow("r-1")
    old = shipper._snapshot()
    shipper.cursors["r-1"].offset = 42
    new = shipper._snapshot()
    shipper._write(*new)
    shipper._write(*old)
    assert _saved(tmp_path)["r-1"]["offset"] == 42
