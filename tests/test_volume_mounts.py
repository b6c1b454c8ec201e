"""Rentals mount volumes on the agent (issue 41, point 5), against the real engine and real loop-mounted volumes.

A volume written by one rental is read by the next on the same host; a read-only mount reads and cannot write; a
start naming a volume the host does not have fails ``volume_not_found`` before anything runs; the agent killed and
restarted while a rental with a volume runs finds the volume mounted and the file there, and after a reboot (the
volume unmounted) the next start mounts it again. Volumes are ``agent/volumes.py``'s ``VolumeStore`` on loop disks
(root, ``mkfs.ext4``), made here as the agent's ``create_volume`` would.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.commands import CommandExecutor
from agent.logship import LogShipper
from agent.runtimes.containeropts import resource_name
from agent.runtimes.diskquota import detect_loop_disks
from agent.volumes import VolumeStore
from shared import protocol
from shared.errors import BadRequest
from shared.protocol import VolumeMount
from tests.test_container_runtime import Managers, backend, inspect, log_text, managers, owner, put_file, sh  # noqa: F401  (fixtures)

LOOP = detect_loop_disks()
pytestmark = pytest.mark.skipif(isinstance(LOOP, str), reason=f"loop disks: {LOOP}")


def store(tmp_path: Path) -> VolumeStore:
    """The host's volumes (a fresh object each call: as a restarted agent makes it)."""
    assert not isinstance(LOOP, str)
    return VolumeStore(tmp_path / "volumes", LOOP)


def new_volume(tmp_path: Path) -> str:
    volume_id = f"vol-{secrets.token_hex(8)}"
    store(tmp_path).create(volume_id, 1)
    return volume_id


def unmount(path: Path) -> None:
    """Take the volume away as a reboot would (its image stays, nothing is mounted)."""
    assert not isinstance(LOOP, str)
    subprocess.run([LOOP.umount, str(path)], check=True, capture_output=True, timeout=30)
    assert not os.path.ismount(path)


@pytest.fixture(autouse=True)
def _unmount_volumes(tmp_path: Path) -> object:
    yield
    for volume_id in store(tmp_path).ids():
        store(tmp_path).delete(volume_id)


class TestMounts:
    async def test_a_file_written_by_one_rental_is_read_by_the_next(
        self,
        managers: Managers,  # noqa: F811 (a fixture imported above)
        gpus: list[str],
        docker_image: str,
        tmp_path: Path,
        owner: str,  # noqa: F811 (a fixture imported above)
    ) -> None:
        """The first rental writes /data/note and stops (its container gone); the next, with the same volume, reads it."""
        manager, exits = managers(volumes=store(tmp_path))
        volume_id = new_volume(tmp_path)
        data = [VolumeMount(volume_id=volume_id, mount="/data")]
        first, second = (f"v{secrets.token_hex(3)}" for _ in range(2))
        await manager.start(
            first,
            [gpus[0]],
            sh("echo checkpoint-7 > /data/note && echo wrote", image=docker_image),
            volumes=data,
        )
        assert await exits.wait_for(first) == 0
        await manager.stop(first, timeout=0)
        assert inspect(resource_name(first, owner)) is None
        await manager.start(
            second,
            [gpus[1]],
            sh("echo read=$(cat /data/note); exec sleep 600", image=docker_image),
            volumes=data,
        )
        await log_text(manager, second, containing="read=checkpoint-7")
        info = inspect(resource_name(second, owner))
        assert info is not None
        [mount] = [m for m in info["Mounts"] if m["Destination"] == "/data"]
        assert (mount["Type"], mount["Source"], mount["RW"]) == (
            "bind",
            str(store(tmp_path).path(volume_id)),
            True,
        )

    async def test_a_read_only_mount_reads_and_cannot_write(
        self,
        managers: Managers,  # noqa: F811 (a fixture imported above)
        gpus: list[str],
        docker_image: str,
        tmp_path: Path,
    ) -> None:
        manager, _ = managers(volumes=store(tmp_path))
        volume_id = new_volume(tmp_path)
        (store(tmp_path).path(volume_id) / "weights").write_text("w\n")
        rental = f"o{secrets.token_hex(3)}"
        script = "echo read=$(cat /w/weights); touch /w/x 2>&1; echo touched=$?; exec sleep 600"
        await manager.start(
            rental,
            [gpus[0]],
            sh(script, image=docker_image),
            volumes=[VolumeMount(volume_id=volume_id, mount="/w", read_only=True)],
        )
        text = await log_text(manager, rental, containing="touched=")
        assert "read=w" in text and "Read-only file system" in text and "touched=1" in text, text
        assert not (store(tmp_path).path(volume_id) / "x").exists()

    async def test_a_volume_not_on_the_host_fails_the_start_before_anything_runs(
        self,
        managers: Managers,  # noqa: F811 (a fixture imported above)
        gpus: list[str],
        docker_image: str,
        tmp_path: Path,
        owner: str,  # noqa: F811 (a fixture imported above)
    ) -> None:
        for volumes in (store(tmp_path), None):  # a volume unknown here; an agent that keeps no volumes
            manager, _ = managers(volumes=volumes)
            rental = f"n{secrets.token_hex(3)}"
            with pytest.raises(BadRequest) as refused:
                await manager.start(rental, [gpus[0]], sh("exec sleep 600", image=docker_image),
                                    volumes=[VolumeMount(volume_id="vol-0123456789abcdef", mount="/data")])  # fmt: skip
            assert refused.value.code == "volume_not_found", refused.value
            assert manager.running() == [] and inspect(resource_name(rental, owner)) is None


class TestRestarts:
    async def test_the_agent_killed_and_restarted_finds_the_volume_mounted_and_the_file_there(
        self,
        managers: Managers,  # noqa: F811 (a fixture imported above)
        gpus: list[str],
        docker_image: str,
        tmp_path: Path,
        owner: str,  # noqa: F811 (a fixture imported above)
    ) -> None:
        """The agent dies while the rental runs: the new agent mounts its volumes (``remount_all``) and adopts the
        container, whose /data is still the volume with its file, and which reads what is written there afterwards."""
        first, _ = managers(volumes=store(tmp_path))
        volume_id = new_volume(tmp_path)
        rental = f"k{secrets.token_hex(3)}"
        script = "echo kept > /data/keep; echo wrote; while [ ! -e /data/go ]; do sleep 0.05; done; echo read=$(cat /data/keep); exec sleep 600"
        await first.start(
            rental,
            [gpus[0]],
            sh(script, image=docker_image),
            volumes=[VolumeMount(volume_id=volume_id, mount="/data")],
        )
        await log_text(first, rental, containing="wrote")
        await first.close()  # as if killed: nothing stopped, nothing unmounted
        volumes = store(tmp_path)
        assert volumes.remount_all() == [volume_id]
        second, _ = managers(volumes=volumes)
        await second.resume()
        assert second.running() == [rental]
        path = volumes.path(volume_id)
        assert os.path.ismount(path) and (path / "keep").read_text() == "kept\n"
        put_file(resource_name(rental, owner), "/data", "go")
        await log_text(second, rental, containing="read=kept")

    async def test_after_a_reboot_the_next_start_mounts_the_volume_again(
        self,
        managers: Managers,  # noqa: F811 (a fixture imported above)
        gpus: list[str],
        docker_image: str,
        tmp_path: Path,
    ) -> None:
        """Stopped, the volume unmounted as by a reboot, a new agent: the next rental's start mounts it, files intact."""
        first, exits = managers(volumes=store(tmp_path))
        volume_id = new_volume(tmp_path)
        data = [VolumeMount(volume_id=volume_id, mount="/data")]
        rental = f"b{secrets.token_hex(3)}"
        await first.start(
            rental, [gpus[0]], sh("echo before-reboot > /data/note", image=docker_image), volumes=data
        )
        assert await exits.wait_for(rental) == 0
        await first.stop(rental, timeout=0)
        await first.close()
        path = store(tmp_path).path(volume_id)
        unmount(path)
        second, _ = managers(volumes=store(tmp_path))
        nxt = f"b{secrets.token_hex(3)}"
        await second.start(
            nxt,
            [gpus[0]],
            sh("echo read=$(cat /data/note); exec sleep 600", image=docker_image),
            volumes=data,
        )
        await log_text(second, nxt, containing="read=before-reboot")
        assert os.path.ismount(path)


class TestStartCommand:
    async def test_a_start_command_mounts_its_volumes_and_one_not_here_fails_volume_not_found(
        self,
        managers: Managers,  # noqa: F811 (a fixture imported above)
        gpus: list[str],
        docker_image: str,
        tmp_path: Path,
    ) -> None:
        """``start_workload.volumes`` reaches the container; a volume the host lacks fails the command with the code."""
        manager, _ = managers(volumes=store(tmp_path))

        async def unused(*args: Any) -> Any:
            raise AssertionError("not called")

        async def send(body: protocol.WorkloadLogsBody) -> None:
            pass

        commands = CommandExecutor(workloads=manager, backend=manager.backend, logs=LogShipper(tmp_path, manager, send),
                                   measure=unused, install_certificate=unused)  # fmt: skip
        volume_id = new_volume(tmp_path)
        (store(tmp_path).path(volume_id) / "note").write_text("from-the-host\n")
        workload = sh("echo read=$(cat /data/note); exec sleep 600", image=docker_image)
        for rental, vid, ok in ((f"c{secrets.token_hex(3)}", "vol-0123456789abcdef", False), (f"c{secrets.token_hex(3)}", volume_id, True)):
            start = protocol.StartWorkload(rental_id=rental, gpu_uuids=[gpus[0]], workload=workload,
                                           volumes=[VolumeMount(volume_id=vid, mount="/data")])  # fmt: skip
            result = await commands.execute(protocol.CommandBody.of(f"cmd-{secrets.token_hex(4)}", start))
            assert result.ok is ok, result
            if not ok:
                assert result.data.get("code") == "volume_not_found", result
            else:
                await log_text(manager, rental, containing="read=from-the-host")
