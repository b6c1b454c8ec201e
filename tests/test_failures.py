"""Every failure has a typed cause and an owner (issue 39): the table, the agent's codes, the master's paths, and a
property test that no renter's or platform's failure moves a host's reliability.

On SQLite and PostgreSQL where a database is used.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from master.context import Master
from master.models import Host, HostEvent, Rental
from master.services.market import (
    OWNERS,
    FailureCode,
    Owner,
    UnknownFailureCode,
    agent_failure_code,
    owner_of,
    record_failure,
    reliability,
)
from shared.ids import new_id
from tests.apiclient import Api
from tests.factories import create_principal

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)
MIGRATION = importlib.import_module("master.migrations.versions.0030_failure_owner")

# Where the agent passes a code that is not a string literal it names, and why no code of a rental comes from there.
NOT_LITERAL = {
    ("agent/enroll.py", "str(body.get('code', 'enrollment_refused')) if isinstance(body, dict) else None"): "the master's code, at enrollment",
    ("agent/gpu/nvml.py", "code"): "power-limit refusals: _SET_LIMIT_REFUSALS, read below",
    ("agent/gpu/sim.py", "code"): "an XID number of a GPU event, not an error",
    ("agent/sampling.py", "e.code"): "an XID number of a GPU event, not an error",
    ("shared/errors.py", "code"): "GpumarketError's constructor",
}


def _agent_codes() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """Every error code the agent can put in a failed result: ``code=`` in agent/ (literals, module constants and the
    returns of local functions), class-level ``code`` of agent/ and shared/errors.py, and the protocol's refusals."""
    codes: dict[str, set[str]] = {}
    unresolved: set[tuple[str, str]] = set()
    files = [*sorted((ROOT / "agent").rglob("*.py")), ROOT / "shared/errors.py", *sorted((ROOT / "shared/protocol").rglob("*.py"))]
    for path in files:
        where = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        constants = {
            target.id: node.value.value
            for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(target, ast.Name)
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        }  # fmt: skip
        functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        for node in ast.walk(tree):
            found: list[str] = []
            if isinstance(node, ast.keyword) and node.arg == "code":
                value = node.value
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    found.append(value.value)
                elif isinstance(value, ast.Name) and value.id in constants:
                    found.append(constants[value.id])
                elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in functions:
                    found += [r.value.value for r in ast.walk(functions[value.func.id])
                              if isinstance(r, ast.Return) and isinstance(r.value, ast.Constant) and isinstance(r.value.value, str)]  # fmt: skip
                else:
                    unresolved.add((where, ast.unparse(value)))
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    names = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
                    assigned = getattr(item, "value", None)
                    if any(isinstance(n, ast.Name) and n.id == "code" for n in names) and isinstance(assigned, ast.Constant) \
                            and isinstance(assigned.value, str):
                        found.append(assigned.value)
            for code in found:
                codes.setdefault(code, set()).add(where)
    return codes, unresolved


class TestTheTable:
    def test_every_code_the_agent_can_emit_has_an_owner(self) -> None:
        """A code the agent can send that the table lacks fails here, naming the file that sends it."""
        codes, unresolved = _agent_codes()
        from agent.gpu.nvml import _SET_LIMIT_REFUSALS

        for code, _hint in _SET_LIMIT_REFUSALS.values():
            codes.setdefault(code, set()).add("agent/gpu/nvml.py")
        codes.setdefault("power_limit_refused", set()).add("agent/gpu/nvml.py")
        assert unresolved == set(NOT_LITERAL), "a new code= the scan cannot read: add it to NOT_LITERAL with why, or make it a literal"
        missing = {code: sorted(where) for code, where in codes.items() if code not in {c.value for c in FailureCode}}
        assert missing == {}, f"codes the agent emits with no owner: {missing}"
        assert {"image_not_found", "workload_start_failed", "registry_auth_unreadable", "bad_command"} <= codes.keys()

    def test_every_code_has_exactly_one_owner_and_the_migration_agrees(self) -> None:
        """The table is total, and 0030's copy (a migration never imports the app, and is never edited once shipped: it
        holds the codes of its day, a later code is not in it) gives each of its codes the owner the table gives."""
        assert set(OWNERS) == set(FailureCode) and all(isinstance(owner, Owner) for owner in OWNERS.values())
        now = {code.value: owner.value for code, owner in OWNERS.items()}
        assert set(MIGRATION.OWNERS) <= set(now)
        assert {code: now[code] for code in MIGRATION.OWNERS} == MIGRATION.OWNERS

    @pytest.mark.parametrize(
        ("code", "owner"),
        [
            # The issue's rules, one by one.
            ("image_not_found", Owner.RENTER), ("registry_auth_failed", Owner.RENTER), ("image_not_allowed", Owner.RENTER),
            ("workload_exited", Owner.RENTER), ("disk_quota_exceeded", Owner.RENTER), ("program_not_executable", Owner.RENTER),
            ("host_lost", Owner.PROVIDER), ("workload_lost", Owner.PROVIDER), ("agent_failure", Owner.PROVIDER),
            ("gpu_not_found", Owner.PROVIDER), ("container_runtime_unavailable", Owner.PROVIDER),
            ("workload_start_failed", Owner.PROVIDER), ("image_pull_failed", Owner.PROVIDER),
            ("placement_interrupted", Owner.PLATFORM), ("queue_timeout", Owner.PLATFORM), ("gpu_in_use", Owner.PLATFORM),
            ("registry_auth_unreadable", Owner.PLATFORM), ("bad_command", Owner.PLATFORM),
        ],
    )  # fmt: skip
    def test_the_issues_rules(self, code: str, owner: Owner) -> None:
        """Each kind of failure the issue names has the owner it gives."""
        assert owner_of(code) == owner

    def test_an_unknown_code_is_a_typed_error_and_an_agents_unknown_code_is_the_agents(self) -> None:
        """``owner_of`` never guesses; an agent's code the master does not know is recorded as ``agent_failure``."""
        with pytest.raises(UnknownFailureCode) as unknown:
            owner_of("workload exited with code 1")
        assert unknown.value.code == "unknown_failure_code" and isinstance(unknown.value, ValueError)
        assert agent_failure_code("from_a_newer_agent") == agent_failure_code(None) == FailureCode.AGENT_FAILURE
        assert agent_failure_code("image_not_found") == FailureCode.IMAGE_NOT_FOUND

    def test_the_engine_words_for_a_program_that_cannot_run_are_the_renters(self) -> None:
        """runc's ``exec:`` refusal is ``program_not_executable``; any other refusal of the engine stays the host's."""
        from agent.runtimes.container import start_failure_code

        runc = 'OCI runtime create failed: runc create failed: unable to start container process: exec: "train": executable file not found in $PATH'
        assert start_failure_code(runc) == "program_not_executable"
        assert start_failure_code("error gathering device information while adding custom device") == "workload_start_failed"


class TestMigration:
    @pytest.mark.parametrize(
        ("row", "expected"),
        [
            (("failed", "h-1", "image_not_found", "image_not_found: manifest unknown"), ("image_not_found", "renter")),
            (("failed", "h-1", "from_an_old_agent", "from_an_old_agent: ..."), ("agent_failure", "provider")),
            (("failed", "h-1", None, "workload exited with code 1"), ("workload_exited", "renter")),
            (("failed", "h-1", None, "workload ended (ended while the agent was not watching)"), ("workload_lost", "provider")),
            (("failed", "h-1", None, "host h-1 lost: silent since 2026-01-01T00:00:00Z"), ("host_lost", "provider")),
            (("failed", "h-1", None, "the host was revoked"), ("host_revoked", "provider")),
            (("failed", None, None, "placement interrupted"), ("placement_interrupted", "platform")),
            (("failed", None, None, "queue timeout"), ("queue_timeout", "platform")),
            (("failed", None, None, "offer h-x:0 is gone"), ("placement_failed", "platform")),
            (("failed", "h-1", None, "something else"), ("agent_failure", "provider")),
            (("stopped", "h-1", None, None), None),
            (("preempted", "h-1", None, "preempted by rental r-2"), None),
        ],
    )  # fmt: skip
    def test_the_backfill_gives_each_old_row_its_code_and_owner(
        self, row: tuple[str, str | None, str | None, str | None], expected: tuple[str, str] | None
    ) -> None:
        """0030 reads an old failure's code, or the text it was written from, once; the owner follows the code."""
        assert MIGRATION.legacy_failure(*row) == expected


class TestRecordedByTheMaster:
    async def test_a_failed_start_stores_the_agents_code_and_its_owner(self, api: Api) -> None:
        """Regression (issue 39): an image that does not exist failed the rental as the host's; it is the renter's."""
        await api.host(1)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {"kind": "container", "image": "pytorch"}})
        [start] = await api.commands(rental["id"], "start_workload")
        await api.agent_answers(start, ok=False, detail="cannot pull docker.io/library/pytorch:latest: manifest unknown",
                                data={"code": "image_not_found"})  # fmt: skip
        _, failed = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert (failed["state"], failed["failure_code"], failed["failure_owner"]) == ("failed", "image_not_found", "renter")

    async def test_a_start_failed_with_no_code_or_an_unknown_one_is_the_agents(self, api: Api) -> None:
        """No code (an agent's bug) or one this master does not know: ``agent_failure``, the provider's."""
        await api.host(2)
        for data in (None, {"code": "from_a_newer_agent"}):
            _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {"kind": "hold"}})
            [start] = await api.commands(rental["id"], "start_workload")
            await api.agent_answers(start, ok=False, detail="TypeError: boom", data=data)
            _, failed = await api.as_renter("GET", f"/rentals/{rental['id']}")
            assert (failed["failure_code"], failed["failure_owner"]) == ("agent_failure", "provider"), data


class TestNoOneElsesFailureMovesTheScore:
    async def test_random_failure_mixes_move_the_score_only_by_the_providers(self, master: Master) -> None:
        """Failures of every owner in random order on random hosts: each host's score is what its completed and
        provider-caused rentals alone give, and its counts by owner are the mix's."""
        provider, _ = await create_principal(master, "provider-1", "provider")
        renter, _ = await create_principal(master, "renter-1", "renter")
        loop = asyncio.get_running_loop()

        async def check(mix: list[tuple[int, FailureCode | None]]) -> None:
            hosts = [new_id("h") for _ in range(3)]
            async with master.db.session() as session:
                for host_id in hosts:
                    session.add(Host(id=host_id, owner_id=provider.account_id, state="online", created_at=NOW - 40 * DAY,
                                     state_changed_at=NOW - 40 * DAY))  # fmt: skip
                await session.flush()
                for host_id in hosts:
                    session.add(HostEvent(host_id=host_id, at=NOW - 40 * DAY, from_state=None, to_state="online", cause="t", actor="t"))
                for position, (host, code) in enumerate(mix):
                    stopped_at = NOW - timedelta(hours=position + 1)
                    rental = Rental(id=new_id("r"), renter_id=renter.account_id, host_id=hosts[host], gpu_count=1,
                                    state="stopped" if code is None else "failed", created_at=stopped_at - timedelta(hours=1),
                                    stopped_at=stopped_at)  # fmt: skip
                    if code is not None:
                        record_failure(rental, code, f"words that say nothing: {position}")
                    session.add(rental)
            async with master.db.session() as session:
                for index, host_id in enumerate(hosts):
                    row = (await session.scalars(select(Host).where(Host.id == host_id))).one()
                    score, inputs = await reliability.compute_reliability(session, row, now=NOW)
                    mine = [code for at, code in mix if at == index]
                    completed = sum(1 for code in mine if code is None)
                    by_owner = {owner: sum(1 for code in mine if code is not None and OWNERS[code] == owner) for owner in Owner}
                    expected = round((completed + 4) / (completed + by_owner[Owner.PROVIDER] + 4), 4)
                    assert score == expected, (mine, inputs["rentals"])
                    assert reliability.failed_rentals(inputs) == {owner.value: n for owner, n in by_owner.items()}
                    if by_owner[Owner.PROVIDER]:
                        assert score is not None and score < 1

        @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(st.lists(st.tuples(st.integers(0, 2), st.none() | st.sampled_from(list(FailureCode))), max_size=12))
        def mixes(mix: list[tuple[int, FailureCode | None]]) -> None:
            asyncio.run_coroutine_threadsafe(check(mix), loop).result()

        await asyncio.to_thread(mixes)
