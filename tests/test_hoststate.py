"""Every transition of the host state machine, allowed and forbidden, against the one table."""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy import select

from master.context import Master
from master.models import Host, HostEvent
from master.services.lifecycle.hosts import (
    HOST_STATES,
    RENTABLE_STATES,
    TRANSITIONS,
    IllegalTransition,
    transition,
)
from tests.factories import create_principal, enroll_host

PAIRS = [(a, b) for a, b in itertools.product(HOST_STATES, HOST_STATES) if a != b]


def test_the_table_names_only_known_states_and_revoked_is_final() -> None:
    assert set(TRANSITIONS) == set(HOST_STATES)
    assert all(targets <= set(HOST_STATES) for targets in TRANSITIONS.values())
    assert TRANSITIONS["revoked"] == frozenset()
    assert all("revoked" in TRANSITIONS[s] for s in HOST_STATES if s != "revoked")
    assert RENTABLE_STATES == {"online", "rented"}
    # A faulty host returns to service only through online (after a health check).
    assert not {"rented"} & TRANSITIONS["faulty"]


async def test_every_pair_is_applied_or_refused_as_the_table_says(master: Master) -> None:
    provider, _ = await create_principal(master, "p", "provider")
    host_id = await enroll_host(master, provider)
    for source, target in PAIRS:
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None
            host.state = source
            before = len((await session.scalars(select(HostEvent).where(HostEvent.host_id == host_id))).all())
            if target in TRANSITIONS[source]:
                assert transition(session, host, target, cause=f"test {source}->{target}", actor="test")
                assert host.state == target
                await session.flush()
                events = (await session.scalars(select(HostEvent).where(HostEvent.host_id == host_id).order_by(HostEvent.id))).all()
                assert len(events) == before + 1
                last = events[-1]
                assert (last.from_state, last.to_state, last.cause, last.actor) == (source, target, f"test {source}->{target}", "test")
            else:
                with pytest.raises(IllegalTransition, match=f"cannot go from {source} to {target}"):
                    transition(session, host, target, cause="test", actor="test")
                assert host.state == source
                await session.flush()
                after = len((await session.scalars(select(HostEvent).where(HostEvent.host_id == host_id))).all())
                assert after == before


async def test_a_transition_to_the_current_state_is_a_no_op(master: Master) -> None:
    provider, _ = await create_principal(master, "p", "provider")
    host_id = await enroll_host(master, provider)
    async with master.db.session() as session:
        host = await session.get(Host, host_id)
        assert host is not None
        assert transition(session, host, host.state, cause="again", actor="test") is False
