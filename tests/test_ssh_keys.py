"""Renters' SSH public keys (``/api/v1/account/ssh-keys``): strict parsing, one key per fingerprint per account,
the per-account limit, each account's keys its own, and the canonical lines the agent's SSH server will authorise.

Driven through the REST API on SQLite and PostgreSQL (the ``api`` fixture). Fingerprints are checked against
what Debian's ``ssh-keygen -lf`` prints for the same key.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed25519, rsa
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from master.api.openapi import build_openapi
from master.api.table import ROUTES
from master.context import Master
from master.db import alembic_config
from master.services.accounts import ssh_keys
from shared.errors import ValidationFailed
from tests.apiclient import Api, assert_error
from tests.factories import create_principal

PATH = "/account/ssh-keys"


def openssh_line(key: Any, comment: str = "") -> str:
    """The ``.pub`` line of a cryptography private key, with ``comment`` appended when given."""
    line: str = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    return f"{line} {comment}" if comment else line


def ed25519_line(comment: str = "") -> str:
    return openssh_line(ed25519.Ed25519PrivateKey.generate(), comment)


async def add(api: Api, public_key: str, key: str | None = None, **extra: Any) -> tuple[int, Any]:
    return await api.call("POST", PATH, key or api.renter_key, json={"public_key": public_key, **extra})


class TestAddListDelete:
    async def test_a_renter_adds_lists_and_deletes_a_key(self, api: Api) -> None:
        """POST answers 201 with the canonical key (comment dropped) and the comment as name; GET lists it; DELETE removes it."""
        line = ed25519_line("alice@laptop")
        status, created = await add(api, line + "\n")
        assert status == 201, created
        assert set(created) == {"id", "name", "algorithm", "fingerprint", "public_key", "created_at", "last_used_at"}
        assert created["name"] == "alice@laptop" and created["algorithm"] == "ssh-ed25519"
        assert created["public_key"] == line.rsplit(" ", 1)[0] and created["last_used_at"] is None
        assert created["fingerprint"].startswith("SHA256:") and not created["fingerprint"].endswith("=")
        status, listed = await api.as_renter("GET", PATH)
        assert status == 200 and listed == {"ssh_keys": [created]}
        status, deleted = await api.as_renter("DELETE", f"{PATH}/{created['id']}")
        assert status == 200 and deleted == {"id": created["id"], "deleted": True}
        assert (await api.as_renter("GET", PATH))[1] == {"ssh_keys": []}
        status, body = await api.as_renter("DELETE", f"{PATH}/{created['id']}")
        assert_error(status, body, 404, "ssh_key_not_found")

    @pytest.mark.parametrize("curve", [ec.SECP256R1(), ec.SECP384R1(), ec.SECP521R1()], ids=["p256", "p384", "p521"])
    async def test_ecdsa_keys_are_accepted(self, api: Api, curve: ec.EllipticCurve) -> None:
        status, body = await add(api, openssh_line(ec.generate_private_key(curve), "ec"))
        assert status == 201, body
        assert body["algorithm"] == f"ecdsa-sha2-nistp{curve.key_size}"

    async def test_rsa_2048_is_accepted_and_every_role_manages_its_own(self, api: Api) -> None:
        """RSA of 2048 bits passes; providers and admins register keys too."""
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        for who in (api.renter_key, api.provider_key, admin_key):
            status, body = await add(api, openssh_line(rsa.generate_private_key(public_exponent=65537, key_size=2048)), who)
            assert status == 201 and body["algorithm"] == "ssh-rsa", body

    async def test_a_given_name_wins_is_nfc_normalised_and_bounded(self, api: Api) -> None:
        """A given name replaces the comment and is stored NFC; look-alike letters are kept; over 100 characters is 422."""
        status, body = await add(api, ed25519_line("comment"), name="  Cafe\u0301 \u0430dmin key  ")  # decomposed é, Cyrillic а
        assert status == 201, body
        assert body["name"] == "Caf\u00e9 \u0430dmin key"
        status, body = await add(api, ed25519_line(), name="x" * 101)
        assert_error(status, body, 422, "invalid_ssh_key_name")
        status, body = await add(api, ed25519_line("é" * 150))
        assert status == 201 and body["name"] == "é" * 100, body
        status, body = await add(api, ed25519_line())
        assert status == 201 and body["name"].startswith("ssh-ed25519 "), body

    async def test_the_api_documents_the_routes(self, api: Api) -> None:
        paths = build_openapi(ROUTES)["paths"]
        assert {"get", "post"} <= set(paths["/api/v1/account/ssh-keys"])
        assert "delete" in paths["/api/v1/account/ssh-keys/{ssh_key_id}"]


class TestRefusals:
    async def refused(self, api: Api, text: str, code: str) -> dict[str, Any]:
        status, body = await add(api, text)
        assert_error(status, body, 422, code)
        assert body["details"]["problems"][0]["field"] == "public_key", body
        assert (await api.as_renter("GET", PATH))[1] == {"ssh_keys": []}
        return dict(body)

    async def test_rsa_1024_is_too_weak(self, api: Api) -> None:
        body = await self.refused(api, openssh_line(rsa.generate_private_key(public_exponent=65537, key_size=1024)), "ssh_key_too_weak")
        assert "1024 bits" in body["message"] and "ssh-keygen -t ed25519" in body["message"]

    async def test_dsa_is_too_weak(self, api: Api) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # cryptography deprecates SSH DSA: the case this test is about
                line = openssh_line(dsa.generate_private_key(key_size=1024))
        except Exception as exc:  # a cryptography that no longer serialises DSA for OpenSSH
            pytest.skip(f"cryptography cannot write an ssh-dss key: {exc}")
        await self.refused(api, line, "ssh_key_too_weak")

    async def test_a_certificate_is_refused(self, api: Api) -> None:
        blob = ed25519_line().split()[1]
        body = await self.refused(api, f"ssh-ed25519-cert-v01@openssh.com {blob} cert", "invalid_ssh_key")
        assert "certificate" in body["message"]

    @pytest.mark.parametrize("form", ["openssh", "pem"])
    async def test_a_private_key_is_refused_and_named(self, api: Api, form: str) -> None:
        key = ed25519.Ed25519PrivateKey.generate() if form == "openssh" else rsa.generate_private_key(public_exponent=65537, key_size=2048)
        fmt = serialization.PrivateFormat.OpenSSH if form == "openssh" else serialization.PrivateFormat.PKCS8
        pem = key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()).decode()
        body = await self.refused(api, pem, "private_key_pasted")
        assert "that is a private key; paste the .pub file" in body["message"]

    async def test_a_putty_private_key_is_refused_and_named(self, api: Api) -> None:
        putty = "PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\nComment: me\nPublic-Lines: 2\nAAAA\nAAAA\n"
        await self.refused(api, putty, "private_key_pasted")

    async def test_a_pem_public_key_is_refused_with_how_to_convert_it(self, api: Api) -> None:
        pem = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
        body = await self.refused(api, pem, "invalid_ssh_key")
        assert "ssh-keygen -i" in body["message"]

    async def test_a_comment_that_mentions_a_private_key_is_only_a_comment(self, api: Api) -> None:
        status, body = await add(api, ed25519_line("the PRIVATE KEY is on my laptop"))
        assert status == 201 and body["name"] == "the PRIVATE KEY is on my laptop", body

    async def test_a_compressed_ec_point_is_refused(self, api: Api) -> None:
        """A P-256 key whose point is compressed (cryptography cannot load it): 422, not a 500."""
        key = ec.generate_private_key(ec.SECP256R1()).public_key()
        point = key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint)
        blob = b"".join(len(part).to_bytes(4, "big") + part for part in (b"ecdsa-sha2-nistp256", b"nistp256", point))
        await self.refused(api, "ecdsa-sha2-nistp256 " + base64.b64encode(blob).decode(), "invalid_ssh_key")

    async def test_two_lines_are_refused(self, api: Api) -> None:
        body = await self.refused(api, ed25519_line("a") + "\n" + ed25519_line("b"), "invalid_ssh_key")
        assert "one key at a time" in body["message"]

    async def test_a_20_kib_line_is_refused(self, api: Api) -> None:
        body = await self.refused(api, ed25519_line("x" * 20 * 1024), "invalid_ssh_key")
        assert "16 KiB" in body["message"]

    @pytest.mark.parametrize(
        "text",
        ["ssh-ed25519 AAAA!!notbase64", "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBad", "ssh-ed25519", "",
         "ssh-rsa AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl",
         'command="ls" ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl'],
        ids=["not-base64", "truncated", "no-base64", "empty", "type-mismatch", "options"],
    )  # fmt: skip
    async def test_garbage_is_refused_with_what_to_paste(self, api: Api, text: str) -> None:
        body = await self.refused(api, text, "invalid_ssh_key")
        assert ".pub" in body["message"] or "accepted:" in body["message"], body

    async def test_a_control_character_is_refused(self, api: Api) -> None:
        # C0 controls: the body reader's 400 invalid_character naming the field (master/api/characters.py).
        status, body = await add(api, ed25519_line("evil\x1b[31mred"))
        assert_error(status, body, 400, "invalid_character")
        assert "U+001B" in body["message"] and "'public_key'" in body["message"]
        await self.refused(api, ed25519_line("spoof\u202etxt.exe"), "invalid_ssh_key")
        # A lone surrogate: the API's body reader refuses it as not JSON; the service, called directly, too.
        status, body = await add(api, ed25519_line("lone \ud800 surrogate"))
        assert_error(status, body, 400, "invalid_json")
        with pytest.raises(ValidationFailed) as refused:
            ssh_keys.parse_public_key(ed25519_line("lone \ud800 surrogate"))
        assert refused.value.code == "invalid_ssh_key"
        with pytest.raises(ValidationFailed) as refused:
            ssh_keys.key_name("bad\ud800name", ssh_keys.parse_public_key(ed25519_line()))
        assert refused.value.code == "invalid_ssh_key_name"


class TestDuplicatesAndLimits:
    async def test_the_same_key_again_is_409_and_changes_nothing(self, api: Api) -> None:
        """Posting a key the account holds (even with another comment or name) is 409 ssh_key_exists naming the key."""
        line = ed25519_line("first")
        status, created = await add(api, line)
        assert status == 201
        status, body = await add(api, line.rsplit(" ", 1)[0] + " second", name="another name")
        assert_error(status, body, 409, "ssh_key_exists")
        assert body["details"] == {"id": created["id"]} and "first" in body["message"]
        assert (await api.as_renter("GET", PATH))[1] == {"ssh_keys": [created]}
        # Another account may register the same key.
        status, body = await add(api, line, api.provider_key)
        assert status == 201 and body["fingerprint"] == created["fingerprint"], body

    async def test_an_account_holds_at_most_50_keys(self, api: Api) -> None:
        for i in range(ssh_keys.MAX_KEYS_PER_ACCOUNT):
            status, body = await add(api, ed25519_line(f"k{i}"))
            assert status == 201, body
        status, body = await add(api, ed25519_line("one too many"))
        assert_error(status, body, 409, "too_many_ssh_keys")
        status, listed = await api.as_renter("GET", PATH)
        assert len(listed["ssh_keys"]) == 50
        await api.as_renter("DELETE", f"{PATH}/{listed['ssh_keys'][0]['id']}")
        status, body = await add(api, ed25519_line("room again"))
        assert status == 201, body


class TestIsolation:
    async def test_another_account_neither_lists_nor_deletes_your_keys(self, api: Api) -> None:
        """Another renter, a provider and an admin see none of the renter's keys; deleting one is 404 as an unknown id."""
        status, created = await add(api, ed25519_line("mine"))
        assert status == 201
        other_renter = (await create_principal(api.master, "renter-2", "renter"))[1]
        admin = (await create_principal(api.master, "admin-1", "admin"))[1]
        for key in (other_renter, api.provider_key, admin):
            status, listed = await api.call("GET", PATH, key)
            assert status == 200 and listed == {"ssh_keys": []}
            theirs = await api.call("DELETE", f"{PATH}/{created['id']}", key)
            unknown = await api.call("DELETE", f"{PATH}/sshk-0000000000000000", key)
            assert_error(*theirs, 404, "ssh_key_not_found")
            assert (theirs[0], theirs[1]["code"]) == (unknown[0], unknown[1]["code"])
        assert (await api.as_renter("GET", PATH))[1] == {"ssh_keys": [created]}


class TestForTheSshServer:
    async def test_authorized_keys_are_the_canonical_lines(self, api: Api) -> None:
        lines = [ed25519_line("one"), openssh_line(ec.generate_private_key(ec.SECP256R1()), "two words")]
        for line in lines:
            assert (await add(api, "  " + line + "\r\n"))[0] == 201
        await add(api, ed25519_line("someone else's"), api.provider_key)
        async with api.master.db.session() as session:
            authorized = await ssh_keys.authorized_keys(session, api.renter.account_id)
        assert authorized == [" ".join(line.split()[:2]) for line in lines]

    async def test_mark_used_sets_last_used_at(self, api: Api) -> None:
        status, created = await add(api, ed25519_line())
        assert status == 201, created
        now = api.master.clock.now()
        async with api.master.db.session() as session:
            assert await ssh_keys.mark_used(session, api.renter.account_id, created["fingerprint"], now=now)
            assert not await ssh_keys.mark_used(session, api.provider.account_id, created["fingerprint"], now=now)
        [listed] = (await api.as_renter("GET", PATH))[1]["ssh_keys"]
        assert listed["last_used_at"] == now.isoformat()


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa", "rsa"])
def test_the_fingerprint_is_what_ssh_keygen_prints(kind: str, tmp_path: Path) -> None:
    """A key made by ssh-keygen itself: ours equals ``ssh-keygen -lf``'s, and the stored line is the .pub's first two fields."""
    assert shutil.which("ssh-keygen"), "ssh-keygen is missing: install Debian's openssh-client (`make test` does, as root)"
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "who@where", "-f", str(tmp_path / "id")], check=True)
    pub = (tmp_path / "id.pub").read_text()
    printed = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "id.pub")], check=True, capture_output=True, text=True).stdout
    parsed = ssh_keys.parse_public_key(pub)
    assert parsed.fingerprint == printed.split()[1]
    assert parsed.public_key == " ".join(pub.split()[:2]) and parsed.comment == "who@where"
    with pytest.raises(ValidationFailed) as refused:
        ssh_keys.parse_public_key((tmp_path / "id").read_text())
    assert refused.value.code == "private_key_pasted"


class TestMigration:
    async def test_0015_downgrades_and_upgrades_again(self, master: Master) -> None:
        """Down to 0014 removes the table (the rest stays); up again brings it back, on SQLite and PostgreSQL."""

        def tables_after(sync: Connection, revision: str) -> set[str]:
            step = command.downgrade if revision == "0014" else command.upgrade
            step(alembic_config(sync), revision)
            return set(inspect(sync).get_table_names())

        async with master.db.engine.begin() as conn:
            down = await conn.run_sync(tables_after, "0014")
        async with master.db.engine.begin() as conn:
            up = await conn.run_sync(tables_after, "head")
        assert "ssh_keys" not in down and "templates" in down
        assert "ssh_keys" in up


class TestConcurrency:
    async def test_the_same_key_posted_at_once_is_stored_once(self, api: Api) -> None:
        """Five simultaneous posts of one key: one 201, the others 409 ssh_key_exists, one row."""
        line = ed25519_line("raced")
        answers = await asyncio.gather(*(add(api, line) for _ in range(5)))
        assert sorted(status for status, _ in answers) == [201, 409, 409, 409, 409], answers
        assert all(body["code"] == "ssh_key_exists" for status, body in answers if status == 409)
        assert len((await api.as_renter("GET", PATH))[1]["ssh_keys"]) == 1

    async def test_the_limit_holds_when_keys_are_posted_at_once(self, api: Api) -> None:
        """With 48 keys, five different keys posted at once: two are added, three are 409 too_many_ssh_keys."""
        async with api.master.db.session() as session:
            for i in range(ssh_keys.MAX_KEYS_PER_ACCOUNT - 2):
                await ssh_keys.add_key(session, api.renter.account_id, ed25519_line(f"k{i}"), now=api.master.clock.now())
        answers = await asyncio.gather(*(add(api, ed25519_line(f"new{i}")) for i in range(5)))
        assert sorted(status for status, _ in answers) == [201, 201, 409, 409, 409], answers
        assert {body["code"] for status, body in answers if status == 409} == {"too_many_ssh_keys"}
        assert len((await api.as_renter("GET", PATH))[1]["ssh_keys"]) == ssh_keys.MAX_KEYS_PER_ACCOUNT
