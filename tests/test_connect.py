"""``POST /rentals/{id}/connect`` and what feeds it, on the master (SQLite and PostgreSQL through the
``api`` fixture): the renter's SSH keys reach the start command, the agent's host key is kept and
pinned, tokens name exactly what they open, ports must be declared, tunnel bytes count once, and an
ended rental's /workspace stays reachable until it is released or its retention passes.

The relay and agent sides are in tests/test_tunnels.py (end to end on ``gpumarket up``).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from master.models import Rental
from master.services.rentals import core as rentals
from master.telemetry import hosts
from shared import protocol
from shared.crypto import certificate_public_key
from shared.crypto.tokens import verify_connect_token
from shared.registry import RelayRecord
from tests.apiclient import Api, assert_error
from tests.factories import command_result, create_principal, envelope
from tests.helpers import ManualClock
from tests.test_ssh_keys import ed25519_line

HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
WORKLOAD = {"kind": "container", "image": "ubuntu:24.04", "command": ["sleep", "infinity"], "ports": [8888]}


async def _relay_up(api: Api, relay_id: str = "relay-t") -> None:
    await api.master.registry.put_relay(RelayRecord(
        relay_id=relay_id, region="local", url="wss://relay.example:8443/v1/agent", host="relay.example", port=8443,
        connections=1, capacity=100, draining=False, updated_at=datetime.now(UTC).timestamp(),
        ports_url="https://{label}.ports.example:8444/",
    ), ttl=60)


async def _running(api: Api, workload: dict[str, Any] | None = None, *, host_key: str | None = HOST_KEY) -> dict[str, Any]:
    """A rental of the renter's, started by the (simulated) agent, which reported ``host_key``."""
    await api.host(1)
    status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": workload or WORKLOAD})
    assert status == 201, rental
    [command] = await api.commands(rental["id"], "start_workload")
    data = {"kind": "container", "ssh_host_key": host_key} if host_key else {"kind": "container"}
    async with api.master.db.session() as session:
        await hosts.handle_command_result(session, envelope(command_result(command.host_id, 900, command.id, data=data)))
    return dict(rental)


async def _connect(api: Api, rental_id: str, port: Any = "ssh", key: str | None = None) -> tuple[int, Any]:
    return await api.call("POST", f"/rentals/{rental_id}/connect", key or api.renter_key, json={"port": port})


async def test_the_renters_keys_go_with_the_start_and_the_host_key_comes_back(api: Api) -> None:
    line = ed25519_line("alice@laptop")
    status, _ = await api.as_renter("POST", "/account/ssh-keys", json={"public_key": line})
    assert status == 201
    rental = await _running(api)
    [command] = await api.commands(rental["id"], "start_workload")
    start = protocol.StartWorkload.model_validate(command.args)
    assert start.authorized_keys == [" ".join(line.split()[:2])]
    view = (await api.as_renter("GET", f"/rentals/{rental['id']}"))[1]
    assert view["ssh_host_key"] == HOST_KEY and view["tunnel"] == {"bytes_in": 0, "bytes_out": 0}


async def test_connect_hands_a_token_for_the_relay_the_host_is_on(api: Api) -> None:
    rental = await _running(api)
    status, body = await _connect(api, rental["id"])
    assert_error(status, body, 409, "host_offline")  # no relay in the registry
    await _relay_up(api)
    status, view = await _connect(api, rental["id"])
    assert status == 200, view
    assert view["relay_url"] == "wss://relay.example:8443/v1/connect" and view["relay_id"] == "relay-t"
    assert view["ssh"] == {"host_key": HOST_KEY, "host_alias": f"{rental['id']}.gpumarket", "user": "gpumarket"}
    assert view["ca_pem"].startswith("-----BEGIN CERTIFICATE-----") and view["web_url"] is None
    claims = verify_connect_token(certificate_public_key(api.master.ca.certificate), view["token"],
                                  now=datetime.now(UTC).timestamp())
    assert (claims.account_id, claims.rental_id, claims.host_id, claims.kind, claims.port) == (
        api.renter.account_id, rental["id"], rental["host_id"], "ssh", 22)
    assert claims.expires_at <= datetime.now(UTC).timestamp() + api.master.settings.connect_token_ttl_s + 1
    # A declared port: a web address on the relay's ports domain, the token in its query.
    status, port = await _connect(api, rental["id"], 8888)
    assert status == 200 and port["kind"] == "tcp" and port["ssh"] is None
    assert port["web_url"].startswith(f"https://{rental['id']}-8888.ports.example:8444/?gm_token=gmc1.")


@pytest.mark.parametrize("port", [22, 9999, 0, 70000, True, "http"])
async def test_only_declared_ports_connect(api: Api, port: Any) -> None:
    rental = await _running(api)
    await _relay_up(api)
    status, body = await _connect(api, rental["id"], port)
    assert status == 422, body
    assert body["code"] in ("port_not_declared", "validation_failed")


async def test_nobody_else_connects_and_hold_rentals_have_nothing_to_log_into(api: Api) -> None:
    rental = await _running(api)
    await _relay_up(api)
    _, other_key = await create_principal(api.master, "renter-2", "renter")
    _, admin_key = await create_principal(api.master, "admin-9", "admin")
    for key in (other_key, admin_key, api.provider_key):
        status, body = await _connect(api, rental["id"], key=key)
        assert_error(status, body, 404, "rental_not_found")
    hold = await _running(api, {"kind": "hold"}, host_key=None)
    status, body = await _connect(api, hold["id"])
    assert_error(status, body, 409, "nothing_to_log_into")
    old_agent = await _running(api, host_key=None)
    status, body = await _connect(api, old_agent["id"])
    assert_error(status, body, 409, "no_ssh_host_key")


async def test_tunnel_bytes_count_once_per_report_and_only_for_the_hosts_own_rentals(api: Api) -> None:
    rental = await _running(api)
    other_host, _ = await api.host(1)
    usage = protocol.TunnelUsage(host_id=rental["host_id"], seq=77, ts=datetime.now(UTC), body=protocol.TunnelUsageBody(
        at=datetime.now(UTC), rentals=[protocol.TunnelUsageItem(rental_id=rental["id"], bytes_in=100, bytes_out=5000)]))
    for _ in range(2):  # a redelivery counts nothing more
        async with api.master.db.session() as session:
            await hosts.handle_tunnel_usage(session, envelope(usage))
    foreign = usage.model_copy(update={"host_id": other_host, "seq": 1})
    async with api.master.db.session() as session:
        assert await hosts.handle_tunnel_usage(session, envelope(foreign)) == 0
    view = (await api.as_renter("GET", f"/rentals/{rental['id']}"))[1]
    assert view["tunnel"] == {"bytes_in": 100, "bytes_out": 5000}


async def test_a_key_that_logged_in_shows_when_it_was_last_used(api: Api) -> None:
    status, key = await api.as_renter("POST", "/account/ssh-keys", json={"public_key": ed25519_line("bob")})
    assert status == 201 and key["last_used_at"] is None
    rental = await _running(api)
    at = datetime(2026, 11, 26, 5, 0, tzinfo=UTC)
    usage = protocol.TunnelUsage(host_id=rental["host_id"], seq=78, ts=at, body=protocol.TunnelUsageBody(at=at, rentals=[
        protocol.TunnelUsageItem(rental_id=rental["id"], bytes_in=0, bytes_out=0, keys_used=[key["fingerprint"]])]))
    async with api.master.db.session() as session:
        await hosts.handle_tunnel_usage(session, envelope(usage))
    [listed] = (await api.as_renter("GET", "/account/ssh-keys"))[1]["ssh_keys"]
    assert listed["last_used_at"] is not None and listed["last_used_at"].startswith("2026-11-26T05:00")


async def test_an_exited_rentals_workspace_stays_reachable_until_released(api: Api) -> None:
    rental = await _running(api)
    await _relay_up(api)
    exited = protocol.WorkloadExited(host_id=rental["host_id"], seq=901, ts=datetime.now(UTC), body=protocol.WorkloadExitedBody(
        rental_id=rental["id"], exit_code=0, at=datetime.now(UTC), reason="exited"))
    async with api.master.db.session() as session:
        await hosts.handle_workload_exited(session, envelope(exited))
    view = (await api.as_renter("GET", f"/rentals/{rental['id']}"))[1]
    assert view["state"] == "stopped" and view["workspace_until"] is not None
    status, ssh = await _connect(api, rental["id"])
    assert status == 200 and ssh["kind"] == "ssh"  # SFTP into /workspace
    status, body = await _connect(api, rental["id"], 8888)
    assert_error(status, body, 409, "rental_not_running")  # its ports went with the workload
    status, _ = await api.as_renter("DELETE", f"/rentals/{rental['id']}")
    assert status == 202
    [release] = await api.commands(rental["id"], "stop_workload")
    assert release.args["rental_id"] == rental["id"] and release.args["reason"] == "released"
    status, body = await _connect(api, rental["id"])
    assert_error(status, body, 409, "rental_not_running")


async def test_a_kept_workspace_is_released_when_its_retention_passes(api: Api) -> None:
    clock = ManualClock(datetime.now(UTC))
    api.master.clock = clock
    rental = await _running(api)
    exited = protocol.WorkloadExited(host_id=rental["host_id"], seq=902, ts=datetime.now(UTC), body=protocol.WorkloadExitedBody(
        rental_id=rental["id"], exit_code=3, at=clock.now(), reason="exited"))
    async with api.master.db.session() as session:
        await hosts.handle_workload_exited(session, envelope(exited))
    assert await rentals.release_expired_workspaces(api.master) == 0
    clock.advance(timedelta(hours=24, seconds=1).total_seconds())
    assert await rentals.release_expired_workspaces(api.master) == 1
    assert len(await api.commands(rental["id"], "stop_workload")) == 1
    async with api.master.db.session() as session:
        assert (await session.get(Rental, rental["id"])).workspace_until is None  # type: ignore[union-attr]
    assert await rentals.release_expired_workspaces(api.master) == 0
