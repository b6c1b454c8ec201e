"""Workloads on a provider host: GPU isolation, cgroup limits, logs, exits, stops and restarts.

Real processes (``python -c`` and ``sh -c``) and, where this host allows, real cgroups; the
only stand-in is the GPU hardware (the simulated backend). Every process a test starts
carries its rental id in ``GPUMARKET_RENTAL_ID``; the ``prefix`` fixture kills any that
outlive the test. Waiting is event-driven (``on_exit``) or a short bounded poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shlex
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from agent.gpu.base import GpuInfo, GpuSample
from agent.gpu.sim import SimulatedBackend
from agent.runtimes.base import host_capacity
from agent.runtimes.cgroups import (
    MIB,
    CgroupLimiter,
    CgroupSupport,
    NoCgroupLimiter,
    detect_cgroup_support,
)
from agent.runtimes.container import ContainerRuntime
from agent.runtimes.containeropts import ContainerOptions, PreparedImage
from agent.runtimes.isolation import ProcessIsolation, isolation_facts
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.pids import process_start_time
from shared.errors import BadRequest, Conflict, NotFound
from shared.protocol import (
    MAX_STOP_GRACE_S,
    MAX_STOP_REASON_CHARS,
    ContainerWorkload,
    GpuShare,
    HoldWorkload,
    ProcessWorkload,
    StartWorkload,
    StopWorkload,
    WorkloadSpec,
)
from tests.helpers import eventually
from tests.workloadfixtures import Exits

PY = sys.executable
# These tests run workloads as the agent's own user (tests/test_process_isolation.py: under uids of their own).
UNISOLATED = isolation_facts(ProcessIsolation("none", "the tests' choice"), container_engine=None, allow_unisolated=True)
WAIT = 10.0  # the longest any one wait may take before the test fails; never slept through


def py(code: str) -> list[str]:
    return [PY, "-c", code]


class MigEnabledBackend:
    """A simulated A100 host with MIG mode on (a backend lists GPUs, not their MIG instances)."""

    name = "sim"

    def __init__(self) -> None:
        self._sim = SimulatedBackend("sim:1xA100-80GB", seed="t")

    def gpus(self) -> list[GpuInfo]:
        return [dataclasses.replace(g, mig_mode=True) for g in self._sim.gpus()]

    def sample(self) -> list[GpuSample]:
        return self._sim.sample()

    def set_power_limit(self, index: int, watts: float) -> float:
        return self._sim.set_power_limit(index, watts)

    def restore_power_limit(self, index: int) -> float:
        return self._sim.restore_power_limit(index)

    def close(self) -> None:
        self._sim.close()


def _kill_leftovers(prefix: str) -> list[int]:
    """SIGKILL (and reap, when ours) every process whose GPUMARKET_RENTAL_ID starts with ``prefix``."""
    marker = f"GPUMARKET_RENTAL_ID={prefix}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if any(item.startswith(marker) for item in environ.split(b"\0")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    for pid in killed:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return killed


@pytest.fixture
def prefix() -> Iterator[str]:
    """A rental id prefix of this test's own; processes still carrying it afterwards are killed."""
    value = f"t{secrets.token_hex(4)}"
    yield value
    _kill_leftovers(value)


Managers = Callable[..., WorkloadManager]


@pytest.fixture
async def managers(
    tmp_path: Path, backend: SimulatedBackend, cgroups: CgroupLimiter, exits: Exits, prefix: str
) -> AsyncIterator[Managers]:
    """Makes managers over one work dir (short timeouts); stops what they still run afterwards."""
    made: list[WorkloadManager] = []

    def make(**overrides: Any) -> WorkloadManager:
        options: dict[str, Any] = {
            "backend": backend, "on_exit": exits, "cgroups": cgroups, "isolation": UNISOLATED,
            "stop_timeout": 2.0, "kill_timeout": 2.0, "check_interval": 0.02,
        }
        options.update(overrides)
        manager = WorkloadManager(options.pop("work_dir", tmp_path / "work"), **options)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        await manager.close(stop_workloads=True)


async def file_text(path: Path, *, containing: str = "") -> str:
    """The file's text once it exists (and holds ``containing``), polled briefly."""

    async def check() -> str | None:
        with contextlib.suppress(FileNotFoundError):
            text = path.read_text()
            if text and containing in text:
                return text
        return None

    return await eventually(check, timeout=WAIT, every=0.01, what=f"{path.name} to be written")


async def gone(pid: int) -> None:
    async def check() -> bool:
        return process_start_time(pid) is None

    await eventually(check, timeout=WAIT, every=0.01, what=f"pid {pid} to end")


def registry(manager: WorkloadManager) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(manager.registry_path.read_text())
    return data


SLEEP = ProcessWorkload(argv=["sleep", "60"])
IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "open('ready', 'w').close()\n"
    "while True: time.sleep(1)"
)
HOLD = HoldWorkload()
SHARE_ENV = ("GPUMARKET_GPU_MILLI", "GPUMARKET_GPU_MEMORY_MIB", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


def share(milli: int, memory_mib: int = 0) -> GpuShare:
    return GpuShare(milli=milli, memory_mib=memory_mib)


class TestIsolation:
    """A process workload sees only its GPUs, a clean environment and its own folder."""

    async def test_process_sees_only_its_gpus_and_a_clean_environment_in_its_folder(
        self, managers: Managers, exits: Exits, gpus: list[str], prefix: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The child's environment names only its GPU, carries none of the agent's secrets, and it runs in its folder."""
        monkeypatch.setenv("GPUMARKET_TEST_AGENT_SECRET", "hunter2")
        manager = managers()
        rental = f"{prefix}-env"
        dump = "import json, os; json.dump({'env': dict(os.environ), 'cwd': os.getcwd()}, open('seen.json', 'w'))"
        await manager.start(rental, [gpus[1]], ProcessWorkload(argv=py(dump), env={"MODEL": "llama"}))
        assert await exits.wait_for(rental) == 0
        seen = json.loads((manager.work_dir / rental / "seen.json").read_text())
        env = seen["env"]
        assert env["CUDA_VISIBLE_DEVICES"] == env["NVIDIA_VISIBLE_DEVICES"] == env["GPUMARKET_GPU_UUIDS"] == gpus[1]
        assert gpus[0] not in json.dumps(env)
        assert env["MODEL"] == "llama" and env["GPUMARKET_RENTAL_ID"] == rental
        assert "GPUMARKET_TEST_AGENT_SECRET" not in env
        allowed = {
            "PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "HOME", "PWD", "MODEL",
            "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "GPUMARKET_GPU_UUIDS", "GPUMARKET_RENTAL_ID",
        }
        assert set(env) <= allowed, set(env) - allowed
        assert seen["cwd"] == env["HOME"] == str(manager.work_dir / rental)

    async def test_several_gpus_are_listed_in_the_order_given(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """A two-GPU workload sees both UUIDs, comma-separated, in the allocation's order."""
        manager = managers()
        rental = f"{prefix}-two"
        await manager.start(rental, [gpus[1], gpus[0]], ProcessWorkload(argv=["sh", "-c", 'printf %s "$CUDA_VISIBLE_DEVICES" > seen']))
        assert await exits.wait_for(rental) == 0
        assert (manager.work_dir / rental / "seen").read_text() == f"{gpus[1]},{gpus[0]}"

    async def test_unknown_gpu_is_refused_and_nothing_starts(self, managers: Managers, prefix: str) -> None:
        """A GPU UUID this host does not have is refused before anything runs."""
        manager = managers()
        rental = f"{prefix}-unknown"
        with pytest.raises(BadRequest) as refused:
            await manager.start(rental, ["GPU-00000000-0000-0000-0000-000000000000"], SLEEP)
        assert refused.value.code == "gpu_not_found"
        assert manager.running() == []
        assert not (manager.work_dir / rental).exists()

    async def test_mig_instance_is_exposed_by_its_uuid(self, managers: Managers, exits: Exits, prefix: str, tmp_path: Path) -> None:
        """On a MIG-enabled host a MIG instance UUID is accepted and is all the workload sees; elsewhere it is refused."""
        instance = "MIG-8d3c4ab1-8a4e-5d4b-9b2c-7e1f4f2b5a11"
        argv = ["sh", "-c", 'printf "%s %s" "$CUDA_VISIBLE_DEVICES" "$NVIDIA_VISIBLE_DEVICES" > seen']
        with pytest.raises(BadRequest):
            await managers().start(f"{prefix}-nomig", [instance], ProcessWorkload(argv=argv))
        manager = managers(backend=MigEnabledBackend(), work_dir=tmp_path / "mig")
        rental = f"{prefix}-mig"
        await manager.start(rental, [instance], ProcessWorkload(argv=argv))
        assert await exits.wait_for(rental) == 0
        assert (manager.work_dir / rental / "seen").read_text() == f"{instance} {instance}"

    def test_spec_cannot_override_gpu_visibility(self) -> None:
        """The spec's env may not set the variables that choose GPUs."""
        for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "GPUMARKET_GPU_UUIDS"):
            with pytest.raises(ValidationError, match=name):
                ProcessWorkload.model_validate({"kind": "process", "argv": ["true"], "env": {name: "all"}})

    async def test_a_gpu_serving_another_rental_is_refused(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A GPU already given to a running rental is not given to a second one."""
        manager = managers()
        await manager.start(f"{prefix}-first", [gpus[0]], HoldWorkload())
        with pytest.raises(Conflict) as refused:
            await manager.start(f"{prefix}-second", [gpus[1], gpus[0]], SLEEP)
        assert refused.value.code == "gpu_in_use"
        assert manager.running() == [f"{prefix}-first"]


class TestGpuShares:
    """Fractional shares of one GPU: several may hold it while their thousandths and memory fit; whole workloads need it unheld."""

    async def test_shares_hold_one_gpu_together_up_to_a_whole_gpu(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """Shares of 500, 300 and 200 fill a GPU; one more thousandth is refused naming every holder, and fits again once one leaves."""
        manager = managers()
        for name, milli in (("a", 500), ("b", 300), ("c", 200)):
            await manager.start(f"{prefix}-{name}", [gpus[0]], HOLD, share=share(milli))
        with pytest.raises(Conflict) as refused:
            await manager.start(f"{prefix}-d", [gpus[0]], HOLD, share=share(1))
        assert refused.value.code == "gpu_in_use"
        assert "0/1000 left" in refused.value.message
        for name, milli in (("a", 500), ("b", 300), ("c", 200)):
            assert f"rental {prefix}-{name} ({milli}/1000)" in refused.value.message
        assert manager.running() == [f"{prefix}-a", f"{prefix}-b", f"{prefix}-c"]
        await manager.stop(f"{prefix}-c")
        with pytest.raises(Conflict, match="200/1000 left"):
            await manager.start(f"{prefix}-d", [gpus[0]], HOLD, share=share(201))
        await manager.start(f"{prefix}-d", [gpus[0]], HOLD, share=share(200))
        await manager.start(f"{prefix}-e", [gpus[1]], HOLD, share=share(999))  # the other GPU is untouched
        assert manager.running() == [f"{prefix}-a", f"{prefix}-b", f"{prefix}-d", f"{prefix}-e"]

    async def test_shares_memory_must_fit_the_gpus(
        self, managers: Managers, backend: SimulatedBackend, gpus: list[str], prefix: str
    ) -> None:
        """The shares' memory sums to at most the GPU's; a share asking more than the whole GPU is a bad request."""
        total = backend.gpus()[0].memory_total_mib
        manager = managers()
        await manager.start(f"{prefix}-big", [gpus[0]], HOLD, share=share(100, total - 1000))
        with pytest.raises(Conflict) as refused:
            await manager.start(f"{prefix}-more", [gpus[0]], HOLD, share=share(100, 1001))
        assert refused.value.code == "gpu_in_use"
        assert "1000 MiB left" in refused.value.message and f"rental {prefix}-big" in refused.value.message
        await manager.start(f"{prefix}-fits", [gpus[0]], HOLD, share=share(100, 1000))
        await manager.start(f"{prefix}-nomem", [gpus[0]], HOLD, share=share(100, 0))  # no memory of its own
        with pytest.raises(BadRequest) as too_big:
            await manager.start(f"{prefix}-huge", [gpus[1]], HOLD, share=share(100, total + 1))
        assert too_big.value.code == "bad_gpu_share" and f"has {total} MiB" in too_big.value.message
        assert manager.running() == [f"{prefix}-big", f"{prefix}-fits", f"{prefix}-nomem"]

    async def test_a_share_never_joins_a_whole_gpu_workload_nor_the_reverse(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A share is refused on a GPU a whole-GPU workload holds, and a whole-GPU workload on a GPU a share holds."""
        manager = managers()
        await manager.start(f"{prefix}-whole", [gpus[0]], HOLD)
        with pytest.raises(Conflict) as refused:
            await manager.start(f"{prefix}-part", [gpus[0]], HOLD, share=share(100))
        assert refused.value.code == "gpu_in_use" and f"rental {prefix}-whole whole" in refused.value.message
        await manager.start(f"{prefix}-part", [gpus[1]], HOLD, share=share(100))
        with pytest.raises(Conflict) as refused:
            await manager.start(f"{prefix}-both", [gpus[0], gpus[1]], SLEEP)
        assert refused.value.code == "gpu_in_use"
        assert f"rental {prefix}-whole" in refused.value.message and f"rental {prefix}-part (100/1000)" in refused.value.message
        with pytest.raises(Conflict, match=f"rental {prefix}-part"):
            await manager.start(f"{prefix}-other", [gpus[1]], HOLD)
        assert manager.running() == [f"{prefix}-part", f"{prefix}-whole"]

    async def test_a_share_workload_is_told_its_share_and_the_mps_limits(
        self, managers: Managers, exits: Exits, gpus: list[str], prefix: str
    ) -> None:
        """The environment names the share and sets the MPS thread percentage and the pinned memory of device 0."""
        manager = managers()
        dump = "import json, os; json.dump(dict(os.environ), open('seen.json', 'w'))"
        big, small = f"{prefix}-big", f"{prefix}-small"
        await manager.start(big, [gpus[1]], ProcessWorkload(argv=py(dump)), share=share(995, 8192))
        await manager.start(small, [gpus[1]], ProcessWorkload(argv=py(dump)), share=share(5))
        assert await exits.wait_for(big) == 0 and await exits.wait_for(small) == 0
        seen = json.loads((manager.work_dir / big / "seen.json").read_text())
        assert seen["CUDA_VISIBLE_DEVICES"] == seen["GPUMARKET_GPU_UUIDS"] == gpus[1]
        assert {name: seen[name] for name in SHARE_ENV} == {
            "GPUMARKET_GPU_MILLI": "995", "GPUMARKET_GPU_MEMORY_MIB": "8192",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "99", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M",
        }
        seen = json.loads((manager.work_dir / small / "seen.json").read_text())
        assert seen["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"  # 0.5 % rounds up to the least MPS takes
        assert seen["GPUMARKET_GPU_MILLI"] == "5" and seen["GPUMARKET_GPU_MEMORY_MIB"] == "0"
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in seen  # no memory limit of its own

    async def test_a_whole_gpu_workload_gets_no_share_variables(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """Without a share none of the share or MPS variables is set."""
        manager = managers()
        rental = f"{prefix}-whole"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py("import json, os; json.dump(dict(os.environ), open('seen.json', 'w'))")))
        assert await exits.wait_for(rental) == 0
        seen = json.loads((manager.work_dir / rental / "seen.json").read_text())
        assert not set(SHARE_ENV) & set(seen)

    def test_the_spec_cannot_set_the_mps_limits_of_a_share(self, gpus: list[str], prefix: str) -> None:
        """A share workload's env may not set the MPS limits the agent derives from its share."""
        for name in ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"):
            spec = {"kind": "process", "argv": ["true"], "env": {name: "100"}}
            with pytest.raises(ValidationError, match=name):
                StartWorkload.model_validate({"rental_id": f"{prefix}-mps", "gpu_uuids": [gpus[0]], "workload": spec, "share": share(100)})

    @pytest.mark.parametrize(
        "raw",
        [
            "250", [250], 250,
            {"milli": 250}, {"memory_mib": 0}, {"milli": 250, "memory_mib": 0, "gpu": 0},
            {"milli": 0, "memory_mib": 0}, {"milli": 1000, "memory_mib": 0}, {"milli": -5, "memory_mib": 0},
            {"milli": 250.0, "memory_mib": 0}, {"milli": "250", "memory_mib": 0}, {"milli": True, "memory_mib": 0},
            {"milli": 250, "memory_mib": -1}, {"milli": 250, "memory_mib": 1.5}, {"milli": 250, "memory_mib": "8G"},
            {"milli": 250, "memory_mib": False}, {"milli": None, "memory_mib": 0},
        ],
    )
    def test_bad_shares_are_refused(self, gpus: list[str], prefix: str, raw: Any) -> None:
        """A share that is not exactly ``{"milli": 1..999, "memory_mib": >= 0}`` is refused before anything starts."""
        with pytest.raises(ValidationError) as refused:
            StartWorkload.model_validate({"rental_id": f"{prefix}-bad", "gpu_uuids": [gpus[0]], "workload": SLEEP, "share": raw})
        assert refused.value.errors()[0]["loc"][0] == "share"

    async def test_a_share_names_exactly_one_gpu(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A share of two GPUs, or of none, is refused."""
        manager = managers()
        for chosen in (gpus, []):
            with pytest.raises(BadRequest, match=f"names {len(chosen)}") as refused:
                await manager.start(f"{prefix}-gpus", chosen, HOLD, share=share(100))
            assert refused.value.code == "bad_gpu_share"
        assert manager.running() == []

    async def test_the_gpu_looks_busy_until_its_last_share_leaves(
        self, managers: Managers, exits: Exits, backend: SimulatedBackend, gpus: list[str], prefix: str
    ) -> None:
        """A share that stops, or ends on its own, leaves its GPU busy while another share still runs on it."""
        manager = managers()
        held, ends, stopped = f"{prefix}-held", f"{prefix}-ends", f"{prefix}-stopped"
        await manager.start(held, [gpus[0]], SLEEP, share=share(300))
        await manager.start(stopped, [gpus[0]], SLEEP, share=share(300))
        await manager.start(ends, [gpus[0]], ProcessWorkload(argv=["true"]), share=share(300))
        assert await exits.wait_for(ends) == 0
        assert backend.sample()[0].processes
        await manager.stop(stopped)
        assert backend.sample()[0].processes
        await manager.stop(held)
        assert backend.sample()[0].processes == ()


class TestSimulatedLoad:
    """Simulated GPUs show load only while a workload runs on them, in proportion to what it holds."""

    async def test_only_the_gpus_of_a_running_workload_show_load(
        self, managers: Managers, backend: SimulatedBackend, gpus: list[str], prefix: str
    ) -> None:
        """A process workload loads its GPU; a hold beside it leaves its GPU idle; stopped, the GPU idles again."""
        manager = managers()
        runs, holds = f"{prefix}-runs", f"{prefix}-holds"
        await manager.start(runs, [gpus[0]], SLEEP)
        await manager.start(holds, [gpus[1]], HOLD)
        busy, held = backend.sample()
        assert busy.gpu_util_pct is not None and busy.gpu_util_pct >= 90 and len(busy.processes) == 1
        assert held.gpu_util_pct is not None and held.gpu_util_pct <= 5 and held.processes == ()
        assert held.power_draw_w is not None and busy.power_draw_w is not None and held.power_draw_w < busy.power_draw_w / 4
        await manager.stop(runs)
        calm = backend.sample()[0]
        assert calm.gpu_util_pct is not None and calm.gpu_util_pct <= 5 and calm.processes == ()

    async def test_shares_load_their_gpu_by_their_milli(
        self, managers: Managers, backend: SimulatedBackend, gpus: list[str], prefix: str
    ) -> None:
        """Two running quarter shares show one process each and about half the GPU's utilization."""
        manager = managers()
        for name in ("a", "b"):
            await manager.start(f"{prefix}-{name}", [gpus[0]], SLEEP, share=share(250))
        sample = backend.sample()[0]
        assert len(sample.processes) == 2
        assert sample.gpu_util_pct is not None and 0.5 * 92 <= sample.gpu_util_pct <= 0.5 * 100
        await manager.stop(f"{prefix}-a")
        sample = backend.sample()[0]
        assert len(sample.processes) == 1
        assert sample.gpu_util_pct is not None and 0.25 * 92 <= sample.gpu_util_pct <= 0.25 * 100

    async def test_a_mig_instance_loads_its_gpu_by_its_slices(self, managers: Managers, prefix: str) -> None:
        """A workload on a 3g MIG instance shows on its GPU as 3/7 of it; a hold on another instance adds nothing."""
        mig_backend = SimulatedBackend("sim:1xA100-80GB:mig", seed="t")
        (gpu,) = mig_backend.gpus()
        by_profile = {m.profile: m.uuid for m in gpu.mig_instances}
        manager = managers(backend=mig_backend)
        await manager.start(f"{prefix}-3g", [by_profile["3g.40gb"]], SLEEP)
        await manager.start(f"{prefix}-2g", [by_profile["2g.20gb"]], HOLD)
        (sample,) = mig_backend.sample()
        assert len(sample.processes) == 1
        assert sample.gpu_util_pct is not None and 3 / 7 * 92 <= sample.gpu_util_pct <= 3 / 7 * 100


class TestCgroupLimits:
    """Where the host allows, a workload runs in a cgroup of its own carrying its CPU and memory limits."""

    async def test_workload_is_in_its_cgroup_with_its_limits_from_its_first_instruction(
        self, managers: Managers, gpus: list[str], prefix: str
    ) -> None:
        """The child's very first command already runs in the rental's cgroup, whose files hold the spec's limits."""
        manager = managers()
        support = manager.cgroup_support
        print(f"cgroup support on this host: {support.mode}: {support.reason}")
        rental = f"{prefix}-cg"
        spec = ProcessWorkload(argv=["sh", "-c", "cat /proc/self/cgroup > cgroup.txt; exec sleep 60"], cpu_cores=1.5, memory_mib=256)
        result = await manager.start(rental, [gpus[0]], spec)
        seen = await file_text(manager.work_dir / rental / "cgroup.txt")
        if not support.available:
            assert result["limits"] == "unavailable" and result["limits_reason"] == support.reason
            assert support.reason.startswith("no way to limit CPU and memory: ")
            pytest.skip(f"this host has no usable cgroups: {support.reason}")
        assert result["limits"] == "applied", result
        if support.mode == "systemd":
            assert result["systemd_unit"] in seen
            return
        groups = [Path(d) for d in result["cgroups"]]
        suffix = f"/{support.slices[0].name}/rental-{rental}"
        lines = seen.splitlines()
        if support.mode == "cgroup2":
            assert any(line.startswith("0::") and line.endswith(suffix) for line in lines), seen
            (group,) = groups
            assert (group / "cpu.max").read_text().split() == ["150000", "100000"]
            assert (group / "memory.max").read_text().strip() == str(256 * MIB)
        else:
            for controller in ("cpu", "memory"):
                assert any(controller in line.split(":")[1].split(",") and line.endswith(suffix) for line in lines), seen
            cpu_group, memory_group = groups[0], groups[1]  # then the pids group, where that hierarchy is mounted
            assert (cpu_group / "cpu.cfs_quota_us").read_text().strip() == "150000"
            assert (cpu_group / "cpu.cfs_period_us").read_text().strip() == "100000"
            assert (memory_group / "memory.limit_in_bytes").read_text().strip() == str(256 * MIB)
        for group in groups:
            assert str(result["pid"]) in (group / "cgroup.procs").read_text().split()
        await manager.stop(rental)
        assert not any(group.exists() for group in groups)

    async def test_a_process_that_leaves_the_process_group_is_killed_through_the_cgroup(
        self, managers: Managers, gpus: list[str], prefix: str
    ) -> None:
        """A grandchild that made itself a new session (out of reach of killpg) still dies when the rental stops."""
        manager = managers()
        support = manager.cgroup_support
        rental = f"{prefix}-escape"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "setsid sleep 60 & echo $! > escaped.pid; exec sleep 60"]))
        escaped = int(await file_text(manager.work_dir / rental / "escaped.pid", containing="\n"))

        async def own_session() -> bool:  # $! is known before the background setsid has run
            return os.getsid(escaped) == escaped

        await eventually(own_session, timeout=WAIT, every=0.01, what="the grandchild to leave the session")
        await manager.stop(rental)
        if support.mode not in ("cgroup1", "cgroup2"):
            pytest.skip(f"needs the cgroup filesystem; this host: {support.mode}: {support.reason}")
        assert process_start_time(escaped) is None

    async def test_limits_without_cgroup_support_are_reported_unavailable(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """Without cgroups the workload still runs, and the start result says its limits (its share of the host, when it names none) are unavailable and why."""
        manager = managers(cgroups=NoCgroupLimiter(CgroupSupport("none", "no cgroups in this test")))
        limited = await manager.start(f"{prefix}-limited", [gpus[0]], ProcessWorkload(argv=["sleep", "60"], cpu_cores=2.0, memory_mib=4096))
        assert limited["limits"] == "unavailable" and limited["limits_reason"] == "no cgroups in this test"
        assert process_start_time(limited["pid"]) is not None
        unnamed = await manager.start(f"{prefix}-unnamed", [gpus[1]], SLEEP)
        assert unnamed["limits"] == "unavailable" and unnamed["pids_limit"] is not None and unnamed["memory_mib"] is not None

    def test_detection_explains_itself_and_creates_nothing(self) -> None:
        """Detection names what it chose (or why nothing works) and leaves the cgroup tree as it was."""
        support = detect_cgroup_support(slice_name=f"gpumarket-test-{secrets.token_hex(4)}.slice")
        print(f"cgroup support on this host: {support.mode}: {support.reason}")
        assert support.mode in ("cgroup2", "cgroup1", "systemd", "none") and support.reason
        assert support.available == (support.mode != "none")
        assert not any(slice_dir.exists() for slice_dir in support.slices)

    @pytest.mark.parametrize(
        "limits",
        [{"cpu_cores": 0}, {"cpu_cores": -1.0}, {"cpu_cores": True}, {"cpu_cores": "2"}, {"cpu_cores": float("nan")},
         {"memory_mib": 1}, {"memory_mib": 4096.5}, {"memory_mib": "4G"}],
    )
    def test_limits_out_of_range_are_refused(self, limits: dict[str, Any]) -> None:
        """A limit that is not a sane number is refused with what to write instead."""
        with pytest.raises(ValidationError, match="must be a") as refused:
            ProcessWorkload.model_validate({"kind": "process", "argv": ["true"], **limits})
        assert refused.value.errors()[0]["loc"] == tuple(limits)


class TestLogs:
    """Output goes to a bounded ``output.log`` read back incrementally by offset."""

    async def test_output_is_captured_and_read_back_in_pages(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """stdout and stderr land in the log; pages chain by their offsets up to the end."""
        manager = managers()
        rental = f"{prefix}-log"
        code = "import sys\nfor i in range(200):\n    print(f'out {i}', flush=True)\n    print(f'err {i}', file=sys.stderr, flush=True)"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(code)))
        assert await exits.wait_for(rental) == 0
        expected = "".join(f"out {i}\nerr {i}\n" for i in range(200)).encode()
        offset, pages = 0, []
        while True:
            chunk, next_offset = manager.read_log(rental, offset=offset, limit=100)
            if not chunk:
                break
            assert len(chunk) <= 100 and next_offset - len(chunk) == offset
            pages.append(chunk)
            offset = next_offset
        assert b"".join(pages) == expected and offset == len(expected)
        assert manager.read_log(rental, offset=offset) == (b"", offset)
        assert manager.read_log(rental, offset=offset + 10) == (b"", offset + 10)

    async def test_log_is_readable_while_the_workload_runs(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """New output can be read while the workload is still running."""
        manager = managers()
        rental = f"{prefix}-live"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "echo ready; exec sleep 60"]))

        async def read() -> tuple[bytes, int] | None:
            chunk, next_offset = manager.read_log(rental, offset=0)
            return (chunk, next_offset) if chunk else None

        assert await eventually(read, timeout=WAIT, every=0.01, what="output") == (b"ready\n", 6)
        assert manager.running() == [rental]

    async def test_cap_keeps_the_newest_bytes(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """Past ``max_log_bytes`` the oldest bytes go: what remains is the newest output, at its original offsets."""
        cap = 64 << 10
        manager = managers(max_log_bytes=cap)
        rental = f"{prefix}-cap"
        code = "import sys\nfor i in range(20000):\n    sys.stdout.write(f'line {i:06d}\\n')"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(code)))
        assert await exits.wait_for(rental) == 0
        expected = "".join(f"line {i:06d}\n" for i in range(20000)).encode()
        first, offset = manager.read_log(rental, offset=0, limit=16 << 10)
        kept_from = offset - len(first)
        pages = [first]
        while chunk := manager.read_log(rental, offset=offset, limit=16 << 10)[0]:
            pages.append(chunk)
            offset += len(chunk)
        kept = b"".join(pages)
        assert cap - (16 << 10) < len(kept) <= cap
        assert kept_from == len(expected) - len(kept) and offset == len(expected)
        assert expected.endswith(kept)
        log_file = manager.work_dir / rental / "output.log"
        assert log_file.stat().st_size == len(expected)  # offsets never move...
        assert log_file.stat().st_blocks * 512 <= cap + (16 << 10)  # ...but the dropped bytes take no disk

    async def test_log_survives_the_workload_until_forget(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """The log stays readable after the workload ends; ``forget`` deletes it, and is refused while it runs."""
        manager = managers()
        rental = f"{prefix}-keep"
        (manager.work_dir / rental).mkdir()
        os.mkfifo(manager.work_dir / rental / "gate")
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "read x < gate; echo done"]))
        with pytest.raises(Conflict):
            await manager.forget(rental)
        await asyncio.to_thread((manager.work_dir / rental / "gate").write_text, "go\n")
        assert await exits.wait_for(rental) == 0
        assert manager.read_log(rental, offset=0) == (b"done\n", 5)
        await manager.forget(rental)
        with pytest.raises(NotFound):
            manager.read_log(rental, offset=0)

    async def test_bad_reads_are_refused(self, managers: Managers, prefix: str) -> None:
        """Unknown rentals, negative offsets and out-of-range limits are refused."""
        manager = managers()
        with pytest.raises(NotFound):
            manager.read_log(f"{prefix}-never", offset=0)
        for offset, limit in ((-1, 10), (0, 0), (0, manager.max_read_bytes + 1)):
            with pytest.raises(BadRequest):
                manager.read_log(f"{prefix}-never", offset=offset, limit=limit)


class TestExitReporting:
    """A workload that ends on its own is noticed and reported through ``on_exit``; a stopped one is not."""

    async def test_workload_that_exits_on_its_own_is_reported_with_its_code(
        self, managers: Managers, exits: Exits, backend: SimulatedBackend, gpus: list[str], prefix: str
    ) -> None:
        """``on_exit`` gets the exit code; the rental stops running and its GPUs are free."""
        manager = managers()
        rental = f"{prefix}-seven"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "exit 7"]))
        assert await exits.wait_for(rental) == 7
        assert manager.running() == []
        assert backend.sample()[0].processes == ()

        async def reported() -> bool:
            return registry(manager) == {"version": 1, "workloads": [], "unreported_exits": {}}

        await eventually(reported, timeout=WAIT, every=0.01, what="the registry to forget the reported exit")

    async def test_workload_killed_by_a_signal_reports_minus_the_signal(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """A workload ended by signal N reports exit code -N."""
        manager = managers()
        rental = f"{prefix}-killed"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "kill -KILL $$"]))
        assert await exits.wait_for(rental) == -signal.SIGKILL

    async def test_processes_left_behind_by_the_main_one_are_killed(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """When the main process exits, what it left running in the background is killed."""
        manager = managers()
        rental = f"{prefix}-bg"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "sleep 60 & echo $! > bg.pid; exit 0"]))
        assert await exits.wait_for(rental) == 0
        background = int((manager.work_dir / rental / "bg.pid").read_text())
        await gone(background)

    async def test_stop_is_not_reported_as_an_exit(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """Stopping returns the exit code to the caller and never calls ``on_exit``."""
        manager = managers()
        rental = f"{prefix}-stopped"
        await manager.start(rental, [gpus[0]], SLEEP)
        assert await manager.stop(rental) == {"exit_code": -signal.SIGTERM}
        await asyncio.sleep(0.05)  # several watcher intervals: a late report would show up
        assert exits.calls == []

    async def test_exit_not_yet_reported_is_reported_by_the_next_manager(
        self, managers: Managers, exits: Exits, gpus: list[str], prefix: str
    ) -> None:
        """An exit whose ``on_exit`` was cut short by ``close()`` is reported again after a restart (at least once)."""
        entered = asyncio.Event()

        async def hangs(rental_id: str, exit_code: int | None) -> None:
            entered.set()
            await asyncio.Event().wait()

        first = managers(on_exit=hangs)
        rental = f"{prefix}-unreported"
        await first.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "exit 4"]))
        async with asyncio.timeout(WAIT):
            await entered.wait()
        await first.close()
        assert registry(first)["unreported_exits"] == {rental: 4}
        second = managers()
        await second.resume()
        assert await exits.wait_for(rental) == 4


class TestGracefulStop:
    """Stopping sends SIGTERM to the process group and SIGKILL after ``stop_timeout``."""

    async def test_child_that_handles_sigterm_exits_cleanly(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A child that exits on SIGTERM reports its own exit code."""
        manager = managers()
        rental = f"{prefix}-clean"
        code = (
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
            "open('ready', 'w').close()\n"
            "while True: time.sleep(1)"
        )
        result = await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(code)))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="the SIGTERM handler")
        assert await manager.stop(rental) == {"exit_code": 0}
        assert process_start_time(result["pid"]) is None

    async def test_child_ignoring_sigterm_is_killed_after_stop_timeout(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A child that ignores SIGTERM gets SIGKILL once ``stop_timeout`` has passed."""
        manager = managers(stop_timeout=0.2)
        rental = f"{prefix}-stubborn"
        result = await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(IGNORES_SIGTERM)))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="SIGTERM to be ignored")
        began = time.monotonic()
        assert await manager.stop(rental) == {"exit_code": -signal.SIGKILL}
        assert 0.2 <= time.monotonic() - began < 2.0
        assert process_start_time(result["pid"]) is None

    async def test_stop_is_idempotent_and_concurrent_stops_share_one(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """Two concurrent stops get the same result; later ones and unknown rentals report already stopped."""
        manager = managers()
        rental = f"{prefix}-twice"
        await manager.start(rental, [gpus[0]], SLEEP)
        first, second = await asyncio.gather(manager.stop(rental), manager.stop(rental))
        assert first == second == {"exit_code": -signal.SIGTERM}
        assert await manager.stop(rental) == {"already_stopped": True}
        assert await manager.stop(f"{prefix}-never") == {"already_stopped": True}

    async def test_cancelling_stop_does_not_abandon_the_stop(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A cancelled ``stop()`` call leaves the stop running; the next call gets its result."""
        manager = managers(stop_timeout=0.2)
        rental = f"{prefix}-cancelled"
        result = await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(IGNORES_SIGTERM)))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="SIGTERM to be ignored")
        caller = asyncio.create_task(manager.stop(rental))
        await asyncio.sleep(0.01)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert await manager.stop(rental) == {"exit_code": -signal.SIGKILL}
        assert process_start_time(result["pid"]) is None and manager.running() == []

    async def test_hold_stops_without_an_exit_code(self, managers: Managers, backend: SimulatedBackend, gpus: list[str], prefix: str) -> None:
        """A hold runs nothing: its GPUs stay idle while it holds them, and it stops with no exit code."""
        manager = managers()
        rental = f"{prefix}-hold"
        assert await manager.start(rental, gpus, HoldWorkload()) == {"kind": "hold", "pid": None}
        assert manager.running() == [rental]
        assert not any(sample.processes for sample in backend.sample())
        assert all(sample.gpu_util_pct is not None and sample.gpu_util_pct <= 5 for sample in backend.sample())
        assert await manager.stop(rental) == {"exit_code": None}
        assert not any(sample.processes for sample in backend.sample())

    async def test_a_stops_grace_replaces_stop_timeout(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A child ignoring SIGTERM is killed after the stop's own grace, well before a long ``stop_timeout``."""
        manager = managers(stop_timeout=30.0)
        rental = f"{prefix}-preempted"
        result = await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(IGNORES_SIGTERM)))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="SIGTERM to be ignored")
        began = time.monotonic()
        assert await manager.stop(rental, timeout=0.2, reason="preempted") == {"exit_code": -signal.SIGKILL}
        assert 0.2 <= time.monotonic() - began < 2.0
        assert process_start_time(result["pid"]) is None

    async def test_a_longer_grace_lets_a_slow_shutdown_finish(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A child that needs longer than ``stop_timeout`` to finish after SIGTERM gets it when the stop's grace allows."""
        manager = managers(stop_timeout=0.05)
        rental = f"{prefix}-slow"
        code = (
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), sys.exit(5)))\n"
            "open('ready', 'w').close()\n"
            "while True: time.sleep(1)"
        )
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(code)))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="the SIGTERM handler")
        assert await manager.stop(rental, timeout=WAIT) == {"exit_code": 5}

    async def test_zero_grace_kills_at_once(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A grace of 0 sends SIGKILL right after SIGTERM."""
        manager = managers(stop_timeout=30.0)
        rental = f"{prefix}-now"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(IGNORES_SIGTERM)))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="SIGTERM to be ignored")
        began = time.monotonic()
        assert await manager.stop(rental, timeout=0) == {"exit_code": -signal.SIGKILL}
        assert time.monotonic() - began < 2.0

    async def test_the_log_says_why_and_when_sigkill_follows(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """Before SIGTERM the log gets one line with the reason and the grace, on a line of its own after the workload's output."""
        manager = managers()
        rental = f"{prefix}-why"
        code = (
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
            "sys.stdout.write('epoch 3'); sys.stdout.flush()\n"  # no newline yet
            "open('ready', 'w').close()\n"
            "while True: time.sleep(1)"
        )
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(code)))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="the output")
        reason = "preempted by a higher-priority rental"
        assert await manager.stop(rental, timeout=30, reason=reason) == {"exit_code": 0}
        assert manager.read_log(rental, offset=0)[0] == f"epoch 3\ngpumarket: stopping ({reason}); SIGKILL in 30s\n".encode()

    async def test_without_a_reason_the_log_names_the_default_grace(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A stop with neither reason nor grace logs the plain line with ``stop_timeout``; a hold has no log to write to."""
        manager = managers(stop_timeout=2.5)
        rental = f"{prefix}-plain"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "echo up; exec sleep 60"]))
        await eventually(_exists(manager.work_dir / rental / "output.log"), timeout=WAIT, every=0.01, what="the log")
        await eventually(lambda: _true(manager.read_log(rental, offset=0)[0] == b"up\n"), timeout=WAIT, every=0.01, what="the output")
        assert await manager.stop(rental) == {"exit_code": -signal.SIGTERM}
        assert manager.read_log(rental, offset=0)[0] == b"up\ngpumarket: stopping; SIGKILL in 2.5s\n"
        await manager.start(f"{prefix}-hold", [gpus[1]], HOLD)
        assert await manager.stop(f"{prefix}-hold", reason="rental ended") == {"exit_code": None}
        assert not (manager.work_dir / f"{prefix}-hold").exists()

    async def test_the_largest_grace_and_longest_reason_are_accepted(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """The bounds themselves (a grace of 600 s, a reason of 200 characters) are valid."""
        manager = managers()
        rental = f"{prefix}-bounds"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", "trap 'exit 0' TERM; touch ready; while :; do sleep 0.01; done"]))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="the trap")
        reason = "r" * MAX_STOP_REASON_CHARS
        assert await manager.stop(rental, timeout=MAX_STOP_GRACE_S, reason=reason) == {"exit_code": 0}
        assert f"gpumarket: stopping ({reason}); SIGKILL in 600s" in manager.read_log(rental, offset=0)[0].decode()

    @pytest.mark.parametrize(
        ("timeout", "reason", "field"),
        [
            (-1, None, "grace_s"), (600.5, None, "grace_s"), ("30", None, "grace_s"),
            (True, None, "grace_s"), (float("nan"), None, "grace_s"), (float("inf"), None, "grace_s"),
            ([30], None, "grace_s"),
            (None, 42, "reason"), (None, "r" * 201, "reason"), (None, "two\nlines", "reason"),
            (None, ["preempted"], "reason"),
        ],
    )
    def test_bad_grace_or_reason_is_refused_and_stops_nothing(self, prefix: str, timeout: Any, reason: Any, field: str) -> None:
        """A grace outside 0-600 s or not a number, or a reason that is not one short line, is refused (a refused
        ``stop_workload`` reaches no workload: see test_agent_runner)."""
        with pytest.raises(ValidationError) as refused:
            StopWorkload.model_validate({"rental_id": f"{prefix}-bad", "grace_s": timeout, "reason": reason})
        assert refused.value.errors()[0]["loc"][0] == field


def _exists(path: Path) -> Callable[[], Any]:
    async def check() -> bool:
        return path.exists()

    return check


async def _true(value: bool) -> bool:
    return value


class TestRestart:
    """A new manager over the same work dir re-adopts live workloads and reports the ones that died."""

    async def test_new_manager_adopts_a_running_workload_and_can_stop_it(
        self, managers: Managers, exits: Exits, gpus: list[str], prefix: str
    ) -> None:
        """After a restart the still-running process is listed again, and stopping it kills it."""
        first = managers()
        rental = f"{prefix}-adopted"
        pid = (await first.start(rental, [gpus[0]], SLEEP))["pid"]
        started = process_start_time(pid)
        (record,) = registry(first)["workloads"]
        assert (record["rental_id"], record["pid"], record["start_time"], record["kind"]) == (rental, pid, started, "process")
        await first.close()  # an agent restart: stop_workloads=False
        assert process_start_time(pid) == started
        second = managers()
        assert second.running() == [rental]
        await second.resume()
        # This test process is the workload's parent, so the new manager can reap it and learn
        # its code; a restarted agent is not, and gets None.
        assert await second.stop(rental) == {"exit_code": -signal.SIGTERM}
        assert process_start_time(pid) is None
        assert second.running() == [] and exits.calls == []

    async def test_hold_workloads_survive_a_restart(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A hold is kept across a restart."""
        first = managers()
        rental = f"{prefix}-held"
        await first.start(rental, [gpus[1]], HoldWorkload())
        await first.close()
        second = managers()
        assert second.running() == [rental]
        assert await second.start(rental, [gpus[1]], HoldWorkload()) == {"already_running": True, "kind": "hold", "pid": None}

    async def test_workload_that_died_while_the_agent_was_down_is_reported(
        self, managers: Managers, exits: Exits, gpus: list[str], prefix: str
    ) -> None:
        """A workload gone by the time the new manager starts is reported through ``on_exit`` and not listed."""
        first = managers()
        rental = f"{prefix}-died"
        pid = (await first.start(rental, [gpus[0]], SLEEP))["pid"]
        await first.close()
        os.killpg(pid, signal.SIGKILL)
        await gone(pid)
        second = managers()
        assert second.running() == []
        await second.resume()
        assert await exits.wait_for(rental) == -signal.SIGKILL  # reaped as our child; a real restart reports None

    async def test_adopted_workload_that_exits_later_is_reported(
        self, managers: Managers, exits: Exits, gpus: list[str], prefix: str, tmp_path: Path
    ) -> None:
        """An adopted process (not the new manager's child) is still watched, and its exit reported."""
        gate = tmp_path / "gate"
        os.mkfifo(gate)
        first = managers()
        rental = f"{prefix}-later"
        await first.start(rental, [gpus[0]], ProcessWorkload(argv=["sh", "-c", f"read x < {shlex.quote(str(gate))}; exit 3"]))
        await first.close()
        second = managers()
        await second.resume()
        assert second.running() == [rental]
        await asyncio.to_thread(gate.write_text, "go\n")
        assert await exits.wait_for(rental) == 3
        assert second.running() == []

    async def test_a_reused_pid_is_not_adopted(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """A recorded pid that now names another process (other start time) is not adopted, and that process is left alone."""
        other = await asyncio.create_subprocess_exec("sleep", "60", env={**os.environ, "GPUMARKET_RENTAL_ID": f"{prefix}-other"})
        try:
            started = process_start_time(other.pid)
            assert started is not None
            rental = f"{prefix}-reused"
            record = {
                "rental_id": rental, "kind": "process", "gpu_uuids": [gpus[0]], "started_at": "2024-01-01T00:00:00+00:00",
                "pid": other.pid, "start_time": started - 1, "cgroup_dirs": [], "systemd_unit": None, "container": None,
            }
            work_dir = managers().work_dir
            (work_dir / "workloads.json").write_text(json.dumps({"version": 1, "workloads": [record], "unreported_exits": {}}))
            manager = managers()
            assert manager.running() == []
            await manager.resume()
            assert await exits.wait_for(rental) is None
            assert await manager.stop(rental) == {"already_stopped": True}
            assert process_start_time(other.pid) == started
        finally:
            other.kill()
            await other.wait()

    async def test_shares_survive_a_restart_and_still_bound_the_gpu(
        self, managers: Managers, backend: SimulatedBackend, gpus: list[str], prefix: str
    ) -> None:
        """The registry keeps each share: after a restart the sum rule and the whole-GPU rule still hold, and the GPU stays busy."""
        first = managers()
        running, held = f"{prefix}-running", f"{prefix}-held"
        pid = (await first.start(running, [gpus[0]], SLEEP, share=share(600, 4096)))["pid"]
        await first.start(held, [gpus[0]], HOLD, share=share(300))
        records = {r["rental_id"]: r for r in registry(first)["workloads"]}
        assert records[running]["share"] == {"milli": 600, "memory_mib": 4096} and records[held]["share"] == {"milli": 300, "memory_mib": 0}
        await first.close()
        backend.set_busy(gpus, False)  # a restarted agent's backend knows nothing yet
        second = managers()
        assert second.running() == [held, running]
        assert backend.sample()[0].processes
        with pytest.raises(Conflict, match="100/1000 left"):
            await second.start(f"{prefix}-late", [gpus[0]], HOLD, share=share(101))
        with pytest.raises(Conflict, match=f"rental {running} \\(600/1000\\)"):
            await second.start(f"{prefix}-whole", [gpus[0]], HOLD)
        await second.start(f"{prefix}-late", [gpus[0]], HOLD, share=share(100))
        assert await second.stop(running) == {"exit_code": -signal.SIGTERM}
        assert process_start_time(pid) is None
        await second.start(f"{prefix}-after", [gpus[0]], HOLD, share=share(600))

    async def test_records_without_a_share_are_whole_gpus_and_bad_shares_are_skipped(
        self, managers: Managers, gpus: list[str], prefix: str
    ) -> None:
        """A record written before shares existed holds its GPU whole; a record with a malformed share is not adopted."""
        base: dict[str, Any] = {"kind": "hold", "started_at": "2024-01-01T00:00:00+00:00", "pid": None, "start_time": None,
                "cgroup_dirs": [], "systemd_unit": None, "container": None}
        old = {**base, "rental_id": f"{prefix}-old", "gpu_uuids": [gpus[0]]}
        bad = {**base, "rental_id": f"{prefix}-bad", "gpu_uuids": [gpus[1]], "share": {"milli": 5000, "memory_mib": 0}}
        two = {**base, "rental_id": f"{prefix}-two", "gpu_uuids": gpus, "share": {"milli": 100, "memory_mib": 0}}
        work_dir = managers().work_dir
        (work_dir / "workloads.json").write_text(json.dumps({"version": 1, "workloads": [old, bad, two], "unreported_exits": {}}))
        manager = managers()
        assert manager.running() == [f"{prefix}-old"]
        with pytest.raises(Conflict, match=f"rental {prefix}-old whole"):
            await manager.start(f"{prefix}-part", [gpus[0]], HOLD, share=share(100))
        assert registry(manager)["workloads"][0]["share"] is None

    async def test_unreadable_registry_is_set_aside(self, managers: Managers, tmp_path: Path) -> None:
        """A damaged registry is moved aside and the manager starts empty instead of failing."""
        work_dir = tmp_path / "work"
        work_dir.mkdir()
        (work_dir / "workloads.json").write_text("{not json")
        manager = managers()
        assert manager.running() == []
        assert (work_dir / "workloads.json.unreadable").read_text() == "{not json"
        assert registry(manager)["workloads"] == []

    async def test_close_can_stop_every_workload(self, managers: Managers, exits: Exits, gpus: list[str], prefix: str) -> None:
        """``close(stop_workloads=True)`` (the demo) stops everything and reports no exit."""
        manager = managers()
        pids = [(await manager.start(f"{prefix}-all{i}", [gpus[i]], SLEEP))["pid"] for i in range(2)]
        await manager.close(stop_workloads=True)
        assert all(process_start_time(pid) is None for pid in pids)
        assert registry(manager)["workloads"] == [] and exits.calls == []
        with pytest.raises(Conflict):
            await manager.start(f"{prefix}-late", [gpus[0]], SLEEP)


class TestStartAndValidation:
    """Starting is idempotent and refuses what it cannot run, saying why."""

    async def test_limits_above_the_hosts_are_refused_and_start_nothing(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """More CPU cores or memory than this host has is refused (limits_exceed_host), before anything starts."""
        manager = managers()
        cores, memory = host_capacity()
        too_many = [
            ProcessWorkload(argv=["sleep", "60"], cpu_cores=cores + 1),
            ProcessWorkload(argv=["sleep", "60"], memory_mib=memory + 1),
        ]
        for i, spec in enumerate(too_many):
            with pytest.raises(BadRequest) as refused:
                await manager.start(f"{prefix}-big{i}", [gpus[0]], spec)
            assert refused.value.code == "limits_exceed_host" and "this host has" in refused.value.message
        assert manager.running() == []
        await manager.start(f"{prefix}-fits", [gpus[0]], ProcessWorkload(argv=["sleep", "60"], cpu_cores=cores, memory_mib=64))
        assert manager.running() == [f"{prefix}-fits"]

    async def test_start_twice_reports_the_running_workload(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A second start of a running rental starts nothing and reports the first."""
        manager = managers()
        rental = f"{prefix}-again"
        first = await manager.start(rental, [gpus[0]], SLEEP)
        again = await manager.start(rental, [gpus[0]], SLEEP)
        assert again == {"already_running": True, "kind": "process", "pid": first["pid"]}
        assert manager.running() == [rental]

    async def test_start_while_stopping_is_refused(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A start that arrives while the same rental is stopping is refused, not reported as running."""
        manager = managers(stop_timeout=0.2)
        rental = f"{prefix}-stopping"
        await manager.start(rental, [gpus[0]], ProcessWorkload(argv=py(IGNORES_SIGTERM)))
        await eventually(_exists(manager.work_dir / rental / "ready"), timeout=WAIT, every=0.01, what="SIGTERM to be ignored")
        stopping = asyncio.create_task(manager.stop(rental))
        await asyncio.sleep(0.01)
        with pytest.raises(Conflict) as refused:
            await manager.start(rental, [gpus[0]], SLEEP)
        assert refused.value.code == "workload_stopping"
        assert await stopping == {"exit_code": -signal.SIGKILL}
        assert (await manager.start(rental, [gpus[0]], SLEEP))["pid"] is not None

    @pytest.mark.parametrize(
        "spec",
        [
            {"kind": "vm"},
            {"kind": "process"},
            {"kind": "process", "argv": []},
            {"kind": "process", "argv": "python train.py"},
            {"kind": "hold", "argv": ["true"]},
            {"kind": "process", "argv": ["true"], "memory_mb": 1024},
            {"kind": "process", "argv": ["true"], "env": {"1BAD": "x"}},
            {"kind": "process", "argv": ["true"], "env": {"FLAG": True}},
            {"image": "-v/:/host"},
        ],
    )
    def test_bad_specs_are_refused(self, spec: dict[str, Any]) -> None:
        """A malformed spec is refused before anything starts."""
        with pytest.raises(ValidationError):
            TypeAdapter(WorkloadSpec).validate_python(spec)

    def test_a_bad_image_reference_is_refused(self, tmp_path: Path) -> None:
        """An image reference that could pass for a docker option is refused, by the protocol and by the runtime."""
        with pytest.raises(ValidationError):
            ContainerWorkload(image="-v/:/host")
        with pytest.raises(BadRequest) as refused:
            ContainerRuntime(tmp_path, ContainerOptions(), device_requests=False).check_image("-v/:/host")
        assert refused.value.code == "bad_workload_spec"

    async def test_missing_program_is_refused(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A program that is not on PATH is refused by name, not started to fail later."""
        manager = managers()
        with pytest.raises(BadRequest, match="gpumarket-no-such-program") as refused:
            await manager.start(f"{prefix}-missing", [gpus[0]], ProcessWorkload(argv=["gpumarket-no-such-program"]))
        assert refused.value.code == "program_not_executable" and manager.running() == []

    async def test_rental_id_cannot_escape_the_work_dir(self, managers: Managers, gpus: list[str]) -> None:
        """A rental id is a folder name, so one that could climb out of the work dir is refused."""
        manager = managers()
        for rental in ("../escape", "a/b", ".hidden", ""):
            with pytest.raises(BadRequest) as refused:
                await manager.start(rental, [gpus[0]], SLEEP)
            assert refused.value.code == "bad_rental_id"


class TestContainers:
    """What needs no engine: refusals before one is asked, and the container's configuration.

    Everything that runs a container is in ``tests/test_container_runtime.py`` (a real engine).
    """

    IMAGE = PreparedImage(id="sha256:" + "0" * 64, user="", env=("PATH=/bin",), size=1 << 20, pulled=False)

    async def test_image_without_container_settings_is_refused(self, managers: Managers, gpus: list[str], prefix: str) -> None:
        """A manager made without ``ContainerOptions`` runs no containers, and says so."""
        manager = managers()
        with pytest.raises(BadRequest) as refused:
            await manager.start(f"{prefix}-image", [gpus[0]], ContainerWorkload(image="nvcr.io/nvidia/pytorch:24.05-py3"))
        assert refused.value.code == "container_runtime_unavailable" and manager.running() == []

    async def test_an_engine_that_does_not_answer_is_named_with_the_fix(
        self, managers: Managers, gpus: list[str], prefix: str, tmp_path: Path
    ) -> None:
        """No engine at the socket: refused with the socket and how to start docker; nothing held."""
        socket = tmp_path / "no-engine.sock"
        manager = managers(container=ContainerOptions(owner=prefix, docker_url=f"unix://{socket}"))
        with pytest.raises(BadRequest) as refused:
            await manager.start(f"{prefix}-image", [gpus[0]], ContainerWorkload(image="ubuntu:24.04"))
        assert refused.value.code == "container_runtime_unavailable"
        assert str(socket) in refused.value.message and "docker" in refused.value.message
        assert manager.running() == []
        facts = await manager.container_facts()
        assert facts is not None and facts.engine is None and str(socket) in facts.reason
        await manager.start(f"{prefix}-after", [gpus[0]], SLEEP)  # its GPU was not kept

    async def test_an_image_the_policy_does_not_allow_is_refused_before_the_engine(
        self, managers: Managers, gpus: list[str], prefix: str, tmp_path: Path
    ) -> None:
        """The provider's policy refuses an image by name, whether or not an engine answers."""
        options = ContainerOptions(owner=prefix, docker_url=f"unix://{tmp_path}/none.sock", allowed_images=("nvcr.io/nvidia/*",))
        manager = managers(container=options)
        with pytest.raises(BadRequest, match=r"docker\.io/library/ubuntu:24\.04") as refused:
            await manager.start(f"{prefix}-image", [gpus[0]], ContainerWorkload(image="ubuntu:24.04"))
        assert refused.value.code == "image_not_allowed" and "nvcr.io/nvidia/*" in refused.value.message

    async def test_a_stop_during_the_image_pull_cancels_the_start(
        self, managers: Managers, gpus: list[str], prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A rental stopped while its image is still coming does not start later: the pull is cancelled, the GPU freed."""
        manager = managers(container=ContainerOptions(owner=prefix, docker_url=f"unix://{tmp_path}/none.sock"))
        pulling = asyncio.Event()

        async def slow_pull(rental_id: str, spec: ContainerWorkload, registry_auth: object = None) -> PreparedImage:
            pulling.set()
            await asyncio.sleep(3600)
            raise AssertionError("not cancelled")

        monkeypatch.setattr(manager.containers, "prepare", slow_pull)
        start = asyncio.create_task(manager.start(f"{prefix}-pull", [gpus[0]], ContainerWorkload(image="ubuntu:24.04")))
        await asyncio.wait_for(pulling.wait(), WAIT)
        assert await asyncio.wait_for(manager.stop(f"{prefix}-pull"), WAIT) == {"already_stopped": True}
        with pytest.raises(Conflict) as refused:
            await start
        assert refused.value.code == "workload_stopped" and manager.running() == []
        await manager.start(f"{prefix}-next", [gpus[0]], SLEEP)  # its GPU is free again

    def test_a_real_gpu_host_asks_for_device_requests_by_uuid(self, tmp_path: Path) -> None:
        """On an NVIDIA host the engine is asked for exactly the rental's GPUs; the agent's GPU variables win over the image's."""
        runtime = ContainerRuntime(tmp_path, ContainerOptions(owner="o"), device_requests=True)
        spec = ContainerWorkload(
            image="ubuntu:24.04", env={"X": "1"}, cpu_cores=2.5, memory_mib=4096, shm_mib=1024, pids_limit=100
        )
        cuda_image = dataclasses.replace(self.IMAGE, env=("NVIDIA_VISIBLE_DEVICES=all",))  # as CUDA images say
        config = runtime.container_config("r-1", ["GPU-a", "MIG-b"], spec, cuda_image, None, user="1000:1000", name="n", labels={})
        host = config["HostConfig"]
        assert host["DeviceRequests"] == [{"Driver": "nvidia", "DeviceIDs": ["GPU-a", "MIG-b"], "Capabilities": [["gpu"]]}]
        assert "NVIDIA_VISIBLE_DEVICES=GPU-a,MIG-b" in config["Env"] and "X=1" in config["Env"]
        assert host["NanoCpus"] == 2_500_000_000 and host["Memory"] == host["MemorySwap"] == 4096 << 20
        assert host["ShmSize"] == 1024 << 20 and host["PidsLimit"] == 100 and host["CapDrop"] == ["ALL"]
        assert host["SecurityOpt"] == ["no-new-privileges"] and host["Init"] is True and not host["Privileged"]
        assert "PortBindings" not in host and host["Mounts"] == [{"Type": "volume", "Source": "n", "Target": "/workspace"}]

    def test_a_simulated_host_names_gpus_in_the_environment_only(self, tmp_path: Path) -> None:
        """Simulated GPUs are no devices: the environment alone names them, and a share's limits come along."""
        runtime = ContainerRuntime(tmp_path, ContainerOptions(owner="o"), device_requests=False)
        share = GpuShare(milli=250, memory_mib=1024)
        config = runtime.container_config("r-1", ["GPU-a"], ContainerWorkload(image="ubuntu:24.04"), self.IMAGE, share, user="u", name="n", labels={})
        assert "DeviceRequests" not in config["HostConfig"]
        assert {"CUDA_VISIBLE_DEVICES=GPU-a", "GPUMARKET_GPU_UUIDS=GPU-a", "GPUMARKET_RENTAL_ID=r-1", "GPUMARKET_GPU_MILLI=250"} <= set(config["Env"])
