"""Shared fixtures: real PostgreSQL (a database per test, as fresh as a new one), real Redis, a master on either database.

The servers are the machine's own (PostgreSQL at 127.0.0.1:5432, Redis at 6379), or
the ones named by ``GPUMARKET_TEST_POSTGRES_URL`` / ``GPUMARKET_REDIS_URL``. A server
that cannot be reached fails the test with a message saying how to start it; it is
never a skip.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Generic, TypeVar

import asyncpg
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from playwright.async_api import Browser, Playwright, async_playwright
from pydantic import SecretStr

from gpumarket.mailsink import MailSink
from master.app import close_master, open_master
from master.context import Master
from master.db import migrate_or_wait
from shared.bus import InProcessBus
from shared.crypto import CertificateAuthority
from tests import pgpool, sqlcache
from tests.apiclient import Api, serve_api
from tests.browserns import BrowserNamespace, browser_namespace
from tests.factories import master_settings

T = TypeVar("T")

# The workload tests' fixtures (exits, backend, gpus, cgroups), shared by name.
pytest_plugins = ["tests.workloadfixtures", "tests.runreport"]

# Every engine this process opens (a master's per test) shares one statement cache (tests/sqlcache.py).
sqlcache.share_statement_caches()

# A bench that a test runs records its figures in a scratch file, never in the committed bench/results.json.
os.environ.setdefault("GPUMARKET_BENCH_RESULTS", os.path.join(tempfile.gettempdir(), f"gpumarket-test-bench-{os.getpid()}.json"))

PG_ADMIN_URL = os.environ.get("GPUMARKET_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("GPUMARKET_REDIS_URL", "redis://127.0.0.1:6379/0")


ONE_WORKER_SCOPES: tuple[tuple[str, ...], ...] = (
    ("tests/test_console_browser.py", "tests/test_console_charts.py", "tests/test_console_clusters.py",
     "tests/test_console_credit.py", "tests/test_console_join.py", "tests/test_console_layout.py",
     "tests/test_console_services.py", "tests/test_console_teams.py", "tests/test_console_volumes.py"),
    ("tests/faults/",), ("tests/test_install_agent.py::TestInstaller",), ("tests/test_tunnels.py",),
    ("tests/test_gateway.py",), ("tests/test_simulate.py",), ("tests/test_readme_walkthrough.py",),
    ("tests/test_clusternet.py::TestClusterNetwork",), ("tests/test_volume_files.py",),
)  # fmt: skip
"""Tests that share an expensive fixture (the fault cluster, a module's ``gpumarket up`` or browser): under
pytest-xdist each of these scopes (the tests under any of its node id prefixes, named by the first) runs whole on one
worker, so that the fixture is set up once; the console's browser modules but the power policy's (which needs a
marketplace with no rental in its history) share one `gpumarket up` (``_console_market``). Longest first (on 4
workers, 2026-11-26: the console's about 180 s, the fault scenarios about 170 s, the installer's about 110–150 s, the
tunnels' about 25 s, the gateway's about 15 s, the last three a few seconds to 20 s): the scheduler starts them in
this order."""

ONE_WORKER_STAGGER = 40
"""Single tests handed out between the starts of two of ``ONE_WORKER_SCOPES`` after the first two."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give each schemathesis operation (``tests/test_api_schemathesis.py``) a node id of its own. schemathesis names
    its items ``test…[GET /api/v1/…]`` after pytest 9 fixed their ids from the bare function name: the 60 operations
    shared one id, so under pytest-xdist only one of them ran (found 2026-11-26: 1 test in 12 s instead of 60 in 177 s).

    A test that uses the worker's Chromium (the ``browser`` fixture below) runs on the session's event loop, the one
    Playwright's objects belong to: the other tests keep a loop of their own each."""
    for item in items:
        if type(item).__name__ == "SchemathesisFunction" and item.parent is not None and not item.nodeid.endswith("]"):
            item._id = item.parent.id.child(item.name)  # what pytest computes from the name
        if "_chromium" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.asyncio(loop_scope="session"), append=False)  # before asyncio_mode's own mark


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under pytest-xdist, before any worker starts: rewrite the test modules' asserts once for all of them
    (``tests/rewritecache.py``), and start the Docker engine (``tests/dockerengine.py``) where this suite may start
    one: once, rather than by each worker that finds none answering at the same moment (each would start a dockerd
    of its own). A failure to start it is the ``docker_image`` fixture's to report, in the tests that need the
    engine."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    from tests import dockerengine, rewritecache

    rewritecache.rewrite_test_modules(config, Path(__file__).parent)
    with contextlib.suppress(RuntimeError, OSError):
        dockerengine.ensure_engine()


class WhileUsed(Generic[T]):
    """A resource for the modules next to each other that use it: opened by the first test that asks (``get``), closed
    after the last of those modules (``pytest_runtest_teardown``), opened again if a later module asks. Modules that
    share it and run one after the other (one scope of ``ONE_WORKER_SCOPES``) share one, and it does not idle through
    the rest of the session."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._value: T | None = None

    def get(self, open_: Callable[[], AbstractContextManager[T]]) -> T:
        if self._value is None:
            self._value = self._stack.enter_context(open_())
        return self._value

    def close(self) -> None:
        self._value = None
        self._stack.close()


_CONSOLE_MARKET = pytest.StashKey[WhileUsed[Any]]()


@pytest.fixture(scope="session")
def _console_market(request: pytest.FixtureRequest) -> Iterator[WhileUsed[Any]]:
    """The `gpumarket up` of ``tests/test_console_browser.py``'s ``market`` fixture, which the console's charts, clusters,
    credit, layout and services modules use too: one for all when they run one after the other, stopped after the last
    of them."""
    shared: WhileUsed[Any] = WhileUsed()
    request.config.stash[_CONSOLE_MARKET] = shared
    try:
        yield shared
    finally:
        shared.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of a module: close ``_console_market``'s `gpumarket up` unless the next test uses it (as
    a module fixture that uses it caches it till the module's end). A failure to stop cleanly fails this test's
    teardown, as a module fixture's would."""
    try:
        return (yield)
    finally:
        shared = item.config.stash.get(_CONSOLE_MARKET, None)
        if shared is not None and (
            nextitem is None
            or (nextitem.getparent(pytest.Module) is not item.getparent(pytest.Module)
                and "_console_market" not in getattr(nextitem, "fixturenames", ()))
        ):  # fmt: skip
            shared.close()


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N`` (``--dist load`` or ``loadgroup``): every test on its own, but each of ``ONE_WORKER_SCOPES`` as one
    unit of work. pytest-xdist's own ``xdist_group`` marks do not take under pytest 9 (it renames ``item._nodeid``,
    which pytest 9 no longer reads)."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    # The single tests in the order collected; the shared-fixture scopes longest first and at the start, so that none
    # of those long chains on one worker is what the run waits for at its end (the tunnels' module, collected late,
    # used to start when the others were done). The first two start at once, the others ONE_WORKER_STAGGER tests
    # apart, so that their processes (`gpumarket up`, Chromium, an installer) do not all start in the same seconds.
    config.option.loadscopereorder = False

    class OneWorkerScopes(LoadScopeScheduling):  # type: ignore[misc]
        _order: list[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            return next((scope[0] for scope in ONE_WORKER_SCOPES if nodeid.startswith(scope)), nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if self._order is None:  # the whole queue is known at the first assignment
                names = [scope[0] for scope in ONE_WORKER_SCOPES]
                shared = [name for name in names if name in self.workqueue]
                single = [scope for scope in self.workqueue if scope not in names]
                self._order = shared[:2]
                for scope in shared[2:]:
                    self._order += [*single[:ONE_WORKER_STAGGER], scope]
                    del single[:ONE_WORKER_STAGGER]
                self._order += single
            while self._order and self._order[0] not in self.workqueue:
                self._order.pop(0)
            if self._order:
                self.workqueue.move_to_end(self._order.pop(0), last=False)
            super()._assign_work_unit(node)

    return OneWorkerScopes(config, log)


async def _admin() -> asyncpg.Connection:
    try:
        return await asyncpg.connect(PG_ADMIN_URL, timeout=10)
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {PG_ADMIN_URL} ({exc}); start it with "
            "`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` or set GPUMARKET_TEST_POSTGRES_URL"
        )


@pytest.fixture
async def postgres_url() -> AsyncIterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards (what the migration tests start from)."""
    name = pgpool.new_name()
    admin = await _admin()
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield pgpool.database_url(PG_ADMIN_URL, name)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.fixture(scope="session")
def _postgres_template() -> Iterator[str]:
    """A database migrated to head once per session (per xdist worker), opened again only to record what it holds
    (``_postgres_pool``): the tests' migrated databases are copies of it (``CREATE DATABASE … TEMPLATE``, a tenth of
    migrating one)."""

    async def create() -> str:
        name = f"gm_template_{secrets.token_hex(6)}"
        admin = await _admin()
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        await migrate_or_wait(pgpool.database_url(PG_ADMIN_URL, name), check_only=False, wait_s=0)
        return name

    async def drop(name: str) -> None:
        admin = await _admin()
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    name = asyncio.run(create())
    try:
        yield name
    finally:
        asyncio.run(drop(name))


@pytest.fixture(scope="session")
def _postgres_pool(_postgres_template: str) -> Iterator[pgpool.PostgresPool]:
    """The session's (xdist worker's) copies of the template, reset between tests (``tests/pgpool.py``) and dropped at
    its end."""

    async def record() -> pgpool.TemplateState:
        connection = await asyncpg.connect(pgpool.database_url(PG_ADMIN_URL, _postgres_template), timeout=10)
        try:
            return await pgpool.record(connection)
        finally:
            await connection.close()

    pool = pgpool.PostgresPool(PG_ADMIN_URL, _admin, _postgres_template, asyncio.run(record()))
    try:
        yield pool
    finally:
        asyncio.run(pool.close())


@pytest.fixture
async def migrated_postgres_url(_postgres_pool: pgpool.PostgresPool) -> AsyncIterator[str]:
    """A PostgreSQL database with the schema at head and only the rows the migrations seed, as a fresh copy of the
    template would be (ids included), under a name of its own: one of the worker's pool, reset and put back afterwards."""
    url = await _postgres_pool.take()
    try:
        yield url
    finally:
        await _postgres_pool.put_back(url)


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head once per session (per xdist worker); tests get copies."""
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    asyncio.run(migrate_or_wait(f"sqlite:///{path}", check_only=False, wait_s=0))
    assert not path.with_name(path.name + "-wal").exists(), "the template's write-ahead log was not checkpointed"
    return path


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    """The Redis server's URL, checked to answer."""
    client = aioredis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        await client.ping()
    except Exception as exc:
        pytest.fail(
            f"Redis is not reachable at {REDIS_URL} ({exc}); start it with `redis-server --daemonize yes` or set GPUMARKET_REDIS_URL"
        )
    finally:
        await client.aclose()
    yield REDIS_URL


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    """The master's CA, fresh in the test's tmp dir."""
    return CertificateAuthority.load_or_create(tmp_path / "ca")


@pytest.fixture
def other_ca(tmp_path: Path) -> CertificateAuthority:
    """A CA that is not ours: what it signs must be refused."""
    return CertificateAuthority.load_or_create(tmp_path / "other-ca", common_name="not gpumarket")


@pytest.fixture
def bus_prefix() -> str:
    return f"gmtest:{secrets.token_hex(6)}:"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each persistence test runs on SQLite and on PostgreSQL: a database of its own with the schema at head
    and only the seeded rows (a copy of the session's migrated template, or on PostgreSQL one reset to be like a copy;
    ``postgres_url`` is an empty one)."""
    if request.param == "sqlite":
        path = tmp_path / "test.db"
        shutil.copyfile(request.getfixturevalue("_sqlite_template"), path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("migrated_postgres_url")
    return url


@pytest.fixture
async def master(database_url: str, tmp_path: Path) -> AsyncIterator[Master]:
    """A master context on the parametrized database and an in-process bus (no HTTP, no loops)."""
    m = await open_master(master_settings(tmp_path, database_url=database_url), bus=InProcessBus())
    try:
        yield m
    finally:
        await close_master(m)


@pytest.fixture
async def api(master: Master) -> AsyncIterator[Api]:
    async with serve_api(master) as client:
        yield client

@pytest.fixture
async def sink(api: Api) -> AsyncIterator[MailSink]:
    """A real SMTP server on loopback (aiosmtpd) that the ``api`` fixture's master mails through; its links point at
    http://console.test."""
    mailbox = await MailSink().start()
    api.master.settings.smtp_url = SecretStr(mailbox.url)
    api.master.settings.public_url = "http://console.test"
    try:
        yield mailbox
    finally:
        await mailbox.close()



def unmount_under(root: str) -> None:
    """Unmount (lazily) every filesystem mounted below ``root``: rentals' loop-mounted disks (``mount -o loop``
    detaches the loop device once the filesystem lets go)."""
    with open("/proc/self/mounts") as mounts:
        mounted = [line.split()[1] for line in mounts if line.split()[1].startswith(root)]
    for point in sorted(mounted, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


@pytest.fixture(autouse=True)
def _rental_disks_unmounted(request: pytest.FixtureRequest) -> Iterator[None]:
    """A root agent mounts each rental's size-capped disk under its work dir until the rental is forgotten
    (``agent.runtimes.diskquota``); what a test's ``tmp_path`` still holds mounted is unmounted after it."""
    if "tmp_path" not in request.fixturenames or os.geteuid() != 0:
        yield
        return
    root = str(request.getfixturevalue("tmp_path")) + "/"
    yield
    unmount_under(root)


@pytest.fixture(scope="session", autouse=True)
def _rental_disks_unmounted_at_the_end(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The same for what module-scoped fixtures left (a module's ``gpumarket up`` keeps its rentals' disks mounted
    for its containers, as the demo does across a restart): unmounted when this worker's session ends, so that no
    loop device outlives the run (CI runs on one machine again and again) and pytest can remove its old folders."""
    yield
    if os.geteuid() == 0:
        unmount_under(str(tmp_path_factory.getbasetemp()) + "/")


@pytest.fixture(scope="session")
def browser_netns() -> Iterator[BrowserNamespace]:
    """Where this worker's Chromium runs (``tests/browserns.py``): a network namespace of its own, whose addresses the
    suite's containers, veths and WireGuard devices never change, with a proxy to the host's loopback."""
    with browser_namespace() as namespace:
        yield namespace


class SharedChromium:
    """One Chromium for the tests of a worker, launched at the first that asks (again if it went away: a crash in
    one test is not every later test's failure)."""

    def __init__(self, playwright: Playwright, namespace: BrowserNamespace) -> None:
        self._playwright = playwright
        self._namespace = namespace
        self._browser: Browser | None = None

    async def browser(self) -> Browser:
        if self._browser is None or not self._browser.is_connected():
            self._browser = await self._playwright.chromium.launch(
                executable_path=str(self._namespace.executable), args=self._namespace.args)  # fmt: skip
        return self._browser

    async def close(self) -> None:
        if self._browser is not None and self._browser.is_connected():
            await self._browser.close()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def _chromium(browser_netns: BrowserNamespace) -> AsyncIterator[SharedChromium]:
    """Playwright's driver and Debian's Chromium, headless, in this worker's network namespace for browsers
    (``tests/browserns.py``), once per worker rather than per test (a launch costs ~1.4 s of CPU). On the session's
    event loop: ``pytest_collection_modifyitems`` puts the tests that use it there."""
    async with async_playwright() as playwright:
        shared = SharedChromium(playwright, browser_netns)
        try:
            yield shared
        finally:
            await shared.close()


@pytest_asyncio.fixture(loop_scope="session")
async def browser(_chromium: SharedChromium) -> AsyncIterator[Browser]:
    """The worker's Chromium; a missing browser fails the test (it is part of `make test`). A test opens its own
    contexts (``browser.new_context``: cookies, storage and permissions of their own, as a fresh browser's), and
    every context it leaves open is closed after it. Its other async fixtures must be on the session's loop too."""
    browser = await _chromium.browser()
    assert not browser.contexts, "a context of an earlier test is still open"
    try:
        yield browser
    finally:
        for context in list(browser.contexts):
            await context.close()


@pytest.fixture(scope="session")
def docker_image() -> str:
    """A Docker engine that answers (``dockerd`` started when none does) and the locally built
    busybox test image's name (``tests/dockerengine.py``); fails, never skips, without one."""
    from tests import dockerengine

    # Parallel workers (pytest-xdist) each ask: one at a time, so that one starts dockerd and imports the image.
    with open(Path(tempfile.gettempdir()) / "gpumarket-test-docker.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            dockerengine.ensure_engine()
            return dockerengine.busybox_image()
        except RuntimeError as exc:
            pytest.fail(str(exc))


@pytest.fixture(scope="session")
def torch_image(docker_image: str) -> str:
    """The locally built PyTorch test image's name (``tests/dockerengine.py``: Debian's python3-torch and what it
    needs, with ``tests/allreduce.py``); fails, never skips, when python3-torch is not installed. Built by one worker
    at a time (``dockerengine.package_image``); through ``docker_image``, its tests also wait for the browser tests."""
    from tests import dockerengine

    try:
        return dockerengine.torch_image()
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def openai_image(docker_image: str) -> str:
    """The locally built image of the OpenAI-compatible sample server (``tests/dockerengine.py``: Debian's python3
    with ``examples/openai_cpu_server.py``, serving on port 8000). Built by one worker at a time; through
    ``docker_image``, its tests also wait for the browser tests."""
    from tests import dockerengine

    try:
        return dockerengine.openai_image()
    except RuntimeError as exc:
        pytest.fail(str(exc))
