"""The GPU challenge on the agent (``agent/verification.py``) through the rental path: the challenge image
(``gpumarket/images.py``: ``CHALLENGE_IMAGE``, built with this machine's engine) runs as a container workload of a
real ``WorkloadManager``, with the claimed GPUs by UUID (simulated GPUs), the files exchanged in its private
``/workspace``; the commands go through the agent's ``CommandExecutor``. An honest run's commitment and openings pass
the master's ``verify``; a rental's start on the GPU cancels a challenge (the rental starts, the challenge's late
reveal answers ``challenge_cancelled``); the challenge's workload is never reported as a rental's. A challenge never
outlives its agent for long: the next agent removes what an earlier one left, and the program stops waiting for a
reveal soon after the challenge's deadline.

The master's side of the flow: tests/test_verification_flow.py.
"""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from agent.commands import CommandExecutor
from agent.gpu.sim import SimulatedBackend
from agent.logship import LogShipper
from agent.runtimes.containeropts import ContainerOptions, resource_name
from agent.runtimes.manager import WorkloadManager
from agent.verification import WAIT_ENV, ChallengeError, ChallengeRunner, is_challenge, workload_id
from gpumarket import images
from master.services.hosts import challenge as challenge_protocol
from shared import protocol
from shared.ids import new_id
from tests import dockerengine
from tests.helpers import eventually
from tests.workloadfixtures import container_manager


@pytest.fixture(scope="module")
def challenge_image(docker_image: str) -> str:
    try:
        return images.challenge_image()
    except images.ImageBuildError as exc:
        pytest.fail(str(exc))


@pytest.fixture
async def manager(tmp_path: Path, challenge_image: str) -> AsyncIterator[WorkloadManager]:
    async with container_manager(tmp_path / "work", seed="v") as made:
        yield made


@pytest.fixture
def agent(tmp_path: Path, manager: WorkloadManager, challenge_image: str) -> CommandExecutor:
    async def send(body: protocol.WorkloadLogsBody) -> None:
        pass

    async def unused(*args: Any) -> Any:
        raise AssertionError("not called")

    runner = ChallengeRunner(manager, image=challenge_image)
    return CommandExecutor(workloads=manager, backend=manager.backend, logs=LogShipper(tmp_path, manager, send), measure=unused,
                           install_certificate=unused, challenges=runner)  # fmt: skip


def uuids(manager: WorkloadManager) -> list[str]:
    return [gpu.uuid for gpu in manager.backend.gpus()]


def challenge_for(gpu_uuids: list[str]) -> tuple[dict[str, Any], protocol.CommandBody]:
    """The master's challenge for simulated RTX 4090s (``make_challenge`` scaled down for a CPU) and its command."""
    challenge_id = new_id("gv")
    claims = [{"uuid": uuid, "model_key": "rtx-4090", "vram_mib": 24564} for uuid in gpu_uuids]
    challenge = challenge_protocol.make_challenge(challenge_id=challenge_id, seed=secrets.token_bytes(32), gpus=claims,
                                                  dtype="bf16", simulation=True)  # fmt: skip
    command = protocol.StartChallenge(challenge_id=challenge_id, gpu_uuids=gpu_uuids, challenge=challenge, timeout_s=300)
    return challenge, protocol.CommandBody.of(f"cmd-{secrets.token_hex(4)}", command)


def container_env(manager: WorkloadManager, rental_id: str) -> dict[str, str]:
    name = resource_name(rental_id, manager.containers.options.owner)
    status, body = dockerengine.request("GET", f"/containers/{quote(name, safe='')}/json")
    assert status == 200, body
    return dict(item.split("=", 1) for item in json.loads(body)["Config"]["Env"])


class TestChallenge:
    async def test_an_honest_run_in_a_container_with_its_gpus_passes(self, agent: CommandExecutor, manager: WorkloadManager) -> None:
        gpus = uuids(manager)
        challenge, start = challenge_for(gpus)
        result = await agent.result_for(start)
        assert result.ok, result.detail
        commitment = result.data["commitment"]
        assert commitment["challenge_id"] == challenge["challenge_id"] and set(commitment["gpus"]) == set(gpus)
        # It ran as a renter's container would: its GPUs by UUID, and it runs until its reveal.
        rental_id = workload_id(challenge["challenge_id"])
        assert container_env(manager, rental_id)["NVIDIA_VISIBLE_DEVICES"] == ",".join(gpus)
        assert rental_id in manager.running() and is_challenge(rental_id)
        # A resend of the start answers the same commitment, without a second run.
        again = await agent.result_for(protocol.CommandBody.of("cmd-resend", protocol.decode_command(start)))
        assert again.ok and again.data["commitment"] == commitment
        reveal = challenge_protocol.choose_reveal(random.Random(7), challenge)
        opened = await agent.result_for(protocol.CommandBody.of(
            f"cmd-{secrets.token_hex(4)}", protocol.RevealChallenge(challenge_id=challenge["challenge_id"], reveal=reveal)))  # fmt: skip
        assert opened.ok, opened.detail
        verdicts = challenge_protocol.verify(challenge, commitment, reveal, opened.data["openings"], committed_after_s=1.0)
        assert {uuid: v.outcome for uuid, v in verdicts.items()} == dict.fromkeys(gpus, "passed"), verdicts
        # Over: the workload and its /workspace are gone.
        assert rental_id not in manager.running()
        assert await manager.containers.workspace_path(rental_id) is None

    async def test_a_rental_on_its_gpu_cancels_the_challenge_and_starts(self, agent: CommandExecutor, manager: WorkloadManager) -> None:
        gpus = uuids(manager)
        challenge, start = challenge_for(gpus[:1])
        committed = await agent.result_for(start)
        assert committed.ok, committed.detail
        rental = protocol.StartWorkload(rental_id=f"r{secrets.token_hex(3)}", gpu_uuids=gpus[:1], workload=protocol.HoldWorkload())
        started = await agent.result_for(protocol.CommandBody.of(f"cmd-{secrets.token_hex(4)}", rental))
        assert started.ok, started.detail
        assert workload_id(challenge["challenge_id"]) not in manager.running()
        reveal = challenge_protocol.choose_reveal(random.Random(7), challenge)
        late = await agent.result_for(protocol.CommandBody.of(
            f"cmd-{secrets.token_hex(4)}", protocol.RevealChallenge(challenge_id=challenge["challenge_id"], reveal=reveal)))  # fmt: skip
        assert not late.ok and late.data == {"code": "challenge_cancelled"}, late
        # A challenge on a GPU the rental holds cannot start (the rental is never interrupted).
        _, second = challenge_for(gpus[:1])
        refused = await agent.result_for(second)
        assert not refused.ok and refused.data.get("code") == "gpu_in_use", refused


def start_command(challenge: dict[str, Any], gpu_uuids: list[str]) -> protocol.StartChallenge:
    return protocol.StartChallenge(challenge_id=challenge["challenge_id"], gpu_uuids=gpu_uuids, challenge=challenge, timeout_s=300)


class TestNeverPastItsAgent:
    async def test_a_challenge_an_agent_left_running_is_removed_when_the_next_agent_starts(
        self, tmp_path: Path, manager: WorkloadManager, challenge_image: str
    ) -> None:  # fmt: skip
        """The agent died after its challenge committed: its container runs on, waiting for a reveal that can never
        reach it. The next agent re-adopts it (same work folder, same owner) and removes it, container and folder."""
        gpus = uuids(manager)
        challenge, _ = challenge_for(gpus[:1])
        committed = await ChallengeRunner(manager, image=challenge_image).start(start_command(challenge, gpus[:1]))
        assert committed.commitment["challenge_id"] == challenge["challenge_id"]
        rental_id = workload_id(challenge["challenge_id"])
        name = resource_name(rental_id, manager.containers.options.owner)
        await manager.close(stop_workloads=False)  # the agent goes; its workloads stay, recorded for the next one
        assert dockerengine.request("GET", f"/containers/{quote(name, safe='')}/json")[0] == 200
        after = WorkloadManager(manager.work_dir, SimulatedBackend("sim:2xRTX4090", seed="v"),
                                container=ContainerOptions(owner=manager.containers.options.owner),
                                stop_timeout=2.0, kill_timeout=5.0, check_interval=0.05)  # fmt: skip
        try:
            await after.resume()
            assert rental_id in after.running()  # re-adopted
            assert await ChallengeRunner(after, image=challenge_image).remove_orphans() == [rental_id]
            assert rental_id not in after.running() and not (after.work_dir / rental_id).exists()
            assert dockerengine.request("GET", f"/containers/{quote(name, safe='')}/json")[0] == 404
        finally:
            await after.close(stop_workloads=True)

    async def test_a_challenge_that_ended_while_its_agent_was_down_leaves_nothing(
        self, tmp_path: Path, manager: WorkloadManager, challenge_image: str
    ) -> None:  # fmt: skip
        """Its folder (the seed, the answers) is removed too when the next agent starts, though nothing runs."""
        (manager.work_dir / workload_id("gv-gone")).mkdir()
        (manager.work_dir / workload_id("gv-gone") / "challenge.json").write_text("{}")
        (manager.work_dir / "r-kept").mkdir()
        assert await ChallengeRunner(manager, image=challenge_image).remove_orphans() == [workload_id("gv-gone")]
        assert not (manager.work_dir / workload_id("gv-gone")).exists() and (manager.work_dir / "r-kept").exists()

    async def test_the_program_waits_for_its_reveal_until_the_deadline_and_a_margin_then_ends(
        self, manager: WorkloadManager, challenge_image: str
    ) -> None:  # fmt: skip
        """The agent sets the program's wait from the challenge's deadline (not its 600 s default): with no reveal
        (the agent gone, the master silent) the container ends on its own soon after; a late reveal then fails and
        the run's folder goes. A failed start removes its workload at once."""
        gpus = uuids(manager)
        challenge, _ = challenge_for(gpus[:1])
        challenge["deadline_s"] = 1.0
        runner = ChallengeRunner(manager, image=challenge_image, reveal_margin_s=2.0)
        command = start_command(challenge, gpus[:1])
        assert runner.program_wait_s(command) == 3.0
        assert runner.program_wait_s(command.model_copy(update={"challenge": {"gpus": []}})) == 300.0  # no deadline: the command's
        await runner.start(command)
        rental_id = workload_id(challenge["challenge_id"])
        assert container_env(manager, rental_id)[WAIT_ENV] == "3"
        await eventually(lambda: _not_running(manager, rental_id), timeout=60, what="the program to stop waiting")
        reveal = challenge_protocol.choose_reveal(random.Random(7), challenge)
        with pytest.raises(ChallengeError, match=r"exited without writing openings\.json"):
            await runner.reveal(protocol.RevealChallenge(challenge_id=challenge["challenge_id"], reveal=reveal))
        assert not (manager.work_dir / rental_id).exists()
        # No commitment in time: the start fails and its workload goes (it does not compute on for nobody).
        slow, _ = challenge_for(gpus[:1])
        with pytest.raises(ChallengeError, match=r"no commitment\.json"):
            await runner.start(protocol.StartChallenge(challenge_id=slow["challenge_id"], gpu_uuids=gpus[:1], challenge=slow, timeout_s=0.001))
        assert workload_id(slow["challenge_id"]) not in manager.running()


async def _not_running(manager: WorkloadManager, rental_id: str) -> bool:
    return rental_id not in manager.running()
