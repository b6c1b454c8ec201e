"""The agent's side of volumes (docs/volumes.md), for real: loop-mounted ext4 filesystems made, filled to ENOSPC,
mounted again after a simulated restart and deleted by ``agent.volumes.VolumeStore`` as root; and a volume's whole
round trip through a real agent behind a real relay, its results applied by the master on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
from pathlib import Path

import pytest
from sqlalchemy import select

from access.relay import Relay
from agent.gpu.sim import SimulatedBackend
from agent.runner import Agent
from agent.runtimes.diskquota import GIB, detect_loop_disks
from agent.volumes import VolumeStore, with_volumes
from master.models import Command
from master.telemetry import hosts
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import CertificateAuthority, server_ssl_context
from shared.errors import BadRequest
from tests.agents import FAST, enrolled_state, fast_timings
from tests.apiclient import Api
from tests.conftest import unmount_under
from tests.helpers import eventually
from tests.test_agent_runner import running
from tests.test_volumes_api import lending_host

LOOP = detect_loop_disks()
pytestmark = pytest.mark.skipif(isinstance(LOOP, str), reason=f"loop disks: {LOOP}")
VOLUME = "vol-0123456789abcdef"


def fill(folder: Path, *, chunk: int = 8 << 20, most: int = 4 * GIB) -> tuple[int, int]:
    """Write zeros into ``folder/fill`` until the filesystem refuses; (bytes written, the errno that stopped it)."""
    data, written = bytes(chunk), 0
    with open(folder / "fill", "wb") as file:
        try:
            while written < most:
                written += file.write(data)
                file.flush()
            os.fsync(file.fileno())
        except OSError as exc:
            return written, exc.errno or 0
    return written, 0


@pytest.fixture
def store(tmp_path: Path) -> VolumeStore:
    assert not isinstance(LOOP, str)
    return VolumeStore(tmp_path / "volumes", LOOP, owner=(0, 0))


class TestVolumeStore:
    def test_a_volume_is_its_own_filesystem_and_a_write_past_its_size_is_enospc(
        self, store: VolumeStore
    ) -> None:
        """1 GiB made and mounted: writing more fails with ENOSPC near 1 GiB, and the host's image holds no more."""
        mounted = store.create(VOLUME, 1)
        assert os.path.ismount(mounted) and mounted == store.root / VOLUME / "disk"
        written, code = fill(mounted)
        assert code == errno.ENOSPC and 0.8 * GIB < written <= GIB
        image = store.root / VOLUME / "disk.img"
        assert image.stat().st_size == GIB and image.stat().st_blocks * 512 <= GIB + (64 << 20)
        assert store.ids() == [VOLUME]

    def test_making_it_again_keeps_its_size_and_files(self, store: VolumeStore) -> None:
        mounted = store.create(VOLUME, 1)
        (mounted / "keep").write_text("kept\n")
        assert store.create(VOLUME, 5) == mounted  # a repeated create_volume: the same volume
        assert (mounted / "keep").read_text() == "kept\n" and (
            store.root / VOLUME / "disk.img"
        ).stat().st_size == GIB

    def test_a_restart_mounts_every_volume_again_with_its_files(
        self, store: VolumeStore, tmp_path: Path
    ) -> None:
        """Unmounted as by a reboot, a new store's ``remount_all`` (the agent's start) mounts each again, intact."""
        other = "vol-fedcba9876543210"
        for volume_id in (VOLUME, other):
            (store.create(volume_id, 1) / "keep").write_text(volume_id)
        unmount_under(str(store.root))
        assert not os.path.ismount(store.root / VOLUME / "disk")
        assert not isinstance(LOOP, str)
        again = VolumeStore(tmp_path / "volumes", LOOP, owner=(0, 0))
        assert again.remount_all() == sorted([VOLUME, other])
        for volume_id in (VOLUME, other):
            disk = again.root / volume_id / "disk"
            assert os.path.ismount(disk) and (disk / "keep").read_text() == volume_id

    def test_deleting_unmounts_it_and_removes_its_files_and_is_idempotent(self, store: VolumeStore) -> None:
        mounted = store.create(VOLUME, 1)
        (mounted / "keep").write_text("gone soon")
        store.delete(VOLUME)
        assert not os.path.ismount(mounted) and not (store.root / VOLUME).exists()
        assert store.ids() == [] and not store.exists(VOLUME)
        store.delete(VOLUME)  # nothing there: still deleted
        with pytest.raises(BadRequest) as found:
            store.path(VOLUME)
        assert found.value.code == "volume_not_found"

    def test_a_volume_larger_than_the_free_disk_less_the_reserve_is_refused(self, tmp_path: Path) -> None:
        assert not isinstance(LOOP, str)
        store = VolumeStore(tmp_path / "volumes", LOOP, reserved_disk_gib=1 << 30)  # more than any disk here
        with pytest.raises(BadRequest) as refused:
            store.create(VOLUME, 1)
        assert refused.value.code == "volume_no_space" and "0 GiB free" in refused.value.message
        assert store.ids() == []

    def test_an_agent_without_loop_disks_keeps_none_and_says_why(self, tmp_path: Path) -> None:
        store = VolumeStore(tmp_path / "volumes", "the agent is not root, so it cannot mount a rental's disk")
        with pytest.raises(BadRequest) as refused:
            store.create(VOLUME, 1)
        assert refused.value.code == "volume_unsupported" and "not root" in refused.value.message
        facts = with_volumes(protocol.IsolationFacts(), store)
        assert facts.volumes is False and "not root" in facts.volumes_unavailable
        assert not isinstance(LOOP, str)
        assert with_volumes(protocol.IsolationFacts(), VolumeStore(tmp_path / "v", LOOP)).volumes is True


# ---- a real agent behind a real relay, the master applying what it says ---------------------------


class Link:
    """A relay on a bus of its own and an agent enrolled as the master's host ``host_id``; what the agent says is
    applied to the master as the ingestor would."""

    def __init__(self, api: Api, tmp: Path, host_id: str) -> None:
        self.api = api
        self.ca = CertificateAuthority.load_or_create(tmp / "ca")
        self.key_file, self.cert_file = self.ca.write_server_certificate(
            tmp / "relay", ["127.0.0.1", "localhost"]
        )
        self.state = enrolled_state(self.ca, tmp / "agent", host_id)
        self.host_id = host_id
        self.bus = InProcessBus()
        self.relay: Relay | None = None
        self.applied: set[str] = set()

    async def start_relay(self) -> Relay:
        context = server_ssl_context(self.cert_file, self.key_file, self.ca.cert_path)
        self.relay = Relay(relay_id="relay-v", bus=self.bus, ssl_context=context, port=0,
                           heartbeat_interval=FAST.heartbeat_interval, telemetry_interval=FAST.telemetry_interval)  # fmt: skip
        await self.relay.start()
        await self.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, "observer")
        return self.relay

    def agent(self) -> Agent:
        assert self.relay is not None
        return Agent(self.state, SimulatedBackend("sim:1xRTX4090", seed="volumes-round-trip"), relay_urls=[self.relay.url],
                     timings=fast_timings(), rng=random.Random(3))  # fmt: skip

    async def deliver(self, command: Command) -> None:
        """Send the master's command row to the agent through the relay, as the master's publish would."""
        assert self.relay is not None
        body = protocol.CommandBody(command_id=command.id, kind=command.kind, args=command.args)
        delivery = protocol.CommandDelivery(host_id=self.host_id, command=protocol.Command(body=body))
        await self.bus.publish(
            protocol.commands_stream(self.relay.relay_id), delivery.model_dump_json().encode()
        )

    async def pump(self) -> list[protocol.BusEnvelope]:
        """Apply what the agent put on the bus since the last call (hellos and command results), oldest first."""
        batch = await self.bus.read(protocol.AGENT_EVENTS_STREAM, "observer", "t", count=10_000, block=None)
        envelopes = [protocol.decode_bus_envelope(m.payload) for m in batch]
        for envelope in envelopes:
            async with self.api.master.db.session() as session:
                if isinstance(envelope.message, protocol.Hello):
                    await hosts.handle_hello(session, envelope)
                elif isinstance(envelope.message, protocol.CommandResult):
                    await hosts.handle_command_result(session, envelope)
                    self.applied.add(envelope.message.body.command_id)
        return envelopes

    async def answered(self, command: Command) -> None:
        async def done() -> bool | None:
            await self.pump()
            return True if command.id in self.applied else None

        await eventually(done, what=f"the agent's result of {command.kind}")

    async def close(self) -> None:
        if self.relay is not None:
            await self.relay.close()
        await self.bus.close()


async def only_command(api: Api, kind: str) -> Command:
    async with api.master.db.session() as session:
        [command] = (await session.scalars(select(Command).where(Command.kind == kind))).all()
    return command


class TestRoundTrip:
    async def test_made_by_a_real_agent_ready_full_at_its_size_kept_across_a_restart_then_deleted(
        self, api: Api, tmp_path: Path
    ) -> None:
        """The agent's hello says it keeps volumes; POST /volumes → create_volume → the agent makes a 1 GiB
        filesystem → ready; a write past 1 GiB is ENOSPC; unmounted and the agent restarted, it is mounted again with
        its files; DELETE → delete_volume → the files are gone → deleted."""
        backend = SimulatedBackend("sim:1xRTX4090", seed="volumes-round-trip")
        gpus = [protocol.GpuInfoModel.model_validate(g.to_wire()) for g in backend.gpus()]
        host_id = await lending_host(
            api, isolation=protocol.IsolationFacts(kinds=["hold"], volumes=False), gpus=gpus
        )
        link = Link(api, tmp_path, host_id)
        try:
            await link.start_relay()
            async with running(link.agent()) as agent:
                await agent.connected.wait()
                await eventually(lambda: _hello_applied(link), what="the agent's hello")
                _, host = await api.as_renter("GET", f"/hosts/{host_id}")
                assert host["volumes_kept"] is True, host  # from the real agent's hello
                status, volume = await api.as_renter(
                    "POST", "/volumes", json={"name": "ckpt", "size_gib": 1, "host_id": host_id}
                )
                assert status == 201, volume
                create = await only_command(api, "create_volume")
                await link.deliver(create)
                await link.answered(create)
                _, shown = await api.as_renter("GET", "/volumes/ckpt")
                assert shown["state"] == "ready", shown
                disk = link.state.dir / "volumes" / volume["id"] / "disk"
                assert os.path.ismount(disk)
                (disk / "keep").write_text("checkpoint\n")
                written, code = await asyncio.to_thread(fill, disk)
                assert code == errno.ENOSPC and written <= GIB
                (disk / "fill").unlink()
            unmount_under(str(link.state.dir / "volumes"))  # as a reboot leaves it
            assert not os.path.ismount(disk)
            async with running(link.agent()) as agent:
                await agent.connected.wait()
                await eventually(
                    lambda: _true(os.path.ismount(disk)), what="the volume mounted again at start"
                )
                assert (disk / "keep").read_text() == "checkpoint\n"
                status, deleting = await api.as_renter("DELETE", "/volumes/ckpt")
                assert status == 202 and deleting["state"] == "deleting"
                delete = await only_command(api, "delete_volume")
                await link.deliver(delete)
                await link.answered(delete)
            _, shown = await api.as_renter("GET", f"/volumes/{volume['id']}")
            assert shown["state"] == "deleted"
            assert not (link.state.dir / "volumes" / volume["id"]).exists()
        finally:
            await link.close()


async def _hello_applied(link: Link) -> bool | None:
    return True if any(isinstance(e.message, protocol.Hello) for e in await link.pump()) else None


async def _true(value: bool) -> bool | None:
    return True if value else None
