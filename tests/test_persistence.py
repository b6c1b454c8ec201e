"""The master's persistence on SQLite and on PostgreSQL: migrations, accounts, enrollment,
ingestion handlers, the host state machine and command tracking."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, text, update

from master.context import Master
from master.db import MIGRATIONS_DIR, head_revisions
from master.models import ApiKey, EnrollmentToken, Gpu, Host, HostEvent, TelemetrySample, version_key
from master.models import Command as CommandRow
from master.services import commands
from master.services.accounts.core import authenticate, create_account
from master.services.hosts import enrollment
from master.services.lifecycle.hosts import IllegalTransition, transition
from master.telemetry import hosts
from shared import protocol
from shared.crypto import generate_private_key, make_csr
from shared.errors import Conflict, EnrollmentError, Unauthorized
from tests.factories import create_principal, envelope, gpu_info, hello, online_host, telemetry


def _csr() -> str:
    return make_csr(generate_private_key(), "h").decode()


class TestSchema:
    async def test_migrations_reach_head_and_rerun_harmlessly(self, master: Master) -> None:
        """The schema is at the newest revision (the one head of the scripts, numbered like every other) and migrating
        again changes nothing."""
        await master.db.migrate()
        async with master.db.session() as session:
            version = await session.scalar(text("SELECT version_num FROM alembic_version"))
        newest = max(path.name.split("_", 1)[0] for path in (MIGRATIONS_DIR / "versions").glob("[0-9]*_*.py"))
        assert head_revisions() == {newest}
        assert version == newest

    async def test_the_migrations_match_the_models(self, master: Master) -> None:
        """Alembic's autogenerate finds nothing to add: migrations and models agree."""
        from alembic.autogenerate import compare_metadata
        from alembic.migration import MigrationContext

        from master.models import Base

        async with master.db.engine.connect() as conn:
            diff = await conn.run_sync(lambda sync: compare_metadata(MigrationContext.configure(sync), Base.metadata))
        assert diff == []

    async def test_timestamps_come_back_as_aware_utc(self, master: Master) -> None:
        """A stored datetime is read back equal and timezone-aware on both databases."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None and host.state_changed_at.tzinfo is not None
            stamp = datetime(2026, 5, 1, 12, 30, 15, 123456, tzinfo=UTC)
            host.last_seen_at = stamp
        async with master.db.session() as session:
            again = await session.get(Host, host_id)
            assert again is not None and again.last_seen_at == stamp


class TestAccounts:
    async def test_keys_are_stored_hashed_and_authenticate(self, master: Master) -> None:
        """The clear key exists only for the caller; the database holds its hash."""
        async with master.db.session() as session:
            account, key = await create_account(session, "alice", "renter")
        async with master.db.session() as session:
            stored = (await session.scalars(select(ApiKey.key_hash))).all()
            assert key not in stored and len(stored) == 1
            who = await authenticate(session, key)
        assert (who.account_id, who.role) == (account.id, "renter")

    async def test_unknown_or_revoked_keys_are_refused(self, master: Master) -> None:
        """A key that was never issued, or was revoked, does not authenticate."""
        async with master.db.session() as session:
            _, key = await create_account(session, "bob", "renter")
        async with master.db.session() as session:
            with pytest.raises(Unauthorized):
                await authenticate(session, key + "x")
            await session.execute(update(ApiKey).values(revoked_at=datetime.now(UTC)))
        async with master.db.session() as session:
            with pytest.raises(Unauthorized):
                await authenticate(session, key)

    async def test_account_names_are_unique(self, master: Master) -> None:
        """Creating a second account with a taken name is a conflict."""
        await create_principal(master, "carol", "provider")
        with pytest.raises(Conflict):
            await create_principal(master, "carol", "renter")


class TestEnrollment:
    async def test_a_token_works_exactly_once(self, master: Master) -> None:
        """The first redemption creates an enrolling host; the second is refused."""
        provider, _ = await create_principal(master, "p", "provider")
        token, _ = await enrollment.create_token(master, provider.account_id)
        result = await enrollment.enroll(master, token, _csr(), hostname="gpu-box")
        assert "BEGIN CERTIFICATE" in result.certificate_pem
        async with master.db.session() as session:
            host = await session.get(Host, result.host_id)
            assert host is not None and (host.state, host.owner_id, host.name) == ("enrolling", provider.account_id, "gpu-box")
            assert token not in (await session.scalars(select(EnrollmentToken.token_hash))).all()
        with pytest.raises(EnrollmentError) as caught:
            await enrollment.enroll(master, token, _csr())
        assert caught.value.code == "token_used"

    async def test_unknown_and_expired_tokens_are_refused(self, master: Master) -> None:
        """Tokens never issued, or past their expiry, enroll nothing."""
        provider, _ = await create_principal(master, "p", "provider")
        with pytest.raises(EnrollmentError) as unknown:
            await enrollment.enroll(master, "gmt_not-a-token", _csr())
        assert unknown.value.code == "token_unknown"
        token, _ = await enrollment.create_token(master, provider.account_id)
        async with master.db.session() as session:
            await session.execute(update(EnrollmentToken).values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        with pytest.raises(EnrollmentError) as expired:
            await enrollment.enroll(master, token, _csr())
        assert expired.value.code == "token_expired"
        async with master.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(Host)) == 0

    async def test_racing_redemptions_of_one_token_create_one_host(self, master: Master) -> None:
        """Of several agents racing with the same token, exactly one gets a certificate."""
        provider, _ = await create_principal(master, "p", "provider")
        token, _ = await enrollment.create_token(master, provider.account_id)
        results = await asyncio.gather(*(enrollment.enroll(master, token, _csr()) for _ in range(4)), return_exceptions=True)
        assert sum(not isinstance(r, BaseException) for r in results) == 1
        assert all(isinstance(r, EnrollmentError | Exception) for r in results if isinstance(r, BaseException))
        async with master.db.session() as session:
            assert await session.scalar(select(func.count()).select_from(Host)) == 1


class TestIngestion:
    async def test_hello_registers_gpus_and_brings_the_host_online(self, master: Master) -> None:
        """After hello the host is online with its GPUs, and the transition is recorded with its cause."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0), gpu_info(1, name="NVIDIA A100-SXM4-80GB", memory=81920)])
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            gpus = (await session.scalars(select(Gpu).where(Gpu.host_id == host_id).order_by(Gpu.index))).all()
            events = (await session.scalars(select(HostEvent).where(HostEvent.host_id == host_id).order_by(HostEvent.id))).all()
        assert host is not None and host.state == "online" and host.relay_id == "relay-t"
        assert [(g.index, g.memory_total_mib) for g in gpus] == [(0, 24564), (1, 81920)]
        assert [(e.from_state, e.to_state) for e in events] == [(None, "enrolling"), ("enrolling", "online")]
        assert "hello" in events[-1].cause

    async def test_a_gpu_that_vanishes_is_marked_absent(self, master: Master) -> None:
        """A later hello without a GPU marks that GPU not present (and unrentable)."""
        provider, _ = await create_principal(master, "p", "provider")
        gpus = [gpu_info(0), gpu_info(1)]
        host_id = await online_host(master, provider, gpus)
        async with master.db.session() as session:
            await hosts.handle_hello(session, envelope(hello(host_id, 5, gpus[:1])))
        async with master.db.session() as session:
            present = dict((await session.execute(select(Gpu.uuid, Gpu.present).where(Gpu.host_id == host_id))).all())
        assert present == {gpus[0].uuid: True, gpus[1].uuid: False}

    async def test_telemetry_is_stored_once_per_sequence_number(self, master: Master) -> None:
        """Redelivered telemetry is recognised by (host, seq) and not stored twice."""
        provider, _ = await create_principal(master, "p", "provider")
        gpus = [gpu_info(0)]
        host_id = await online_host(master, provider, gpus)
        outcomes = []
        for seq in (3, 1, 3, 2, 1):
            async with master.db.session() as session:
                outcomes.append(await hosts.handle_telemetry(session, envelope(telemetry(host_id, seq, gpus))))
        assert outcomes == [True, True, False, True, False]
        async with master.db.session() as session:
            seqs = (await session.scalars(select(TelemetrySample.seq).where(TelemetrySample.host_id == host_id).order_by(TelemetrySample.seq))).all()
            host = await session.get(Host, host_id)
        assert list(seqs) == [1, 2, 3]
        assert host is not None and host.latest_telemetry_seq == 3  # out-of-order arrivals do not roll it back

    async def test_unknown_hosts_are_refused(self, master: Master) -> None:
        """Messages from a host id the registry does not hold raise UnknownHost."""
        async with master.db.session() as session:
            with pytest.raises(hosts.UnknownHost):
                await hosts.handle_telemetry(session, envelope(telemetry("h-nobody", 1, [gpu_info(0)])))


class TestHostStateMachine:
    async def test_silent_hosts_go_offline_and_come_back(self, master: Master) -> None:
        """A host missing its heartbeats goes offline; its next heartbeat brings it back online."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        async with master.db.session() as session:
            gone = await hosts.mark_silent_hosts_offline(session, now=datetime.now(UTC) + timedelta(seconds=31), deadline=timedelta(seconds=30))
        assert gone == [host_id]
        async with master.db.session() as session:
            assert await hosts.mark_silent_hosts_offline(session, now=datetime.now(UTC), deadline=timedelta(seconds=30)) == []
            beat = protocol.Heartbeat(host_id=host_id, seq=9, ts=datetime.now(UTC), body=protocol.HeartbeatBody(uptime_s=5))
            await hosts.handle_heartbeat(session, envelope(beat))
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            causes = (await session.scalars(select(HostEvent.cause).where(HostEvent.host_id == host_id).order_by(HostEvent.id))).all()
        assert host is not None and host.state == "online"
        assert any("no heartbeat" in c for c in causes) and causes[-1] == "heartbeat resumed"

    async def test_illegal_transitions_are_refused_and_not_applied(self, master: Master) -> None:
        """enrolling → rented is not in the table: refused, state unchanged, nothing recorded."""
        provider, _ = await create_principal(master, "p", "provider")
        token, _ = await enrollment.create_token(master, provider.account_id)
        host_id = (await enrollment.enroll(master, token, _csr())).host_id
        async with master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None
            with pytest.raises(IllegalTransition):
                transition(session, host, "rented", cause="test", actor="test")
            assert host.state == "enrolling"
            count = await session.scalar(select(func.count()).select_from(HostEvent).where(HostEvent.host_id == host_id))
        assert count == 1


class TestCommands:
    async def test_commands_go_to_the_hosts_relay_and_are_resent_until_answered(self, master: Master) -> None:
        """An open command is published on its relay's stream, marked sent, and due again after the retry interval."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        async with master.db.session() as session:
            command = commands.new_command(session, host_id=host_id, command=protocol.StopWorkload(rental_id="r-x"), rental_id=None)
            command_id = command.id
        assert await commands.publish(master, [command_id]) == 1
        stream = protocol.commands_stream("relay-t")
        await master.bus.ensure_group(stream, "check")
        delivered = await master.bus.read(stream, "check", "c", block=None)
        assert [protocol.decode_command_delivery(m.payload).command.body.command_id for m in delivered] == [command_id]
        async with master.db.session() as session:
            row = await session.get(CommandRow, command_id)
            assert row is not None and (row.state, row.send_count) == ("sent", 1) and row.last_sent_at is not None
            sent_at = row.last_sent_at
        # Measured from when it was sent, not from the wall clock now: a loaded machine may take longer than the retry
        # interval between the send and the check.
        retry = timedelta(seconds=master.settings.command_retry_interval)
        assert await commands.due_for_resend(master, sent_at + retry - timedelta(milliseconds=1)) == []
        assert await commands.due_for_resend(master, sent_at + retry + timedelta(seconds=1)) == [command_id]

    async def test_a_result_is_recorded_once(self, master: Master) -> None:
        """The first result completes the command; a duplicate report changes nothing."""
        provider, _ = await create_principal(master, "p", "provider")
        host_id = await online_host(master, provider, [gpu_info(0)])
        async with master.db.session() as session:
            row = commands.new_command(session, host_id=host_id, command=protocol.StopWorkload(rental_id="r-y"), rental_id=None)
            first = datetime.now(UTC)
            assert commands.complete(row, ok=True, result={"n": 1}, at=first)
            assert not commands.complete(row, ok=False, result={"n": 2}, at=first + timedelta(seconds=1))
            assert (row.state, row.result) == ("succeeded", {"n": 1})


@pytest.mark.parametrize(
    ("text", "key"),
    [("8.9", 8009), ("12.4", 12004), ("9", 9000), ("12.10.3", 12010), (" 7.5 ", 7005), ("", None), ("eight", None),
     ("8.x", None), (None, None), (8.9, None), ("1234567.0", None)],
)  # fmt: skip
def test_version_keys_order_like_versions(text: object, key: int | None) -> None:
    """The GPU rows' version keys (what the offer search compares) read the versions the agent reports."""
    assert version_key(text) == key
