"""The renter CLI's HTTP client for ``/api/v1`` and its saved login (``config.json``).

Errors the user should see are ``CliError``s: one line, what went wrong and what to do next,
and the exit status (1 for what the API refused or could not be reached, 2 for usage and configuration).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

API_PREFIX = "/api/v1"
ENV_URL = "GPUMARKET_API_URL"
ENV_KEY = "GPUMARKET_API_KEY"
ENV_CONFIG = "GPUMARKET_CONFIG"
ENV_TEAM = "GPUMARKET_TEAM"
TEAM_HEADER = "Gpumarket-Team"  # the team a call acts for (docs/accounts.md, "Teams")

# What to do next after the API's error codes (the API's own message says what went wrong).
NEXT_STEP: dict[str, str] = {
    "invalid_api_key": "log in again with `gpumarket login` (or fix GPUMARKET_API_KEY)",
    "missing_api_key": "log in with `gpumarket login` (or set GPUMARKET_API_KEY)",
    "forbidden": "this needs another role of account; `gpumarket account` shows yours, `gpumarket team list` the teams you can act for",
    "offer_not_found": "list offers with `gpumarket offers`",
    "template_not_found": "`gpumarket rent --help` names the templates, or give --image",
    "rental_not_found": "list yours with `gpumarket rentals --all`",
    "cluster_not_found": "list yours with `gpumarket cluster list --all`",
    "service_not_found": "list yours with `gpumarket service list --all`",
    "volume_not_found": "list yours with `gpumarket volume list --all`",
    "volume_host_full": "ask for less, or choose another host (`gpumarket offers` shows each host's volume_gib_free)",
    "volume_host_lends_none": "`gpumarket offers` shows the hosts that lend storage (volume_gib_free)",
    "insufficient_capacity": "see what is free with `gpumarket offers`, or wait for GPUs with --queue",
    "exceeds_fleet": "see what there is with `gpumarket offers`",
    "quota_exceeded": "`gpumarket account` shows your quotas; stop a rental or ask an admin for more",
    "insufficient_credit": "`gpumarket account` shows your balance; top up your account",
    "spend_cap_reached": "`gpumarket account` shows your spend cap and this month's spend",
    "bid_below_minimum": "bid at least the offer's minimum (`gpumarket offers --json` shows min_bid_per_gpu_hour)",
    "invalid_query": "see the query language in `gpumarket offers --help`",
    "rate_limited": "wait a moment and try again",
    "rental_not_running": "`gpumarket rentals` shows its state; connect once it is running",
    "host_offline": "its host is not connected to a relay now; try again in a minute",
    "port_not_declared": "use a port it declared (ports are declared when renting: `gpumarket rent --image REF --port P`)",
    "no_ssh_host_key": "this rental serves no SSH (or has not reported its key yet); try again once it runs",
    "team_not_found": "`gpumarket team list` shows your teams; `gpumarket team use personal` acts for yourself again",
    "team_role_forbids": "`gpumarket team show` shows your role; ask the team's owner or an admin",
}


class CliError(Exception):
    """What the user sees: one line and an exit status."""

    def __init__(self, message: str, *, status: int = 1) -> None:
        super().__init__(message)
        self.message = " ".join(message.split())
        self.status = status


class UsageError(CliError):
    """A wrong option or a missing configuration: exit status 2."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=2)


class ApiError(CliError):
    """The API answered with an error: its JSON ``code`` and ``message``, and the next step."""

    def __init__(self, http_status: int, code: str, message: str) -> None:
        self.http_status, self.code, self.api_message = http_status, code, message
        text = f"{message.rstrip('.')} ({code})"
        if code in NEXT_STEP:
            text += f"; {NEXT_STEP[code]}"
        super().__init__(text)


class Unreachable(CliError):
    """Nothing (or nothing sensible) answered at the API's URL."""


# ---- the saved login ---------------------------------------------------------------------------


def default_config_path(environ: Mapping[str, str]) -> Path:
    """``$GPUMARKET_CONFIG``, else ``$XDG_CONFIG_HOME/gpumarket/config.json`` (default ``~/.config``)."""
    if environ.get(ENV_CONFIG):
        return Path(environ[ENV_CONFIG])
    return config_dir(environ) / "config.json"


def config_dir(environ: Mapping[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/gpumarket`` (default ``~/.config/gpumarket``): the SSH files live here."""
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpumarket"


def normalize_url(url: str) -> str:
    """The API's base URL without a trailing slash or ``/api/v1``; only http(s)."""
    url = url.strip().rstrip("/")
    if url.endswith(API_PREFIX):
        url = url[: -len(API_PREFIX)]
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"the API URL must start with http:// or https://, not {url[:60]!r}")
    return url


@dataclass(frozen=True)
class Login:
    api_url: str
    api_key: str
    team: str | None = None  # the team id calls act for (``gpumarket team use``); None: the account's own


def read_config(path: Path) -> dict[str, str]:
    """The saved login file's contents, ``{}`` when there is none."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path} ({exc}); run `gpumarket login` again") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{path} is not a gpumarket login file; run `gpumarket login` again")
    return {k: v for k, v in raw.items() if isinstance(v, str)}


def load_login(path: Path | None, environ: Mapping[str, str]) -> Login:
    """The API URL and key: ``GPUMARKET_API_URL`` / ``GPUMARKET_API_KEY`` override the saved login."""
    path = path or default_config_path(environ)
    saved = read_config(path)
    url = environ.get(ENV_URL) or saved.get("api_url")
    key = environ.get(ENV_KEY) or saved.get("api_key")
    if not url or not key:
        missing = " and ".join(n for n, v in (("API URL", url), ("API key", key)) if not v)
        raise UsageError(f"no {missing}: run `gpumarket login --api URL`, or set {ENV_URL} and {ENV_KEY}")
    team = environ.get(ENV_TEAM, saved.get("team")) or None
    return Login(normalize_url(url), key, None if team == "personal" else team)


def save_login(path: Path, login: Login) -> None:
    """Write the login readable by its owner only (file 0600, its folder 0700), replacing any other at once."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.parent.name == "gpumarket":
        os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            saved = {"api_url": login.api_url, "api_key": login.api_key} | ({"team": login.team} if login.team else {})
            json.dump(saved, out, indent=2)
            out.write("\n")
        os.chmod(tmp, 0o600)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---- the client --------------------------------------------------------------------------------


class Client:
    """``/api/v1`` with a bearer key. Every call is bounded by ``timeout`` seconds.

    ``retries`` repeats a call that got no answer, or a 502/503/504, after ``retry_delay`` seconds;
    only for calls safe to repeat: reads, and a ``POST /rentals`` with its ``Idempotency-Key``.
    """

    def __init__(self, login: Login, *, timeout: float = 30.0, retries: int = 2, retry_delay: float = 1.0) -> None:
        self.login = login
        self.timeout, self.retries, self.retry_delay = timeout, retries, retry_delay
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            headers={"Authorization": f"Bearer {self.login.api_key}", "Accept": "application/json"},
        )
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._session is not None:
            await self._session.close()

    def url(self, path: str) -> str:
        return f"{self.login.api_url}{API_PREFIX}{path}"

    async def get(self, path: str, params: Mapping[str, str | int] | None = None) -> Any:
        return await self.request("GET", path, params=params, retry=True)

    async def request(
        self, method: str, path: str, *, params: Mapping[str, str | int] | None = None, json_body: Any = None,
        headers: Mapping[str, str] | None = None, retry: bool = False, personal: bool = False,
    ) -> Any:  # fmt: skip
        """The JSON body of a 2xx answer; ``ApiError`` for the API's errors, ``Unreachable`` for no answer. The call
        acts for the login's team (``Gpumarket-Team``) unless ``personal``."""
        if self.login.team and not personal:
            headers = {**(headers or {}), TEAM_HEADER: self.login.team}
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            try:
                return await self._once(method, path, params=params, json_body=json_body, headers=headers)
            except (Unreachable, ApiError) as exc:
                again = isinstance(exc, Unreachable) or exc.http_status in (502, 503, 504)
                if not again or attempt + 1 >= attempts:
                    raise
            await asyncio.sleep(self.retry_delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _once(
        self, method: str, path: str, *, params: Mapping[str, str | int] | None, json_body: Any, headers: Mapping[str, str] | None
    ) -> Any:
        assert self._session is not None, "use the client in `async with`"
        url = self.url(path)
        try:
            async with self._session.request(method, url, params=params, json=json_body, headers=headers) as response:
                text = await response.text(errors="replace")
                status = response.status
        except (aiohttp.ClientConnectionError, aiohttp.InvalidURL, TimeoutError, OSError) as exc:
            raise Unreachable(
                f"the API at {self.login.api_url} did not answer ({_why(exc, self.timeout)}); check the URL with "
                f"`gpumarket login --api URL` (or {ENV_URL}) and that the master is up"
            ) from None
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = None
        if 200 <= status < 300:
            if body is None:
                raise Unreachable(f"{url} answered {status} with no JSON; is {self.login.api_url} a gpumarket master?")
            return body
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("code"), str):  # {"error": {"code": ..., "message": ...}}
            body = error
        if isinstance(body, dict) and isinstance(body.get("code"), str):
            raise ApiError(status, body["code"], str(body.get("message") or "no message"))
        raise ApiError(status, f"http_{status}", f"{method} {url} answered {status} {text[:120]!r}; is {self.login.api_url} a gpumarket master?")


def _why(exc: BaseException, timeout: float) -> str:
    """A short reason a connection failed: "Connection refused", "no answer in 30 s", the name did not resolve."""
    if isinstance(exc, TimeoutError):
        return f"no answer in {timeout:g} s"
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, OSError) and os_error.errno:
        return os.strerror(os_error.errno) if os_error.errno > 0 else (os_error.strerror or str(os_error))
    return str(exc) or type(exc).__name__
