"""``POST /api/v1/enroll/check``: whether an enrollment token can enroll a host, asked without using it up.

The installer (``deploy/install-agent.sh``) asks before it downloads anything, so that a refused
token costs a provider no install: ``TestInstallerAsksFirst`` runs it against the app; its enroll
step (``gpumarket agent enroll``, ``TestAgentEnroll``) still checks, as a token may be used or
expire in between. Every test runs on SQLite and on PostgreSQL (the ``api`` fixture).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from sqlalchemy import func, select, update

from gpumarket.cli import main
from master.models import EnrollmentToken, Host
from shared.crypto import generate_private_key, make_csr
from tests.apiclient import Api, assert_error

INSTALLER = Path(__file__).resolve().parents[1] / "deploy" / "install-agent.sh"


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


class TestAgentEnroll:
    async def test_a_refused_token_is_one_line_with_the_masters_reason_and_leaves_no_key(
        self, api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`gpumarket agent enroll` with a token the master refuses exits 2 with its reason (what the installer shows when
        a token passed its check and was used or expired before the enroll step) and writes no key."""
        used, _ = await _new_token(api)
        assert (await _enroll(api, used))[0] == 201
        base, state = str(api.client.make_url("")).rstrip("/"), tmp_path / "state"
        with pytest.raises(SystemExit) as done:
            await asyncio.to_thread(main, ["agent", "enroll", "--master", base, "--token", used, "--data-dir", str(state)])
        assert done.value.code == 2
        error = "gpumarket: error: the master refused enrollment: this enrollment token was already used; create a new one"
        assert capsys.readouterr().err.splitlines()[-1] == error
        assert not (state / "key.pem").exists()


def _install(master: str, token: str, prefix: Path, *more: str | Path) -> subprocess.CompletedProcess[str]:
    """The installer's first install of a simulated host, without systemd, in the background of the test's loop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMARKET_")}
    argv = ["sh", str(INSTALLER), "--master", master, "--token", token, "--prefix", str(prefix), "--no-systemd", "--gpus", "sim:1xT4"]
    return subprocess.run(
        [*argv, *map(str, more)], capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL, check=False
    )


class TestInstallerAsksFirst:
    async def test_a_used_or_malformed_token_stops_the_installer_before_any_download(self, api: Api, tmp_path: Path) -> None:
        """A refused token is one line with the master's reason, then that nothing was installed; nothing was fetched."""
        used, _ = await _new_token(api)
        assert (await _enroll(api, used))[0] == 201
        base, prefix = str(api.client.make_url("")).rstrip("/"), tmp_path / "agent"
        cases = {
            used: "the master refused enrollment: this enrollment token was already used; create a new one",
            "gmt_x": "the master refused enrollment: token: String should have at least 8 characters; copy the token "
                     "again from the console",
        }  # fmt: skip
        for token, message in cases.items():
            refused = await asyncio.to_thread(_install, base, token, prefix)
            assert refused.returncode != 0
            assert refused.stderr.splitlines() == [f"install-agent: error: {message}", "install-agent: nothing was installed (status 1)"]
            assert "downloading" not in refused.stdout
            assert not prefix.exists()
        assert not (api.master.settings.data_dir / "downloads").exists()  # no package was asked for (or built)

    async def test_an_accepted_token_lets_the_install_go_on_and_a_failure_part_way_undoes_it(self, api: Api, tmp_path: Path) -> None:
        """Past an accepted token the install goes on; when it then fails part-way, after making the prefix and the venv
        (here: a Python whose venvs lack pip, so the first pip command fails), it removes them and says nothing was
        installed. The token stays unused."""
        token, _ = await _new_token(api)
        python = tmp_path / "python-without-pip"
        python.write_text(f'#!/bin/sh\n[ "$1 $2" != "-m venv" ] || {{ shift 2; exec {sys.executable} -m venv --without-pip "$@"; }}\n'
                          f'exec {sys.executable} "$@"\n')  # fmt: skip
        python.chmod(0o755)
        wheel = tmp_path / "gpumarket-0.1.0-py3-none-any.whl"  # never read: pip is missing
        wheel.write_bytes(b"PK")
        base, prefix = str(api.client.make_url("")).rstrip("/"), tmp_path / "agent"
        before = await _state(api)
        result = await asyncio.to_thread(_install, base, token, prefix, "--python", python, "--package", wheel)
        assert result.returncode != 0
        assert "the master accepts the enrollment token" in result.stdout and f"installing {wheel.name}" in result.stdout
        assert result.stderr.splitlines()[-1].startswith("install-agent: nothing was installed (status "), result.stderr
        assert not prefix.exists()
        assert await _state(api) == before

    async def test_a_master_without_the_check_is_warned_about_and_the_install_goes_on(self, tmp_path: Path) -> None:
        """A master that does not know POST /api/v1/enroll/check (404: an older one) stops nothing: the installer warns
        that enrolling will check the token, and goes on to the download (404 here too)."""
        server = TestServer(web.Application())
        await server.start_server()
        try:
            base, prefix = str(server.make_url("")).rstrip("/"), tmp_path / "agent"
            result = await asyncio.to_thread(_install, base, "gmt_" + "x" * 43, prefix)
        finally:
            await server.close()
        assert result.returncode != 0
        assert f"install-agent: warning: {base} does not check enrollment tokens beforehand" in result.stderr, result.stderr
        assert f"downloading the agent package from {base}/downloads/agent" in result.stdout
        assert f"{base}/downloads/agent answered HTTP 404" in result.stderr and "nothing was installed" in result.stderr
        assert not prefix.exists()
