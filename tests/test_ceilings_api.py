"""Every rental's ceilings at the master: limits a host cannot give (issue 35, "no ceilings by default").

A ``pids_limit`` above the rental's share of a host's ``pid_max``, or CPU, memory or disk above what the
host gives rentals, is never placed there: 422 naming the field on its offer, and when no host could
give it, 422 naming the field and the most any host allows. Static bounds (the kernel's 4,194,304 pids)
are refused before any placement. Through the REST API on SQLite and PostgreSQL; hosts are simulated
by their hellos' isolation facts.
"""

from __future__ import annotations

from typing import Any

from master.services import isolation
from master.services.isolation import Refusal
from shared import protocol
from tests.apiclient import RTX, Api, assert_error
from tests.test_templates import CONTAINER, PROCESS, host_with, rent


def ceiling_facts(*, pid_max: int = 32768, reserved_pids: int = 2048, memory_mib: int = 16384, cores: float = 8.0,
                  disk_quota: str | None = "loop", max_disk_gib: int | None = 100) -> protocol.IsolationFacts:  # fmt: skip
    """A host that runs containers and processes and reports its ceilings as this branch's agent does."""
    return protocol.IsolationFacts.model_validate({
        "kinds": ["container", "process", "hold"], "container_engine": "docker 20.10.24", "process_isolation": "uid",
        "max_cpu_cores": cores, "max_memory_mib": memory_mib, "pid_max": pid_max, "reserved_pids": reserved_pids,
        "reserved_memory_mib": 1024, "reserved_cpu_cores": 0.5, "disk_quota": disk_quota, "max_disk_gib": max_disk_gib,
    })  # fmt: skip


def problem_field(body: Any) -> str:
    return str(body["details"]["problems"][0]["field"])


class TestStaticBounds:
    """Limits no host can ever give are refused before placement."""

    async def test_a_pids_limit_above_the_kernels_is_refused_naming_the_field(self, api: Api) -> None:
        """pids_limit 4,194,305 (past the kernel's pid_max ceiling) is 422 on ``workload.pids_limit``; nothing is made."""
        await host_with(api, ceiling_facts())
        status, body = await rent(api, workload={**CONTAINER, "pids_limit": (1 << 22) + 1})
        assert status == 422, body
        assert problem_field(body).startswith("workload.") and problem_field(body).endswith(".pids_limit")


class TestPlacementWithinCeilings:
    """A host whose reported size or pid_max cannot hold the request is not a candidate."""

    async def test_the_audits_pids_limit_is_refused_on_a_host_with_pid_max_32768(self, api: Api) -> None:
        """Regression (issue 35): pids_limit 4,194,304 was accepted on a host whose pid_max is 32,768; now 422 naming the field and the most allowed."""
        host = await host_with(api, ceiling_facts(), count=8)
        status, body = await rent(api, offer_id=f"{host}:{RTX}", workload={**CONTAINER, "pids_limit": 1 << 22})
        assert_error(status, body, 422, "limits_exceed_host")
        assert problem_field(body) == "workload.pids_limit" and "pid_max is 32768" in body["message"]
        status, body = await rent(api, workload={**CONTAINER, "pids_limit": 1 << 22})
        assert_error(status, body, 422, "limits_exceed_host")
        # One of eight GPUs: an eighth of pid_max less the reserve, (32768 - 2048) / 8.
        assert problem_field(body) == "workload.pids_limit" and body["details"]["most"] == 3840
        status, body = await rent(api, workload={**CONTAINER, "pids_limit": 3840})
        assert status == 201, body

    async def test_a_pids_limit_is_measured_against_the_rentals_share(self, api: Api) -> None:
        """The same pids_limit fits a rental of all eight GPUs and not one of a single GPU."""
        host = await host_with(api, ceiling_facts(), count=8)
        status, body = await rent(api, offer_id=f"{host}:{RTX}", workload={**PROCESS, "pids_limit": 20000})
        assert_error(status, body, 422, "limits_exceed_host")
        status, body = await rent(api, offer_id=f"{host}:{RTX}", gpu_count=8, workload={**PROCESS, "pids_limit": 20000})
        assert status == 201, body

    async def test_memory_above_the_host_is_refused_naming_the_field(self, api: Api) -> None:
        """memory_mib above the host's RAM is 422 on ``workload.memory_mib`` with the most any host allows."""
        await host_with(api, ceiling_facts(memory_mib=16384))
        status, body = await rent(api, workload={**CONTAINER, "memory_mib": 16385})
        assert_error(status, body, 422, "limits_exceed_host")
        assert problem_field(body) == "workload.memory_mib" and body["details"]["most"] == 16384

    async def test_disk_is_refused_above_the_largest_quota_and_where_there_is_none(self, api: Api) -> None:
        """disk_gib above a host's largest quota, or on a host with no disk quota, is not placed there."""
        quota = await host_with(api, ceiling_facts(max_disk_gib=50))
        status, body = await rent(api, offer_id=f"{quota}:{RTX}", workload={**CONTAINER, "disk_gib": 80})
        assert_error(status, body, 422, "limits_exceed_host")
        assert problem_field(body) == "workload.disk_gib"
        none = await host_with(api, ceiling_facts(disk_quota="none", max_disk_gib=None))
        status, body = await rent(api, offer_id=f"{none}:{RTX}", workload={**CONTAINER, "disk_gib": 5})
        assert_error(status, body, 422, "limits_exceed_host")
        status, body = await rent(api, offer_id=f"{quota}:{RTX}", workload={**CONTAINER, "disk_gib": 50})
        assert status == 201, body


class TestRefusalArithmetic:
    """``isolation.refusal`` with a rental's fraction of its host."""

    def test_an_older_agent_that_reports_no_pid_max_bounds_no_pids(self) -> None:
        """Facts without pid_max or a disk quota (an older agent) refuse no pids_limit or disk_gib."""
        facts = {"kinds": ["container", "hold"], "max_cpu_cores": 8, "max_memory_mib": 8192}
        workload = {**CONTAINER, "pids_limit": 1 << 22, "disk_gib": 1000}
        assert isolation.refusal(facts, workload, fraction=0.125) is None

    def test_a_share_counts_as_its_fraction(self) -> None:
        """A 250-milli share of one GPU of a one-GPU host may run a quarter of its usable pids."""
        facts = ceiling_facts().model_dump()
        assert isolation.refusal(facts, {**PROCESS, "pids_limit": 7680}, fraction=0.25) is None
        assert isolation.refusal(facts, {**PROCESS, "pids_limit": 7681}, fraction=0.25) == Refusal.LIMITS
