"""The invariants every fault scenario checks afterwards, read from the bus and the database.

* **Telemetry, exactly once, no gaps.** ``Wire`` reads the ``agent-events`` stream itself: every
  message a relay put on the bus (and so acknowledged to its agent), duplicates included.
  ``check_telemetry`` waits until every telemetry ``(host, seq)`` on the wire is in the
  ``telemetry`` table, then checks that each is stored once, that nothing is stored that never
  went on the wire, and that no report is missing *between* the stored ones. Sequence numbers
  are shared by all of a host's messages (and an unacknowledged hello is superseded by the next
  one, leaving a hole that is no loss), so holes in them do not say which telemetry is missing;
  the reports themselves do: each carries ``sampled_at`` and ``window_s``, the seconds since the
  previous report was made (both read at the same instant), so consecutive stored reports
  satisfy ``sampled_at[k] − sampled_at[k−1] = window_s[k]``, and a missing report shows as at
  least one telemetry interval too much.
* **Workload logs, exactly once, no gaps.** Chunks are stored once per ``(rental, offset)``; a
  rental's chunks must tile its output from byte 0 with no hole and no overlap.
* **Allocation.** No GPU held by two rentals at once, now or at any time (intervals of
  ``gpu_allocations``); no rental half-allocated: an active rental holds exactly its GPUs, an
  ended one holds nothing, and every GPU's counters equal what its active allocations hold.
* **Money.** The trial balance balances; each rental's usage postings cover disjoint periods and
  add up to exactly its billed seconds' cost (billed once), and a minimum period or downtime
  credit is posted at most once.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, cast

import redis.asyncio as aioredis
from sqlalchemy import select, text

from billing import ledger
from billing.rating import per_second
from master.db import Database
from master.models import Rental
from shared import protocol

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass
class HostWire:
    entries: int = 0  # every telemetry entry, republished ones included
    telemetry: set[int] = field(default_factory=set)  # distinct telemetry seqs


class Wire:
    """What the relays put on the ``agent-events`` stream, read incrementally (entries are never trimmed here)."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.redis_url = redis_url
        self.key = prefix + protocol.AGENT_EVENTS_STREAM
        self.last_id = "0-0"
        self.hosts: dict[str, HostWire] = defaultdict(HostWire)
        self.entries = 0
        self.by_kind: Counter[str] = Counter()
        self.seen: set[tuple[str, int]] = set()
        self.republished = 0  # entries of any kind whose (host, seq) was on the bus already

    async def refresh(self) -> None:
        client = aioredis.Redis.from_url(self.redis_url, socket_connect_timeout=5)
        try:
            while True:
                batch = cast("list[tuple[bytes, dict[bytes, bytes]]]",
                             await client.xrange(self.key, min=f"({self.last_id}", max="+", count=5000))  # fmt: skip
                if not batch:
                    return
                for _entry_id, fields in batch:
                    message = json.loads(fields[b"p"])["message"]
                    self.entries += 1
                    self.by_kind[message["type"]] += 1
                    key = (message["host_id"], int(message["seq"]))
                    self.republished += key in self.seen
                    self.seen.add(key)
                    if message["type"] == "telemetry":
                        host = self.hosts[message["host_id"]]
                        host.entries += 1
                        host.telemetry.add(int(message["seq"]))
                self.last_id = batch[-1][0].decode()
        finally:
            await client.aclose()

    def mark(self) -> dict[str, tuple[int, int]]:
        """Each host's (telemetry entries, distinct telemetry reports) so far, to report what one scenario added."""
        return {host_id: (host.entries, len(host.telemetry)) for host_id, host in self.hosts.items()}


async def _stored(db: Database) -> dict[str, list[tuple[int, datetime, float | None, int]]]:
    """Every host's stored reports: (seq, sampled_at, window_s, rows with that seq), by seq."""
    async with db.session() as session:
        rows = (
            await session.execute(text(
                "SELECT host_id, seq, min(sampled_at), min(window_s), count(*) FROM telemetry GROUP BY host_id, seq ORDER BY host_id, seq"
            ))
        ).all()  # fmt: skip
    stored: dict[str, list[tuple[int, datetime, float | None, int]]] = defaultdict(list)
    for host_id, seq, sampled_at, window_s, n in rows:
        stored[host_id].append((int(seq), sampled_at, window_s, int(n)))
    return stored


async def check_telemetry(
    db: Database, wire: Wire, *, hosts: list[str], since: dict[str, tuple[int, int]], covered_after: datetime, interval: float,
    timeout: float = 60, deaths: Sequence[tuple[str, datetime]] = (),
) -> dict[str, Any]:  # fmt: skip
    """Wait until every telemetry report on the wire is stored and each host has one made after ``covered_after``;
    then check exactly-once and the ``window_s`` chain (tolerance half the telemetry ``interval``).

    ``deaths``: (host, when) a scenario killed the host's agent on purpose: a dead agent samples nothing, so the gap
    in its chain around that moment is no lost report (counted as ``gaps_of_killed_agents``).

    Returns the figures; raises ``AssertionError`` naming what does not hold.
    """
    deadline = time.monotonic() + timeout
    await wire.refresh()
    target = {h: set(wire.hosts[h].telemetry) for h in hosts}  # on the bus now: must all be stored
    now = wire.mark()
    while True:
        stored = await _stored(db)
        await wire.refresh()  # after reading the table: whatever it holds went on the bus before
        missing = {h: sorted(target[h] - {seq for seq, *_ in stored.get(h, [])}) for h in hosts}
        missing = {h: seqs for h, seqs in missing.items() if seqs}
        uncovered = [h for h in hosts if not any(at > covered_after for _, at, _, _ in stored.get(h, []))]
        if not missing and not uncovered:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout:g} s: telemetry on the bus but not stored {missing}; "
                                 f"hosts with nothing stored made after {covered_after.isoformat()}: {uncovered}")  # fmt: skip
        await asyncio.sleep(0.5)
    duplicates = {h: [seq for seq, _, _, n in rows if n > 1] for h, rows in stored.items()}
    duplicates = {h: seqs for h, seqs in duplicates.items() if seqs}
    never_sent = {h: sorted({seq for seq, *_ in rows} - wire.hosts[h].telemetry) for h, rows in stored.items()}
    never_sent = {h: seqs for h, seqs in never_sent.items() if seqs}
    gaps: dict[str, list[dict[str, Any]]] = {}
    killed_gaps = 0
    for host_id in hosts:
        rows = stored[host_id]
        for (seq_a, at_a, _, _), (seq_b, at_b, window_b, _) in itertools.pairwise(rows):
            if window_b is None:
                continue
            extra = (at_b - at_a).total_seconds() - window_b
            if abs(extra) > interval / 2:
                if any(host == host_id and at_a <= when <= at_b for host, when in deaths):
                    killed_gaps += 1
                    continue
                gaps.setdefault(host_id, []).append({"after_seq": seq_a, "seq": seq_b, "unaccounted_s": round(extra, 3)})
    sent = sum(now.get(h, (0, 0))[1] - since.get(h, (0, 0))[1] for h in hosts)
    entries = sum(now.get(h, (0, 0))[0] - since.get(h, (0, 0))[0] for h in hosts)
    figures = {
        "hosts": len(hosts),
        "telemetry_sent_in_scenario": sent,
        "bus_entries_in_scenario": entries,
        "republished_in_scenario": entries - sent,
        "bus_entries_total_any_kind": wire.entries,
        "republished_total_any_kind": wire.republished,
        "telemetry_sent_total": sum(len(target[h]) for h in hosts),
        "stored_total": sum(len({seq for seq, *_ in stored[h]} & target[h]) for h in hosts),
        "duplicates": sum(len(v) for v in duplicates.values()),
        "missing": 0,
        "never_sent": sum(len(v) for v in never_sent.values()),
        "gaps": sum(len(v) for v in gaps.values()),
        "gaps_of_killed_agents": killed_gaps,
    }  # fmt: skip
    assert not duplicates, f"telemetry stored more than once: {duplicates}"
    assert not never_sent, f"telemetry stored that no relay put on the bus: {never_sent}"
    assert not gaps, f"telemetry reports missing between stored ones: {gaps}"
    return figures


_OVERLAPS = """
SELECT a.gpu_id, a.rental_id, b.rental_id FROM gpu_allocations a JOIN gpu_allocations b
  ON a.gpu_id = b.gpu_id AND a.id < b.id AND (a.whole OR b.whole)
 AND a.created_at < coalesce(b.released_at, 'infinity') AND b.created_at < coalesce(a.released_at, 'infinity')
"""
_ACTIVE_PER_GPU = """
SELECT g.id, g.rental_id, g.milli_used, count(a.id), coalesce(sum(a.milli), 0), count(a.id) FILTER (WHERE a.whole)
  FROM gpus g LEFT JOIN gpu_allocations a ON a.gpu_id = g.id AND a.released_at IS NULL
 GROUP BY g.id, g.rental_id, g.milli_used
"""
_RENTAL_HOLDS = """
SELECT r.id, r.state, r.gpu_count, r.host_id, r.mig_profile,
       (SELECT count(*) FROM gpu_allocations a WHERE a.rental_id = r.id AND a.released_at IS NULL),
       (SELECT count(*) FROM gpus g WHERE g.rental_id = r.id)
  FROM rentals r
"""


async def check_allocations(db: Database) -> dict[str, Any]:
    """No GPU given twice (now, or at any time), no rental half-allocated; the figures, or ``AssertionError``."""
    async with db.session() as session:
        overlaps = (await session.execute(text(_OVERLAPS))).all()
        per_gpu = (await session.execute(text(_ACTIVE_PER_GPU))).all()
        holds = (await session.execute(text(_RENTAL_HOLDS))).all()
    problems: list[str] = [f"GPU {gpu} held by {a} and {b} at once" for gpu, a, b in overlaps]
    for gpu, rental_id, milli_used, active, milli_sum, whole in per_gpu:
        if whole > 1 or (whole and active > 1) or milli_sum > 1000:
            problems.append(f"GPU {gpu} is given twice: {active} active allocations ({whole} whole, {milli_sum} milli)")
        if milli_used != milli_sum:
            problems.append(f"GPU {gpu} counts {milli_used} milli used but its active allocations hold {milli_sum}")
        if (rental_id is not None) != bool(whole):
            problems.append(f"GPU {gpu} names rental {rental_id} but has {whole} whole allocations")
    active_states = {"starting", "running", "stopping"}
    counted: Counter[str] = Counter()
    for rental_id, state, gpu_count, host_id, mig, allocations, whole_gpus in holds:
        counted[state] += 1
        if state in active_states and (host_id is None or allocations != gpu_count or (mig is None and whole_gpus not in (0, gpu_count))):
            problems.append(f"rental {rental_id} ({state}) is half-allocated: {allocations} allocations, "
                            f"{whole_gpus} GPUs for {gpu_count}")  # fmt: skip
        if state == "pending" and (host_id is not None or allocations):
            problems.append(f"pending rental {rental_id} holds {allocations} allocations on {host_id}")
        if state not in active_states and state != "pending" and (allocations or whole_gpus):
            problems.append(f"{state} rental {rental_id} still holds {allocations} allocations, {whole_gpus} GPUs")
    figures = {"gpus": len(per_gpu), "rentals": dict(sorted(counted.items())), "double_allocated": len(overlaps),
               "problems": len(problems)}  # fmt: skip
    assert not problems, "; ".join(problems[:20])
    return figures


async def check_ledger(db: Database) -> dict[str, Any]:
    """Trial balance, and every rental billed once; the figures, or ``AssertionError``."""
    async with db.session() as session:
        if db.engine.dialect.name == "postgresql":
            # One snapshot for every read: a rating job committing between them would look like a wrong charge.
            await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        trial = await ledger.trial_balance(session)
        rows = (await session.execute(text(
            "SELECT t.rental_id, t.kind, t.key, t.period_start, t.period_end, e.amount FROM ledger_transactions t "
            "JOIN ledger_entries e ON e.transaction_id = t.id JOIN rentals r ON r.id = t.rental_id "
            "WHERE e.account = 'renter' || :colon || r.renter_id || :colon || 'credit' ORDER BY t.rental_id, t.period_start, t.id"
        ), {"colon": ":"})).all()  # fmt: skip
        billed = {r.id: r for r in (await session.scalars(select(Rental).where(Rental.started_at.is_not(None)))).all()}
    postings: dict[str, list[tuple[str, str, datetime | None, datetime | None, Decimal]]] = defaultdict(list)
    for rental_id, kind, key, start, end, amount in rows:
        postings[rental_id].append((kind, key, start, end, Decimal(amount)))
    problems = []
    if not trial["balanced"]:
        problems.append(f"the trial balance does not balance: debits {trial['debits']}, credits {trial['credits']}")
    for rental_id, rental in billed.items():
        mine = postings.get(rental_id, [])
        usage = sorted((p for p in mine if p[0] == "usage"), key=lambda p: (p[2] or EPOCH, p[3] or EPOCH))
        for before, after in itertools.pairwise(usage):
            if before[3] is not None and after[2] is not None and after[2] < before[3]:
                problems.append(f"rental {rental_id}: usage {after[1]} overlaps {before[1]} (billed twice)")
        charged = sum((p[4] for p in mine if p[0] in ("usage", "correction")), Decimal(0))
        expected = ledger.quantize(per_second(rental) * rental.billed_seconds)
        if charged != expected:
            problems.append(f"rental {rental_id}: charged {charged} for {rental.billed_seconds} s, which cost {expected}")
        kinds = Counter(p[0] for p in mine)
        if kinds["minimum"] > 1 or kinds["downtime_credit"] > 1 or (kinds["downtime_credit"] and not kinds["minimum"]):
            problems.append(f"rental {rental_id}: postings {dict(kinds)}")
    figures = {"balanced": trial["balanced"], "debits": trial["debits"], "credits": trial["credits"],
               "rentals_rated": len(billed), "postings": len(rows), "billed_twice": len(problems)}  # fmt: skip
    assert not problems, "; ".join(problems[:20])
    return figures


async def check_logs(db: Database, rental_ids: list[str]) -> dict[str, Any]:
    """Each rental's stored output chunks tile ``[0, end)``: no gap, no overlap; the figures, or ``AssertionError``."""
    async with db.session() as session:
        rows = (await session.execute(
            text("SELECT rental_id, \"offset\", length FROM rental_logs WHERE rental_id = ANY(:ids) ORDER BY rental_id, \"offset\""),
            {"ids": rental_ids},
        )).all()  # fmt: skip
    chunks: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for rental_id, offset, length in rows:
        chunks[rental_id].append((int(offset), int(length)))
    problems = []
    for rental_id in rental_ids:
        end = 0
        for offset, length in chunks.get(rental_id, []):
            if offset != end:
                problems.append(f"rental {rental_id}: {'gap' if offset > end else 'overlap'} at byte {end} (next chunk at {offset})")
            end = max(end, offset + length)
    figures = {"rentals": len(rental_ids), "chunks": len(rows), "bytes": sum(length for _, _, length in rows),
               "gaps_or_overlaps": len(problems)}  # fmt: skip
    assert all(chunks.get(r) for r in rental_ids), f"no output stored for some of {rental_ids}"
    assert not problems, "; ".join(problems[:20])
    return figures
