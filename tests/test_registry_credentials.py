"""Private registry credentials and sealed TOTP secrets: stored sealed, never answered, sent only inside a start.

Real aiohttp apps on SQLite and PostgreSQL (the ``api`` fixture); the command a host gets is read off the in-process
bus as its relay would. ``tests/test_registry_pull.py`` pulls through a real registry.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pyotp
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from sqlalchemy import select, text, update

from master.app import close_master, open_master
from master.models import Account, Host, HostCertificate, RegistryCredential
from master.services import accounts, commands, hosts
from master.services.accounts.registries import normalize_prefix, prefix_matches
from shared import protocol
from shared.bus import InProcessBus
from shared.crypto import generate_private_key, make_csr, sealed, sealed_to
from shared.errors import ValidationFailed
from tests.apiclient import Api, assert_error, serve_api
from tests.factories import create_principal, master_settings

PASSWORD = "s3cret-registry-token-do-not-leak"


async def add(
    api: Api, key: str, prefix: str = "registry.example.com:5000/myorg/", **body: Any
) -> tuple[int, Any]:
    return await api.call(
        "POST",
        "/registry-credentials",
        key,
        json={"prefix": prefix, "username": "robot", "password": PASSWORD, **body},
    )


async def database_text(api: Api) -> str:
    """Every row of the tables a secret could end up in, as text."""
    async with api.master.db.session() as session:
        rows = []
        for table in ("registry_credentials", "commands", "audit_events", "rentals", "rental_events"):
            rows += [repr(tuple(r)) for r in (await session.execute(text(f"SELECT * FROM {table}"))).all()]
    return "\n".join(rows)


class TestPrefixes:
    @pytest.mark.parametrize(("given", "normalized"), [
        ("registry.example.com:5000/myorg/", "registry.example.com:5000/myorg/"),
        ("Registry.Example.com", "registry.example.com/"),
        ("127.0.0.1:5000", "127.0.0.1:5000/"),
        ("localhost/team/sub", "localhost/team/sub/"),
        ("docker.io/myorg/", "docker.io/myorg/"),
    ])  # fmt: skip
    def test_a_prefix_is_a_host_and_a_path_normalized(self, given: str, normalized: str) -> None:
        assert normalize_prefix(given) == normalized

    @pytest.mark.parametrize("given", [
        "myorg/", "https://registry.example.com/", "registry.example.com/My Org/", "registry.example.com/org\n",
        "registry.example.com\x00/", "registry.example.com//org", "régistry.example.com/", "",
    ])  # fmt: skip
    def test_anything_else_is_refused_as_given(self, given: str) -> None:
        with pytest.raises(ValidationFailed, match="registry host"):
            normalize_prefix(given)

    def test_path_components_match_whole_and_docker_hub_names_are_canonical(self) -> None:
        assert prefix_matches("registry.example.com:5000/myorg/", "registry.example.com:5000/myorg/app:1")
        assert not prefix_matches(
            "registry.example.com:5000/myorg/", "registry.example.com:5000/myorg2/app:1"
        )
        assert not prefix_matches("registry.example.com:5000/", "registry.example.com/app")
        assert prefix_matches("docker.io/myorg/", "myorg/app")
        assert prefix_matches("docker.io/library/", "busybox")


class TestApi:
    async def test_the_secret_is_never_answered_nor_stored_in_the_clear(self, api: Api) -> None:
        status, made = await add(api, api.renter_key)
        assert status == 201, made
        assert set(made) == {"id", "prefix", "username", "created_at", "updated_at", "last_used_at"}
        status, listed = await api.as_renter("GET", "/registry-credentials")
        assert status == 200 and listed["total"] == 1 and listed["items"][0]["username"] == "robot"
        _, events = await api.as_renter("GET", "/audit-events")
        assert events["items"][0]["kind"] == "registry_credential_added"
        for answer in (made, listed, events):
            assert PASSWORD not in json.dumps(answer)
        async with api.master.db.session() as session:
            row = await session.scalar(select(RegistryCredential))
            assert row is not None and sealed.is_sealed(row.secret)
        assert PASSWORD not in await database_text(api)

    async def test_the_same_prefix_replaces_the_login_and_another_account_gets_404(self, api: Api) -> None:
        _, first = await add(api, api.renter_key)
        status, again = await add(api, api.renter_key, username="robot2")
        assert (status, again["id"], again["username"]) == (200, first["id"], "robot2")
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        assert (await api.call("GET", "/registry-credentials", other_key))[1]["items"] == []
        assert_error(
            *await api.call("DELETE", f"/registry-credentials/{first['id']}", other_key),
            404,
            "registry_credential_not_found",
        )
        assert (await api.as_renter("DELETE", f"/registry-credentials/{first['id']}"))[0] == 200
        assert_error(
            *await api.as_renter("DELETE", f"/registry-credentials/{first['id']}"),
            404,
            "registry_credential_not_found",
        )
        _, events = await api.as_renter("GET", "/audit-events")
        assert events["items"][0]["kind"] == "registry_credential_removed"

    @pytest.mark.parametrize("body", [
        {"prefix": "registry.example.com/org\n"}, {"prefix": "myorg/"}, {"username": "robot\n"}, {"password": "tok\r\n"},
        {"password": ""}, {"password": "x" * 4097}, {"extra": 1},
    ])  # fmt: skip
    async def test_bad_input_is_a_422(self, api: Api, body: dict[str, Any]) -> None:
        status, answer = await add(api, api.renter_key, **body)
        assert_error(status, answer, 422, "validation_failed")
        assert PASSWORD not in json.dumps(answer)

    async def test_a_read_key_may_not_touch_them(self, api: Api) -> None:
        _, read = await api.as_renter("POST", "/api-keys", json={"name": "ro", "scopes": ["read"]})
        assert_error(*await add(api, read["key"]), 403, "scope_missing")
        assert_error(*await api.call("GET", "/registry-credentials", read["key"]), 403, "scope_missing")

    async def test_a_master_without_secrets_key_refuses_to_store_one(
        self, database_url: str, tmp_path: Path
    ) -> None:
        master = await open_master(
            master_settings(tmp_path, database_url=database_url, secrets_key=None), bus=InProcessBus()
        )
        try:
            async with serve_api(master) as api:
                status, answer = await add(api, api.renter_key)
                assert_error(status, answer, 503, "secrets_key_unset")
                assert "secrets_key" in answer["message"]
        finally:
            await close_master(master)


async def enroll_key(api: Api, host_id: str, *, later: timedelta = timedelta(0)) -> ec.EllipticCurvePrivateKey:
    """A certificate the master's CA signs for ``host_id`` (as at enrollment or, ``later``, a renewal), recorded with
    its key; returns the host's private key."""
    key = generate_private_key()
    issued = api.master.ca.sign_agent_csr(make_csr(key, host_id), host_id=host_id, validity=timedelta(hours=1))
    async with api.master.db.session() as session:
        session.add(hosts.certificate_row(host_id, issued, issued_at=api.master.clock.now() + later))
    return key


async def delivered_start(api: Api, host_id: str, command_id: str) -> tuple[str, protocol.StartWorkload]:
    """Send the start as ``publish`` does and read it off the host's relay's stream, as the relay would: the raw
    delivery and its command."""
    async with api.master.db.session() as session:
        await session.execute(update(Host).where(Host.id == host_id).values(relay_id="relay-t"))
    stream = protocol.commands_stream("relay-t")
    await api.master.bus.ensure_group(stream, "t")
    await commands.publish(api.master, [command_id])
    payloads = [m.payload.decode() for m in await api.master.bus.read(stream, "t", "t", block=0)]
    mine = [(raw, protocol.CommandDelivery.model_validate_json(raw)) for raw in payloads]
    raw, delivery = [(raw, d) for raw, d in mine if d.command.body.command_id == command_id][-1]
    command = protocol.decode_command(delivery.command.body)
    assert isinstance(command, protocol.StartWorkload)
    return raw, command


class TestStartCommand:
    async def test_the_longest_prefix_goes_out_with_the_start_sealed_to_the_host_and_never_into_its_row(
        self, api: Api
    ) -> None:
        """The delivery on the bus holds only an ``ecies:v1`` token, which opens with the host's certificate key, for
        that host and that command, and with nothing else."""
        host_id, _ = await api.host(1)
        host_key = await enroll_key(api, host_id)
        await add(api, api.renter_key, prefix="registry.example.com:5000/")
        await add(api, api.renter_key, prefix="registry.example.com:5000/myorg/", username="org-robot")
        _, other_key = await create_principal(api.master, "renter-2", "renter")
        await add(api, other_key, prefix="registry.example.com:5000/myorg/app/", username="not-yours")
        status, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {
            "kind": "container", "image": "registry.example.com:5000/myorg/app:1"}})  # fmt: skip
        assert status == 201, rental
        [start] = await api.commands(rental["id"], "start_workload")
        assert "registry_auth" not in start.args and "sealed_registry_auth" not in start.args
        raw, command = await delivered_start(api, host_id, start.id)
        assert PASSWORD not in raw and "org-robot" not in raw and '"registry_auth"' not in raw  # the bus sees a token only
        assert command.sealed_registry_auth is not None and sealed_to.is_sealed_to(command.sealed_registry_auth)
        context = protocol.registry_auth_context(host_id, start.id)
        opened = protocol.RegistryAuth.model_validate_json(sealed_to.open_with(host_key, command.sealed_registry_auth, context))
        assert (opened.server, opened.username, opened.password) == ("registry.example.com:5000", "org-robot", PASSWORD)
        for key, where in ((generate_private_key(), context), (host_key, protocol.registry_auth_context(host_id, "cmd_other")),
                           (host_key, protocol.registry_auth_context("h_other", start.id))):  # fmt: skip
            with pytest.raises(sealed_to.SealedToError):
                sealed_to.open_with(key, command.sealed_registry_auth, where)
        assert PASSWORD not in repr(command)
        assert PASSWORD not in await database_text(api)
        _, listed = await api.as_renter("GET", "/registry-credentials")
        used = {item["prefix"]: item["last_used_at"] for item in listed["items"]}
        assert (
            used["registry.example.com:5000/myorg/"] is not None
            and used["registry.example.com:5000/"] is None
        )

    async def test_a_renewed_certificate_gets_the_next_sending(self, api: Api) -> None:
        """Sealed to the host's newest unrevoked certificate: once the master signed a renewal, the next sending is
        sealed to the renewal's key (the agent holds it from its CSR on), and a revoked one is never used."""
        host_id, _ = await api.host(1)
        first = await enroll_key(api, host_id)
        await add(api, api.renter_key)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {
            "kind": "container", "image": "registry.example.com:5000/myorg/app:1"}})  # fmt: skip
        [start] = await api.commands(rental["id"], "start_workload")
        context = protocol.registry_auth_context(host_id, start.id)
        _, command = await delivered_start(api, host_id, start.id)
        assert command.sealed_registry_auth is not None
        assert PASSWORD.encode() in sealed_to.open_with(first, command.sealed_registry_auth, context)
        renewed = await enroll_key(api, host_id, later=timedelta(minutes=1))
        _, command = await delivered_start(api, host_id, start.id)
        assert command.sealed_registry_auth is not None
        assert PASSWORD.encode() in sealed_to.open_with(renewed, command.sealed_registry_auth, context)
        async with api.master.db.session() as session:
            await session.execute(update(HostCertificate).where(HostCertificate.host_id == host_id)
                                  .values(revoked_at=api.master.clock.now()))  # fmt: skip
        _, command = await delivered_start(api, host_id, start.id)
        assert command.sealed_registry_auth is None

    async def test_a_host_without_a_known_key_gets_no_login(self, api: Api, caplog: pytest.LogCaptureFixture) -> None:
        """A host whose certificate's key the master never recorded (signed before keys were) is sent no login: the
        login never crosses the bus in the clear, and the log says why."""
        host_id, _ = await api.host(1)
        async with api.master.db.session() as session:
            await session.execute(update(HostCertificate).where(HostCertificate.host_id == host_id).values(public_key=None))
        await add(api, api.renter_key)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {
            "kind": "container", "image": "registry.example.com:5000/myorg/app:1"}})  # fmt: skip
        [start] = await api.commands(rental["id"], "start_workload")
        raw, command = await delivered_start(api, host_id, start.id)
        assert command.sealed_registry_auth is None and PASSWORD not in raw
        assert "no certificate whose key is known" in caplog.text and PASSWORD not in caplog.text

    async def test_a_refused_login_fails_the_rental_as_the_renters_doing(self, api: Api) -> None:
        await api.host(1)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {
            "kind": "container", "image": "registry.example.com:5000/myorg/app:1"}})  # fmt: skip
        [start] = await api.commands(rental["id"], "start_workload")
        detail = "cannot pull registry.example.com:5000/myorg/app:1: unauthorized: authentication required"
        await api.agent_answers(start, ok=False, detail=detail, data={"code": "registry_auth_failed"})
        _, failed = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert failed["state"] == "failed" and failed["failure_code"] == "registry_auth_failed"
        assert failed["failure_owner"] == "renter" and "unauthorized" in failed["failure_reason"]


    async def test_a_login_the_host_cannot_open_fails_the_rental_as_the_platforms_doing(self, api: Api) -> None:
        """``registry_auth_unreadable`` (the sealed login opened with none of the host's keys) blames neither the
        renter nor the host."""
        await api.host(1)
        _, rental = await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "workload": {
            "kind": "container", "image": "registry.example.com:5000/myorg/app:1"}})  # fmt: skip
        [start] = await api.commands(rental["id"], "start_workload")
        detail = "the registry login the platform sent for this start does not open with this host's keys"
        await api.agent_answers(start, ok=False, detail=detail, data={"code": "registry_auth_unreadable"})
        _, failed = await api.as_renter("GET", f"/rentals/{rental['id']}")
        assert failed["state"] == "failed" and failed["failure_code"] == "registry_auth_unreadable"
        assert failed["failure_owner"] == "platform"


class TestSealedTotp:
    async def test_a_secret_kept_in_the_clear_still_works_and_is_sealed_once_used(self, api: Api) -> None:
        secret = pyotp.random_base32(32)
        async with api.master.db.session() as session:
            await session.execute(
                update(Account).where(Account.id == api.renter.account_id).values(totp_secret=secret)
            )
        from datetime import UTC, datetime

        now = datetime.now(UTC)
        key = accounts.secrets_key_of(api.master.settings)
        async with api.master.db.session() as session:
            account = await session.get(Account, api.renter.account_id)
            assert account is not None
            from master.services.accounts import totp

            assert totp.check(
                account, pyotp.TOTP(secret).at(now), now=now, address=None, session=session, key=key
            )
            assert (
                account.totp_secret is not None
                and sealed.is_sealed(account.totp_secret)
                and secret not in account.totp_secret
            )
        async with api.master.db.session() as session:
            account = await session.get(Account, api.renter.account_id)
            assert account is not None
            later = now.replace(microsecond=0) + __import__("datetime").timedelta(seconds=60)
            assert totp.check(
                account, pyotp.TOTP(secret).at(later), now=later, address=None, session=session, key=key
            )

    async def test_a_new_secret_is_sealed_at_rest(self, api: Api) -> None:
        from datetime import UTC, datetime

        key = accounts.secrets_key_of(api.master.settings)
        now = datetime.now(UTC)
        async with api.master.db.session() as session:
            account = await session.get(Account, api.renter.account_id)
            assert account is not None
            started = accounts.totp_begin(account, key=key)
            assert account.totp_pending is not None and sealed.is_sealed(account.totp_pending)
            accounts.totp_confirm(
                session, account, pyotp.TOTP(started["secret"]).at(now), now=now, address=None, key=key
            )
        async with api.master.db.session() as session:
            stored = await session.scalar(
                select(Account.totp_secret).where(Account.id == api.renter.account_id)
            )
        assert stored is not None and sealed.is_sealed(stored) and started["secret"] not in stored
