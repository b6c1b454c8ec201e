"""Test data builders: settings, accounts, enrolled hosts, and agent messages."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import uuid4

from master.context import Master
from master.services.accounts.core import Principal, create_account
from master.services.hosts import enrollment
from master.telemetry import hosts
from shared import protocol
from shared.crypto import generate_private_key, make_csr
from shared.settings import MasterSettings

# One scaled time unit for tests: intervals are multiples of it, never real seconds.
MS = 0.001


TEST_SECRETS_KEY = "dGVzdC1zZWNyZXRzLWtleS1vZi0zMi1ieXRlcy0hISE="  # 32 bytes, URL-safe base64


def master_settings(tmp_path: Path, **overrides: Any) -> MasterSettings:
    values: dict[str, Any] = {
        "data_dir": tmp_path / "master",
        "http_port": 0,
        "heartbeat_interval": 50 * MS,
        "telemetry_interval": 50 * MS,
        "command_retry_interval": 200 * MS,
        "stale_message_idle": 500 * MS,
        "instance_id": "master-test",
        "require_credit": False,  # billing tests turn it on; the rest rent without topping up
        # Tests call the API from 127.0.0.1 as fast as it answers; tests/test_rate_limits.py turns limits on.
        "rate_limits_enabled": False,
        # Argon2id at its smallest: the tests that sign in by password check the hashing, not its cost.
        "password_hash_time_cost": 1,
        "password_hash_memory_kib": 8192,
        # Registry credentials and TOTP secrets are sealed with it (tests/test_registry_credentials.py turns it off).
        "secrets_key": TEST_SECRETS_KEY,
        # Markets of tests list hosts at their first hello; tests/test_verification*.py turn the challenge on.
        "verification_required": False,
    }
    values.update(overrides)
    return MasterSettings.load(**values)


async def create_principal(master: Master, name: str, role: str) -> tuple[Principal, str]:
    async with master.db.session() as session:
        account, key = await create_account(session, name, role)
    return Principal(account_id=account.id, name=account.name, role=account.role), key


async def enroll_host(master: Master, provider: Principal) -> str:
    """Enroll a host the way an agent would (token + CSR); returns its host id."""
    token, _ = await enrollment.create_token(master, provider.account_id)
    csr = make_csr(generate_private_key(), "test-host").decode()
    result = await enrollment.enroll(master, token, csr, hostname="test-host")
    return result.host_id


def gpu_info(index: int, *, name: str = "NVIDIA GeForce RTX 4090", uuid: str | None = None, memory: int = 24564) -> protocol.GpuInfoModel:
    return protocol.GpuInfoModel(
        index=index, uuid=uuid or f"GPU-{uuid4()}", name=name, memory_total_mib=memory,
        compute_capability="8.9",
    )


def envelope(message: protocol.AnyAgentMessage, *, relay: str = "relay-t") -> protocol.BusEnvelope:
    return protocol.BusEnvelope(relay_id=relay, received_at=datetime.now(UTC), message=message)


def hello(host_id: str, seq: int, gpus: list[protocol.GpuInfoModel], *, isolation: protocol.IsolationFacts | None = None) -> protocol.Hello:
    """A hello; without ``isolation`` it is an agent's from before container workloads (the host's facts unknown)."""
    return protocol.Hello(
        host_id=host_id, seq=seq, ts=datetime.now(UTC),
        body=protocol.HelloBody(agent_version="test", gpu_backend="sim", host={"hostname": "test"}, gpus=gpus, isolation=isolation),
    )


def telemetry(host_id: str, seq: int, gpus: list[protocol.GpuInfoModel]) -> protocol.Telemetry:
    return protocol.Telemetry(
        host_id=host_id, seq=seq, ts=datetime.now(UTC),
        body=protocol.TelemetryBody(
            sampled_at=datetime.now(UTC),
            gpus=[protocol.GpuSampleModel(index=g.index, uuid=g.uuid, gpu_util_pct=float(seq % 100)) for g in gpus],
        ),
    )


def command_result(
    host_id: str, seq: int, command_id: str, *, ok: bool = True, detail: str = "", data: dict[str, Any] | None = None
) -> protocol.CommandResult:
    return protocol.CommandResult(
        host_id=host_id, seq=seq, ts=datetime.now(UTC),
        body=protocol.CommandResultBody(command_id=command_id, ok=ok, detail=detail, data=data or {}, finished_at=datetime.now(UTC)),
    )


async def online_host(
    master: Master, provider: Principal, gpus: list[protocol.GpuInfoModel], *, isolation: protocol.IsolationFacts | None = None
) -> str:
    """An enrolled host that said hello with ``gpus`` (so it is online and rentable), and ``isolation`` facts if given."""
    host_id = await enroll_host(master, provider)
    async with master.db.session() as session:
        await hosts.handle_hello(session, envelope(hello(host_id, 0, gpus, isolation=isolation)))
    return host_id
