"""``POST /api/v1/enroll/check``: whether an enrollment token can enroll a host, asked without using it up.

Each test runs on SQLite and on PostgreSQL (the ``api`` fixture).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update

from master.models import EnrollmentToken, Host
from shared.crypto import generate_private_key, make_csr
from tests.apiclient import Api, assert_error


async def _new_token(api: Api) -> tuple[str, datetime]:
    status, body = await api.as_provider("POST", "/enrollment-tokens")
    assert status == 201, body
    return body["token"], datetime.fromisoformat(body["expires_at"])


async def _check(api: Api, body: Any) -> tuple[int, Any]:
    """The check as the installer sends it: no API key."""
    return await api.call("POST", "/enroll/check", None, json=body)


async def _enroll(api: Api, token: str) -> tuple[int, Any]:
    return await api.call("POST", "/enroll", None, json={"token": token, "csr": make_csr(generate_private_key(), "h").decode()})


async def _state(api: Api) -> tuple[list[tuple[Any, ...]], int]:
    """Every token row as enrollment sees it, and how many hosts there are: what a check must never change."""
    async with api.master.db.session() as session:
        rows = await session.execute(
            select(EnrollmentToken.id, EnrollmentToken.used_at, EnrollmentToken.host_id, EnrollmentToken.expires_at)
            .order_by(EnrollmentToken.id)
        )
        hosts = await session.scalar(select(func.count()).select_from(Host))
    return [tuple(row) for row in rows], int(hosts or 0)


class TestEnrollCheck:
    async def test_a_usable_token_is_200_with_its_expiry_and_is_not_used_up(self, api: Api) -> None:
        """A new token answers 200 with its expiry, without an API key, as often as asked; it still enrolls a host after."""
        token, expires_at = await _new_token(api)
        before = await _state(api)
        for _ in range(2):
            status, body = await _check(api, {"token": token})
            assert status == 200, body
            assert body["usable"] is True and datetime.fromisoformat(body["expires_at"]) == expires_at, body
        assert await _state(api) == before
        status, body = await _enroll(api, token)
        assert status == 201, body

    async def test_used_expired_and_unknown_tokens_are_403_with_enrolls_codes_and_change_nothing(self, api: Api) -> None:
        """A used, an expired and an unknown token are refused with the code and message POST /enroll gives them."""
        used, _ = await _new_token(api)
        assert (await _enroll(api, used))[0] == 201
        expired, _ = await _new_token(api)
        async with api.master.db.session() as session:
            past = api.master.clock.now() - timedelta(seconds=1)
            await session.execute(update(EnrollmentToken).where(EnrollmentToken.host_id.is_(None)).values(expires_at=past))
        unknown = "gmt_" + "x" * 43
        before = await _state(api)
        for token, code in ((used, "token_used"), (expired, "token_expired"), (unknown, "token_unknown")):
            status, body = await _check(api, {"token": token})
            assert_error(status, body, 403, code)
            assert "create a new one" in body["message"], body
            enroll_status, enroll_body = await _enroll(api, token)
            assert (enroll_status, enroll_body["code"], enroll_body["message"]) == (403, code, body["message"])
        assert await _state(api) == before

    async def test_malformed_bodies_are_4xx_and_change_nothing(self, api: Api) -> None:
        """A token too short or too long, missing or not a string, an unknown field: 422; a body that is no JSON: 400."""
        token, _ = await _new_token(api)
        before = await _state(api)
        for body in ({"token": "gmt_x"}, {"token": "gmt_" + "x" * 253}, {}, {"token": 12345678}, {"token": token, "csr": "x"}):
            status, answer = await _check(api, body)
            assert_error(status, answer, 422, "validation_failed")
        status, answer = await api.call("POST", "/enroll/check", None, data=b"token=" + token.encode(),
                                        headers={"Content-Type": "application/json"})  # fmt: skip
        assert_error(status, answer, 400, "invalid_json")
        assert await _state(api) == before
        assert (await _check(api, {"token": token}))[0] == 200

