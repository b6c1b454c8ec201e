"""GPU verification's flow on the master (docs/verification.md, "The flow"), on SQLite and PostgreSQL: a host's
agent is played by this test with the challenge's own arithmetic (``shared.verification.compute``, numpy on the
CPU): honest, or wrong, too slow (the master's clock moved past the deadline), short of memory, replaying another
challenge's commitment. Each verdict's consequences: the GPU's figures, the listing's ``verified``, the host listed
or unlisted with the reason, the provider's alert, reliability. The idle pass never touches a rented host, a
rental's start cancels a running challenge, and the admin's on-demand challenge is the admin's alone.

The agent's side (the challenge in a real container) is tests/test_verification_agent.py.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select

from master.models import Command, Gpu, GpuVerification, Host, HostListing
from master.services import alerts, hosts
from master.services.market import reliability
from master.telemetry import hosts as telemetry_hosts
from shared import protocol
from shared.verification import compute
from tests.apiclient import RTX, Api
from tests.factories import command_result, create_principal, enroll_host, envelope, gpu_info, hello
from tests.helpers import ManualClock

H100 = "NVIDIA H100 80GB HBM3"


class Agent:
    """The host's side of the challenge, computed here: ``behaviour`` honest, wrong, memory_short or replay."""

    def __init__(self, api: Api, host_id: str, *, behaviour: str = "honest") -> None:
        self.api = api
        self.host_id = host_id
        self.behaviour = behaviour
        self.seq = 1000
        self.states: dict[str, compute.HostState] = {}
        self.replayed: dict[str, Any] | None = None  # another challenge's commitment, for "replay"

    async def open_command(self, kind: str) -> Command:
        async with self.api.master.db.session() as session:
            row = await session.scalar(
                select(Command).where(Command.host_id == self.host_id, Command.kind == kind, Command.state.in_(("pending", "sent")))
                .order_by(Command.created_at.desc()).limit(1)
            )  # fmt: skip
        assert row is not None, f"no open {kind} command for {self.host_id}"
        return row

    async def answer(self, command: Command, *, ok: bool = True, detail: str = "", data: dict[str, Any] | None = None) -> None:
        self.seq += 1
        # An answer takes time: a challenge issued after it is made later on the master's clock than this one, so the
        # rows sort in the order they were made (a tie sorted them either way on PostgreSQL under load).
        if isinstance(self.api.master.clock, ManualClock):
            self.api.master.clock.advance(0.001)
        message = command_result(self.host_id, self.seq, command.id, ok=ok, detail=detail, data=data)
        async with self.api.master.db.session() as session:
            await telemetry_hosts.handle_command_result(
                session, envelope(message), settings=self.api.master.settings, now=self.api.master.clock.now()
            )

    def commitment(self, challenge: dict[str, Any]) -> dict[str, Any]:
        seed = bytes.fromhex(challenge["seed"])
        gpus: dict[str, Any] = {}
        for gpu in challenge["gpus"]:
            uuid, n = gpu["uuid"], gpu["n"]
            if self.behaviour == "memory_short":
                gpus[uuid] = {"reason": "memory_short", "message": f"the device could not hold A, B and C at n = {n}"}
                continue
            gpu_seed = compute.gpu_seed(seed if self.behaviour != "wrong" else bytes(32), uuid)  # wrong: another A and B
            state = compute.multiply_and_commit(gpu_seed, n, challenge["challenge_id"], uuid=uuid)
            self.states[uuid] = state
            gpus[uuid] = {"root": state.root.hex()}
        if self.behaviour == "replay" and self.replayed is not None:
            return self.replayed
        return {"challenge_id": challenge["challenge_id"], "gpus": gpus}

    async def commit(self) -> dict[str, Any]:
        command = await self.open_command("start_challenge")
        challenge = command.args["challenge"]
        commitment = self.commitment(challenge)
        await self.answer(command, data={"challenge_id": challenge["challenge_id"], "commitment": commitment})
        return commitment

    async def open(self) -> None:
        command = await self.open_command("reveal_challenge")
        reveal = command.args["reveal"]
        openings = {"gpus": {uuid: compute.open_chunks(self.states[uuid], asked) for uuid, asked in reveal["gpus"].items()}}
        await self.answer(command, data={"challenge_id": command.args["challenge_id"], "openings": openings})


async def new_host(api: Api, count: int = 2, *, name: str = H100, memory: int = 81559) -> tuple[str, list[str]]:
    """An enrolled host whose agent said hello, as the master applies it: with ``verification_required`` it stays
    enrolling with its enrollment challenge issued."""
    gpus = [gpu_info(i, name=name, memory=memory) for i in range(count)]
    host_id = await enroll_host(api.master, api.provider)
    async with api.master.db.session() as session:
        await telemetry_hosts.handle_hello(session, envelope(hello(host_id, 0, gpus)), settings=api.master.settings, now=api.master.clock.now())
    return host_id, [g.uuid for g in gpus]


async def listed(api: Api, host_id: str) -> None:
    status, body = await api.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": "2.5"})
    assert status == 201, body


async def state_of(api: Api, host_id: str) -> tuple[str, bool, list[GpuVerification]]:
    async with api.master.db.session() as session:
        host = await session.get(Host, host_id)
        listing = await session.get(HostListing, host_id)
        rows = (await session.scalars(select(GpuVerification).where(GpuVerification.host_id == host_id)
                                      .order_by(GpuVerification.created_at))).all()  # fmt: skip
        assert host is not None
        return host.state, bool(listing is not None and listing.verified), list(rows)


def clock(api: Api) -> ManualClock:
    assert isinstance(api.master.clock, ManualClock)
    return api.master.clock


ADMIN_KEYS: dict[int, str] = {}  # the admin's key of each test's Api


@pytest.fixture
async def verifying(api: Api) -> AsyncIterator[Api]:
    """The ``api`` with verification required, the master's clock moved by hand, and an admin's key."""
    api.master.settings.verification_required = True
    api.master.clock = ManualClock()
    _, ADMIN_KEYS[id(api)] = await create_principal(api.master, "admin-1", "admin")
    yield api
    del ADMIN_KEYS[id(api)]


class TestEnrollment:
    async def test_an_honest_host_passes_then_is_listed_and_verified(self, verifying: Api) -> None:
        api = verifying
        host_id, uuids = await new_host(api)
        state, _, [challenge] = await state_of(api, host_id)
        assert state == "enrolling" and challenge.trigger == "enrollment" and challenge.state == "issued"
        assert sorted(challenge.gpu_uuids) == sorted(uuids)
        await listed(api, host_id)
        agent = Agent(api, host_id)
        clock(api).advance(2)
        await agent.commit()
        assert (await state_of(api, host_id))[2][0].state == "revealed"
        await agent.open()
        state, verified, [challenge] = await state_of(api, host_id)
        assert (state, verified, challenge.state, challenge.reason_code) == ("online", True, "passed", "passed")
        async with api.master.db.session() as session:
            gpus = (await session.scalars(select(Gpu).where(Gpu.host_id == host_id))).all()
        assert {g.verification_outcome for g in gpus} == {"passed"}
        assert all(g.verified_at == api.master.clock.now() and g.verified_vram_mib and g.verified_tflops for g in gpus)
        # Figures in the claimed model's units: the memory proven is at least 90 % of the claimed 80 GB.
        assert all((g.verified_vram_mib or 0) >= 0.9 * 81559 * 0.99 for g in gpus)
        status, body = await api.as_provider("GET", f"/hosts/{host_id}/verifications")
        assert status == 200 and body["items"][0]["state"] == "passed" and "seed" not in body["items"][0]

    async def test_without_verification_required_a_host_is_listed_at_its_hello(self, api: Api) -> None:
        host_id, _ = await new_host(api)
        state, _, rows = await state_of(api, host_id)
        assert (state, rows) == ("online", [])


def assert_unlisted(state: str, verified: bool, challenge: GpuVerification, reason: str) -> None:
    assert (state, verified, challenge.state, challenge.reason_code) == ("faulty", False, "failed", reason), challenge.reason


class TestDishonestHosts:
    @pytest.mark.parametrize("behaviour", ["wrong", "memory_short"])
    async def test_caught_with_its_reason_unlisted_and_alerted(self, verifying: Api, behaviour: str) -> None:
        api = verifying
        host_id, _ = await new_host(api)
        await listed(api, host_id)
        agent = Agent(api, host_id, behaviour=behaviour)
        await agent.commit()
        if behaviour == "wrong":
            await agent.open()
        state, verified, [challenge] = await state_of(api, host_id)
        assert_unlisted(state, verified, challenge, "wrong_result" if behaviour == "wrong" else "memory_short")
        await alerts.evaluate(api.master)
        status, body = await api.as_provider("GET", "/alerts", params={"rule": "gpu_verification"})
        assert status == 200 and [a["host_id"] for a in body["items"]] == [host_id], body
        assert challenge.reason_code in body["items"][0]["summary"]

    async def test_too_slow_by_the_masters_clock(self, verifying: Api) -> None:
        api = verifying
        host_id, _ = await new_host(api)
        _, _, [issued] = await state_of(api, host_id)
        assert issued.deadline_at is not None and issued.sent_at is not None
        clock(api).advance((issued.deadline_at - issued.sent_at).total_seconds() + 1)
        await Agent(api, host_id).commit()
        state, verified, [challenge] = await state_of(api, host_id)
        assert_unlisted(state, verified, challenge, "too_slow")
        async with api.master.db.session() as session:
            reveals = (await session.scalars(select(Command).where(Command.host_id == host_id, Command.kind == "reveal_challenge"))).all()
        assert reveals == []

    async def test_a_commitment_from_another_challenge_is_refused(self, verifying: Api) -> None:
        """The host replays an honest commitment of its earlier challenge: refused, never opened."""
        api = verifying
        host_id, _ = await new_host(api)
        honest = Agent(api, host_id)
        earlier = await honest.commit()
        await honest.open()
        await request_verify(api, host_id)
        replaying = Agent(api, host_id, behaviour="replay")
        replaying.replayed = earlier
        await replaying.commit()
        state, verified, [_, challenge] = await state_of(api, host_id)
        assert_unlisted(state, verified, challenge, "replayed_commitment")

    async def test_a_passing_challenge_lists_the_host_again_and_repeated_failures_count(self, verifying: Api) -> None:
        api = verifying
        api.master.settings.verification_failures = 2
        host_id, _ = await new_host(api)
        await Agent(api, host_id, behaviour="memory_short").commit()  # the enrollment challenge: the first failure
        clock(api).advance(1)
        await request_verify(api, host_id)  # an admin asks again while the host is unlisted
        await Agent(api, host_id, behaviour="memory_short").commit()  # the second in a row
        assert [r.state for r in (await state_of(api, host_id))[2]] == ["failed", "failed"]
        async with api.master.db.session() as session:
            histories = await reliability.load_histories(session, [host_id], since=api.master.clock.now() - timedelta(days=1),
                                                         now=api.master.clock.now() + timedelta(seconds=1))  # fmt: skip
        assert histories[host_id].failed_verifications == 1  # the second failure in a row counts, the first does not
        await request_verify(api, host_id)
        honest = Agent(api, host_id)
        await honest.commit()
        await honest.open()
        state, _, rows = await state_of(api, host_id)
        assert state == "online" and rows[-1].state == "passed"
        async with api.master.db.session() as session:
            assert {g.verification_failures for g in (await session.scalars(select(Gpu).where(Gpu.host_id == host_id))).all()} == {0}


async def request_verify(api: Api, host_id: str) -> dict[str, Any]:
    status, body = await api.call("POST", f"/admin/hosts/{host_id}/verify", ADMIN_KEYS[id(api)])
    assert status == 202 and isinstance(body, dict), body
    return body


class TestIdleAndRentals:
    async def test_the_idle_pass_challenges_idle_hosts_never_rented_ones(self, verifying: Api) -> None:
        api = verifying
        idle_id, _ = await new_host(api, 1)
        honest = Agent(api, idle_id)
        await honest.commit()
        await honest.open()
        rented_id, _ = await new_host(api, 1, name=RTX, memory=24564)
        rented_agent = Agent(api, rented_id)
        await rented_agent.commit()
        await rented_agent.open()
        status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "gpu_model": "RTX 4090"})
        assert status == 201, rental
        api.master.settings.verification_recheck_h = api.master.settings.verification_interval / 3600  # every pass picks
        assert await hosts.verification_pass(api.master, rng=random.Random(1)) == 1
        _, _, idle_rows = await state_of(api, idle_id)
        _, _, rented_rows = await state_of(api, rented_id)
        assert [r.trigger for r in idle_rows] == ["enrollment", "idle"] and [r.trigger for r in rented_rows] == ["enrollment"]
        # The idle challenge's command is on its way: a second pass issues no other while it is open.
        assert await hosts.verification_pass(api.master, rng=random.Random(1)) == 0

    async def test_a_rental_cancels_a_running_challenge(self, verifying: Api) -> None:
        """The agent stops the challenge when a rental's start needs its GPUs: cancelled, no failure, still listed."""
        api = verifying
        host_id, _ = await new_host(api, 1)
        honest = Agent(api, host_id)
        await honest.commit()
        await honest.open()
        await request_verify(api, host_id)
        command = await honest.open_command("start_challenge")
        await honest.answer(command, ok=False, detail="challenge cancelled: rental r-1 needs the GPU", data={"code": "challenge_cancelled"})
        state, verified, rows = await state_of(api, host_id)
        assert (state, verified, rows[-1].state, rows[-1].reason_code) == ("online", False, "cancelled", "cancelled")

    async def test_no_answer_fails_after_the_grace(self, verifying: Api) -> None:
        api = verifying
        host_id, _ = await new_host(api, 1)
        _, _, [issued] = await state_of(api, host_id)
        assert issued.deadline_at is not None
        clock(api).advance((issued.deadline_at - api.master.clock.now()).total_seconds() + api.master.settings.verification_answer_grace_s + 1)
        await hosts.verification_pass(api.master, rng=random.Random(1))
        state, verified, [challenge] = await state_of(api, host_id)
        assert_unlisted(state, verified, challenge, "no_answer")


class TestAdmin:
    async def test_on_demand_is_the_admins_alone(self, verifying: Api) -> None:
        api = verifying
        api.master.settings.verification_required = False
        host_id, _ = await new_host(api, 1)
        status, body = await api.as_provider("POST", f"/admin/hosts/{host_id}/verify")
        assert status == 403, body
        body = await request_verify(api, host_id)
        assert body["trigger"] == "admin" and body["state"] == "issued" and "seed" not in body
        again = await request_verify(api, host_id)
        assert again["id"] == body["id"], again  # the open one, not a second
        status, refused = await api.as_renter("GET", f"/hosts/{host_id}/verifications")
        assert status == 403, refused
        async with api.master.db.session() as session:
            starts = (await session.scalars(select(Command).where(Command.host_id == host_id, Command.kind == "start_challenge"))).all()
        assert len(starts) == 1
        # What the master stored is what the agent accepts.
        command = protocol.decode_command(protocol.CommandBody(command_id=starts[0].id, kind=starts[0].kind, args=starts[0].args))
        assert isinstance(command, protocol.StartChallenge) and command.challenge_id == body["id"]
