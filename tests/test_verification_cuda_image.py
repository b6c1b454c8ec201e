"""The GPU challenge's CUDA image (``agent/challenge_image.py``, docs/verification.md "The challenge images"): which
image an agent runs challenges in (the CUDA image on NVML, the CPU image on sim and replay, the ``challenge_image``
setting over both), what the CUDA image is built from (a base pinned by digest, the agent's program; its name a hash
of both), and its build through this machine's engine. No registry is reachable here, so the base is a stand-in: the
CPU challenge image re-tagged, built ``FROM`` like the PyTorch image would be; the built image runs the program
(``ready.json``) and an honest challenge in it passes through the agent's rental path."""

from __future__ import annotations

import json
import random
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pydantic
import pytest

from agent.challenge_image import (
    CPU_IMAGE,
    CUDA_REPO,
    DEFAULT_CUDA_BASE,
    PROGRAM_DIR,
    SOURCE,
    ChallengeImageError,
    CudaImageBuilder,
    challenge_image_for,
    cuda_image,
)
from agent.runtimes.manager import WorkloadManager
from agent.service import challenge_image_names
from agent.verification import ChallengeError, ChallengeRunner, workload_id
from gpumarket import images
from master.services.hosts import challenge as challenge_protocol
from shared import protocol
from shared.ids import new_id
from shared.settings import AgentSettings
from tests import dockerengine
from tests.workloadfixtures import container_manager


class TestTheChoice:
    def test_nvml_runs_the_cuda_image_sim_and_replay_the_cpu_one_and_the_setting_wins(self) -> None:
        cuda = cuda_image()
        assert cuda.name.startswith(f"{CUDA_REPO}:") and cuda.base == DEFAULT_CUDA_BASE
        assert challenge_image_for("nvml", None, cuda) == cuda.name
        assert challenge_image_for("sim", None, cuda) == challenge_image_for("replay", None, cuda) == CPU_IMAGE
        for backend in ("nvml", "sim", "replay"):
            assert challenge_image_for(backend, "registry.example.com/verify:7", cuda) == "registry.example.com/verify:7"

    def test_the_base_must_be_pinned_by_digest_and_the_setting_defaults_to_the_choice(self) -> None:
        settings = AgentSettings()
        assert settings.challenge_image is None and settings.challenge_cuda_base == DEFAULT_CUDA_BASE
        assert "@sha256:" in DEFAULT_CUDA_BASE and "2.11.0-cuda" in DEFAULT_CUDA_BASE
        for unpinned in ("pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime", "pytorch/pytorch@sha256:abc"):
            with pytest.raises(pydantic.ValidationError):
                AgentSettings(challenge_cuda_base=unpinned)

    def test_a_provider_allowing_only_some_images_still_allows_the_challenge_images(self) -> None:
        """``allowed_images`` patterns are canonical names: the challenge images' are added as such (any tag)."""
        assert challenge_image_names(AgentSettings()) == ("docker.io/gpumarket/verify", f"docker.io/{CUDA_REPO}")
        assert challenge_image_names(AgentSettings(challenge_image="nvcr.io/acme/verify:3")) == ("nvcr.io/acme/verify",)

    def test_the_name_is_a_hash_of_the_base_and_the_program(self, tmp_path: Path) -> None:
        """The same base and program give the same name (nothing is built again); another base or another program
        another name (an agent whose program changed builds anew)."""
        assert cuda_image().name == cuda_image().name
        assert cuda_image("example.com/torch@sha256:" + "1" * 64).name != cuda_image().name
        for name in ("program.py", "compute.py"):
            (tmp_path / name).write_bytes((SOURCE / name).read_bytes())
        assert cuda_image(source=tmp_path).name == cuda_image().name
        (tmp_path / "compute.py").write_bytes((SOURCE / "compute.py").read_bytes() + b"\n# changed\n")
        assert cuda_image(source=tmp_path).name != cuda_image().name


@pytest.fixture(scope="module")
def stand_in_base(docker_image: str) -> Iterator[str]:
    """The CPU challenge image (python3 + numpy) tagged as a PyTorch base would be named: no registry here."""
    try:
        cpu = images.challenge_image()
    except images.ImageBuildError as exc:
        pytest.fail(str(exc))
    repo, tag = "gpumarket-test/torch-stand-in", secrets.token_hex(4)
    dockerengine.engine_json("POST", f"/images/{quote(cpu, safe='')}/tag?repo={repo}&tag={tag}")
    yield f"{repo}:{tag}"
    dockerengine.request("DELETE", f"/images/{quote(f'{repo}:{tag}', safe='')}?noprune=1")


@pytest.fixture
async def manager(tmp_path: Path, stand_in_base: str) -> AsyncIterator[WorkloadManager]:
    async with container_manager(tmp_path / "work", seed="c") as made:
        yield made


def remove_image(name: str) -> None:
    dockerengine.request("DELETE", f"/images/{quote(name, safe='')}?force=1")


class TestTheBuild:
    async def test_the_cuda_image_is_built_from_its_base_once_and_an_honest_challenge_passes_in_it(
        self, manager: WorkloadManager, stand_in_base: str
    ) -> None:  # fmt: skip
        image = cuda_image(stand_in_base)
        builder = CudaImageBuilder(manager.containers.docker, image)
        try:
            assert await builder.ensure() == image.name
            built = dockerengine.engine_json("GET", f"/images/{quote(image.name, safe='')}/json")
            assert built["Config"]["Cmd"] == ["python3", f"{PROGRAM_DIR}/program.py", "/workspace"]
            assert built["Config"]["Labels"]["gpumarket.challenge.base"] == stand_in_base
            # Another agent (a restart) finds it: the same image, nothing built again.
            assert await CudaImageBuilder(manager.containers.docker, cuda_image(stand_in_base)).ensure() == image.name
            again = dockerengine.engine_json("GET", f"/images/{quote(image.name, safe='')}/json")
            assert again["Id"] == built["Id"]
            # It runs the program: ready.json, then an honest challenge through the rental path passes.
            runner = ChallengeRunner(manager, image=image.name, prepare=builder.ensure)
            gpus = [gpu.uuid for gpu in manager.backend.gpus()]
            challenge = challenge_protocol.make_challenge(
                challenge_id=new_id("gv"), seed=secrets.token_bytes(32), dtype="bf16", simulation=True,
                gpus=[{"uuid": uuid, "model_key": "rtx-4090", "vram_mib": 24564} for uuid in gpus],
            )  # fmt: skip
            committed = await runner.start(start(challenge, gpus))
            folder = await manager.containers.workspace_path(workload_id(challenge["challenge_id"]))
            assert folder is not None
            assert json.loads((folder / "ready.json").read_text()) == {"backend": "numpy", "devices": 0}
            reveal = challenge_protocol.choose_reveal(random.Random(3), challenge)
            opened = await runner.reveal(protocol.RevealChallenge(challenge_id=challenge["challenge_id"], reveal=reveal))
            verdicts = challenge_protocol.verify(challenge, committed.commitment, reveal, opened.openings, committed_after_s=1.0)
            assert {v.outcome for v in verdicts.values()} == {"passed"}, verdicts
        finally:
            remove_image(image.name)

    async def test_a_base_that_cannot_be_had_fails_the_build_and_the_challenge_says_why(
        self, manager: WorkloadManager
    ) -> None:  # fmt: skip
        """A base the engine cannot pull (here: a registry that refuses connections) fails the build with the engine's
        reason, and a challenge's start fails as its image not being available, without starting anything."""
        image = cuda_image("127.0.0.1:9/none/torch@sha256:" + "0" * 64)
        builder = CudaImageBuilder(manager.containers.docker, image, build_timeout=120.0)
        with pytest.raises(ChallengeImageError, match="failed"):
            await builder.ensure()
        runner = ChallengeRunner(manager, image=image.name, prepare=builder.ensure)
        gpus = [manager.backend.gpus()[0].uuid]
        challenge: dict[str, Any] = {"challenge_id": new_id("gv"), "deadline_s": 60.0, "gpus": []}
        with pytest.raises(ChallengeError, match="is not available"):
            await runner.start(start(challenge, gpus))
        assert manager.running() == []


def start(challenge: dict[str, Any], gpus: list[str]) -> protocol.StartChallenge:
    return protocol.StartChallenge(challenge_id=challenge["challenge_id"], gpu_uuids=gpus, challenge=challenge, timeout_s=300)
