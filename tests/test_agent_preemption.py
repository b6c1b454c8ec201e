"""The agent carries out a preemption in order: the new workload's image first, then the victims' stop, then its start.

``start_workload`` with ``preempts`` through the agent's ``CommandExecutor`` over a real ``WorkloadManager``:
containers against this machine's Docker engine (the ``docker_image`` fixture; a missing image is a pull that
fails, this machine being offline), holds with none. The master's side: ``tests/test_preemption.py``.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.commands import CommandExecutor
from agent.logship import LogShipper
from agent.runtimes.manager import WorkloadManager
from shared import protocol
from shared.errors import ProtocolError
from shared.protocol import ContainerWorkload, HoldWorkload
from tests.workloadfixtures import container_manager


@pytest.fixture
async def manager(tmp_path: Path, docker_image: str) -> AsyncIterator[WorkloadManager]:
    async with container_manager(tmp_path / "work", seed="p") as made:
        yield made


def executor(tmp_path: Path, manager: WorkloadManager) -> CommandExecutor:
    async def send(body: protocol.WorkloadLogsBody) -> None:
        pass

    async def unused(*args: Any) -> Any:
        raise AssertionError("not called")

    return CommandExecutor(workloads=manager, backend=manager.backend, logs=LogShipper(tmp_path, manager, send), measure=unused,
                           install_certificate=unused)  # fmt: skip


def start(rental_id: str, gpu: str, workload: Any, *victims: str) -> protocol.CommandBody:
    preempts = [protocol.Preemption(rental_id=v, grace_s=1, reason=f"preempted by rental {rental_id}") for v in victims]
    command = protocol.StartWorkload(rental_id=rental_id, gpu_uuids=[gpu], workload=workload, preempts=preempts or None)
    return protocol.CommandBody.of(f"cmd-{secrets.token_hex(4)}", command)


def busy(image: str) -> ContainerWorkload:
    return ContainerWorkload.model_validate({"image": image, "command": ["sh", "-c", "exec sleep 600"]})


class TestOrderedPreemption:
    async def test_a_pull_that_fails_never_touches_the_victim(self, tmp_path: Path, manager: WorkloadManager, docker_image: str) -> None:
        """Regression (issue 39): the image of the preempting rental cannot be pulled, so its start fails with
        ``image_pull_failed`` and lists no victim, and the victim's container still runs."""
        commands = executor(tmp_path, manager)
        gpu = manager.backend.gpus()[0].uuid
        victim, taker = f"v{secrets.token_hex(3)}", f"t{secrets.token_hex(3)}"
        assert (await commands.execute(start(victim, gpu, busy(docker_image)))).ok
        result = await commands.execute(start(taker, gpu, ContainerWorkload(image="gpumarket-test/none:1"), victim))
        assert not result.ok
        assert (result.data["code"], result.data["preempted"]) == ("image_pull_failed", [])
        assert manager.running() == [victim]
        workload = manager.workload(victim)
        assert workload is not None and workload.handle is not None and not workload.handle.exited

    async def test_a_pull_that_succeeds_stops_the_victim_then_starts(self, tmp_path: Path, manager: WorkloadManager, docker_image: str) -> None:
        """With the image here, the victim is stopped (its log says by whom) and the new workload starts on its GPU."""
        commands = executor(tmp_path, manager)
        gpu = manager.backend.gpus()[0].uuid
        victim, taker = f"v{secrets.token_hex(3)}", f"t{secrets.token_hex(3)}"
        assert (await commands.execute(start(victim, gpu, busy(docker_image)))).ok
        result = await commands.execute(start(taker, gpu, busy(docker_image), victim))
        assert result.ok, result.detail
        assert (result.data["kind"], result.data["preempted"]) == ("container", [victim])
        assert manager.running() == [taker]

    async def test_a_gpu_held_by_a_rental_it_does_not_preempt_fails_the_start_first(
        self, tmp_path: Path, manager: WorkloadManager
    ) -> None:
        """The GPUs are checked before anything is stopped: a start that would still find its GPU taken stops no victim."""
        commands = executor(tmp_path, manager)
        first, second = (g.uuid for g in manager.backend.gpus())
        victim, bystander, taker = (f"{c}{secrets.token_hex(3)}" for c in "vbt")
        assert (await commands.execute(start(victim, first, HoldWorkload()))).ok
        assert (await commands.execute(start(bystander, second, HoldWorkload()))).ok
        refused = await commands.execute(start(taker, second, HoldWorkload(), victim))
        assert (refused.ok, refused.data["code"], refused.data["preempted"]) == (False, "gpu_in_use", [])
        assert manager.running() == sorted([victim, bystander])
        taken = await commands.execute(start(taker, first, HoldWorkload(), victim))
        assert taken.ok and taken.data["preempted"] == [victim] and manager.running() == sorted([bystander, taker])


class TestWire:
    def test_a_start_without_victims_carries_no_preempts_so_older_agents_take_it(self) -> None:
        """``preempts`` is left off the wire when there is none: an agent older than it still runs every other start."""
        plain = protocol.StartWorkload(rental_id="r-1", gpu_uuids=["GPU-1"])
        assert "preempts" not in protocol.command_args(plain)
        taking = protocol.StartWorkload(rental_id="r-2", gpu_uuids=["GPU-1"], preempts=[protocol.Preemption(rental_id="r-1", grace_s=30)])
        assert protocol.command_args(taking)["preempts"] == [{"rental_id": "r-1", "grace_s": 30.0}]

    @pytest.mark.parametrize("victim", [{"rental_id": "r-1", "grace_s": 601}, {"rental_id": "r-1", "reason": "two\nlines"}, {"rental_id": ""}])
    def test_a_victim_is_checked_as_a_stop_is(self, victim: dict[str, Any]) -> None:
        """Each victim's grace, reason and id are bounded as ``stop_workload``'s: a bad one refuses the whole start."""
        body = protocol.CommandBody.of("c-1", protocol.StartWorkload(rental_id="r-2", gpu_uuids=["GPU-1"]))
        bad = body.model_copy(update={"args": {**body.args, "preempts": [victim]}})
        with pytest.raises(ProtocolError) as refused:
            protocol.decode_command(bad)
        assert refused.value.code == "bad_command"
