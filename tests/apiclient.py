"""A test client for the ``/api/v1`` REST API: the running app plus the accounts a test acts as.

The ``api`` fixture (tests/conftest.py) builds one over the ``master`` fixture, with no
background loops and no relay: the agent's side is simulated by feeding hello and command
results to ``master.telemetry.hosts`` exactly as the ingestor would.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import func, select

from master.api.base import API
from master.context import Master
from master.models import Command, Rental
from master.services.accounts.core import Principal
from master.services.lifecycle import clusters as clusterstate
from master.telemetry import hosts
from tests.factories import command_result, create_principal, envelope, gpu_info, online_host

RTX = "NVIDIA GeForce RTX 4090"
A100 = "NVIDIA A100-SXM4-80GB"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Api:
    """The running app plus the accounts a test acts as."""

    master: Master
    client: TestClient[Any, Any]
    renter: Principal
    renter_key: str
    provider: Principal
    provider_key: str
    _seq: itertools.count[int]

    async def call(self, method: str, path: str, key: str | None, **kwargs: Any) -> tuple[int, Any]:
        headers = dict(kwargs.pop("headers", {}))
        if key is not None:
            headers.update(bearer(key))
        async with self.client.request(method, API + path, headers=headers, **kwargs) as response:
            assert response.content_type == "application/json", await response.text()
            return response.status, await response.json()

    async def as_renter(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        return await self.call(method, path, self.renter_key, **kwargs)

    async def as_provider(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        return await self.call(method, path, self.provider_key, **kwargs)

    async def host(self, count: int, *, name: str = RTX) -> tuple[str, list[str]]:
        """An online host of the provider with ``count`` GPUs named ``name``; returns its id and GPU uuids."""
        gpus = [gpu_info(i, name=name) for i in range(count)]
        return await online_host(self.master, self.provider, gpus), [g.uuid for g in gpus]

    async def commands(self, rental_id: str, kind: str) -> list[Command]:
        async with self.master.db.session() as session:
            rows = await session.scalars(
                select(Command).where(Command.rental_id == rental_id, Command.kind == kind).order_by(Command.created_at)
            )
            return list(rows.all())

    async def agent_reports(self, rental_id: str, kind: str, *, ok: bool = True, detail: str = "") -> None:
        """Simulate the agent's result for the rental's one ``kind`` command, as the ingestor would apply it."""
        [command] = await self.commands(rental_id, kind)
        await self.agent_answers(command, ok=ok, detail=detail)

    async def agent_answers(self, command: Command, *, ok: bool = True, detail: str = "", data: dict[str, Any] | None = None) -> list[str]:
        """Simulate the agent's result (``data``: its reply) for ``command``, as the ingestor would apply it; returns the
        commands the clusters' hooks wrote meanwhile (which the ingestor publishes)."""
        async with self.master.db.session() as session:
            await hosts.handle_command_result(
                session, envelope(command_result(command.host_id, next(self._seq), command.id, ok=ok, detail=detail, data=data)),
                sign=self.master.ca.sign_connect_token,
            )
        return clusterstate.issued_commands(session.info)

    async def count(self, model: type[Rental] | type[Command]) -> int:
        async with self.master.db.session() as session:
            return int(await session.scalar(select(func.count()).select_from(model)) or 0)


def assert_error(status: int, body: Any, expected_status: int, code: str) -> None:
    assert status == expected_status, body
    assert body["code"] == code, body
    assert isinstance(body["message"], str) and body["message"], body




@asynccontextmanager
async def serve_api(master: Master) -> AsyncIterator[Api]:
    """The master's app (no background loops) on a test server, with a renter and a provider and their keys."""
    from master.app import (
        create_app,  # the app imports the whole API; tests that only build objects need none of it
    )

    renter, renter_key = await create_principal(master, "renter-1", "renter")
    provider, provider_key = await create_principal(master, "provider-1", "provider")
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(master, background=False)))
    await client.start_server()
    try:
        yield Api(master, client, renter, renter_key, provider, provider_key, itertools.count(1))
    finally:
        await client.close()
