"""Container workloads against a real Docker engine: lifecycle, isolation, limits, restarts, images.

The engine is this machine's (started by the ``docker_image`` fixture when none answers) and
the image is built here from ``busybox-static`` (``tests/dockerengine.py``): nothing is pulled.
Each test has an owner of its own (the ``gpumarket.owner`` label), so its manager never sees
another test's containers, and everything labelled with it is removed afterwards. GPUs are
simulated: a container sees them through its environment only.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import secrets
import sys
import tarfile
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp import web
from pydantic import ValidationError

from agent import state
from agent.gpu.sim import SimulatedBackend
from agent.runtimes import containerlogs
from agent.runtimes.base import host_capacity
from agent.runtimes.container import ContainerRuntime
from agent.runtimes.containeropts import (
    OWNER_LABEL,
    RENTAL_LABEL,
    SINCE_NAME,
    ContainerOptions,
    resource_name,
)
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.netguard import NetGuardStatus, install_guard, write_marker
from agent.runtimes.registry import REGISTRY_NAME
from shared.errors import BadRequest, Conflict
from shared.protocol import ContainerWorkload, WorkloadProgressBody
from tests import dockerengine
from tests.helpers import eventually
from tests.workloadfixtures import Exits

WAIT = 20.0


class Progress:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, float | None]] = []

    async def __call__(self, rental_id: str, stage: str, text: str, percent: float | None) -> None:
        self.events.append((rental_id, stage, text, percent))


def inspect(name: str) -> dict[str, Any] | None:
    status, body = dockerengine.request("GET", f"/containers/{quote(name, safe='')}/json")
    return json.loads(body) if status == 200 else None


def exists(kind: str, name: str) -> bool:
    return dockerengine.request("GET", f"/{kind}/{quote(name, safe='')}" + ("/json" if kind == "containers" else ""))[0] == 200


def put_file(container: str, folder: str, name: str, data: bytes = b"") -> None:
    """Write a file into a running container (here: its ``/workspace`` volume) through the engine."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        entry = tarfile.TarInfo(name)
        entry.size, entry.mode, entry.uid, entry.gid = len(data), 0o644, 1000, 1000
        tar.addfile(entry, io.BytesIO(data))
    status, body = dockerengine.request(
        "PUT", f"/containers/{container}/archive?path={quote(folder)}", body=buffer.getvalue(), headers={"Content-Type": "application/x-tar"}
    )
    assert status == 200, body


async def log_text(manager: WorkloadManager, rental_id: str, *, containing: str) -> str:
    async def check() -> str | None:
        with contextlib.suppress(FileNotFoundError):
            text = manager.logs.path(rental_id).read_text(errors="replace")
            if containing in text:
                return text
        return None

    return await eventually(check, timeout=WAIT, every=0.05, what=f"{containing!r} in {rental_id}'s log")


async def until(predicate: Callable[[], Any], *, what: str) -> Any:
    """``predicate()`` (a synchronous engine query) once truthy, polled briefly."""

    async def check() -> Any:
        return predicate()

    return await eventually(check, timeout=WAIT, every=0.05, what=what)


def workspace_kept(manager: WorkloadManager, rental_id: str) -> bool:
    """Whether the rental's /workspace is still there: its size-capped disk (a root agent's), else its volume."""
    disks = manager.containers.disks
    if disks is not None:
        return disks.image(rental_id).exists()
    return exists("volumes", resource_name(rental_id, manager.containers.options.owner))


def sh(script: str, **fields: Any) -> ContainerWorkload:
    return ContainerWorkload.model_validate({"image": fields.pop("image"), "command": ["sh", "-c", script], **fields})


@pytest.fixture
def owner() -> str:
    return f"test-{secrets.token_hex(4)}"


@pytest.fixture
def backend() -> SimulatedBackend:
    return SimulatedBackend("sim:4xRTX4090", seed="c")


@pytest.fixture
async def managers(
    tmp_path: Path, backend: SimulatedBackend, owner: str, docker_image: str
) -> AsyncIterator[Callable[..., tuple[WorkloadManager, Exits]]]:
    """Makes managers over one work dir for this test's owner; removes everything of the owner afterwards."""
    made: list[WorkloadManager] = []

    def make(**overrides: Any) -> tuple[WorkloadManager, Exits]:
        exits = Exits()
        options = {"owner": owner, **overrides.pop("options", {})}
        manager = WorkloadManager(
            overrides.pop("work_dir", tmp_path / "work"), backend, on_exit=exits, container=ContainerOptions(**options),
            stop_timeout=2.0, kill_timeout=5.0, check_interval=0.05, **overrides,
        )
        made.append(manager)
        return manager, exits

    yield make
    for manager in made:
        with contextlib.suppress(Exception):
            await manager.close(stop_workloads=True)
    dockerengine.remove_owned(owner)


Managers = Callable[..., tuple[WorkloadManager, Exits]]


class TestLifecycle:
    """Start → running → output in the log → exit reported; stop removes the container and its network."""

    async def test_output_reaches_the_log_and_the_exit_is_reported(self, managers: Managers, gpus: list[str], docker_image: str) -> None:
        """stdout and stderr land in ``output.log``; the exit code comes back; the container and network go, the volume stays until forgotten."""
        manager, exits = managers()
        rental = f"r{secrets.token_hex(3)}"
        script = "echo to-stdout; echo to-stderr >&2; printf 'bytes:\\377\\376\\n'; exit 3"
        result = await manager.start(rental, [gpus[0]], sh(script, image=docker_image))
        name = resource_name(rental, manager.containers.options.owner)
        assert result["kind"] == "container" and result["container"] == name and result["user"] == "1000:1000"
        assert await exits.wait_for(rental) == 3
        text = await log_text(manager, rental, containing="to-stderr")
        assert "to-stdout" in text and b"bytes:\xff\xfe\n" in manager.logs.path(rental).read_bytes()  # not UTF-8: kept as written
        await until(lambda: not exists("containers", name), what="the container removed")
        assert not exists("networks", name) and workspace_kept(manager, rental) and manager.running() == []
        await manager.forget(rental)
        assert not workspace_kept(manager, rental)

    async def test_the_followed_position_is_saved_off_the_event_loop(
        self, managers: Managers, gpus: list[str], docker_image: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``container.since`` (where a restarted agent resumes the output) is written, fsync and all, in a thread."""
        writers: list[int] = []
        real = state.atomic_write

        def recording(path: Path, data: bytes, *, mode: int = 0o644) -> None:
            writers.append(threading.get_ident())
            real(path, data, mode=mode)

        monkeypatch.setattr(containerlogs, "atomic_write", recording)
        manager, exits = managers()
        rental = f"s{secrets.token_hex(3)}"
        await manager.start(rental, [gpus[0]], sh("for i in 1 2 3 4 5 6; do echo line $i; sleep 0.3; done", image=docker_image))
        assert await exits.wait_for(rental) == 0
        await log_text(manager, rental, containing="line 6")
        since = manager.logs.path(rental).parent / SINCE_NAME
        assert writers and threading.get_ident() not in writers and int(since.read_text()) > 0

    async def test_stop_removes_the_container(self, managers: Managers, gpus: list[str], docker_image: str) -> None:
        """A stop says why in the log, ends the container (SIGTERM through its init) and removes it; no exit is reported."""
        manager, exits = managers()
        rental = f"r{secrets.token_hex(3)}"
        await manager.start(rental, [gpus[0]], sh("echo up; exec sleep 600", image=docker_image))
        name = resource_name(rental, manager.containers.options.owner)
        await log_text(manager, rental, containing="up")
        info = inspect(name)
        assert info is not None and info["State"]["Running"]
        host = info["HostConfig"]  # as the engine holds it: nothing of the host, no privileges
        assert not host["Binds"] and not host["PortBindings"] and not host["Privileged"] and host["CapDrop"] == ["ALL"]
        assert host["SecurityOpt"] == ["no-new-privileges"] and host["PidsLimit"] == 4096 and host["Init"]
        assert [m["Destination"] for m in info["Mounts"]] == ["/workspace"] and info["Config"]["User"] == "1000:1000"
        assert info["Config"]["Labels"][RENTAL_LABEL] == rental
        assert (await manager.start(rental, [gpus[0]], sh("true", image=docker_image)))["already_running"]
        stopped = await manager.stop(rental, timeout=1, reason="renter asked")
        assert stopped["exit_code"] == -15  # SIGTERM, forwarded by the init
        assert inspect(name) is None and not exists("networks", name)
        assert "gpumarket: stopping (renter asked)" in manager.logs.path(rental).read_text()
        assert manager.running() == [] and not exits.of(rental)


    async def test_concurrent_starts_share_one_container_and_reserve_its_gpus(
        self, managers: Managers, gpus: list[str], docker_image: str
    ) -> None:
        """Two starts of one rental make one container; another rental asking for its GPU meanwhile is refused."""
        manager, _ = managers()
        rental, other = f"c{secrets.token_hex(3)}", f"o{secrets.token_hex(3)}"
        spec = sh("exec sleep 600", image=docker_image)
        first = asyncio.create_task(manager.start(rental, [gpus[0]], spec))
        await asyncio.sleep(0)  # the first start holds its GPU while it talks to the engine
        with pytest.raises(Conflict) as refused:
            await manager.start(other, [gpus[0]], spec)
        assert refused.value.code == "gpu_in_use"
        second = await manager.start(rental, [gpus[0]], spec)
        assert (await first)["kind"] == "container" and second["already_running"] and manager.running() == [rental]

    async def test_the_workspace_outlives_a_stop_until_forgotten(self, managers: Managers, gpus: list[str], docker_image: str) -> None:
        """A rental started again after a stop finds its /workspace as it left it; ``forget`` removes the volume."""
        manager, exits = managers()
        rental = f"w{secrets.token_hex(3)}"
        await manager.start(rental, [gpus[0]], sh("echo kept > /workspace/file", image=docker_image))
        assert await exits.wait_for(rental) == 0
        exits.calls.clear()
        await until(lambda: rental not in manager.running(), what="the first run to end")
        await manager.start(rental, [gpus[0]], sh("cat /workspace/file", image=docker_image))
        assert await exits.wait_for(rental) == 0
        assert "kept" in await log_text(manager, rental, containing="kept")
        await manager.forget(rental)
        assert not workspace_kept(manager, rental)

    async def test_facts_name_the_engine_and_the_network_guard(self, managers: Managers) -> None:
        """What the host's hello can say: the engine's name and version, the guard on (root, iptables)."""
        manager, _ = managers()
        facts = await manager.container_facts()
        assert facts is not None and facts.engine is not None and facts.engine.startswith(("docker ", "podman "))
        assert facts.network_guard.active, facts.network_guard.reason


class TestIsolation:
    """What a renter's container can see and do: its GPUs, no root, no capabilities, nothing of the host or a neighbour."""

    async def test_gpus_user_and_privileges(self, managers: Managers, gpus: list[str], docker_image: str) -> None:
        """The GPU variables name only the rental's GPUs; the user is not root; CapEff is 0 and NoNewPrivs 1; /workspace is its own."""
        manager, exits = managers()
        rental = f"r{secrets.token_hex(3)}"
        script = "env; id -u; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; pwd; echo data > /workspace/mine && echo wrote-workspace"
        await manager.start(rental, gpus[1:3], sh(script, image=docker_image, env={"MY_VAR": "x"}))
        assert await exits.wait_for(rental) == 0
        lines = set((await log_text(manager, rental, containing="wrote-workspace")).splitlines())
        visible = ",".join(gpus[1:3])
        for variable in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPUMARKET_GPU_UUIDS"):
            assert f"{variable}={visible}" in lines
        assert f"GPUMARKET_RENTAL_ID={rental}" in lines and "MY_VAR=x" in lines and "HOME=/workspace" in lines
        assert not any(gpus[0] in line or gpus[3] in line for line in lines)
        assert "1000" in lines and "0" not in lines  # id -u
        assert "CapEff:\t0000000000000000" in lines and "NoNewPrivs:\t1" in lines and "/workspace" in lines

    async def test_a_hostile_workload_finds_nothing(self, managers: Managers, gpus: list[str], docker_image: str, tmp_path: Path) -> None:
        """From inside, a renter hunts for keys, credentials, the registry, the engine socket, a neighbour's files and
        processes, and tries the neighbour's address, the host (a server on 0.0.0.0) and link-local metadata: all fail."""
        manager, exits = managers()
        work = manager.work_dir
        for decoy in ("key.pem", "credentials.json", "identity.json"):
            (work / decoy).write_text("gpumarket-host-secret\n")
        connections: list[str] = []

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(str(writer.get_extra_info("peername")))
            writer.close()

        server = await asyncio.start_server(on_connect, "0.0.0.0", 0)  # the host service a renter must not reach
        port = server.sockets[0].getsockname()[1]
        victim, hostile = f"v{secrets.token_hex(3)}", f"h{secrets.token_hex(3)}"
        try:
            await manager.start(victim, [gpus[0]], sh(
                "echo victim-secret > /workspace/secret-of-victim; nc -ll -p 8080 -e cat & exec sleep 424242", image=docker_image,
                env={"VICTIM_TOKEN": "victim-env-secret"},
            ))
            await until(lambda: (inspect(resource_name(victim, manager.containers.options.owner)) or {}).get("State", {}).get("Running"), what="the victim running")
            info = inspect(resource_name(victim, manager.containers.options.owner))
            assert info is not None
            victim_ip = next(iter(info["NetworkSettings"]["Networks"].values()))["IPAddress"]
            assert victim_ip

            async def victim_listening() -> bool:
                try:
                    _, writer = await asyncio.wait_for(asyncio.open_connection(victim_ip, 8080), 5)
                except (OSError, TimeoutError):
                    return False
                writer.close()
                return True

            # Running is not listening: the victim's port must answer the host before "not reached" means anything.
            await eventually(victim_listening, timeout=WAIT, what="the victim's nc listening on 8080")
            script = f"""
                find / \\( -path /proc -o -path /sys \\) -prune -o \\( -name '*.pem' -o -name credentials.json -o -name identity.json \
                    -o -name {REGISTRY_NAME} -o -name 'docker.sock' -o -name 'secret-of-victim' -o -name output.log \\) -print | sed 's/^/FOUND /'
                grep -rl gpumarket-host-secret / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev 2>/dev/null | sed 's/^/FOUND /'
                ls /var/run/docker.sock /run/docker.sock 2>/dev/null | sed 's/^/FOUND /'
                ps -o pid,args | grep -v grep | grep -q 424242 && echo FOUND-victim-process
                cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -q victim-env-secret && echo FOUND-victim-env
                nc -ll -p 9999 -e cat &
                i=0; until echo | nc -w 1 127.0.0.1 9999 >/dev/null 2>&1 || [ $i -ge 600 ]; do sleep 0.1; i=$((i+1)); done
                gateway=$(ip route | awk '/^default/ {{print $3}}')
                echo gateway=$gateway
                (echo x | nc -w 2 127.0.0.1 9999 >/dev/null && echo REACHED-self) & p1=$!
                (echo x | nc -w 2 {victim_ip} 8080 >/dev/null && echo REACHED-victim) & p2=$!
                (echo x | nc -w 2 $gateway {port} >/dev/null && echo REACHED-host) & p3=$!
                (echo x | nc -w 2 169.254.169.254 80 >/dev/null && echo REACHED-metadata) & p4=$!
                wait $p1 $p2 $p3 $p4; echo hunt-done
            """
            await manager.start(hostile, [gpus[1]], sh(script, image=docker_image))
            assert await exits.wait_for(hostile) is not None
            text = await log_text(manager, hostile, containing="hunt-done")
        finally:
            server.close()
        assert "REACHED-self" in text, text  # the probe itself works
        assert "gateway=" in text and "gateway=\n" not in text, text
        assert "FOUND" not in text and "REACHED-victim" not in text and "REACHED-host" not in text, text
        assert "REACHED-metadata" not in text and connections == [], text
        assert manager.containers.network_guard is not None and manager.containers.network_guard.active

    async def test_a_memory_hog_is_killed_alone(self, managers: Managers, gpus: list[str], docker_image: str) -> None:
        """A container over its memory limit is OOM-killed (exit -9); its neighbour keeps running."""
        manager, exits = managers()
        hog, neighbour = f"m{secrets.token_hex(3)}", f"n{secrets.token_hex(3)}"
        await manager.start(neighbour, [gpus[0]], sh("exec sleep 600", image=docker_image))
        await manager.start(hog, [gpus[1]], sh("head -c 200m /dev/zero | tail", image=docker_image, memory_mib=32))
        assert await exits.wait_for(hog) == -9
        info = inspect(resource_name(neighbour, manager.containers.options.owner))
        assert info is not None and info["State"]["Running"] and manager.running() == [neighbour]

    async def test_a_fork_bomb_stops_at_its_pids_limit(self, managers: Managers, gpus: list[str], docker_image: str) -> None:
        """Forking past ``pids_limit`` fails inside the container; the processes stay at the limit."""
        manager, exits = managers()
        rental = f"f{secrets.token_hex(3)}"
        # The bomb forks in a subshell, which dies at its first failed fork; the parent then counts with builtins only.
        script = (
            "(i=0; while [ $i -lt 200 ]; do sleep 5 & i=$((i+1)); done); "
            "read n < /sys/fs/cgroup/pids/pids.current || read n < /sys/fs/cgroup/pids.current; echo running=$n; echo bomb-done"
        )
        await manager.start(rental, [gpus[0]], sh(script, image=docker_image, pids_limit=32))
        text = await log_text(manager, rental, containing="bomb-done")
        running = int(text.split("running=")[1].split()[0])
        assert running <= 32 and "fork" in text.lower(), text
        await exits.wait_for(rental)


class TestRestart:
    """An agent killed (``kill -9``-like: the manager closed without stopping) leaves its containers running; the next adopts them."""

    async def test_kill_9_of_the_agent_leaves_the_container_running_for_the_next(
        self, managers: Managers, gpus: list[str], docker_image: str, owner: str, tmp_path: Path
    ) -> None:
        """A real ``kill -9`` of an agent process mid-life: its container keeps running, and a new manager on the
        same folder adopts it, follows its output and stops it (the container removed)."""
        rental = f"x{secrets.token_hex(3)}"
        script = (
            "import asyncio, sys\n"
            "from pathlib import Path\n"
            "from agent.gpu.sim import SimulatedBackend\n"
            "from agent.runtimes.containeropts import ContainerOptions\n"
            "from agent.runtimes.manager import WorkloadManager\n"
            "from shared.protocol import ContainerWorkload\n"
            "async def main():\n"
            "    backend = SimulatedBackend('sim:4xRTX4090', seed='c')\n"
            f"    manager = WorkloadManager(Path({str(tmp_path / 'work')!r}), backend, container=ContainerOptions(owner={owner!r}))\n"
            f"    spec = ContainerWorkload(image={docker_image!r}, command=['sh', '-c', 'i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.2; done'])\n"
            f"    await manager.start({rental!r}, [{gpus[0]!r}], spec)\n"
            "    print('started', flush=True)\n"
            "    await asyncio.sleep(600)\n"
            "asyncio.run(main())\n"
        )
        agent = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, cwd=str(Path(__file__).resolve().parents[1]), stdout=asyncio.subprocess.PIPE
        )
        try:
            assert agent.stdout is not None
            async with asyncio.timeout(WAIT):
                assert (await agent.stdout.readline()).strip() == b"started"
        finally:
            agent.kill()  # SIGKILL: no close, no clean-up
            await agent.wait()
        name = resource_name(rental, owner)
        assert (inspect(name) or {}).get("State", {}).get("Running"), "the container died with its agent"
        second, exits = managers()
        await second.resume()
        assert second.running() == [rental]
        await log_text(second, rental, containing="tick")
        assert (await second.stop(rental, timeout=1))["exit_code"] is not None
        await until(lambda: not exists("containers", name), what="the adopted container removed on stop")
        assert exits.calls == [] and second.running() == []

    async def test_containers_outlive_the_agent_and_are_readopted(self, managers: Managers, gpus: list[str], docker_image: str, owner: str) -> None:
        """Still running: adopted, its later output reaches the log once; ended meanwhile: reported; a container,
        network or volume of this owner that no rental owns: removed."""
        first, _ = managers()
        keeps, ends = f"k{secrets.token_hex(3)}", f"e{secrets.token_hex(3)}"
        wait_go = "while [ ! -e /workspace/go ]; do sleep 0.05; done"
        await first.start(keeps, [gpus[0]], sh(f"echo before; {wait_go}; echo after; exec sleep 600", image=docker_image))
        await first.start(ends, [gpus[1]], sh(f"{wait_go}; exit 7", image=docker_image))
        await log_text(first, keeps, containing="before")
        kept_id = inspect(resource_name(keeps, owner))["Id"]  # type: ignore[index]
        await first.close()  # as if killed: nothing stopped
        # A container of this owner that no rental owns (say, left by a start the agent died in).
        config = {"Image": docker_image, "Cmd": ["sleep", "600"], "Labels": {OWNER_LABEL: owner, RENTAL_LABEL: "ghost"}}
        status, body = dockerengine.request(
            "POST", "/containers/create?name=" + resource_name("ghost", owner), body=json.dumps(config).encode(),
            headers={"Content-Type": "application/json"},
        )
        assert status == 201, body
        labels = {OWNER_LABEL: owner, RENTAL_LABEL: "ghost-net"}
        network = {"Name": resource_name("ghost-net", owner), "Labels": labels, "IPAM": {"Config": [{"Subnet": "10.214.255.240/28"}]}}
        assert dockerengine.request("POST", "/networks/create", body=json.dumps(network).encode(), headers={"Content-Type": "application/json"})[0] == 201
        volume = {"Name": resource_name("ghost-vol", owner), "Labels": {OWNER_LABEL: owner, RENTAL_LABEL: "ghost-vol"}}
        assert dockerengine.request("POST", "/volumes/create", body=json.dumps(volume).encode(), headers={"Content-Type": "application/json"})[0] == 201
        for rental in (keeps, ends):
            put_file(resource_name(rental, owner), "/workspace", "go")
        await until(lambda: not (inspect(resource_name(ends, owner)) or {}).get("State", {}).get("Running", True), what="the ending container to exit")

        second, exits = managers()
        await second.resume()
        assert await exits.wait_for(ends) == 7
        assert second.running() == [keeps]
        info = inspect(resource_name(keeps, owner))
        assert info is not None and info["Id"] == kept_id and info["State"]["Running"]
        text = await log_text(second, keeps, containing="after")
        assert text.count("before") == 1 and text.count("after") == 1
        await until(lambda: not exists("containers", resource_name("ghost", owner)), what="the ghost removed")
        await until(lambda: not exists("networks", resource_name("ghost-net", owner)), what="the ghost network removed")
        await until(lambda: not exists("volumes", resource_name("ghost-vol", owner)), what="the ghost volume removed")
        assert workspace_kept(second, keeps)  # a rental's own stays
        assert (await second.stop(keeps, timeout=1))["exit_code"] == -15 and inspect(resource_name(keeps, owner)) is None


    async def test_another_agent_on_the_engine_leaves_them_alone(
        self, managers: Managers, gpus: list[str], docker_image: str, owner: str, tmp_path: Path
    ) -> None:
        """Several agents share one engine (``gpumarket up``): one starting up never sweeps another owner's containers."""
        mine, _ = managers()
        rental = f"a{secrets.token_hex(3)}"
        await mine.start(rental, [gpus[0]], sh("exec sleep 600", image=docker_image))
        neighbour, _ = managers(work_dir=tmp_path / "other-agent", options={"owner": f"{owner}-neighbour"})
        await neighbour.resume()
        assert neighbour.containers.options.owner != owner
        assert await neighbour.containers.sweep(lambda rental_id: False) == []  # nothing of its own to remove
        info = inspect(resource_name(rental, owner))
        assert info is not None and info["State"]["Running"] and exists("networks", resource_name(rental, owner))
        dockerengine.remove_owned(f"{owner}-neighbour")


class TestImages:
    """The provider's image policy, missing images and bad references: refused with the code and the reason."""

    async def test_an_image_outside_the_policy_is_refused(self, managers: Managers, gpus: list[str], docker_image: str) -> None:
        manager, _ = managers(options={"allowed_images": ("nvcr.io/*",)})
        with pytest.raises(BadRequest) as refused:
            await manager.start(f"p{secrets.token_hex(3)}", [gpus[0]], sh("true", image=docker_image))
        assert refused.value.code == "image_not_allowed" and "nvcr.io/*" in refused.value.message and manager.running() == []

    async def test_limits_above_the_hosts_are_refused_before_anything_is_made(
        self, managers: Managers, gpus: list[str], docker_image: str
    ) -> None:
        """More memory than the host has is ``limits_exceed_host``: no container, the GPUs free for the next start."""
        manager, _ = managers()
        _, memory = host_capacity()
        with pytest.raises(BadRequest) as refused:
            await manager.start(f"p{secrets.token_hex(3)}", [gpus[0]], sh("true", image=docker_image, memory_mib=memory + 1))
        assert refused.value.code == "limits_exceed_host" and manager.running() == []

    async def test_a_missing_image_fails_the_pull_with_the_registry_reason(self, managers: Managers, gpus: list[str], backend: SimulatedBackend) -> None:
        """``gpumarket-test/none:1`` is nowhere (and this machine is offline): ``image_pull_failed``, the GPUs free again."""
        progress = Progress()
        manager, _ = managers(on_progress=progress)
        rental = f"p{secrets.token_hex(3)}"
        with pytest.raises(BadRequest) as refused:
            await manager.start(rental, [gpus[0]], ContainerWorkload(image="gpumarket-test/none:1"))
        assert refused.value.code == "image_pull_failed" and "docker.io/gpumarket-test/none:1" in refused.value.message
        assert len(refused.value.message) > len("cannot pull docker.io/gpumarket-test/none:1: ")  # the engine's reason follows
        assert (rental, "pulling") in [(r, s) for r, s, _, _ in progress.events] and manager.running() == []
        for rental_id, stage, text, percent in progress.events:  # each fits the wire's workload_progress
            WorkloadProgressBody.model_validate({"rental_id": rental_id, "at": "2026-01-01T00:00:00Z", "stage": stage, "text": text, "percent": percent})

    async def test_an_image_over_the_size_limit_is_refused(self, managers: Managers, gpus: list[str], docker_image: str) -> None:
        manager, _ = managers(options={"max_image_mib": 1})
        with pytest.raises(BadRequest, match="at most 1 MiB") as refused:
            await manager.start(f"s{secrets.token_hex(3)}", [gpus[0]], sh("true", image=docker_image))
        assert refused.value.code == "image_too_large" and dockerengine.image_exists(docker_image)  # local: not removed

    async def test_a_pull_reports_progress_and_an_image_too_large_is_removed(self, tmp_path: Path) -> None:
        """Against a stand-in engine (this machine is offline): the pull's progress comes at most every
        ``progress_interval`` with a percentage, and an image over ``max_image_mib`` that the agent pulled
        is refused and removed again."""
        pulled: list[str] = []
        deleted: list[str] = []

        async def version(request: web.Request) -> web.Response:
            return web.json_response({"ApiVersion": "1.41", "Version": "20.10.24", "Components": [{"Name": "Engine"}]})

        async def inspect_image(request: web.Request) -> web.Response:
            if not pulled:
                return web.json_response({"message": "No such image"}, status=404)
            return web.json_response({"Id": "sha256:" + "a" * 64, "Size": 3 << 20, "Config": {}})

        async def pull(request: web.Request) -> web.StreamResponse:
            pulled.append(request.query["fromImage"])
            response = web.StreamResponse()
            await response.prepare(request)
            for current in range(0, 101, 10):
                event = {"status": "Downloading", "id": "layer1", "progressDetail": {"current": current, "total": 100}}
                await response.write(json.dumps(event).encode() + b"\r\n")
                await asyncio.sleep(0.03)
            await response.write(b'{"status": "Download complete", "id": "layer1"}\r\n')
            return response

        async def delete_image(request: web.Request) -> web.Response:
            deleted.append(request.match_info["name"])
            return web.json_response([{"Deleted": request.match_info["name"]}])

        async def ping(request: web.Request) -> web.Response:
            return web.Response(text="OK")

        app = web.Application()
        app.add_routes([
            web.get("/_ping", ping), web.get("/version", version), web.post("/v1.41/images/create", pull),
            web.get("/v1.41/images/{name:.+}/json", inspect_image), web.delete("/v1.41/images/{name:.+}", delete_image),
        ])
        runner = web.AppRunner(app)
        await runner.setup()
        socket = tmp_path / "engine.sock"
        await web.UnixSite(runner, str(socket)).start()
        progress = Progress()
        runtime = ContainerRuntime(
            tmp_path, ContainerOptions(owner="o", docker_url=f"unix://{socket}", max_image_mib=2, progress_interval=0.1),
            device_requests=False, on_progress=progress,
        )
        try:
            with pytest.raises(BadRequest, match="at most 2 MiB") as refused:
                await runtime.prepare("r-1", ContainerWorkload(image="nvcr.io/nvidia/pytorch:24.05-py3"))
        finally:
            await runtime.close()
            await runner.cleanup()
        assert refused.value.code == "image_too_large" and pulled == ["nvcr.io/nvidia/pytorch:24.05-py3"]
        assert deleted == ["sha256:" + "a" * 64]
        stages = [stage for _, stage, _, _ in progress.events]
        assert stages[0] == "pulling" and stages[-1] == "pulled" and 3 <= len(stages) <= 8  # throttled: 11 events, ~0.35 s
        percents = [p for _, stage, _, p in progress.events if stage == "pulling" and p is not None]
        assert percents and percents == sorted(percents) and all(0 <= p <= 100 for p in percents)

    async def test_an_invalid_reference_is_refused(self, managers: Managers, gpus: list[str]) -> None:
        """Upper case, a leading dash, an option look-alike: refused by the protocol, and by the runtime if it ever got one."""
        for image in ("Ubuntu:24.04", "-v/:/host", "ubuntu:24.04 --privileged"):
            with pytest.raises(ValidationError):
                ContainerWorkload(image=image)
        manager, _ = managers()
        with pytest.raises(BadRequest) as refused:
            await manager.start(f"b{secrets.token_hex(3)}", [gpus[0]], ContainerWorkload.model_construct(image="-v/:/host"))
        assert refused.value.code == "bad_workload_spec"


class TestNetworkGuardMarker:
    """A non-root agent trusts the firewall rules only when root recorded putting them in place this boot."""

    async def test_a_non_root_agent_reads_roots_marker(self, tmp_path: Path) -> None:
        marker = tmp_path / "gpumarket-netguard"
        off = await install_guard(marker=marker, euid=1000)
        assert not off.active and "gpumarket agent netguard" in off.reason
        write_marker(NetGuardStatus(True, "rules in place"), marker)
        on = await install_guard(marker=marker, euid=1000)
        assert on.active and str(marker) in on.reason
        write_marker(NetGuardStatus(False, "iptables is not installed"), marker)
        assert not marker.exists() and not (await install_guard(marker=marker, euid=1000)).active

    async def test_a_marker_someone_else_wrote_is_not_trusted(self, tmp_path: Path) -> None:
        """A marker not owned by root (a renter or the agent writing it) says nothing."""
        marker = tmp_path / "gpumarket-netguard"
        marker.write_text("active\n")
        os.chown(marker, 1000, 1000)
        assert not (await install_guard(marker=marker, euid=1000)).active
