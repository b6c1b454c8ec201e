"""``gpumarket up``: the whole marketplace in one process, for demos and end-to-end tests.

Master (REST API and console), one access relay, and N provider agents with the
explicit simulated GPU backend, over the in-process bus and a SQLite file in the
data dir. The simulated agents take exactly a real agent's path: they enroll over
HTTP with a one-time token, hold their own key and certificate, and talk to the
relay over TLS websockets. Nothing bypasses the relay.

Data dir layout: ``gpumarket.db``, ``ca/``, ``relay/``, ``agents/agent-NN/``,
``credentials.json`` (0600), ``mail/`` (what the master mailed: sign-up and password-reset links, one
``.eml`` file each, kept by a local SMTP sink, ``gpumarket.mailsink``, unless ``GPUMARKET_SMTP_URL`` names a
real mail server). Starting again with the same data dir resumes the same
accounts and hosts.

Rentals cannot read any of it: the data dir is made 0700 (its files 0600), and when ``up``
runs as root the agents run each process rental under a uid of its own with its home in
``rentals_root``, outside the data dir. Not root, process workloads are refused unless
``allow_unisolated_workloads``; ``run_up`` says in one line what the demo agents run.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import secrets
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography import x509
from pydantic import SecretStr, TypeAdapter
from sqlalchemy import select

from access.geodns.server import GeoDnsServer
from access.relay import Relay
from agent.enroll import enroll
from agent.gpu import open_backend
from agent.runner import Agent
from agent.runtimes.container import probe_container_engine
from agent.runtimes.containeropts import ContainerOptions
from agent.runtimes.isolation import HostIsolation, host_isolation, isolation_summary, prove_rental_network
from agent.runtimes.users import DEFAULT_RENTALS_ROOT
from agent.state import AgentState, atomic_write, make_private
from agent.timings import AgentTimings
from billing import credits
from gpumarket import demo, images
from gpumarket.mailsink import MailSink
from master.app import bound_port, close_master, create_app, open_master
from master.context import Master
from master.models import Account
from master.services import hosts
from master.services.accounts import create_account, create_api_key, key_is_valid
from shared.bus import Bus, InProcessBus
from shared.crypto import (
    certificate_not_after,
    certificate_public_key,
    sealed,
    server_ssl_context,
    web_ssl_context,
)
from shared.errors import ConfigError
from shared.registry import MemoryRegistry, Registry
from shared.settings import ENV_PREFIX, MasterSettings
from shared.slowstop import step

log = logging.getLogger(__name__)

# A realistic spread of what providers bring: consumer cards, workstations, datacenter.
# The first host rents shares (gpumarket.demo lists it so); the A100 host has a fifth A100 in MIG mode (one
# 3g.40gb, one 2g.20gb, two 1g.10gb instances). Every demo host carries seeded history (gpumarket.demo).
DEMO_FLEET = (
    "sim:2xRTX4090",
    "sim:1xRTX3060",
    "sim:4xA100-80GB,1xA100-80GB:mig",
    "sim:8xH100",
    "sim:1xRTX4090",
    "sim:2xL40S",
    "sim:4xRTX3090",
    "sim:1xT4",
    "sim:2xH200",
    "sim:1xRTX5090",
)
DEMO_ZONE = "relays.gpumarket.local"
# Renters' web ports: https://<rental>-<port>.ports.localhost:<port>/ (browsers resolve *.localhost to the loopback).
PORTS_DOMAIN = "ports.localhost"
DEMO_ACCOUNTS = (("renter", "demo-renter"), ("provider", "demo-provider"), ("admin", "admin"))
DEMO_CREDIT = "1000.00"  # USD of prepaid credit the demo renter starts with


@dataclass
class Marketplace:
    """A running embedded marketplace; ``stop()`` shuts it down in reverse order."""

    master: Master
    relay: Relay
    dns: GeoDnsServer
    runner: web.AppRunner
    api_url: str
    console_url: str
    credentials: dict[str, Any]
    isolation: HostIsolation
    mail: MailSink | None = None  # None: the master mails through GPUMARKET_SMTP_URL
    demo_image: str | None = None  # the demo template's image, when built
    agents: list[Agent] = field(default_factory=list)
    agent_tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self, progress: Callable[[str], None] | None = None) -> None:
        """Stop in reverse order; a step still running after a few seconds is told to ``progress`` by name, and the
        log gets every task's stack (``shared.slowstop``)."""
        await step("the agents", self._stop_agents(), progress=progress)
        await step("the relay", self.relay.close(), progress=progress)
        await step("the geo DNS", self.dns.close(), progress=progress)
        await step("the API and its background loops", self.runner.cleanup(), progress=progress)
        await step("the database and the bus", close_master(self.master), progress=progress)
        if self.mail is not None:
            await step("the mail sink", self.mail.close(), progress=progress)

    async def _stop_agents(self) -> None:
        for task in self.agent_tasks:
            task.cancel()
        for task in self.agent_tasks:
            # ConfigError: an agent that stopped on its own (its host was revoked) and logged why.
            with contextlib.suppress(asyncio.CancelledError, ConfigError):
                await task
        for agent in self.agents:
            await agent.close()


SECRETS_KEY_FILE = "secrets.key"
METRICS_TOKEN_FILE = "metrics.token"


def demo_secrets_key(path: Path, make: Callable[[], str] = sealed.new_key) -> str:
    """The demo's ``secrets_key`` (or another secret ``make`` makes): read from ``path``, or made there (mode 0600) on
    the first start."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        key = make()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(key + "\n")
        return key


async def start_marketplace(
    data_dir: Path,
    *,
    agents: int = 3,
    http_host: str = "127.0.0.1",
    http_port: int = 8080,
    relay_port: int = 8443,
    dns_port: int = 0,
    # None: from GPUMARKET_* in the environment, or the settings' defaults (10 s, 10 s, 3).
    heartbeat_interval: float | None = None,
    telemetry_interval: float | None = None,
    missed_heartbeats_offline: int | None = None,
    network_interval: float = 3600.0,
    settings: MasterSettings | None = None,
    rentals_root: Path = DEFAULT_RENTALS_ROOT,
    allow_unisolated_workloads: bool = False,
    container_engine: str | None = None,
    docker_url: str | None = None,
    demo_image: bool = False,
    progress: Callable[[str], None] | None = None,
    bus: Bus | None = None,
    registry: Registry | None = None,
) -> Marketplace:
    """Start it all. ``container_engine`` is what the engine probe answered (``None``: none answers); by
    default the engine at ``docker_url`` (or the system's socket) is asked. ``progress`` is told one line
    per step done (database, relay, geo DNS, API, agents), and lines starting ``"  ..  "`` while the demo image builds.
    ``demo_image``: build the demo image (``gpumarket.demo.build_demo_image``; a few seconds the first time, then
    found) and point the ``demo`` template at it, or have the template say why there is none.

    Raises ``ConfigError`` saying which port and which flag when a port it must bind is taken; it checks
    them all before it starts anything.

    ``bus`` and ``registry`` (default: in-process ones) let relays in other processes join it (``bench_scp.py
    --layout processes`` runs its relay in a process of its own over Redis); the marketplace closes them."""
    step = progress or (lambda _line: None)
    data_dir = data_dir.resolve()
    check_ports_free(http_host, up_ports(http_port, relay_port, dns_port))
    make_private(data_dir)  # the CA key, credentials.json, the agents' keys: nobody else's business
    isolation = await asyncio.to_thread(
        host_isolation, allow_unisolated=allow_unisolated_workloads, container_engine=container_engine, rentals_root=rentals_root,
        private_dirs=[data_dir],
    )
    engine_name, engine_reason = container_engine, ""
    if container_engine is None:
        engine = await probe_container_engine(ContainerOptions(docker_url=docker_url), data_dir / "agents")
        isolation = isolation.with_container_engine(engine.engine)
        engine_name, engine_reason = engine.engine, engine.reason
    built: demo.DemoImage | None = None
    if demo_image:
        built = await demo.build_demo_image(engine_name, engine_reason, docker_url=docker_url,
                                            progress=lambda line: step(f"  ..  demo image  {line}"))  # fmt: skip
    # GPU verification (docs/verification.md): the demo's hosts are listed once they pass their enrollment challenge,
    # which runs in the challenge image; without an engine to build it in, they are listed unverified.
    verify, challenge = False, images.CHALLENGE_LATEST
    challenge_note = "challenge   image not built (no container engine to build it in): hosts are listed unverified"
    if built is not None and built.image is not None and (socket_path := demo.engine_socket(docker_url)) is not None:
        try:
            challenge = await asyncio.to_thread(images.challenge_image, socket_path=socket_path)
            challenge_note, verify = f"challenge   {challenge}: hosts are listed once their GPUs pass it", True
        except (images.ImageBuildError, OSError) as exc:
            challenge_note = f"challenge   image not built ({exc}): hosts are listed unverified"
    isolation = isolation.with_network(await prove_rental_network(None, isolation.users))
    # Sign-up and password resets mail their links: to a local SMTP sink, unless a real server is configured.
    real_server = f"{ENV_PREFIX}SMTP_URL" in os.environ or (settings is not None and settings.smtp_url is not None)
    sink = None if real_server else MailSink(host=http_host, folder=data_dir / "mail")
    if sink is not None:
        await sink.start()
        step(f"mail sink   {sink.url}, messages in {sink.folder}")
    settings = settings or MasterSettings.load(
        data_dir=data_dir,
        http_host=http_host,
        http_port=http_port,
        heartbeat_interval=heartbeat_interval,
        telemetry_interval=telemetry_interval,
        missed_heartbeats_offline=missed_heartbeats_offline,
        instance_id="master-embedded",
        # Renters add credit from the console at once, no card charged (GPUMARKET_PAYMENTS=stripe to try Checkout).
        payments=None if f"{ENV_PREFIX}PAYMENTS" in os.environ else "demo",
        verification_required=verify,
    )
    if sink is not None:
        settings.smtp_url = SecretStr(sink.url)
    if settings.secrets_key is None:
        # Registry credentials and TOTP secrets are sealed with a key of the data dir's own, kept across restarts.
        settings.secrets_key = SecretStr(demo_secrets_key(data_dir / SECRETS_KEY_FILE))
    if settings.metrics_token is None and not settings.metrics_open:
        # /metrics is closed without a token: the demo makes one of its own, kept across restarts, printed when up.
        settings.metrics_token = demo_secrets_key(data_dir / METRICS_TOKEN_FILE, lambda: secrets.token_urlsafe(24))
    bus = bus or InProcessBus()
    registry = registry or MemoryRegistry()
    try:
        master = await open_master(settings, bus=bus, registry=registry)
    except BaseException:
        await _close_sink(sink)
        raise
    step(f"database    {_database_name(settings)}")
    try:
        relay_dir = data_dir / "relay"
        cert_file, key_file = relay_dir / "server.crt", relay_dir / "server.key"
        if (not cert_file.exists() or certificate_not_after(cert_file.read_bytes()) < datetime.now(UTC) + timedelta(days=7)
                or f"*.{PORTS_DOMAIN}" not in _dns_names(cert_file)):
            master.ca.write_server_certificate(relay_dir, ["localhost", "127.0.0.1", "::1", f"*.{PORTS_DOMAIN}"], basename="server")
        relay = Relay(
            relay_id="relay-local",
            bus=bus,
            # Agents present a client certificate; renters (gpumarket ssh) connect without one.
            ssl_context=server_ssl_context(cert_file, key_file, master.ca.cert_path, require_client_cert=False),
            host=http_host,
            port=relay_port,
            heartbeat_interval=settings.heartbeat_interval,
            telemetry_interval=settings.telemetry_interval,
            registry=registry,
            public_host="localhost",
            # Every demo agent connects from 127.0.0.1: the per-source limit is for the internet.
            max_connections_per_source_per_minute=100_000,
            connection_burst_per_source=10_000,
            token_key=certificate_public_key(master.ca.certificate),
            ports_domain=PORTS_DOMAIN,
            ports_port=relay_port + 1 if relay_port else 0,
            ports_ssl_context=web_ssl_context(cert_file, key_file),
        )
        try:
            await relay.start()
        except OSError as exc:
            raise listen_error(exc, http_host, relay_port, "--relay-port") from None
        step(f"relay       {relay.url}")
        dns = GeoDnsServer(registry, zone=DEMO_ZONE, host=http_host, port=dns_port, refresh_interval=1.0, ttl=5)
        try:
            await dns.start()
        except OSError as exc:
            await relay.close()
            raise listen_error(exc, http_host, dns_port, "--dns-port") from None
        step(f"geo DNS     {DEMO_ZONE} on {http_host} port {dns.port} (UDP and TCP)")
    except BaseException:
        await close_master(master)
        await _close_sink(sink)
        raise
    settings.relay_urls = [relay.url]
    # Every demo agent enrolls from 127.0.0.1 at start: let them all through (the API stays rate-limited).
    settings.enrollment_burst = max(settings.enrollment_burst, agents)
    runner = web.AppRunner(create_app(master), shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, http_host, http_port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        await relay.close()
        await dns.close()
        await close_master(master)
        await _close_sink(sink)
        raise listen_error(exc, http_host, http_port, "--http-port") from None
    port = bound_port(site)
    base = f"http://{http_host}:{port}"
    step(f"API         {base}/api/v1 and the console at {base}/")
    settings.public_url = base
    api_url, console_url = f"{base}/api/v1", f"{base}/"
    credentials = await _demo_credentials(master, data_dir / "credentials.json", api_url, console_url, metrics=_metrics_access(settings, base))
    make_private(data_dir / "agents")
    make_private(data_dir)  # again, now that the master made its folders (ca/, relay/) and database
    market = Marketplace(
        master=master, relay=relay, dns=dns, runner=runner, api_url=api_url, console_url=console_url, credentials=credentials,
        isolation=isolation, mail=sink, demo_image=built.image if built is not None else None,
    )
    try:
        if built is not None:
            await demo.register_demo_template(master, built)
            step(f"demo image  {built.image}: the {demo.DEMO_TEMPLATE} template (a shell, Python 3, a server on port "
                 f"{images.DEMO_PORT})" if built.image else f"demo image  not built: {built.why}; the {demo.DEMO_TEMPLATE} "
                 "template says so")  # fmt: skip
            step(challenge_note)
        async with master.db.session() as session:  # once per data dir: the reference makes it idempotent
            await credits.top_up(session, await _account_id(master, "demo-renter"), DEMO_CREDIT, reference="demo-credit",
                                 at=master.clock.now())  # fmt: skip
        provider_id = await _account_id(master, "demo-provider")
        for i in range(agents):
            agent = await _demo_agent(
                master, data_dir / "agents" / f"agent-{i:02d}", i, base, relay.url, provider_id,
                network_interval=network_interval, dns=(http_host, dns.port), isolation=isolation,
                container=ContainerOptions(docker_url=docker_url), challenge_image=challenge,
            )
            market.agents.append(agent)
            market.agent_tasks.append(asyncio.create_task(agent.run(), name=f"agent-{i:02d}"))
        # First speed tests and the listings (shares, storage for volumes), once the hosts are connected; stopped with the agents.
        market.agent_tasks.append(asyncio.create_task(demo.prepare_demo_hosts(master, market.agents, provider=provider_id),
                                                      name="demo-setup"))  # fmt: skip
    except BaseException:
        await market.stop()
        raise
    step(f"agents      {agents} simulated provider host(s) enrolled, connecting through the relay")
    return market


async def _close_sink(sink: MailSink | None) -> None:
    if sink is not None:
        await sink.close()


def up_ports(http_port: int, relay_port: int, dns_port: int) -> list[tuple[int, str, str]]:
    """Every port ``up`` binds: (port, the flag that changes it, a note for the message)."""
    return [
        (http_port, "--http-port", ""), (relay_port, "--relay-port", ""),
        (relay_port + 1 if relay_port else 0, "--relay-port", " (the relay's web ports take the port after it)"),
        (dns_port, "--dns-port", ""),
    ]  # fmt: skip


def check_ports_free(host: str, ports: list[tuple[int, str, str]]) -> None:
    """``ConfigError`` naming the first of ``ports`` (port, the flag that changes it, a note) that cannot be bound
    on ``host`` over TCP (UDP too for the geo DNS's); port 0 (any free one) is skipped."""
    for port, flag, note in ports:
        if not port:
            continue
        kinds = (socket.SOCK_STREAM, socket.SOCK_DGRAM) if flag == "--dns-port" else (socket.SOCK_STREAM,)
        for kind in kinds:
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                with socket.socket(family, kind) as probe:
                    if kind == socket.SOCK_STREAM:
                        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is free
                    probe.bind((host, port))
            except OSError as exc:
                raise listen_error(exc, host, port, flag, note) from None


def listen_error(exc: OSError, host: str, port: int, flag: str, note: str = "") -> ConfigError:
    """One line for a port that cannot be bound: which port, and the flag that picks another."""
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"port {port} is in use{note}; choose another with {flag}")
    reason = exc.strerror or str(exc)
    return ConfigError(f"cannot listen on {host} port {port} ({reason}){note}; choose another with {flag}")


def _database_name(settings: MasterSettings) -> str:
    if settings.database_url:
        return settings.database_url.split("@")[-1]  # never the password
    return f"SQLite at {settings.data_dir / 'gpumarket.db'}"


async def _account_id(master: Master, name: str) -> str:
    async with master.db.session() as session:
        account_id = await session.scalar(select(Account.id).where(Account.name == name))
    assert account_id is not None
    return account_id


def _metrics_access(settings: MasterSettings, base: str) -> dict[str, Any]:
    """How to scrape ``/metrics``: its URL and token (``None`` when it is open on purpose: ``metrics_open``)."""
    return {"url": f"{base}/metrics", "token": settings.metrics_token}


async def _demo_credentials(master: Master, path: Path, api_url: str, console_url: str, *,
                            metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reuse the demo accounts' keys from ``credentials.json`` when still valid, else mint new ones; ``metrics``: how to
    scrape /metrics, written beside them."""
    old: dict[str, Any] = {}
    if path.exists():
        with contextlib.suppress(ValueError):
            old = json.loads(path.read_text())
    creds: dict[str, Any] = {"api_url": api_url, "console_url": console_url}
    if metrics is not None:
        creds["metrics"] = metrics
    async with master.db.session() as session:
        for role, name in DEMO_ACCOUNTS:
            key = (old.get(role) or {}).get("api_key")
            if isinstance(key, str) and await key_is_valid(session, key):
                creds[role] = {"api_key": key, "account": name}
                continue
            existing = await session.scalar(select(Account).where(Account.name == name))
            if existing is None:
                _, key = await create_account(session, name, role)
            else:
                key = await create_api_key(session, existing.id)
            creds[role] = {"api_key": key, "account": name}
    atomic_write(path, (json.dumps(creds, indent=2) + "\n").encode(), mode=0o600)
    path.chmod(0o600)
    return creds


async def _demo_agent(
    master: Master, folder: Path, i: int, base_url: str, relay_url: str, provider_id: str, *,
    network_interval: float, dns: tuple[str, int], isolation: HostIsolation, container: ContainerOptions,
    challenge_image: str = images.CHALLENGE_LATEST,
) -> Agent:
    await enroll_demo_host(master, folder, i, base_url, relay_url, provider_id)
    return demo_agent(
        folder, i, relay_url, heartbeat_interval=master.settings.heartbeat_interval,
        telemetry_interval=master.settings.telemetry_interval, network_interval=network_interval, dns=dns,
        isolation=isolation, container=container, challenge_image=challenge_image,
    )


async def enroll_demo_host(master: Master, folder: Path, i: int, base_url: str, relay_url: str, provider_id: str) -> str:
    """Enroll the ``i``-th demo host in ``folder`` (once: a folder enrolled already is kept) and seed its history;
    returns its host id."""
    state = AgentState(folder)
    spec = DEMO_FLEET[i % len(DEMO_FLEET)]
    if not state.enrolled:
        token, _ = await hosts.create_token(master, provider_id)
        await enroll(base_url, token, folder, hostname=f"demo-host-{i:02d}", gpus=spec, relay_url=relay_url)
    identity = state.identity()
    await demo.seed_history(master, identity.host_id, uptime=demo.demo_uptime(i))  # once per host
    return identity.host_id


def demo_agent(
    folder: Path, i: int, relay_url: str, *, heartbeat_interval: float, telemetry_interval: float,
    network_interval: float, dns: tuple[str, int] | None, isolation: HostIsolation, container: ContainerOptions,
    challenge_image: str = images.CHALLENGE_LATEST,
) -> Agent:
    """The ``i``-th demo host's agent on its enrolled ``folder`` (no master needed: a benchmark runs it in a process of
    its own). ``dns``: the geo DNS that names its relays; ``None``: none, the agent stays on ``relay_url``."""
    state = AgentState(folder)
    spec = DEMO_FLEET[i % len(DEMO_FLEET)]
    identity = state.identity()
    backend = open_backend(identity.gpus or spec, seed=identity.host_id)
    return Agent(
        state,
        backend,
        relay_urls=[relay_url],  # used until the geo DNS answers, and if it ever cannot
        zone=DEMO_ZONE if dns is not None else None,
        resolver=dns[0] if dns is not None else None,
        resolver_port=dns[1] if dns is not None else 53,
        region=("eu-west", "us-east", "ap-south")[i % 3],
        timings=AgentTimings(
            sample_interval=min(1.0, telemetry_interval),
            telemetry_interval=telemetry_interval,
            heartbeat_interval=heartbeat_interval,
            network_interval=network_interval,
        ),
        network_max_bytes=4 << 20,
        network_target_seconds=0.5,
        stop_workloads_on_close=True,  # the demo's hosts go away with it
        isolation=isolation,
        container=container,
        # The agent setting, read here too: GPUMARKET_CLUSTER_DIRECT=false sends every cluster tunnel through the relay.
        cluster_direct=TypeAdapter(bool).validate_python(os.environ.get("GPUMARKET_CLUSTER_DIRECT", "true")),
        challenge_image=challenge_image,  # the one built now, by its content's name (another build may move :latest)
    )


async def run_up(
    data_dir: Path, *, agents: int, http_host: str, http_port: int, relay_port: int, dns_port: int, stop: asyncio.Event,
    rentals_root: Path = DEFAULT_RENTALS_ROOT, allow_unisolated_workloads: bool = False, container_engine: str | None = None,
    log_file: Path | None = None,
) -> None:
    """Start, print one line per step and then the box of what to open, wait for ``stop``, stop in order."""
    check_ports_free(http_host, up_ports(http_port, relay_port, dns_port))  # a taken port: its one line, nothing else
    say(f"gpumarket up: state in {data_dir.resolve()}" + (f", logs in {log_file}" if log_file else ""))
    market = await start_marketplace(
        data_dir, agents=agents, http_host=http_host, http_port=http_port, relay_port=relay_port, dns_port=dns_port,
        rentals_root=rentals_root, allow_unisolated_workloads=allow_unisolated_workloads, container_engine=container_engine,
        demo_image=True, progress=lambda line: say(line if line.startswith("  ") else f"  ok  {line}"),
    )
    try:
        say(f"  web ports:   {_web_ports(market)}")
        say(f"  workloads:   {isolation_summary(market.isolation.facts, who='demo agents')}")
        say(ready_box(market, data_dir.resolve() / "credentials.json"))
        await stop.wait()
        say("stopping…")
    finally:
        await market.stop(progress=say)
    say("stopped cleanly")


def say(line: str) -> None:
    print(line, flush=True)


def ready_box(market: Marketplace, credentials_file: Path) -> str:
    """The last thing on screen once up: where to go, how to sign in, how to stop."""
    base = market.console_url.rstrip("/")
    rows = [
        "gpumarket is up",
        "",
        f"console   {market.console_url}",
        "sign in with an API key:",
        *(f"  {role:<9} {market.credentials[role]['api_key']}" for role, _ in DEMO_ACCOUNTS),
        f"  (also in {credentials_file})",
        *([f"or sign up in the console: its mail lands in {market.mail.folder}/"] if market.mail is not None and market.mail.folder else []),
        f"API       {market.api_url}",
        f"API docs  {base}/api/docs",
        *_metrics_rows(market),
        f"CLI       {cli_hint()}",
        *(try_rows(market) if market.demo_image else []),
        "",
        "Press Ctrl-C to stop.",
    ]
    width = max(len(row) for row in rows)
    encoding = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "┌─│└┐┘".encode(encoding)
        top, side, bottom = f"┌{'─' * (width + 2)}┐", "│", f"└{'─' * (width + 2)}┘"
    except (UnicodeEncodeError, LookupError):
        top = bottom = f"+{'-' * (width + 2)}+"
        side = "|"
    return "\n".join([top, *(f"{side} {row:<{width}} {side}" for row in rows), bottom])


def cli_hint(executable: str | None = None, path: str | None = None) -> str:
    """How to run ``gpumarket`` from this shell: plainly when ``path`` (default ``$PATH``) finds this one, else the
    virtual environment's own (``.venv/bin/gpumarket``) or ``. .venv/bin/activate`` first."""
    bin_dir = Path(executable or sys.executable).parent
    script = bin_dir / "gpumarket"
    found = shutil.which("gpumarket", path=path)
    if found is not None and Path(found).resolve() == script.resolve():
        return "gpumarket (on your PATH)"
    with contextlib.suppress(ValueError):
        bin_dir = bin_dir.absolute().relative_to(Path.cwd())
    return f"{bin_dir}/gpumarket, or `. {bin_dir}/activate` first to type gpumarket"


def try_rows(market: Marketplace) -> list[str]:
    """A newcomer's first rental from the CLI, each step one that works as printed: log in as the demo renter, register
    an SSH key (``gpumarket ssh`` says the same when there is none), rent the demo, SSH in."""
    return [f"try       gpumarket login --api {market.api_url.removesuffix('/api/v1')} <<< {market.credentials['renter']['api_key']}",
            "          gpumarket ssh-key add   (~/.ssh/id_ed25519.pub; none yet? ssh-keygen -t ed25519 first)",
            f"          gpumarket rent --template {demo.DEMO_TEMPLATE}, then gpumarket ssh RENTAL -- echo hi"]  # fmt: skip


def _metrics_rows(market: Marketplace) -> list[str]:
    metrics = market.credentials.get("metrics")
    if not isinstance(metrics, dict):
        return []
    token = metrics.get("token")
    how = f"(Authorization: Bearer {token})" if token else "(open: metrics_open is set)"
    return [f"metrics   {metrics['url']} {how}"]


def _dns_names(cert_file: Path) -> list[str]:
    certificate = x509.load_pem_x509_certificate(cert_file.read_bytes())
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return names.get_values_for_type(x509.DNSName)


def _web_ports(market: Marketplace) -> str:
    web = market.relay.web_ports
    if web is None:
        return "none"
    return f"{web.url_template.replace('{label}', '<rental>-<port>')} (a certificate of the marketplace's own CA: accept it once)"
