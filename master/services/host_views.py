"""What the host routes read and ask of a host beyond ``hosts.py``: a network test on demand, and the
reads of the live telemetry stream (``GET /hosts/{id}/metrics/stream``).

Each function opens its own short transaction, so a caller that waits between calls (the
stream) holds none. Imports ``master.services``, ``master.telemetry`` and ``master.context``;
never ``master.api`` or ``billing``.
"""

from __future__ import annotations

from typing import Any

from master.context import Master
from master.services import commands, hosts
from master.services.accounts import Principal
from master.telemetry import store as telemetry


async def request_network_test(master: Master, who: Principal, host_id: str) -> str:
    """Ask the host's agent to measure its network now (its provider or an admin); the command's id."""
    async with master.db.session() as session:
        host = await hosts.owned_host(session, who, host_id)
        command = commands.new_command(session, host_id=host.id, kind="measure_network", args={}, rental_id=None)
        command_id = command.id
    await commands.publish(master, [command_id])
    return command_id


async def stream_start(
    master: Master, who: Principal, host_id: str, *, resume: int | None, backlog: int, limit: int
) -> tuple[str, list[dict[str, Any]], int]:
    """Where a live stream of a visible host starts: its id, the samples to send first and the last sequence number sent.

    After ``resume`` (a sequence number the client saw last): up to ``limit`` samples after it.
    Otherwise the newest ``backlog`` raw samples, and the stream goes on after the latest stored one.
    """
    async with master.db.session() as session:
        host = await hosts.visible_host(session, who, host_id)
        if resume is not None:
            first = await telemetry.samples_after(session, host.id, resume, limit=limit)
        else:
            first = await telemetry.raw_series(session, host.id, since=None, until=None, limit=backlog) if backlog else []
            resume = await telemetry.latest_seq(session, host.id)
    return host.id, first, max([resume, *(item["seq"] for item in first)])


async def samples_after(master: Master, host_id: str, after_seq: int, *, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` raw samples of the host after ``after_seq``, oldest first."""
    async with master.db.session() as session:
        return await telemetry.samples_after(session, host_id, after_seq, limit=limit)
