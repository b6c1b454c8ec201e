"""The ``gpumarket`` command line. Each subcommand has ``--help``; services list their settings there."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.runtimes.users import DEFAULT_RENTALS_ROOT
from gpumarket.renter.options import positive_int
from shared import eventloop
from shared.errors import GpumarketError
from shared.settings import AccessSettings, AgentSettings, DnsSettings, MasterSettings, ServiceSettings

if TYPE_CHECKING:
    from master.db import Database

log = logging.getLogger("gpumarket")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _setup_file_logging(log_file: Path, level: str, *, verbose: bool) -> None:
    """Log to ``log_file`` (appended, owner-only), and to stderr as well when ``verbose``."""
    log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    log_file.touch(mode=0o600, exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(log_file, encoding="utf-8")]
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _run_until_signal(
    main: Callable[[asyncio.Event], Coroutine[Any, Any, None]], *, log_level: str, configured: bool = False,
    loop: str | None = "asyncio",
) -> None:
    """Log at ``log_level`` (unless ``configured`` already), then run ``main(stop)`` on the event loop ``loop`` names
    (``shared.eventloop``; ``None``: ``GPUMARKET_EVENT_LOOP``, else uvloop where it imports); SIGINT/SIGTERM set
    ``stop`` so ``main`` shuts down in order."""
    if not configured:
        _setup_logging(log_level)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    eventloop.run(runner(), kind=loop)


def _settings_epilog(cls: type[ServiceSettings]) -> str:
    return "settings (environment variables; also keys of the TOML file given by --config):\n" + cls.describe()


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML settings file ([master], [access], [agent] tables)")


# ---- commands -----------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> None:
    from gpumarket.up import run_up

    log_file = args.data_dir.resolve() / "up.log"
    _setup_file_logging(log_file, args.log_level, verbose=args.verbose)
    _run_until_signal(
        lambda stop: run_up(
            args.data_dir, agents=args.agents, http_host=args.host, http_port=args.http_port, relay_port=args.relay_port,
            dns_port=args.dns_port, stop=stop, rentals_root=args.rentals_root,
            allow_unisolated_workloads=args.allow_unisolated_workloads, log_file=log_file,
        ),
        log_level=args.log_level,
        configured=True,
    )


def cmd_topology(args: argparse.Namespace) -> None:
    from gpumarket.cluster import run_cluster

    codes: list[int] = []

    async def main(stop: asyncio.Event) -> None:
        codes.append(await run_cluster(
            args.workdir, database_url=args.database_url, redis_url=args.redis_url, bus_prefix=args.bus_prefix,
            agents=args.agents, fresh=args.fresh, check=args.check, stop=stop,
        ))  # fmt: skip

    _run_until_signal(main, log_level=args.log_level)
    if codes and codes[0]:
        raise SystemExit(codes[0])


def cmd_master(args: argparse.Namespace) -> None:
    from master.app import serve_master

    settings = MasterSettings.load(args.config, http_port=args.http_port)
    _run_until_signal(lambda stop: serve_master(settings, stop=stop), log_level=settings.log_level)


def cmd_migrate(args: argparse.Namespace) -> None:
    from master.db import migrate_or_wait, sqlite_url

    settings = MasterSettings.load(args.config)
    _setup_logging(settings.log_level)
    url = settings.database_url or sqlite_url(settings.data_dir / "gpumarket.db")
    if not settings.database_url:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    before, after = asyncio.run(migrate_or_wait(url, check_only=args.check, wait_s=args.wait))
    now = ", ".join(sorted(after)) or "none"
    if args.check:
        print(f"the schema is at revision {now}, this version's newest")
    elif before == after:
        print(f"the schema was already at revision {now}; nothing to do")
    else:
        print(f"migrated the schema from revision {', '.join(sorted(before)) or 'none'} to {now}")


def cmd_worker(args: argparse.Namespace) -> None:
    from billing.celery_app import make_celery, queue_name
    from billing.tasks import check_database

    settings = MasterSettings.load(args.config)
    app = make_celery(settings)  # ConfigError when the broker or the database is not set
    asyncio.run(check_database(settings))  # reachable and migrated by a master, or a clear error now
    argv = [
        "worker", f"--loglevel={args.loglevel or settings.log_level}", f"--concurrency={args.concurrency}",
        # Prefork children forked from this process: they inherit the app built from the settings above.
        "--pool=prefork", "--pool-start-method=fork",
        f"--queues={queue_name(settings)}", f"--hostname=billing-{os.getpid()}@%h",
        # Billing workers share no state with each other: no start-up sync (mingle) or gossip.
        "--without-mingle", "--without-gossip",
    ]  # fmt: skip
    if args.beat:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        argv += ["--beat", f"--schedule-filename={settings.data_dir / 'celerybeat-schedule'}"]
    code = app.start(argv)  # = app.worker_main(argv), keeping the worker's exit status
    if code:
        raise SystemExit(code)


def cmd_access(args: argparse.Namespace) -> None:
    from access.service import serve_access

    settings = AccessSettings.load(args.config, port=args.port, region=args.region, relay_id=args.relay_id)
    # The relay and the agent carry renters' bytes: uvloop (issue 42). The rest stays on asyncio's loop, whose internals
    # some of it reads (the master's bound port).
    _run_until_signal(lambda stop: serve_access(settings, stop=stop), log_level=settings.log_level, loop=None)


def cmd_dns(args: argparse.Namespace) -> None:
    from access.geodns.server import serve_dns

    settings = DnsSettings.load(args.config, port=args.port, zone=args.zone)
    _run_until_signal(lambda stop: serve_dns(settings, stop=stop), log_level=settings.log_level)


def cmd_agent_run(args: argparse.Namespace) -> None:
    from agent.service import serve_agent

    settings = AgentSettings.load(args.config, data_dir=args.data_dir, gpus=args.gpus, relay_url=args.relay_url)
    _run_until_signal(lambda stop: serve_agent(settings, stop=stop), log_level=settings.log_level, loop=None)


def cmd_agent_enroll(args: argparse.Namespace) -> None:
    from agent.enroll import enroll

    settings = AgentSettings.load(args.config, data_dir=args.data_dir, gpus=args.gpus)
    _setup_logging(settings.log_level)
    identity = asyncio.run(
        enroll(args.master, args.token, settings.data_dir, gpus=settings.gpus, relay_url=args.relay_url, hostname=args.hostname)
    )
    print(f"enrolled as host {identity.host_id}; start the agent with `gpumarket agent run --data-dir {settings.data_dir}`")


def cmd_agent_record_nvml(args: argparse.Namespace) -> None:
    from agent.record import main as record

    _setup_logging("WARNING")
    print(record(args.out, seconds=args.seconds))


def cmd_agent_netguard(args: argparse.Namespace) -> None:
    from agent.runtimes.isolation import prove_rental_network
    from agent.runtimes.netguard import MARKER, EgressPolicy, NetGuardStatus, write_marker

    settings = AgentSettings.load(getattr(args, "config", None))
    _setup_logging("WARNING")
    policy = EgressPolicy.for_host(settings.egress_allow, process_pool=settings.process_subnet_pool)
    network = asyncio.run(prove_rental_network(policy, None))
    if os.geteuid() == 0:
        write_marker(network.guard if network.proven else NetGuardStatus(False, network.why_not))
    print(f"network guard {'on' if network.guard.active else 'off'}: {network.guard.reason}")
    if network.check is not None:
        print(network.check.line)
    if os.geteuid() == 0 and network.proven:
        print(f"recorded in {MARKER} for the agent")
    if not network.proven:
        raise SystemExit(1)


async def _admin_database(settings: MasterSettings) -> Database:
    """The master's database for an admin command: migrated as a master would (``migrate_on_start``), or its schema
    checked. Only the database: an admin command opens no bus, registry or CA, and does not import the master's app."""
    from master.db import open_database, sqlite_url

    if not settings.database_url:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    url = settings.database_url or sqlite_url(settings.data_dir / "gpumarket.db")
    return await open_database(url, migrate=settings.migrate_on_start, who="admin commands with migrate_on_start=false")


def cmd_admin_create_account(args: argparse.Namespace) -> None:
    from master.services.accounts import create_account

    settings = MasterSettings.load(args.config)

    async def main() -> str:
        db = await _admin_database(settings)
        try:
            async with db.session() as session:
                _, key = await create_account(session, args.name, args.role)
            return key
        finally:
            await db.close()

    key = asyncio.run(main())
    print(key)


def cmd_admin_set_account_access(args: argparse.Namespace) -> None:
    """``disable-account`` / ``enable-account``: the change and its ``update_access`` commands are written to the
    database; the running master's resend pass sends them (within ``command_retry_interval`` / 2)."""
    from sqlalchemy import select

    from master.models import Account
    from master.services import accounts
    from shared.clock import SystemClock

    settings = MasterSettings.load(args.config)
    change = accounts.disable_account if args.disable else accounts.enable_account

    async def main() -> int:
        db = await _admin_database(settings)
        try:
            async with db.session() as session:
                account_id = await session.scalar(select(Account.id).where(Account.name == args.name))
                if account_id is None:
                    raise SystemExit(f"no account named {args.name!r}")
                return len(await change(session, account_id, now=SystemClock().now()))
        finally:
            await db.close()

    rentals = asyncio.run(main())
    what = "disabled: its API keys, sessions and SSH keys stop working" if args.disable else "enabled again"
    print(f"account {args.name!r} {what}; {rentals} live rental(s) told")


def cmd_admin_issue_relay_cert(args: argparse.Namespace) -> None:
    from shared.crypto import CertificateAuthority

    settings = MasterSettings.load(args.config)
    ca = CertificateAuthority.load_or_create(settings.data_dir / "ca")
    key_path, cert_path = ca.write_server_certificate(args.out, args.name, basename="relay")
    ca_copy = args.out / "ca.crt"
    ca_copy.write_bytes(ca.cert_pem)
    print(f"GPUMARKET_CERT_FILE={cert_path}\nGPUMARKET_KEY_FILE={key_path}\nGPUMARKET_CA_FILE={ca_copy}")


# ---- parser -------------------------------------------------------------------------


def _service_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, settings: type[ServiceSettings], **kwargs: Any
) -> argparse.ArgumentParser:
    """A command configured by ``settings``: they are listed in its epilog, and it takes --config."""
    parser = sub.add_parser(
        name, epilog=_settings_epilog(settings), formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs
    )
    _add_config(parser)
    return parser


def _add_agent_run_options(parser: argparse.ArgumentParser) -> None:
    _add_config(parser)
    parser.add_argument("--data-dir", type=Path, metavar="DIR", help="overrides GPUMARKET_DATA_DIR")
    parser.add_argument("--gpus", metavar="SPEC", help="'nvml' or 'sim:4xRTX4090' (overrides GPUMARKET_GPUS)")
    parser.add_argument("--relay-url", metavar="URL", help="wss:// URL of a relay (overrides the enrolled one)")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="gpumarket", description="gpumarket: a decentralized GPU compute marketplace.", formatter_class=formatter
    )
    from gpumarket import __version__

    parser.add_argument("--version", action="version", version=f"gpumarket {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up",
        help="run the whole marketplace on this machine (demo)",
        description="Master, one relay and N simulated provider agents in one process, SQLite in the data dir. "
        "One line per step while it starts, then where the console, the API and its reference are and the demo "
        "accounts' API keys. Logs go to DATA_DIR/up.log (--verbose: here too). A port in use is one line naming the "
        "flag that picks another (exit status 2).",
        formatter_class=formatter,
    )
    up.add_argument("--agents", type=int, default=3, metavar="N", help="simulated provider hosts (default 3)")
    up.add_argument("--data-dir", type=Path, default=Path(".gpumarket"), metavar="DIR", help="state folder (default ./.gpumarket)")
    up.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    up.add_argument("--http-port", type=int, default=8080, metavar="P", help="API and console port (default 8080; 0 = any free)")
    up.add_argument("--relay-port", type=int, default=8443, metavar="P", help="relay TLS port (default 8443; 0 = any free)")
    up.add_argument("--dns-port", type=int, default=0, metavar="P", help="geo DNS port, UDP and TCP (default 0 = any free)")
    up.add_argument(
        "--rentals-root", type=Path, default=DEFAULT_RENTALS_ROOT, metavar="DIR",
        help=f"where process rentals' homes live when up runs as root, outside the data dir (default {DEFAULT_RENTALS_ROOT})",
    )
    up.add_argument(
        "--allow-unisolated-workloads", action="store_true",
        help="not root: run process workloads as this user anyway (they could read the data dir's files)",
    )
    up.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    up.add_argument("--verbose", action="store_true", help="show the logs here too (they always go to DATA_DIR/up.log)")
    up.set_defaults(func=cmd_up)

    topology = sub.add_parser(
        "topology", help="run the production topology as separate processes on this machine",
        formatter_class=formatter,
        description="The migration job, two masters, two relays (eu-west and us-east) with the geo DNS on loopback, a "
        "Celery worker with beat and a second worker, and N simulated agents, each its own process, on PostgreSQL and "
        "Redis. With --check it follows one rental end to end through them and stops; otherwise it stays up until "
        "Ctrl-C. Logs go to WORKDIR/logs/.",
        epilog="examples:\n  gpumarket topology --fresh --check  (what `make cluster` runs)\n  gpumarket topology --agents 8",
    )  # fmt: skip
    topology.add_argument("--workdir", type=Path, default=Path(".gpumarket-cluster"), metavar="DIR", help="logs and state (default ./.gpumarket-cluster)")
    topology.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/gpumarket_cluster", metavar="URL", help="PostgreSQL database (default: gpumarket_cluster on the local server)")
    topology.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", metavar="URL", help="Redis (default redis://127.0.0.1:6379/0)")
    topology.add_argument("--bus-prefix", default="gpumarket-cluster:", metavar="P", help="key prefix in Redis (default gpumarket-cluster:)")
    topology.add_argument("--agents", type=positive_int, default=4, metavar="N", help="simulated provider hosts (default 4)")
    topology.add_argument("--fresh", action="store_true", help="start over: drop and create the database, delete the prefix's Redis keys and the workdir's state")
    topology.add_argument("--check", action="store_true", help="rent, watch, get charged and stop one rental through the cluster, then stop")
    topology.add_argument("--log-level", default="WARNING", help="this command's own log level (default WARNING)")
    topology.set_defaults(func=cmd_topology)

    master = _service_parser(
        sub, "master", MasterSettings, help="run a master API process",
        description="A master process: REST API, console, ingestion from the bus, monitors. Needs Redis; PostgreSQL in production.",
    )
    master.add_argument("--http-port", type=int, metavar="P", help="overrides GPUMARKET_HTTP_PORT")
    master.set_defaults(func=cmd_master)

    migrate = _service_parser(
        sub, "migrate", MasterSettings, help="bring the database schema to this version (a deployment's migration job)",
        description="Run the Alembic migrations on GPUMARKET_DATABASE_URL up to this version's newest revision and exit. "
        "Run it once per deployment before the masters start (with migrate_on_start=false on the masters); it is safe "
        "to run again or from several places at once. With --check it changes nothing and waits until another process "
        "has migrated: a master's init container. Exit status 0 when the schema is at the newest revision, 2 otherwise.",
    )  # fmt: skip
    migrate.add_argument("--check", action="store_true", help="change nothing: succeed once the schema is at this version's newest revision")
    migrate.add_argument("--wait", type=float, default=0.0, metavar="S", help="keep retrying this many seconds while the database is unreachable (or, with --check, behind) (default 0)")
    migrate.set_defaults(func=cmd_migrate)

    worker = _service_parser(
        sub, "worker", MasterSettings, help="run a Celery worker for billing's periodic jobs",
        description="A Celery worker running billing's jobs (rating, credit enforcement, payouts, ...) from the billing "
        "queue in Redis (GPUMARKET_REDIS_URL) against the masters' database (GPUMARKET_DATABASE_URL). Run exactly one "
        "with --beat (it also schedules the jobs), as many without as the load needs, and set "
        "billing_in_process=false on the masters. Workers do not migrate the database: run `gpumarket migrate` (or a master) first.",
    )  # fmt: skip
    worker.add_argument("--beat", action="store_true", help="also run the scheduler (exactly one worker in a deployment may)")
    worker.add_argument("--concurrency", type=positive_int, default=2, metavar="N", help="worker processes (default 2)")
    worker.add_argument("--loglevel", metavar="L", help="DEBUG, INFO, WARNING or ERROR (default: GPUMARKET_LOG_LEVEL)")
    worker.set_defaults(func=cmd_worker)

    access = _service_parser(
        sub, "access", AccessSettings, help="run an access relay",
        description="A relay: TLS websocket server for agents, forwarding to the master over the Redis bus.",
    )
    access.add_argument("--port", type=int, metavar="P", help="overrides GPUMARKET_PORT")
    access.add_argument("--region", metavar="R", help="the region this relay serves (overrides GPUMARKET_REGION)")
    access.add_argument("--relay-id", metavar="ID", help="unique relay name (overrides GPUMARKET_RELAY_ID)")
    access.set_defaults(func=cmd_access)

    dns = _service_parser(
        sub, "dns", DnsSettings, help="run the geo DNS server for the relay zone",
        description="Authoritative DNS (UDP and TCP) for the relay zone: answers _gpumarket._tcp.ZONE SRV and ZONE A/AAAA "
        "with the healthy relays nearest to the asker, from the relay registry in Redis.",
    )
    dns.add_argument("--port", type=int, metavar="P", help="overrides GPUMARKET_PORT")
    dns.add_argument("--zone", metavar="ZONE", help="overrides GPUMARKET_ZONE")
    dns.set_defaults(func=cmd_dns)

    agent = sub.add_parser(
        "agent", help="the provider agent (run, enroll)", epilog=_settings_epilog(AgentSettings), formatter_class=formatter,
        description="The provider agent. `gpumarket agent` alone is `gpumarket agent run`.",
    )
    agent_sub = agent.add_subparsers(dest="agent_command", metavar="ACTION")
    _add_agent_run_options(agent)
    agent.set_defaults(func=cmd_agent_run)
    run = agent_sub.add_parser("run", help="run the enrolled agent", epilog=_settings_epilog(AgentSettings), formatter_class=formatter)
    _add_agent_run_options(run)
    run.set_defaults(func=cmd_agent_run)
    enroll = agent_sub.add_parser(
        "enroll", help="enroll this host with a one-time token", formatter_class=formatter,
        description="Create this host's key, send a CSR with the token, store the certificate the master signs.",
    )
    _add_config(enroll)
    enroll.add_argument("--master", required=True, metavar="URL", help="the master's URL, e.g. https://gpumarket.example")
    enroll.add_argument("--token", required=True, help="one-time enrollment token from the console or API")
    enroll.add_argument("--data-dir", type=Path, metavar="DIR", help="overrides GPUMARKET_DATA_DIR")
    enroll.add_argument("--gpus", metavar="SPEC", help="'nvml' or 'sim:…' (recorded with the identity)")
    enroll.add_argument("--relay-url", metavar="URL", help="use this relay instead of the ones the master lists")
    enroll.add_argument("--hostname", help="name to show for this host (default: the system hostname)")
    enroll.set_defaults(func=cmd_agent_enroll)
    record = agent_sub.add_parser(
        "record-nvml", help="record this host's GPU readings for the replay backend", formatter_class=formatter,
        description="Capture identity and a few seconds of live NVML readings to a JSON file (serials redacted). "
        "Play it back with --gpus replay:FILE.",
    )
    record.add_argument("--out", type=Path, required=True, metavar="FILE", help="where to write the recording")
    record.add_argument("--seconds", type=float, default=5.0, metavar="S", help="how long to sample (default 5)")
    record.set_defaults(func=cmd_agent_record_nvml)
    netguard = agent_sub.add_parser(
        "netguard", help="put the rentals' firewall rules in place and self-test them (as root)", formatter_class=formatter,
        description="Install the iptables rules that keep every rental's network (gm+) off this host's own services, "
        "link-local metadata, other rentals and private ranges other than the agent's egress_allow (idempotent), "
        "then prove them from a rental's network namespace. Run as root before a non-root agent starts "
        "(the installer's unit does, ExecStartPre=+): it leaves a marker in /run that the agent reads. "
        "Exits 1 when the rules cannot be installed or the self-test fails, saying why.",
    )
    _add_config(netguard)  # egress_allow and process_subnet_pool come from the agent's settings
    netguard.set_defaults(func=cmd_agent_netguard)

    from gpumarket.research import add_parsers as add_research_parsers

    add_research_parsers(sub)  # simulate, train-placer: the scheduler's experiments on the trace and the simulator

    from gpumarket.renter.clusters import add_parsers as add_cluster_parsers
    from gpumarket.renter.commands import add_parsers as add_renter_parsers
    from gpumarket.renter.credit import add_parsers as add_credit_parsers
    from gpumarket.renter.keys import add_parsers as add_key_parsers
    from gpumarket.renter.ports import add_parsers as add_port_parsers
    from gpumarket.renter.registries import add_parsers as add_registry_parsers
    from gpumarket.renter.services import add_parsers as add_service_parsers
    from gpumarket.renter.sshcmds import add_parsers as add_ssh_parsers
    from gpumarket.renter.sshkeys import add_parsers as add_ssh_key_parsers
    from gpumarket.renter.teams import add_parsers as add_team_parsers
    from gpumarket.renter.volumes import add_parsers as add_volume_parsers

    add_renter_parsers(sub)  # login, offers, rent, rentals, logs, stop, account: the renter's side, over the REST API
    add_ssh_parsers(sub)  # ssh, ssh-config, cp, tunnel: OpenSSH to rentals through the relays
    add_ssh_key_parsers(sub)  # ssh-key add, list, delete: the SSH keys the account's rentals accept
    add_port_parsers(sub)  # open: a rental's web port through its relay
    add_cluster_parsers(sub)  # cluster create, list, show, stop, ssh: clusters over the REST API
    add_credit_parsers(sub)  # credit add: prepaid credit through the payment provider
    add_key_parsers(sub)  # keys create, list, revoke: the account's API keys
    add_team_parsers(sub)  # team list, create, show, invite, accept, role, remove, leave, use: teams and the context
    add_registry_parsers(sub)  # registry login, list, remove: private registries' credentials
    add_service_parsers(sub)  # service create, list, show, scale, delete, token: elastic services over the REST API
    from gpumarket.renter.volumefiles import add_parsers as add_volume_file_parsers

    # volume create, list, show, delete over the REST API; open and copy, its files without a rental
    add_volume_file_parsers(add_volume_parsers(sub))

    admin = sub.add_parser("admin", help="operator tasks against the master's database and CA")
    admin_sub = admin.add_subparsers(dest="admin_command", required=True, metavar="ACTION")
    account = admin_sub.add_parser("create-account", help="create an account and print its API key")
    _add_config(account)
    account.add_argument("--name", required=True)
    account.add_argument("--role", required=True, choices=("renter", "provider", "admin"))
    account.set_defaults(func=cmd_admin_create_account)
    for action, disable, words in (("disable-account", True, "disable an account: its API keys, console sessions and "
                                    "rentals' SSH access stop (open SSH connections are closed within seconds)"),
                                   ("enable-account", False, "enable a disabled account again")):  # fmt: skip
        toggle = admin_sub.add_parser(action, help=words)
        _add_config(toggle)
        toggle.add_argument("--name", required=True)
        toggle.set_defaults(func=cmd_admin_set_account_access, disable=disable)
    relay_cert = admin_sub.add_parser("issue-relay-cert", help="issue a relay's TLS certificate from the master's CA")
    _add_config(relay_cert)
    relay_cert.add_argument("--name", action="append", required=True, help="DNS name or IP of the relay (repeatable)")
    relay_cert.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder for relay.key, relay.crt and ca.crt")
    relay_cert.set_defaults(func=cmd_admin_issue_relay_cert)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except GpumarketError as exc:
        message = " ".join(exc.message.split())  # one line, whatever the message's own layout
        print(f"gpumarket: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
