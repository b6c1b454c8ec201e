"""What the fleet knows of the network between its hosts, and a cluster's bounds on it (docs/clusters.md, "Network bounds").

Each member of a cluster measures its peers through the private network once it is made
(``cluster_network``); every measured pair of members is a pair of hosts, and its latest figures
go into ``host_links`` (``record``): round trip, throughput, loss where the agent measures it, or
unreachable. A cluster's ``network`` bounds (``NetworkBounds``) are then honoured at placement
(``cluster_placement``, ``cluster_policy``): a pair of hosts measured outside them is never put in
one cluster, a pair never measured (or measured longer ago than ``host_link_max_age_s``) is allowed.
After creation the cluster's own figures are checked against the same bounds (``breaches``).

No I/O but the database; imports ``master.scheduler`` for the gang search's ``Rtt`` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import HostLink
from master.scheduler.gang import Rtt

BOUNDS: Final = ("max_latency_ms", "max_loss_pct", "min_mbit_s")
UNREACHABLE: Final = "unreachable"  # a breach's ``bound`` when the pair could not reach each other at all
# The gang search's limit when bounds other than latency are given, and the round trip it ranks a pair never
# measured at without a latency bound: past any real round trip, so measured pairs that keep the bounds rank first.
UNBOUNDED_MS: Final = 1e9
RTT_STEP_MS: Final = 0.1  # measured round trips closer than this rank as equal at placement (the placer decides)


def pair(host_a: str, host_b: str) -> tuple[str, str]:
    """The pair's key in ``host_links``: the smaller id first. Host ids are ``h-`` and 16 hex digits, so
    PostgreSQL's collation orders them as Python does (the table's check constraint)."""
    return (host_a, host_b) if host_a < host_b else (host_b, host_a)


@dataclass(frozen=True)
class Figures:
    """One pair's measurement: ``reachable`` false (with ``error``) when the tunnel carried nothing."""

    reachable: bool = True
    rtt_ms: float | None = None
    mbit_s: float | None = None
    loss_pct: float | None = None
    error: str | None = None
    path: str | None = None  # direct | relay, as the agent said

    @classmethod
    def of_pair(cls, measured: Mapping[str, Any]) -> Figures:
        """From a pair of ``private_network["pairs"]`` (``{a, b, rtt_ms, mbit_s, loss_pct, error}``)."""
        if measured.get("error"):
            return cls(reachable=False, error=str(measured["error"]))
        return cls(rtt_ms=measured.get("rtt_ms"), mbit_s=measured.get("mbit_s"), loss_pct=measured.get("loss_pct"))


@dataclass(frozen=True)
class Breach:
    """One bound a pair was measured outside: ``bound`` is one of ``BOUNDS`` or ``UNREACHABLE``."""

    bound: str
    measured: float | None
    limit: float | None
    error: str | None = None

    def text(self) -> str:
        if self.bound == "max_latency_ms":
            return f"{_num(self.measured)} ms round trip over the {_num(self.limit)} ms bound"
        if self.bound == "max_loss_pct":
            return f"{_num(self.measured)} % loss over the {_num(self.limit)} % bound"
        if self.bound == "min_mbit_s":
            return f"{_num(self.measured)} Mbit/s under the {_num(self.limit)} Mbit/s bound"
        return f"unreachable ({self.error})" if self.error else "unreachable"

    def view(self) -> dict[str, Any]:
        return {"bound": self.bound, "measured": self.measured, "limit": self.limit}


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class NetworkBounds:
    """A cluster's bounds between any two of its nodes (``ClusterNetworkBody``); none set: no bounds."""

    max_latency_ms: float | None = None
    max_loss_pct: float | None = None
    min_mbit_s: float | None = None

    @classmethod
    def of(cls, network: Mapping[str, Any] | None) -> NetworkBounds:
        """From a cluster's ``network`` as stored (keys absent or null: not bounded)."""
        network = network or {}
        return cls(**{name: float(network[name]) for name in BOUNDS if network.get(name) is not None})

    def __bool__(self) -> bool:
        return any(getattr(self, name) is not None for name in BOUNDS)

    def text(self) -> str:
        """``round trip ≤ 2 ms, loss ≤ 1 %, ≥ 1000 Mbit/s``."""
        parts = []
        if self.max_latency_ms is not None:
            parts.append(f"round trip ≤ {_num(self.max_latency_ms)} ms")
        if self.max_loss_pct is not None:
            parts.append(f"loss ≤ {_num(self.max_loss_pct)} %")
        if self.min_mbit_s is not None:
            parts.append(f"≥ {_num(self.min_mbit_s)} Mbit/s")
        return ", ".join(parts)

    def breaches(self, figures: Figures) -> list[Breach]:
        """The bounds ``figures`` are outside of; a figure not measured keeps its bound, and an unreachable pair
        keeps none (without bounds nothing is a breach)."""
        if not self:
            return []
        if not figures.reachable:
            return [Breach(UNREACHABLE, None, None, figures.error)]
        found = []
        if self.max_latency_ms is not None and figures.rtt_ms is not None and figures.rtt_ms > self.max_latency_ms:
            found.append(Breach("max_latency_ms", figures.rtt_ms, self.max_latency_ms))
        if self.max_loss_pct is not None and figures.loss_pct is not None and figures.loss_pct > self.max_loss_pct:
            found.append(Breach("max_loss_pct", figures.loss_pct, self.max_loss_pct))
        if self.min_mbit_s is not None and figures.mbit_s is not None and figures.mbit_s < self.min_mbit_s:
            found.append(Breach("min_mbit_s", figures.mbit_s, self.min_mbit_s))
        return found


async def record(
    session: AsyncSession, measured: Mapping[tuple[str, str], Figures], *, cluster_id: str | None, at: datetime
) -> None:
    """Upsert each measured pair (keys from ``pair``): the latest figures win, an older answer applied late changes nothing."""
    if not measured:
        return
    rows = [
        {"host_a": a, "host_b": b, "reachable": f.reachable, "rtt_ms": f.rtt_ms if f.reachable else None,
         "mbit_s": f.mbit_s if f.reachable else None, "loss_pct": f.loss_pct if f.reachable else None,
         "error": (f.error or "")[:300] or None, "path": f.path, "measured_at": at, "cluster_id": cluster_id}
        for (a, b), f in sorted(measured.items())
    ]  # fmt: skip
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    statement = insert(HostLink).values(rows)
    updated = ("reachable", "rtt_ms", "mbit_s", "loss_pct", "error", "path", "measured_at", "cluster_id")
    await session.execute(
        statement.on_conflict_do_update(
            index_elements=["host_a", "host_b"],
            set_={name: statement.excluded[name] for name in updated},
            where=HostLink.measured_at <= statement.excluded.measured_at,
        )
    )


async def among(session: AsyncSession, host_ids: Collection[str], *, since: datetime) -> dict[tuple[str, str], Figures]:
    """The links measured since ``since`` between any two of ``host_ids``, in one query (one bound parameter per host:
    the pairs are filtered on their first host in SQL, on the second here)."""
    if len(host_ids) < 2:
        return {}
    wanted = set(host_ids)
    rows = await session.execute(
        select(HostLink.host_a, HostLink.host_b, HostLink.reachable, HostLink.rtt_ms, HostLink.mbit_s, HostLink.loss_pct,
               HostLink.error).where(HostLink.host_a.in_(sorted(wanted)), HostLink.measured_at >= since)
    )  # fmt: skip
    return {(a, b): Figures(reachable, rtt, mbit, loss, error) for a, b, reachable, rtt, mbit, loss, error in rows if b in wanted}


async def breaching_peers(session: AsyncSession, host_ids: Iterable[str], bounds: NetworkBounds, *, since: datetime) -> set[str]:
    """Hosts measured (since ``since``) outside ``bounds`` with any of ``host_ids``: the hosts a cluster on those may not add."""
    hosts = set(host_ids)
    if not bounds or not hosts:
        return set()
    rows = await session.execute(
        select(HostLink.host_a, HostLink.host_b, HostLink.reachable, HostLink.rtt_ms, HostLink.mbit_s, HostLink.loss_pct,
               HostLink.error).where(or_(HostLink.host_a.in_(sorted(hosts)), HostLink.host_b.in_(sorted(hosts))),
                                     HostLink.measured_at >= since, _may_breach(bounds))
    )  # fmt: skip
    peers: set[str] = set()
    for a, b, reachable, rtt, mbit, loss, error in rows:
        if bounds.breaches(Figures(reachable, rtt, mbit, loss, error)):
            peers |= {a, b}
    return peers - hosts


def _may_breach(bounds: NetworkBounds) -> Any:
    """The rows that may be outside ``bounds`` (``NetworkBounds.breaches`` decides)."""
    conditions: list[Any] = [HostLink.reachable.is_(False)]
    if bounds.max_latency_ms is not None:
        conditions.append(HostLink.rtt_ms > bounds.max_latency_ms)
    if bounds.max_loss_pct is not None:
        conditions.append(HostLink.loss_pct > bounds.max_loss_pct)
    if bounds.min_mbit_s is not None:
        conditions.append(HostLink.mbit_s < bounds.min_mbit_s)
    return or_(*conditions)


def placement_rtt(
    links: Mapping[tuple[str, str], Figures], bounds: NetworkBounds, host_of: Callable[[str], str], *, rtt_step_ms: float = RTT_STEP_MS
) -> tuple[Rtt | None, float | None]:
    """``rtt_ms`` and ``max_rtt_ms`` for ``gang.place_gang`` (its node ids → hosts by ``host_of``), so that the gang
    search honours ``bounds`` without knowing them:

    * a pair measured outside the bounds (or unreachable): ``None`` — under a limit, never in one set;
    * a pair measured within them: its round trip, rounded up to ``rtt_step_ms`` (the smallest worst round trip still
      wins; pairs closer than that tie, and the placer decides among them);
    * a pair never measured (or with no round trip): the latency bound, or ``UNBOUNDED_MS`` — allowed, ranked after
      every measured pair that keeps the bounds;
    * ``max_rtt_ms``: the latency bound, ``UNBOUNDED_MS`` with other bounds only, else no limit (an unreachable pair
      then ranks worst of all, but is not refused).

    ``(None, None)`` when no link is known among the candidates: the gang search skips its RTT work entirely. Each link
    is judged once here; a look-up is then two ``host_of`` calls and one dict read.
    """
    if not links:
        return None, None
    limit = bounds.max_latency_ms if bounds.max_latency_ms is not None else UNBOUNDED_MS
    unmeasured = limit
    values: dict[tuple[str, str], float | None] = {}
    for key, figures in links.items():
        if not figures.reachable or bounds.breaches(figures):
            values[key] = None
        elif figures.rtt_ms is None:
            values[key] = unmeasured
        else:
            values[key] = min(math.ceil(figures.rtt_ms / rtt_step_ms) * rtt_step_ms, limit)

    def rtt_ms(node_a: str, node_b: str) -> float | None:
        host_a, host_b = host_of(node_a), host_of(node_b)
        return values.get((host_a, host_b) if host_a < host_b else (host_b, host_a), unmeasured)

    return rtt_ms, (limit if bounds else None)
