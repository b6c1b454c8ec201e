"""Every rental's ceilings on the agent (issue 35, "no ceilings by default"), against the real engine and real processes.

A container or process rental that names no limits runs within its share of the host (memory, CPU,
pids, disk); a pids hog, a memory hog and a disk hog each stop at their ceiling while a neighbour keeps
running; a limit the host cannot give is refused with ``limits_exceed_host`` naming the field. The host's
size is given (``HostSize``) so that each share is small and known; the disks are real loop-mounted
ext4 images (root, ``mkfs.ext4``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from agent.runtimes.ceilings import CeilingPolicy
from agent.runtimes.containeropts import resource_name
from agent.runtimes.diskquota import LoopDisks, detect_loop_disks
from agent.runtimes.users import RentalUsers
from shared.ceilings import HostSize
from shared.errors import BadRequest
from shared.protocol import DISK_QUOTA_EXCEEDED, ProcessWorkload
from tests.helpers import eventually
from tests.test_container_runtime import Managers, backend, exists, inspect, managers, owner, put_file, sh  # noqa: F401  (fixtures)
from tests.test_process_isolation import TOOLS, WAIT, Host, host, in_home  # noqa: F401  (fixtures)
from tests.test_process_isolation import Managers as ProcessManagers
from tests.test_process_isolation import managers as process_managers  # noqa: F401
from tests.test_process_isolation import sh as argv_sh

LOOP = detect_loop_disks()
pytestmark = pytest.mark.skipif(isinstance(LOOP, str), reason=f"loop disks: {LOOP}")

# A small host: with four GPUs (the backend of tests.test_container_runtime) a rental of one gets 256 MiB,
# one core (the floor), 256 processes and a 1 GiB disk.
SMALL = HostSize(cpu_cores=float(os.cpu_count() or 1), memory_mib=1024, pid_max=1024, max_disk_gib=4, disk_gib=1)


async def log_text(manager: Any, rental_id: str, *, containing: str) -> str:
    """The rental's output once it holds ``containing``: a hog on a loaded machine takes seconds to reach its ceiling."""

    async def check() -> str | None:
        text = manager.logs.path(rental_id).read_text(errors="replace") if manager.logs.path(rental_id).exists() else ""
        return text if containing in text else None

    return str(await eventually(check, timeout=HOG_WAIT, every=0.1, what=f"{containing!r} in {rental_id}'s log"))


HOG_WAIT = 120.0


def small_policy(work_dir: Path) -> CeilingPolicy:
    assert not isinstance(LOOP, str)
    return CeilingPolicy(SMALL, "loop", LoopDisks(work_dir, LOOP))


def container_manager(managers: Managers, tmp_path: Path) -> tuple[Any, Any]:  # noqa: F811 (a fixture imported above)
    return managers(work_dir=tmp_path / "work", ceilings=small_policy(tmp_path / "work"))


class TestContainerCeilings:
    """A container rental always has memory, CPU, pids and disk ceilings."""

    async def test_a_container_naming_no_limits_gets_its_share(self, managers: Managers, gpus: list[str], docker_image: str, tmp_path: Path) -> None:  # noqa: F811 (a fixture imported above)
        """Regression (issue 35): Memory 0, NanoCpus 0 and pids 4,194,304 by default; now the rental's share of the host, and a 1 GiB /workspace."""
        manager, _ = container_manager(managers, tmp_path)
        rental = f"d{secrets.token_hex(3)}"
        result = await manager.start(rental, [gpus[0]], sh("exec sleep 600", image=docker_image))
        info = inspect(resource_name(rental, manager.containers.options.owner))
        assert info is not None
        host = info["HostConfig"]  # noqa: F811 (a fixture imported above)
        assert (host["Memory"], host["MemorySwap"], host["NanoCpus"], host["PidsLimit"]) == (256 << 20, 256 << 20, 10**9, 256)
        assert [(m["Type"], m["Destination"]) for m in info["Mounts"]] == [("bind", "/workspace")]
        assert (result["memory_mib"], result["pids_limit"], result["disk_gib"], result["disk_quota"]) == (256, 256, 1, "loop")

    async def test_hogs_stop_at_their_ceilings_while_a_neighbour_keeps_running(
        self, managers: Managers, gpus: list[str], docker_image: str, tmp_path: Path  # noqa: F811 (a fixture imported above)
    ) -> None:
        """A fork bomb stops at 256 processes, a memory hog is OOM-killed at 256 MiB and a disk hog gets ENOSPC at 1 GiB; the neighbour runs on."""
        manager, exits = container_manager(managers, tmp_path)
        exits.wait = HOG_WAIT  # three hogs on a loaded machine: filling 256 MiB and 1 GiB takes seconds each
        neighbour, bomb, hog, filler = (f"{p}{secrets.token_hex(3)}" for p in "nbmf")
        await manager.start(neighbour, [gpus[0]], sh("echo up; exec sleep 600", image=docker_image))
        script = (
            "(i=0; while [ $i -lt 400 ]; do sleep 5 & i=$((i+1)); done); "
            "read n < /sys/fs/cgroup/pids/pids.current || read n < /sys/fs/cgroup/pids.current; echo running=$n; echo bomb-done"
        )
        await manager.start(bomb, [gpus[1]], sh(script, image=docker_image))
        await manager.start(hog, [gpus[2]], sh("head -c 600m /dev/zero | tail", image=docker_image))
        await manager.start(filler, [gpus[3]], sh("dd if=/dev/zero of=/workspace/fill bs=1M count=1500; echo dd-exit=$?", image=docker_image))
        text = await log_text(manager, bomb, containing="bomb-done")
        assert int(text.split("running=")[1].split()[0]) <= 256 and "fork" in text.lower(), text
        assert await exits.wait_for(hog) == -9
        text = await log_text(manager, filler, containing="dd-exit=")
        assert "No space left on device" in text and "dd-exit=1" in text, text
        info = inspect(resource_name(neighbour, manager.containers.options.owner))
        assert info is not None and info["State"]["Running"]

    async def test_limits_the_host_cannot_give_are_refused_naming_the_field(
        self, managers: Managers, gpus: list[str], docker_image: str, tmp_path: Path  # noqa: F811 (a fixture imported above)
    ) -> None:
        """pids_limit above the rental's share of pid_max, memory above the host, disk above its largest quota: ``limits_exceed_host``."""
        manager, _ = container_manager(managers, tmp_path)
        for field, value in (("pids_limit", 257), ("memory_mib", 1025), ("disk_gib", 5)):
            with pytest.raises(BadRequest) as refused:
                await manager.start(f"x{secrets.token_hex(3)}", [gpus[0]], sh("true", image=docker_image, **{field: value}))
            assert refused.value.code == "limits_exceed_host" and refused.value.message.startswith(f"workload.{field}:")
        assert manager.running() == []


class TestProcessCeilings:
    """A process rental has the same ceilings: a pids cgroup, and a size-capped home."""

    async def test_a_fork_bomb_and_a_disk_hog_stop_at_their_ceilings(
        self, process_managers: ProcessManagers, host: Host, gpus: list[str]  # noqa: F811 (a fixture imported above)
    ) -> None:
        """Regression (issue 35: a process rental sat in the pids root): forks stop at 256, a write stops with ENOSPC at 1 GiB."""
        manager = process_managers(ceilings=small_policy(host.work_dir))
        bomb, filler = f"b{secrets.token_hex(3)}", f"f{secrets.token_hex(3)}"
        script = "(i=0; while [ $i -lt 400 ]; do sleep 5 & i=$((i+1)); done) 2>/dev/null; echo done > bomb-done; exec sleep 60"
        started = await manager.start(bomb, [gpus[0]], ProcessWorkload(argv=argv_sh(script)))
        assert (started["pids_limit"], started["memory_mib"], started["disk_quota"]) == (256, 256, "loop")
        await in_home(host, bomb, "bomb-done")
        pids_dirs = [d for d in manager.workload(bomb).placement.cgroup_dirs if (d / "pids.current").exists()]  # type: ignore[union-attr]
        assert pids_dirs and int((pids_dirs[0] / "pids.max").read_text()) == 256
        assert int((pids_dirs[0] / "pids.current").read_text()) <= 256
        fill = "dd if=/dev/zero of=fill bs=1M count=1500 2> dd.err; echo $? > dd.exit; exec sleep 60"
        await manager.start(filler, [gpus[1]], ProcessWorkload(argv=argv_sh(fill)))
        exit_file = await in_home(host, filler, "dd.exit")
        assert exit_file.read_text().strip() == "1" and "No space left on device" in (exit_file.parent / "dd.err").read_text()
        assert manager.running() == sorted([bomb, filler])

    async def test_a_pids_limit_above_the_share_is_refused(self, process_managers: ProcessManagers, host: Host, gpus: list[str]) -> None:  # noqa: F811 (a fixture imported above)
        """A process rental asking for more processes than its share of pid_max: ``limits_exceed_host`` on ``workload.pids_limit``."""
        manager = process_managers(ceilings=small_policy(host.work_dir))
        with pytest.raises(BadRequest) as refused:
            await manager.start(f"x{secrets.token_hex(3)}", [gpus[0]], ProcessWorkload(argv=argv_sh("true"), pids_limit=257))
        assert refused.value.code == "limits_exceed_host" and refused.value.message.startswith("workload.pids_limit:")


def unmount(path: Path) -> None:
    """Take a rental's disk away as a reboot would (the image stays, nothing is mounted)."""
    assert not isinstance(LOOP, str)
    subprocess.run([LOOP.umount, str(path)], check=True, capture_output=True, timeout=30)
    assert not os.path.ismount(path)


class TestWritableLayerQuota:
    """Where the engine cannot bound a container's writable layer (overlay2 on ext4), the agent watches it."""

    async def test_a_container_writing_past_its_quota_outside_workspace_is_stopped_alone(
        self, managers: Managers, gpus: list[str], docker_image: str, tmp_path: Path, owner: str  # noqa: F811 (a fixture imported above)
    ) -> None:
        """1.1 GiB written to /tmp over a 1 GiB quota: the container is stopped, its exit's reason ``disk_quota_exceeded: ...``
        (what the runner reports: the renter's doing at the master); the neighbour runs on."""
        work = tmp_path / "work"
        manager, exits = managers(work_dir=work, ceilings=small_policy(work), disk_check_interval=0.1)
        assert manager.containers.disk_quota == "loop"  # the engine here does not enforce --storage-opt: watched
        exits.wait = HOG_WAIT  # writing 1.1 GiB on a loaded machine takes seconds
        reasons: dict[str, str | None] = {}

        async def on_exit(rental_id: str, exit_code: int | None) -> None:
            reasons[rental_id] = manager.exit_reason(rental_id)  # what agent.runner sends as the exit's reason
            await exits(rental_id, exit_code)

        manager.on_exit = on_exit
        neighbour, hog = f"n{secrets.token_hex(3)}", f"h{secrets.token_hex(3)}"
        await manager.start(neighbour, [gpus[0]], sh("exec sleep 600", image=docker_image))
        await manager.start(hog, [gpus[1]], sh("dd if=/dev/zero of=/tmp/fill bs=1M count=1126; echo written; exec sleep 600", image=docker_image))
        exit_code = await exits.wait_for(hog)
        assert exit_code is not None and exit_code != 0
        why = reasons[hog]
        assert why is not None and why.startswith(f"{DISK_QUOTA_EXCEEDED}: the container wrote ") and why.endswith("over its 1 GiB quota"), why
        await log_text(manager, hog, containing=f"gpumarket: stopping ({DISK_QUOTA_EXCEEDED}: ")
        assert manager.running() == [neighbour] and not exists("containers", resource_name(hog, owner))
        assert manager.exit_reason(hog) is None  # reported: forgotten with the exit
        info = inspect(resource_name(neighbour, owner))
        assert info is not None and info["State"]["Running"]


class TestDisksMountedAgain:
    """A rental's disk survives an agent restart and a reboot: mounted again, its files intact."""

    async def test_an_adopted_container_keeps_its_disk_and_files(
        self, managers: Managers, gpus: list[str], docker_image: str, tmp_path: Path, owner: str  # noqa: F811 (a fixture imported above)
    ) -> None:
        """An agent restart: the new manager adopts the running container, whose /workspace is still its mounted disk with its files."""
        work = tmp_path / "work"
        first, _ = managers(work_dir=work, ceilings=small_policy(work))
        rental = f"a{secrets.token_hex(3)}"
        script = "echo kept > /workspace/keep; echo wrote; while [ ! -e /workspace/go ]; do sleep 0.05; done; echo read=$(cat /workspace/keep); exec sleep 600"
        await first.start(rental, [gpus[0]], sh(script, image=docker_image))
        await log_text(first, rental, containing="wrote")
        await first.close()  # as if killed: nothing stopped
        second, _ = managers(work_dir=work, ceilings=small_policy(work))
        await second.resume()
        assert second.running() == [rental]
        disk = small_policy(work).disks.default_mountpoint(rental)  # type: ignore[union-attr]
        assert os.path.ismount(disk) and (disk / "keep").read_text() == "kept\n"
        put_file(resource_name(rental, owner), "/workspace", "go")
        await log_text(second, rental, containing="read=kept")

    async def test_a_disk_unmounted_as_by_a_reboot_is_mounted_again_with_its_files(
        self, managers: Managers, gpus: list[str], docker_image: str, tmp_path: Path  # noqa: F811 (a fixture imported above)
    ) -> None:
        """Stopped, its disk unmounted, the agent restarted: the renter's files (``workspace_path``, SFTP's) and a new start both find it mounted again, intact."""
        work = tmp_path / "work"
        first, _ = managers(work_dir=work, ceilings=small_policy(work))
        rental = f"r{secrets.token_hex(3)}"
        await first.start(rental, [gpus[0]], sh("echo kept > /workspace/keep; echo wrote; exec sleep 600", image=docker_image))
        await log_text(first, rental, containing="wrote")
        await first.stop(rental, timeout=0)
        await first.close()
        disk = small_policy(work).disks.default_mountpoint(rental)  # type: ignore[union-attr]
        unmount(disk)
        second, _ = managers(work_dir=work, ceilings=small_policy(work))
        assert await second.containers.workspace_path(rental) == disk
        assert os.path.ismount(disk) and (disk / "keep").read_text() == "kept\n"
        unmount(disk)
        await second.start(rental, [gpus[0]], sh("echo read=$(cat /workspace/keep); exec sleep 600", image=docker_image))
        await log_text(second, rental, containing="read=kept")
        assert os.path.ismount(disk)

    async def test_an_adopted_process_rental_keeps_its_home_disk_and_files(
        self, process_managers: ProcessManagers, host: Host, gpus: list[str]  # noqa: F811 (a fixture imported above)
    ) -> None:
        """An agent restart: the new manager adopts the process rental, whose home is still its mounted disk with its files;
        stopping it then unmounts and deletes the disk."""
        assert not isinstance(TOOLS, str)
        first = process_managers(ceilings=small_policy(host.work_dir))
        rental = f"p{secrets.token_hex(3)}"
        script = "echo kept > keep; touch ready; while [ ! -e go ]; do sleep 0.05; done; cat keep > read.new; mv read.new read; exec sleep 60"
        await first.start(rental, [gpus[0]], ProcessWorkload(argv=argv_sh(script)))
        await in_home(host, rental, "ready")
        home = host.users.root / rental
        assert os.path.ismount(home)
        await first.close()
        fresh_users = RentalUsers(host.users.root, TOOLS, uid_min=host.users.uid_min, uid_max=host.users.uid_max)
        policy = small_policy(host.work_dir)
        second = process_managers(rental_users=fresh_users, ceilings=policy)
        assert second.running() == [rental] and os.path.ismount(home) and (home / "keep").read_text() == "kept\n"
        (home / "go").touch()
        assert (await in_home(host, rental, "read")).read_text() == "kept\n"
        await second.stop(rental)
        assert not os.path.ismount(home) and not policy.disks.image(rental).exists()  # type: ignore[union-attr]
