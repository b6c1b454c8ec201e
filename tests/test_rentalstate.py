"""Every transition of the rental state machine, allowed and forbidden, against the one table."""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy import select

from master.context import Master
from master.models import Rental, RentalEvent
from master.services.lifecycle.rentals import (
    ACTIVE_STATES,
    FINAL_STATES,
    RENTAL_STATES,
    TRANSITIONS,
    IllegalRentalTransition,
    RentalState,
    advance,
    transition,
)
from shared.ids import new_id
from tests.factories import create_principal

PAIRS = [(a, b) for a, b in itertools.product(RentalState, RentalState) if a != b]


def test_the_table_names_every_state_and_the_ended_ones_are_final() -> None:
    assert set(TRANSITIONS) == set(RentalState)
    assert RENTAL_STATES == ("pending", "starting", "running", "stopping", "stopped", "failed", "preempted")
    assert all(TRANSITIONS[state] == frozenset() for state in FINAL_STATES)
    assert set(ACTIVE_STATES) | set(FINAL_STATES) == set(RentalState)
    # A stopping rental can no longer be preempted: its GPUs are on their way back already.
    assert RentalState.PREEMPTED not in TRANSITIONS[RentalState.STOPPING]


async def _rental(master: Master) -> str:
    renter, _ = await create_principal(master, "r", "renter")
    async with master.db.session() as session:
        rental = Rental(id=new_id("r"), renter_id=renter.account_id, gpu_count=1, state=RentalState.PENDING.value)
        session.add(rental)
    return rental.id


async def _events(master: Master, rental_id: str) -> int:
    async with master.db.session() as session:
        return len((await session.scalars(select(RentalEvent).where(RentalEvent.rental_id == rental_id))).all())


async def test_every_pair_is_applied_or_refused_as_the_table_says(master: Master) -> None:
    rental_id = await _rental(master)
    for source, target in PAIRS:
        before = await _events(master, rental_id)
        async with master.db.session() as session:
            rental = await session.get(Rental, rental_id)
            assert rental is not None
            rental.state = source.value
            if target in TRANSITIONS[source]:
                assert transition(session, rental, target, f"test {source}->{target}")
                assert rental.state == target and type(rental.state) is str  # the column keeps plain strings
            else:
                with pytest.raises(IllegalRentalTransition, match=f"cannot go from {source} to {target}"):
                    transition(session, rental, target, "test")
                assert advance(session, rental, target, "test") is False  # the lenient path skips it
                assert rental.state == source
        assert await _events(master, rental_id) == before + (target in TRANSITIONS[source])


async def test_a_transition_to_the_current_state_is_a_no_op(master: Master) -> None:
    rental_id = await _rental(master)
    async with master.db.session() as session:
        rental = await session.get(Rental, rental_id)
        assert rental is not None
        assert transition(session, rental, RentalState.PENDING, "again") is False
        assert advance(session, rental, RentalState.PENDING, "again") is False
    assert await _events(master, rental_id) == 0
