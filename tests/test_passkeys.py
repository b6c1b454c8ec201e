"""People add passkeys from a console session and sign in with them (WebAuthn, checked by py_webauthn).

Real aiohttp app on SQLite and PostgreSQL (the ``api`` fixture); the authenticator and the browser's part are simulated
in Python (``tests/webauthnsim.py``: EC P-256 keys, 'none' attestation), so every answer the master gets is one a real
browser could send, right or deliberately wrong. The relying party is ``public_url``'s host, ``console.test``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyotp
import pytest
from sqlalchemy import select
from webauthn.helpers import bytes_to_base64url

from master.models import Passkey
from master.services.accounts import passkeys
from tests.apiclient import Api, bearer
from tests.factories import master_settings
from tests.test_signup import EMAIL, audit_kinds, call, post, sign_in, sign_up
from tests.webauthnsim import Authenticator

ORIGIN = "http://console.test"


async def signed_in(api: Api, sink: Any) -> str:
    """Sign up and in by password; the session's CSRF token."""
    await sign_up(api, sink)
    status, body = await sign_in(api)
    assert status == 201, body
    return str(body["csrf_token"])


async def add_passkey(
    api: Api, csrf: str, authenticator: Authenticator, *, name: str = "laptop", origin: str = ORIGIN
) -> tuple[int, Any]:
    status, options = await post(api, "/account/passkeys/options", {}, csrf=csrf)
    assert status == 200, options
    return await post(
        api,
        "/account/passkeys",
        {"name": name, "credential": authenticator.create(options, origin)},
        csrf=csrf,
    )


async def passkey_sign_in(api: Api, authenticator: Authenticator, **answer: Any) -> tuple[int, Any]:
    """A browser with no cookie signs in with the authenticator's passkey."""
    api.client.session.cookie_jar.clear()
    status, options = await post(api, "/sessions/passkey/options", {})
    assert status == 200, options
    origin = answer.pop("origin", ORIGIN)
    return await post(api, "/sessions/passkey", {"credential": authenticator.get(options, origin, **answer)})


class TestAddingPasskeys:
    async def test_a_signed_in_person_adds_lists_and_removes_a_passkey(self, api: Api, sink: Any) -> None:
        """A passkey added from a password session is listed (never its key), removed, and both are in the audit log."""
        csrf = await signed_in(api, sink)
        status, options = await post(api, "/account/passkeys/options", {}, csrf=csrf)
        assert status == 200
        assert options["rp"] == {"id": "console.test", "name": "gpumarket"}
        assert options["authenticatorSelection"]["residentKey"] == "required"
        assert options["authenticatorSelection"]["userVerification"] == "required"
        authenticator = Authenticator()
        status, added = await post(
            api,
            "/account/passkeys",
            {"name": "laptop", "credential": authenticator.create(options, ORIGIN)},
            csrf=csrf,
        )
        assert status == 201, added
        assert (
            added["name"] == "laptop"
            and added["last_used_at"] is None
            and added["transports"] == ["internal"]
        )
        status, listed = await call(api, "GET", "/account/passkeys")
        assert status == 200 and listed == {"passkeys": [added]}
        # A second options call excludes the passkey the account has, so the same authenticator is not added twice.
        status, again = await post(api, "/account/passkeys/options", {}, csrf=csrf)
        assert [c["id"] for c in again["excludeCredentials"]] == [
            bytes_to_base64url(authenticator.credentials[0].credential_id)
        ]
        status, removed = await call(api, "DELETE", f"/account/passkeys/{added['id']}", csrf=csrf)
        assert status == 200 and removed == {"id": added["id"], "deleted": True}
        assert (await call(api, "GET", "/account/passkeys"))[1] == {"passkeys": []}
        status, body = await call(api, "DELETE", f"/account/passkeys/{added['id']}", csrf=csrf)
        assert status == 404 and body["code"] == "passkey_not_found"
        kinds = await audit_kinds(api, EMAIL)
        assert kinds.index("passkey_added") < kinds.index("passkey_removed")

    async def test_an_answer_for_another_origin_or_relying_party_is_refused(
        self, api: Api, sink: Any
    ) -> None:
        """A credential made at another site's origin, or bound to another RP id, is not added."""
        csrf = await signed_in(api, sink)
        status, body = await add_passkey(api, csrf, Authenticator(), origin="https://evil.example")
        assert status == 400 and body["code"] == "passkey_rejected", body
        status, options = await post(api, "/account/passkeys/options", {}, csrf=csrf)
        answer = Authenticator().create(options, ORIGIN, rp_id="evil.example")
        status, body = await post(api, "/account/passkeys", {"name": "x", "credential": answer}, csrf=csrf)
        assert status == 400 and body["code"] == "passkey_rejected", body
        assert (await call(api, "GET", "/account/passkeys"))[1] == {"passkeys": []}

    async def test_a_registration_challenge_is_good_once_and_for_its_account_only(
        self, api: Api, sink: Any
    ) -> None:
        """Replaying an answer that added a passkey, or answering a challenge after a failed answer, is refused."""
        csrf = await signed_in(api, sink)
        status, options = await post(api, "/account/passkeys/options", {}, csrf=csrf)
        answer = Authenticator().create(options, ORIGIN)
        assert (await post(api, "/account/passkeys", {"name": "a", "credential": answer}, csrf=csrf))[
            0
        ] == 201
        status, body = await post(api, "/account/passkeys", {"name": "a", "credential": answer}, csrf=csrf)
        assert status == 400 and body["code"] == "passkey_challenge_expired"
        status, options = await post(api, "/account/passkeys/options", {}, csrf=csrf)
        wrong = Authenticator().create(options, "https://evil.example")
        assert (await post(api, "/account/passkeys", {"name": "b", "credential": wrong}, csrf=csrf))[1][
            "code"
        ] == "passkey_rejected"
        right = Authenticator().create(options, ORIGIN)  # the same challenge, answered again
        status, body = await post(api, "/account/passkeys", {"name": "b", "credential": right}, csrf=csrf)
        assert status == 400 and body["code"] == "passkey_challenge_expired"

    async def test_a_session_opened_with_an_api_key_cannot_add_one(self, api: Api, sink: Any) -> None:
        """A key's session has the key's scopes; a passkey it added would sign in with every scope."""
        status, body = await post(api, "/sessions", {"api_key": api.renter_key})
        assert status == 201
        status, refused = await post(api, "/account/passkeys/options", {}, csrf=body["csrf_token"])
        assert status == 403 and refused["code"] == "console_session_required"
        api.client.session.cookie_jar.clear()
        async with api.client.post(
            "/api/v1/account/passkeys/options", json={}, headers=bearer(api.renter_key)
        ) as response:
            assert response.status == 403 and (await response.json())["code"] == "console_session_required"

    async def test_garbage_in_place_of_an_answer_is_a_400(self, api: Api, sink: Any) -> None:
        csrf = await signed_in(api, sink)
        for credential in (
            {},
            {
                "id": "x",
                "rawId": "x",
                "type": "public-key",
                "response": {"clientDataJSON": "!!", "attestationObject": "x"},
            },
        ):
            status, body = await post(
                api, "/account/passkeys", {"name": "x", "credential": credential}, csrf=csrf
            )
            assert status == 400 and body["code"] == "invalid_passkey_response", body


class TestSigningInWithAPasskey:
    async def test_a_passkey_opens_a_console_session_without_asking_for_the_second_factor(
        self, api: Api, sink: Any
    ) -> None:
        """Usernameless: the options name no account; the answer opens a session (cookie and CSRF token) even where TOTP is
        on, the passkey's last use and counter are kept, and the audit log says it was a passkey."""
        csrf = await signed_in(api, sink)
        status, begun = await post(api, "/account/totp", {}, csrf=csrf)
        secret = begun["secret"]
        assert (await post(api, "/account/totp/confirm", {"code": pyotp.TOTP(secret).now()}, csrf=csrf))[
            0
        ] == 200
        authenticator = Authenticator()
        status, added = await add_passkey(api, csrf, authenticator)
        assert status == 201
        api.client.session.cookie_jar.clear()
        status, options = await post(api, "/sessions/passkey/options", {})
        assert status == 200 and options["rpId"] == "console.test" and options["allowCredentials"] == []
        assert options["userVerification"] == "required"
        status, opened = await post(
            api, "/sessions/passkey", {"credential": authenticator.get(options, ORIGIN)}
        )
        assert status == 201, opened
        assert opened["account"]["name"] and opened["csrf_token"]
        status, current = await call(api, "GET", "/sessions/current")
        assert status == 200 and current["account"] == opened["account"]
        status, listed = await call(api, "GET", "/account/passkeys")
        assert listed["passkeys"][0]["last_used_at"] is not None
        async with api.master.db.session() as session:
            assert (await session.scalar(select(Passkey.sign_count).where(Passkey.id == added["id"]))) == 1
        status, events = await call(api, "GET", "/audit-events")
        [latest] = [e for e in events["items"] if e["kind"] == "signed_in"][:1]
        assert latest["detail"]["method"] == "passkey" and latest["detail"]["passkey_id"] == added["id"]

    async def test_an_unknown_passkey_and_a_bad_signature_answer_the_same(self, api: Api, sink: Any) -> None:
        """Whether the credential is unknown or its signature wrong, the answer is one 401 with one message."""
        csrf = await signed_in(api, sink)
        authenticator = Authenticator()
        assert (await add_passkey(api, csrf, authenticator))[0] == 201
        stranger = Authenticator()
        stranger.create(
            {"rp": {"id": "console.test"}, "user": {"id": "c29tZW9uZQ"}, "challenge": "AAAA"}, ORIGIN
        )
        unknown = await passkey_sign_in(api, stranger)
        impostor = Authenticator(credentials=[authenticator.credentials[0]])
        api.client.session.cookie_jar.clear()
        _, options = await post(api, "/sessions/passkey/options", {})
        forged = impostor.get(options, ORIGIN)
        forged["response"]["signature"] = stranger.get(options, ORIGIN)["response"]["signature"]
        bad_signature = await post(api, "/sessions/passkey", {"credential": forged})
        assert unknown[0] == bad_signature[0] == 401
        assert unknown[1] == bad_signature[1] and unknown[1]["code"] == "invalid_passkey"
        assert (await call(api, "GET", "/sessions/current"))[0] == 401

    async def test_another_origin_or_relying_party_does_not_sign_in(self, api: Api, sink: Any) -> None:
        csrf = await signed_in(api, sink)
        authenticator = Authenticator()
        assert (await add_passkey(api, csrf, authenticator))[0] == 201
        assert (await passkey_sign_in(api, authenticator, origin="https://evil.example"))[1][
            "code"
        ] == "invalid_passkey"
        assert (await passkey_sign_in(api, authenticator, rp_id="evil.example"))[1][
            "code"
        ] == "invalid_passkey"
        assert (await passkey_sign_in(api, authenticator))[0] == 201

    async def test_a_sign_in_challenge_is_good_once(self, api: Api, sink: Any) -> None:
        """A replayed answer (a captured request sent again) finds its challenge gone."""
        csrf = await signed_in(api, sink)
        authenticator = Authenticator(counter_step=0)  # no counter: only the challenge stops the replay
        assert (await add_passkey(api, csrf, authenticator))[0] == 201
        api.client.session.cookie_jar.clear()
        status, options = await post(api, "/sessions/passkey/options", {})
        answer = authenticator.get(options, ORIGIN)
        assert (await post(api, "/sessions/passkey", {"credential": answer}))[0] == 201
        status, body = await post(api, "/sessions/passkey", {"credential": answer})
        assert status == 400 and body["code"] == "passkey_challenge_expired"
        # Nor does a challenge handed out for adding a passkey.
        status, body = await sign_in(api)
        status, options = await post(api, "/account/passkeys/options", {}, csrf=body["csrf_token"])
        status, body = await post(
            api, "/sessions/passkey", {"credential": authenticator.get(options, ORIGIN)}
        )
        assert status == 400 and body["code"] == "passkey_challenge_expired"

    async def test_a_removed_passkey_signs_in_no_more(self, api: Api, sink: Any) -> None:
        csrf = await signed_in(api, sink)
        authenticator = Authenticator()
        status, added = await add_passkey(api, csrf, authenticator)
        assert (await call(api, "DELETE", f"/account/passkeys/{added['id']}", csrf=csrf))[0] == 200
        status, body = await passkey_sign_in(api, authenticator)
        assert status == 401 and body["code"] == "invalid_passkey"

    async def test_a_counter_that_goes_backwards_is_refused(self, api: Api, sink: Any) -> None:
        """A cloned authenticator shows as a signature counter not above the last one seen: refused, and logged."""
        csrf = await signed_in(api, sink)
        authenticator = Authenticator()
        assert (await add_passkey(api, csrf, authenticator))[0] == 201
        assert (await passkey_sign_in(api, authenticator, sign_count=5))[0] == 201
        status, body = await passkey_sign_in(api, authenticator, sign_count=5)
        assert status == 401 and body["code"] == "invalid_passkey"
        assert (await passkey_sign_in(api, authenticator, sign_count=3))[0] == 401
        assert (await passkey_sign_in(api, authenticator, sign_count=6))[0] == 201
        kinds = await audit_kinds(api, EMAIL)
        assert kinds.count("sign_in_failed") == 2


class TestRelyingParty:
    """Which RP id and origins the passkeys are for, from the settings (docs/operations.md, "Passkeys")."""

    def _party(self, tmp_path: Path, **settings: Any) -> passkeys.RelyingParty:
        return passkeys.relying_party(
            master_settings(tmp_path, database_url="sqlite+aiosqlite://", **settings)
        )

    def test_public_urls_host_and_origin_by_default(self, tmp_path: Path) -> None:
        party = self._party(tmp_path, public_url="https://console.example.com/")
        assert (party.rp_id, party.origins) == ("console.example.com", ("https://console.example.com",))

    def test_a_loopback_address_is_localhost(self, tmp_path: Path) -> None:
        """gpumarket up's console (http://127.0.0.1:PORT) has passkeys at http://localhost:PORT."""
        party = self._party(tmp_path, public_url="http://127.0.0.1:8080")
        assert (party.rp_id, party.origins) == ("localhost", ("http://localhost:8080",))
        assert self._party(tmp_path, public_url="http://[::1]:9000").origins == ("http://localhost:9000",)

    def test_the_settings_name_a_parent_domain_and_the_origins(self, tmp_path: Path) -> None:
        party = self._party(
            tmp_path,
            public_url="http://10.0.0.5:8080",
            webauthn_rp_id="Example.com",
            webauthn_origins=["https://console.example.com/", "https://example.com"],
        )
        assert party.rp_id == "example.com"
        assert party.origins == ("https://console.example.com", "https://example.com")

    def test_an_ip_address_has_no_passkeys(self, tmp_path: Path) -> None:
        with pytest.raises(passkeys.PasskeysUnavailable, match="webauthn_rp_id"):
            self._party(tmp_path, public_url="http://10.0.0.5:8080")

    async def test_the_routes_say_so(self, api: Api) -> None:
        """A master at an IP address answers its passkey routes 503 passkeys_unavailable, saying what to set."""
        api.master.settings.public_url = "http://192.0.2.7:8080"
        status, body = await post(api, "/sessions/passkey/options", {})
        assert status == 503 and body["code"] == "passkeys_unavailable"
