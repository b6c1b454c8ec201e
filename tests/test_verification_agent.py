"""The GPU challenge on the agent (``agent/verification.py``) through the rental path: the challenge image
(``gpumarket/images.py``: ``CHALLENGE_IMAGE``, built with this machine's engine) runs as a container workload of a
real ``WorkloadManager``, with the claimed GPUs by UUID (simulated GPUs), the files exchanged in its private
``/workspace``; the commands go through the agent's ``CommandExecutor``. An honest run's commitment and openings pass
the master's ``verify``; a rental's start on the GPU cancels a challenge (the rental starts, the challenge's late
reveal answers ``challenge_cancelled``); the challenge's workload is never reported as a rental's.

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
from agent.logship import LogShipper
from agent.runtimes.containeropts import resource_name
from agent.runtimes.manager import WorkloadManager
from agent.verification import ChallengeRunner, is_challenge, workload_id
from gpumarket import images
from master.services.hosts import challenge as challenge_protocol
from shared import protocol
from shared.ids import new_id
from tests import dockerengine
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
