"""``gpumarket topology`` (``make cluster``): the production topology as separate processes on this machine.

Unlike ``gpumarket up`` (everything in one process over SQLite), every service here is its own
OS process, started with the same commands and settings a deployment uses:

* a migration job (``gpumarket migrate``) before anything else; the masters do not migrate;
* an admin, a provider and a renter account, written by the cluster itself in one transaction (the
  rows ``gpumarket admin create-account`` writes, without a process per account), and the relays'
  certificate (``gpumarket admin issue-relay-cert``, which creates the CA);
* two masters (``gpumarket master``, ``migrate_on_start=false``, ``billing_in_process=false``)
  on one PostgreSQL database and one Redis, sharing a CA folder;
* two relays (``gpumarket access``) in two regions, ``eu-west`` and ``us-east``, with
  certificates from that CA, and the geo DNS (``gpumarket dns``) for their zone on loopback;
* a Celery worker running beat and a second worker (``gpumarket worker [--beat]``);
* N simulated provider agents, each enrolled with its own token (``gpumarket agent enroll``)
  and run (``gpumarket agent run``); agent *i* asks the DNS from 127.0.0.2 or 127.0.0.3, which
  the geo DNS places in eu-west or us-east, so each finds its own region's relay.

``Cluster.check_rental()`` follows one rental end to end through it: rented on one master,
watched on the other, started by an agent behind a relay, rated by the Celery workers, stopped.
``ProcessGroup`` keeps each process's log, signals whole process groups (``kill -9`` of a
Celery worker takes its pool with it) and restarts a process with the command it started with:
the fault tests (``tests/faults/``) use it to break things on purpose, with ``Cluster.overrides``
(settings per role or process, e.g. a relay's Redis URL through a proxy), ``Cluster.add_agent``
(an agent pinned to one relay URL, e.g. a proxy in front of a relay), ``Cluster.wait_healthy`` and
``Cluster.database()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from gpumarket.up import DEMO_FLEET
from master.db import Database
from master.services.accounts import create_account
from shared.bus import delete_prefix
from shared.errors import ConfigError, GpumarketError

log = logging.getLogger(__name__)

T = TypeVar("T")

CLUSTER_ZONE = "relays.cluster.test"
ACCOUNT_ROLES = ("admin", "provider", "renter")  # one account each, named cluster-<role>


class ClusterError(GpumarketError):
    """A cluster process failed to start or a check through the cluster did not hold."""

    code = "cluster_failed"


@dataclass(frozen=True)
class Region:
    name: str
    relay_id: str
    source: str  # the loopback address this region's agents query the DNS from


REGIONS = (Region("eu-west", "relay-eu-west", "127.0.0.2"), Region("us-east", "relay-us-east", "127.0.0.3"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class _Started:
    args: tuple[str, ...]
    env: dict[str, str]
    process: subprocess.Popen[bytes]


class ProcessGroup:
    """``gpumarket`` service processes, each in its own session (process group), with its log in ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.running: dict[str, _Started] = {}

    def cli(self, *args: str, env: dict[str, str], timeout: float = 120) -> str:
        """Run a one-shot ``gpumarket`` command; its stdout, or ``ClusterError`` with its output."""
        done = subprocess.run(
            [sys.executable, "-m", "gpumarket.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise ClusterError(f"`gpumarket {' '.join(args)}` exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done.stdout

    def start(self, name: str, *args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "ab") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "gpumarket.cli", *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.running[name] = _Started(args, env, process)
        return process

    def restart(self, name: str) -> subprocess.Popen[bytes]:
        """Start ``name`` again with the command and environment it was first started with (it must have exited)."""
        started = self.running[name]
        if started.process.poll() is None:
            raise ClusterError(f"{name} is still running; stop or kill it first")
        return self.start(name, *started.args, env=started.env)

    def alive(self, name: str) -> bool:
        return self.running[name].process.poll() is None

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to ``name``'s whole process group (``SIGKILL``: the service and its children die at once)."""
        process = self.running[name].process
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.running[name].process.wait()

    def stop(self, name: str, *, timeout: float = 15) -> int:
        """SIGTERM, then the exit status; SIGKILL and ``ClusterError`` if it has not stopped within ``timeout``."""
        process = self.running[name].process
        if process.poll() is not None:
            return process.returncode
        self.signal(name, signal.SIGTERM)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(name)
            raise ClusterError(f"{name} did not stop within {timeout:g} s of SIGTERM:\n{self.logs([name])}") from None

    def stop_all(self) -> dict[str, int]:
        """Stop every process, newest first (agents before relays before masters); their exit statuses."""
        codes: dict[str, int] = {}
        for name in reversed(list(self.running)):
            try:
                codes[name] = self.stop(name)
            except ClusterError:
                codes[name] = -signal.SIGKILL
        return codes

    def kill_all(self) -> None:
        for name in self.running:
            if self.alive(name):
                self.kill(name)

    def logs(self, names: list[str] | None = None, *, tail: int = 3000) -> str:
        chosen = names if names is not None else list(self.running)
        return "\n".join(f"--- {n} ---\n{(self.log_dir / f'{n}.log').read_text(errors='replace')[-tail:]}" for n in chosen)


@dataclass
class Cluster:
    """The topology above, in ``workdir`` (logs, the masters' data dir with the CA, each agent's state)."""

    workdir: Path
    database_url: str
    redis_url: str
    bus_prefix: str = "gpumarket-cluster:"
    agents: int = 4
    masters: int = 2
    # Seconds; short so a check through the cluster takes seconds, not minutes: production's 10 s heartbeats and
    # telemetry and 3 missed heartbeats before a host is offline, scaled to 1 s (offline after 3 s). Each halving
    # of these doubles what the masters ingest and sweep while the cluster sits idle.
    heartbeat_interval: float = 1.0
    telemetry_interval: float = 1.0
    billing_interval: float = 1.0
    processes: ProcessGroup = field(init=False)
    master_ports: list[int] = field(default_factory=list)
    relay_ports: dict[str, int] = field(default_factory=dict)
    dns_port: int = 0
    keys: dict[str, str] = field(default_factory=dict)
    host_ids: list[str] = field(default_factory=list)
    on_step: Callable[[str], None] = field(default=lambda _: None)
    # Processes a caller stopped or killed on purpose: waits do not fail because these exited.
    expected_down: set[str] = field(default_factory=set)
    # Extra GPUMARKET_* settings over the ones below, by role ("master" — also the admin commands
    # and workers —, "worker", "relay", "dns", "agent") or by process name ("relay-us-east"); the
    # name's win. E.g. {"master": {"GPUMARKET_RENTAL_GRACE_PERIOD": "8"}}.
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    # Agents added with add_agent(relay_url=...): index → (region, relay URL, GPUs).
    _pinned: dict[int, tuple[Region, str, str | None]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.workdir = self.workdir.resolve()
        self.processes = ProcessGroup(self.workdir / "logs")

    # ---- addresses ---------------------------------------------------------------

    def api(self, i: int = 0) -> str:
        return f"http://127.0.0.1:{self.master_ports[i]}/api/v1"

    def master_names(self) -> list[str]:
        return [f"master-{i + 1}" for i in range(self.masters)]

    def agent_names(self) -> list[str]:
        return [f"agent-{i + 1:02d}" for i in range(self.agents)]

    def agent_region(self, i: int) -> Region:
        pinned = self._pinned.get(i)
        return pinned[0] if pinned else REGIONS[i % len(REGIONS)]

    # ---- environments ------------------------------------------------------------

    def _common_env(self) -> dict[str, str]:
        return {
            **os.environ, "GPUMARKET_REDIS_URL": self.redis_url, "GPUMARKET_BUS_PREFIX": self.bus_prefix,
            "GPUMARKET_LOG_LEVEL": os.environ.get("GPUMARKET_LOG_LEVEL", "INFO"), "PYTHONUNBUFFERED": "1",
            "GPUMARKET_HEARTBEAT_INTERVAL": str(self.heartbeat_interval),
            "GPUMARKET_TELEMETRY_INTERVAL": str(self.telemetry_interval),
        }  # fmt: skip

    def _with_overrides(self, env: dict[str, str], role: str, name: str | None = None) -> dict[str, str]:
        return {**env, **self.overrides.get(role, {}), **(self.overrides.get(name, {}) if name else {})}

    def master_env(self, i: int | None = None) -> dict[str, str]:
        """A master's settings (``None``: those of the one-shot admin commands and the workers)."""
        env = {
            **self._common_env(), "GPUMARKET_DATABASE_URL": self.database_url,
            "GPUMARKET_DATA_DIR": str(self.workdir / "master"), "GPUMARKET_MIGRATE_ON_START": "false",
            "GPUMARKET_BILLING_IN_PROCESS": "false", "GPUMARKET_BILLING_INTERVAL": str(self.billing_interval),
            "GPUMARKET_MISSED_HEARTBEATS_OFFLINE": "3", "GPUMARKET_STALE_MESSAGE_IDLE": "5",
            "GPUMARKET_RELAY_URLS": json.dumps([f"wss://localhost:{p}/v1/agent" for p in self.relay_ports.values()]),
            "GPUMARKET_QUEUE_INTERVAL": "1", "GPUMARKET_RELIABILITY_INTERVAL": "5",
        }  # fmt: skip
        if i is not None:
            env |= {"GPUMARKET_HTTP_PORT": str(self.master_ports[i]), "GPUMARKET_INSTANCE_ID": f"master-{i + 1}",
                    "GPUMARKET_PUBLIC_URL": f"http://127.0.0.1:{self.master_ports[i]}"}  # fmt: skip
        return self._with_overrides(env, "master", self.master_names()[i] if i is not None else None)

    def worker_env(self, name: str) -> dict[str, str]:
        return self._with_overrides({**self.master_env(), "GPUMARKET_DATA_DIR": str(self.workdir / name)}, "worker", name)

    def relay_env(self, region: Region) -> dict[str, str]:
        pki = self.workdir / "relay-pki"
        env = {
            **self._common_env(), "GPUMARKET_PORT": str(self.relay_ports[region.relay_id]),
            "GPUMARKET_PUBLIC_HOST": "localhost", "GPUMARKET_REGISTER_INTERVAL": "0.5",
            "GPUMARKET_CERT_FILE": str(pki / "relay.crt"), "GPUMARKET_KEY_FILE": str(pki / "relay.key"),
            "GPUMARKET_CA_FILE": str(pki / "ca.crt"),
        }  # fmt: skip
        return self._with_overrides(env, "relay", region.relay_id)

    def agent_env(self, i: int) -> dict[str, str]:
        """Agent ``i``'s settings: relay discovery through the geo DNS, or the one relay URL it was added with."""
        env = {
            **self._common_env(), "GPUMARKET_DATA_DIR": str(self.workdir / "agents" / self.agent_names()[i]),
            "GPUMARKET_GPUS": DEMO_FLEET[i % len(DEMO_FLEET)], "GPUMARKET_ZONE": CLUSTER_ZONE,
            "GPUMARKET_RESOLVER": "127.0.0.1", "GPUMARKET_RESOLVER_PORT": str(self.dns_port),
            "GPUMARKET_RESOLVER_SOURCE": self.agent_region(i).source, "GPUMARKET_REGION": self.agent_region(i).name,
            "GPUMARKET_NETWORK_INTERVAL": "0", "GPUMARKET_RECONNECT_MAX_DELAY": "1", "GPUMARKET_SAMPLE_INTERVAL": "0.5",
        }  # fmt: skip
        pinned = self._pinned.get(i)
        if pinned is not None:
            _, relay_url, gpus = pinned
            for discovery in ("GPUMARKET_ZONE", "GPUMARKET_RESOLVER", "GPUMARKET_RESOLVER_PORT", "GPUMARKET_RESOLVER_SOURCE"):
                env.pop(discovery)
            env["GPUMARKET_RELAY_URL"] = relay_url
            if gpus is not None:
                env["GPUMARKET_GPUS"] = gpus
        return self._with_overrides(env, "agent", self.agent_names()[i])

    # ---- start and stop ----------------------------------------------------------

    async def start(self, *, timeout: float = 120) -> None:
        """Start everything in a deployment's order, each step checked before the next; ``ClusterError`` on failure."""
        procs = self.processes
        self.master_ports = [free_port() for _ in range(self.masters)]
        self.relay_ports = {region.relay_id: free_port() for region in REGIONS}
        self.dns_port = free_port()
        admin_env = self.master_env()

        self.on_step("migration job (gpumarket migrate)")
        await asyncio.to_thread(procs.cli, "migrate", "--wait", "30", env=admin_env)
        self.on_step("accounts and the relays' certificates")
        await self._create_accounts()
        await asyncio.to_thread(
            procs.cli, "admin", "issue-relay-cert", "--name", "localhost", "--name", "127.0.0.1",
            "--out", str(self.workdir / "relay-pki"), env=admin_env,
        )  # fmt: skip

        self.on_step(f"{self.masters} masters")
        for i, name in enumerate(self.master_names()):
            procs.start(name, "master", env=self.master_env(i))
        self.on_step("2 relays (eu-west, us-east), geo DNS, Celery worker with beat and a second worker")
        for region in REGIONS:
            procs.start(region.relay_id, "access", "--region", region.name, "--relay-id", region.relay_id,
                        env=self.relay_env(region))  # fmt: skip
        dns_env = {
            **self._common_env(), "GPUMARKET_REFRESH_INTERVAL": "0.5", "GPUMARKET_TTL": "1",
            "GPUMARKET_PREFIX_REGIONS": json.dumps({f"{r.source}/32": r.name for r in REGIONS}),
            "GPUMARKET_REGION_DISTANCE": json.dumps({f"{REGIONS[0].name}:{REGIONS[1].name}": 80}),
        }  # fmt: skip
        procs.start("dns", "dns", "--zone", CLUSTER_ZONE, "--port", str(self.dns_port),
                    env=self._with_overrides(dns_env, "dns", "dns"))  # fmt: skip
        procs.start("worker-beat", "worker", "--beat", "--concurrency", "1", env=self.worker_env("worker-beat"))
        procs.start("worker-2", "worker", "--concurrency", "1", env=self.worker_env("worker-2"))

        async with aiohttp.ClientSession() as http:
            for i in range(self.masters):
                ready = functools.partial(self._ok, http, f"{self.api(i)}/health")
                await self.until(ready, timeout, f"master-{i + 1} ready")
            await self.until(lambda: self._relays_registered(http), timeout, "both relays registered")
            await self._top_up(http)
            self.on_step(f"{self.agents} agents (enroll with a token, then run)")
            for i in range(self.agents):
                await self._enroll_and_run(http, i)
            await self.until(lambda: self._agents_on_their_relays(http), timeout, "every agent online on its region's relay")
        self.on_step("up")

    async def _create_accounts(self) -> None:
        """The admin, provider and renter accounts and their API keys (``keys``), in one transaction here.

        The same rows ``gpumarket admin create-account`` writes; a command process per account would spend a second
        or two of CPU each on importing the master to write one row."""
        async with self.database() as db, db.session() as session:
            for role in ACCOUNT_ROLES:
                _, self.keys[role] = await create_account(session, f"cluster-{role}", role)

    async def _enroll_and_run(self, http: aiohttp.ClientSession, i: int) -> None:
        name = self.agent_names()[i]
        status, token = await self.call(http, "POST", "/enrollment-tokens", "provider", master=i % self.masters)
        if status != 201:
            raise ClusterError(f"no enrollment token from master-{i % self.masters + 1}: {status} {token}")
        out = await asyncio.to_thread(
            self.processes.cli, "agent", "enroll", "--master", f"http://127.0.0.1:{self.master_ports[i % self.masters]}",
            "--token", token["token"], "--hostname", f"cluster-{name}", env=self.agent_env(i),
        )  # fmt: skip
        self.host_ids.append(out.split("enrolled as host ")[1].split(";")[0])
        self.processes.start(name, "agent", "run", env=self.agent_env(i))

    async def add_agent(self, *, relay_url: str, region: Region = REGIONS[0], gpus: str | None = None,
                        timeout: float = 60) -> str:  # fmt: skip
        """Enroll and run one more agent that connects to ``relay_url`` only (no DNS discovery): a relay of
        ``region``, or a proxy in front of it. Returns its process name once its host is online there."""
        i = self.agents
        self._pinned[i] = (region, relay_url, gpus)
        self.agents += 1
        async with aiohttp.ClientSession() as http:
            await self._enroll_and_run(http, i)
            await self.until(lambda: self._agents_on_their_relays(http, [i]), timeout, f"{self.agent_names()[i]} online")
        return self.agent_names()[i]

    async def wait_healthy(self, *, timeout: float = 60) -> None:
        """Until every process runs and every agent's host is online or rented (on any relay); ``ClusterError`` after ``timeout``."""

        async def healthy(http: aiohttp.ClientSession) -> bool:
            if any(not self.processes.alive(name) for name in self.processes.running):
                return False
            status, hosts = await self.call(http, "GET", "/hosts?limit=200", "admin")
            if status != 200:
                return False
            states = {h["id"]: h["state"] for h in hosts["items"]}
            return all(states.get(host_id) in ("online", "rented") for host_id in self.host_ids)

        async with aiohttp.ClientSession() as http:
            await self.until(lambda: healthy(http), timeout, "every process running and every host online")

    @contextlib.asynccontextmanager
    async def database(self) -> AsyncIterator[Database]:
        """A ``Database`` on the cluster's PostgreSQL, for checks that read what the API does not show."""
        db = Database(self.database_url, pool_size=2)
        try:
            yield db
        finally:
            await db.close()

    def stop(self) -> dict[str, int]:
        """Stop every process (SIGTERM, newest first); their exit statuses (0: a clean shutdown)."""
        return self.processes.stop_all()

    # ---- the API -----------------------------------------------------------------

    async def call(
        self, http: aiohttp.ClientSession, method: str, path: str, role: str | None, *, master: int = 0, **kw: Any
    ) -> tuple[int, Any]:
        """One API call as ``role`` to master ``master``; (0, None) when the connection fails."""
        headers = dict(kw.pop("headers", {}))
        if role is not None:
            headers["Authorization"] = f"Bearer {self.keys[role]}"
        try:
            async with http.request(method, self.api(master) + path, headers=headers, **kw) as response:
                return response.status, await response.json(content_type=None)
        except (aiohttp.ClientError, json.JSONDecodeError):
            return 0, None

    async def _ok(self, http: aiohttp.ClientSession, url: str) -> bool:
        try:
            async with http.get(url) as response:
                return response.status == 200
        except aiohttp.ClientError:
            return False

    async def _relays_registered(self, http: aiohttp.ClientSession) -> bool:
        status, body = await self.call(http, "GET", "/relays", "admin")
        return status == 200 and {r["relay_id"] for r in body["items"]} == {r.relay_id for r in REGIONS}

    async def _agents_on_their_relays(self, http: aiohttp.ClientSession, which: list[int] | None = None) -> bool:
        for i, host_id in enumerate(self.host_ids):
            if which is not None and i not in which:
                continue
            status, host = await self.call(http, "GET", f"/hosts/{host_id}", "admin", master=i % self.masters)
            if status != 200 or host["state"] != "online" or host["relay_id"] != self.agent_region(i).relay_id:
                return False
        return True

    async def _top_up(self, http: aiohttp.ClientSession) -> None:
        status, account = await self.call(http, "GET", "/account", "renter")
        body = {"account_id": account["id"], "amount": "1000.00", "reference": "cluster-credit"}
        status, answer = await self.call(http, "POST", "/account/credits", "admin", json=body)
        if status not in (200, 201):
            raise ClusterError(f"could not credit the renter: {status} {answer}")

    async def until(self, check: Callable[[], Awaitable[T | None]], timeout: float, what: str) -> T:
        """The first truthy ``check()``; ``ClusterError`` naming ``what`` (and any process that died) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = await check()
            if value:
                return value
            dead = [n for n in self.processes.running if n not in self.expected_down and not self.processes.alive(n)]
            if time.monotonic() >= deadline or dead:
                why = f"; exited: {', '.join(dead)}\n{self.processes.logs(dead)}" if dead else ""
                raise ClusterError(f"timed out after {timeout:g} s waiting for {what}{why}")
            await asyncio.sleep(0.2)

    # ---- the end-to-end check ----------------------------------------------------

    async def check_rental(self, *, timeout: float = 60) -> dict[str, Any]:
        """Rent one GPU on master-1, watch it on master-2 start on an agent, be charged by the Celery workers, stop.

        Returns what was verified, with the seconds each step took; ``ClusterError`` when a step does not hold.
        """
        other = 1 % self.masters
        report: dict[str, Any] = {}
        async with aiohttp.ClientSession() as http:
            _, before = await self.call(http, "GET", "/account", "renter")
            began = time.monotonic()
            key = str(uuid.uuid4())
            status, rental = await self.call(http, "POST", "/rentals", "renter", json={"gpu_count": 1},
                                             headers={"Idempotency-Key": key})  # fmt: skip
            if status != 201:
                raise ClusterError(f"renting one GPU failed: {status} {rental}")
            status, again = await self.call(http, "POST", "/rentals", "renter", master=other, json={"gpu_count": 1},
                                            headers={"Idempotency-Key": key})  # fmt: skip
            if again is None or again.get("id") != rental["id"]:
                raise ClusterError(f"the same Idempotency-Key on master-{other + 1} gave another answer: {status} {again}")
            rental_id = rental["id"]

            async def state_on_other(state: str) -> dict[str, Any] | None:
                status, body = await self.call(http, "GET", f"/rentals/{rental_id}", "renter", master=other)
                return body if status == 200 and body["state"] == state else None

            running = await self.until(lambda: state_on_other("running"), timeout, "the rental running")
            report["running_after_s"] = round(time.monotonic() - began, 2)
            host_index = self.host_ids.index(running["host_id"])
            report |= {"rental_id": rental_id, "host_id": running["host_id"],
                       "relay_id": self.agent_region(host_index).relay_id, "gpu_uuids": running["gpu_uuids"]}  # fmt: skip

            async def charged() -> Decimal | None:
                status, body = await self.call(http, "GET", f"/rentals/{rental_id}", "renter", master=other)
                amount = Decimal(body["charged"]) if status == 200 else Decimal(0)
                return amount if amount > 0 else None

            first_charge = await self.until(charged, timeout, "the Celery workers' first charge for the rental")
            report["charged_after_s"] = round(time.monotonic() - began, 2)
            status, body = await self.call(http, "DELETE", f"/rentals/{rental_id}", "renter", master=other)
            if status != 202:
                raise ClusterError(f"stopping the rental failed: {status} {body}")
            stopped = await self.until(lambda: state_on_other("stopped"), timeout, "the rental stopped")
            report["stopped_after_s"] = round(time.monotonic() - began, 2)
            # Stopped within the minimum billing period: the workers' next pass charges the whole of it, once.
            minimum = (Decimal(running["price_per_hour"]) * 60 / 3600).quantize(Decimal("0.000001"))

            async def final_charge() -> Decimal | None:
                amount = await charged()
                return amount if amount is not None and abs(amount - minimum) <= Decimal("0.000001") else None

            final = await self.until(final_charge, timeout, f"the minimum period charged ({minimum})")
            await asyncio.sleep(3 * self.billing_interval)  # later passes must post nothing more
            status, settled = await self.call(http, "GET", f"/rentals/{rental_id}", "renter")
            _, after = await self.call(http, "GET", "/account", "renter")
            spent = Decimal(before["credit"]["balance"]) - Decimal(after["credit"]["balance"])
            report |= {"first_charge": str(first_charge), "charged": settled["charged"], "credit_spent": str(spent),
                       "events": [e["to"] for e in stopped["events"]]}  # fmt: skip
            if Decimal(settled["charged"]) != final or spent != final:
                raise ClusterError(f"the money does not add up (charged once {final}): {report}")
        return report


async def run_cluster(
    workdir: Path, *, database_url: str, redis_url: str, bus_prefix: str, agents: int, fresh: bool, check: bool,
    stop: asyncio.Event,
) -> int:
    """``gpumarket topology``: start, then check one rental and stop (``check``), or stay up until ``stop``."""
    if fresh:
        for made in ("logs", "master", "relay-pki", "agents", "worker-beat", "worker-2"):  # only what a cluster makes
            shutil.rmtree(workdir / made, ignore_errors=True)
        await _fresh_database(database_url)
        await delete_prefix(redis_url, bus_prefix)
    cluster = Cluster(workdir, database_url=database_url, redis_url=redis_url, bus_prefix=bus_prefix, agents=agents,
                      on_step=lambda step: print(f"· {step}", flush=True))  # fmt: skip
    began = time.monotonic()
    try:
        await cluster.start()
        print(f"the cluster is up in {time.monotonic() - began:.1f} s ({len(cluster.processes.running)} processes)")
        for i in range(cluster.masters):
            print(f"  master-{i + 1}: {cluster.api(i)}  (console http://127.0.0.1:{cluster.master_ports[i]}/)")
        print(f"  relays: {', '.join(f'{rid} wss://localhost:{p}' for rid, p in cluster.relay_ports.items())}")
        print(f"  geo DNS: {CLUSTER_ZONE} on 127.0.0.1 port {cluster.dns_port}; logs in {cluster.processes.log_dir}")
        print("  API keys: " + ", ".join(f"{role} {key}" for role, key in cluster.keys.items()), flush=True)
        if check:
            report = await cluster.check_rental()
            print("end-to-end rental: " + json.dumps(report, indent=2), flush=True)
        else:
            print("Press Ctrl-C to stop.", flush=True)
            await stop.wait()
    finally:
        codes = await asyncio.to_thread(cluster.stop)
    unclean = {name: code for name, code in codes.items() if code != 0}
    if unclean:
        print(f"processes that did not stop cleanly: {unclean}; see {cluster.processes.log_dir}", file=sys.stderr)
        return 1
    print("stopped cleanly")
    return 0


async def _fresh_database(url: str) -> None:
    """Drop and create the database ``url`` names (PostgreSQL; connects to the server's ``postgres`` database)."""
    import asyncpg
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql" or not parsed.database:
        raise ConfigError(f"--fresh needs a PostgreSQL URL naming a database, not {url!r}")
    admin_url = parsed.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    conn = await asyncpg.connect(admin_url, timeout=10)
    try:
        name = parsed.database.replace('"', '""')
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
