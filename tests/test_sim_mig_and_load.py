"""The simulated backend's MIG mode (``sim:1xA100-80GB:mig``) and its load model (``set_loads``)."""

from __future__ import annotations

import random

import pytest

from agent.gpu.sim import (
    MIG_LAYOUTS,
    MIG_SLICES,
    SIM_MODELS,
    SimItem,
    SimulatedBackend,
    parse_sim_items,
    parse_sim_spec,
)
from shared.errors import ConfigError, NotFound


class TestMigSpec:
    def test_a_mig_suffix_puts_that_entry_in_mig_mode(self) -> None:
        """``:mig`` marks its entry only, case-insensitively; ``parse_sim_spec`` reads the models as before."""
        assert parse_sim_items("sim:2xA100-80GB, 1xh100:MIG") == [SimItem("A100-80GB", 2, False), SimItem("H100", 1, True)]
        assert parse_sim_spec("sim:2xA100-80GB,1xH100:mig") == [("A100-80GB", 2), ("H100", 1)]

    @pytest.mark.parametrize("spec", ["sim:RTX4090:mig", "sim:2xT4:mig"])
    def test_mig_on_a_model_without_it_is_refused(self, spec: str) -> None:
        """Only MIG-capable models (A100, H100, H200) take ``:mig``; the error says which do."""
        with pytest.raises(ConfigError, match="has no MIG mode") as caught:
            parse_sim_items(spec)
        assert "A100-80GB" in str(caught.value)

    def test_every_mig_capable_model_has_a_valid_layout(self) -> None:
        """Each layout fits the GPU's 7 compute slices and 8 memory slices, and mixes profiles."""
        assert set(MIG_LAYOUTS) == {key for key, model in SIM_MODELS.items() if model.mig_capable}
        for layout in MIG_LAYOUTS.values():
            assert sum(slot.compute_slices for slot in layout) <= MIG_SLICES
            assert sum(slot.memory_eighths for slot in layout) <= 8
            assert all(slot.profile.startswith(f"{slot.compute_slices}g.") for slot in layout)
            assert len({slot.profile for slot in layout}) >= 3


class TestMigGpus:
    def test_a_mig_gpu_reports_its_instances_and_a_plain_one_none(self) -> None:
        """The MIG GPU says MIG mode on and lists MIG-… instances by profile; the plain A100 says off."""
        plain, mig = SimulatedBackend("sim:1xA100-80GB,1xA100-80GB:mig", seed="host-a").gpus()
        assert (plain.mig_mode, plain.mig_instances) == (False, ())
        assert mig.mig_mode is True
        assert [m.profile for m in mig.mig_instances] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
        assert all(m.uuid.startswith("MIG-") and m.name == f"NVIDIA A100-SXM4-80GB MIG {m.profile}" for m in mig.mig_instances)
        assert len({m.uuid for m in mig.mig_instances}) == 4
        assert sum(m.memory_total_mib or 0 for m in mig.mig_instances) == mig.memory_total_mib
        assert mig.to_wire()["mig_instances"][2]["profile"] == "1g.10gb"

    def test_instance_uuids_are_stable_per_host_and_differ_between_hosts(self) -> None:
        """A restarted demo agent reports the same instances; another host never the same UUIDs."""
        first = SimulatedBackend("sim:H100:mig", seed="host-a").gpus()[0].mig_instances
        again = SimulatedBackend("sim:H100:mig", seed="host-a").gpus()[0].mig_instances
        other = SimulatedBackend("sim:H100:mig", seed="host-b").gpus()[0].mig_instances
        assert [m.uuid for m in first] == [m.uuid for m in again]
        assert not {m.uuid for m in first} & {m.uuid for m in other}


class TestLoads:
    def test_loads_replace_what_was_shown(self) -> None:
        """``set_loads`` names every running workload: a GPU left out goes idle, one named gets a process per workload."""
        sim = SimulatedBackend("sim:2xRTX4090", seed="s", rng=random.Random(1))
        first, second = (g.uuid for g in sim.gpus())
        sim.set_loads({first: [1.0]})
        sim.set_loads({second: [0.5, 0.25]})
        idle, loaded = sim.sample()
        assert idle.processes == () and idle.gpu_util_pct is not None and idle.gpu_util_pct <= 3
        assert len(loaded.processes) == 2
        assert loaded.gpu_util_pct is not None and 0.75 * 92 <= loaded.gpu_util_pct <= 0.75 * 100
        big, small = loaded.processes
        assert big.used_memory_mib is not None and small.used_memory_mib is not None and big.used_memory_mib > small.used_memory_mib

    def test_a_workload_keeps_its_pid_while_others_come_and_go(self) -> None:
        """Adding a second workload to a GPU keeps the first one's process id."""
        sim = SimulatedBackend("sim:L4", seed="s")
        (gpu,) = sim.gpus()
        sim.set_loads({gpu.uuid: [0.5]})
        (pid,) = (p.pid for p in sim.sample()[0].processes)
        sim.set_loads({gpu.uuid: [0.5, 0.5]})
        assert sim.sample()[0].processes[0].pid == pid

    def test_a_mig_instances_load_counts_on_its_gpu_by_slices(self) -> None:
        """A full load on a 1g instance is 1/7 of its GPU."""
        sim = SimulatedBackend("sim:A100-80GB:mig", seed="s")
        (gpu,) = sim.gpus()
        one_g = next(m.uuid for m in gpu.mig_instances if m.profile == "1g.10gb")
        sim.set_loads({one_g: [1.0]})
        (sample,) = sim.sample()
        assert sample.gpu_util_pct is not None and 92 / 7 <= sample.gpu_util_pct <= 100 / 7
        assert sample.power_draw_w is not None and gpu.power_limit_w is not None and sample.power_draw_w < 0.3 * gpu.power_limit_w

    def test_bad_loads_change_nothing(self) -> None:
        """An unknown UUID is NotFound and a load outside (0, 1] a ValueError; either leaves the GPUs as they were."""
        sim = SimulatedBackend("sim:2xT4", seed="s")
        first, _ = (g.uuid for g in sim.gpus())
        sim.set_loads({first: [1.0]})
        with pytest.raises(NotFound):
            sim.set_loads({"GPU-00000000-0000-0000-0000-000000000000": [1.0]})
        with pytest.raises(ValueError, match="fraction"):
            sim.set_loads({first: [1.5]})
        with pytest.raises(ValueError, match="fraction"):
            sim.set_loads({first: [0.0]})
        assert len(sim.sample()[0].processes) == 1
