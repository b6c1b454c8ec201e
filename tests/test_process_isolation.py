"""Uid-isolated process rentals, tried the way a hostile renter would: real processes, as root.

Each rental runs under a uid of its own (``agent.runtimes.users``) in its own PID, mount and
IPC namespaces. The hostile workload hunts for the agent's key, identity, registry and
spool, another rental's home, log, environment and processes, and the demo's CA key and
``credentials.json``; it must find none of it. The host layout lives under a fresh folder
in ``/tmp`` that everyone may pass through, so only the modes the agent sets protect it.
The renter's programs are the system's ``/usr/bin/python3`` and ``/bin/sh``: the test's own
interpreter may sit where no rental user can reach.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.gpu.sim import SimulatedBackend
from agent.runtimes.cgroups import CgroupLimiter, cgroup_members
from agent.runtimes.isolation import (
    HostIsolation,
    RentalNetworkFacts,
    check_workload_allowed,
    host_isolation,
    isolation_facts,
    isolation_summary,
    process_isolation,
)
from agent.runtimes.manager import WorkloadManager
from agent.runtimes.netguard import EgressPolicy, NetGuardStatus
from agent.runtimes.process import ProcessRuntime
from agent.runtimes.procnet import NetworkCheck
from agent.runtimes.registry import REGISTRY_NAME
from agent.runtimes.users import IsolationTools, RentalUser, RentalUsers, kill_uid, running_uids
from agent.spool import SqliteSpool
from agent.state import AgentState, Identity, atomic_write, make_private
from shared.crypto import CertificateAuthority, generate_private_key, write_private_key
from shared.errors import BadRequest, ConfigError
from shared.protocol import HoldWorkload, IsolationFacts, ProcessWorkload
from tests.helpers import eventually
from tests.workloadfixtures import Exits

TOOLS = IsolationTools.find()
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or isinstance(TOOLS, str) or SYSTEM_PYTHON is None,
    reason="uid isolation needs root, util-linux (unshare, setpriv) and a system python3",
)
WAIT = 10.0
ENGINE_SOCKETS = (Path("/run/docker.sock"), Path("/var/run/docker.sock"), Path("/run/podman/podman.sock"))

# Hunts for everything named in $HUNT (JSON) and writes what it found to $HOME/report.json.
HUNTER = r"""
import json, os, signal
cfg = json.loads(os.environ["HUNT"])
found = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "groups": os.getgroups(),
         "home": os.environ.get("HOME"), "cwd": os.getcwd(), "read": [], "listed": [], "wrote": [],
         "environ": [], "processes": [], "signalled": []}
for path in cfg["read"]:
    try:
        with open(path, "rb") as f:
            f.read(1)
        found["read"].append(path)
    except OSError:
        pass
for path in cfg["list"]:
    try:
        os.listdir(path)
        found["listed"].append(path)
    except OSError:
        pass
for path in cfg["write"]:
    try:
        with open(os.path.join(path, "planted"), "w") as f:
            f.write("x")
        found["wrote"].append(path)
    except OSError:
        pass
for name in os.listdir("/proc"):
    if not name.isdigit():
        continue
    try:
        status = open(f"/proc/{name}/status").read()
        uid = int(next(l for l in status.splitlines() if l.startswith("Uid:")).split()[1])
        found["processes"].append([int(name), uid])
    except (OSError, StopIteration):
        continue
    try:
        if int(name) != os.getpid() and cfg["marker"].encode() in open(f"/proc/{name}/environ", "rb").read():
            found["environ"].append(int(name))
    except OSError:
        pass
found["connected"] = []
for path in cfg.get("sockets", []):
    import socket
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(path)
        found["connected"].append(path)
    except OSError:
        pass
for pid in cfg["signal"]:
    try:
        os.kill(pid, signal.SIGTERM)
        found["signalled"].append(pid)
    except OSError:
        pass
with open("report.tmp", "w") as f:
    json.dump(found, f)
os.rename("report.tmp", "report.json")
print("REPORT " + json.dumps(found), flush=True)  # the log outlives the home, which goes when the rental ends
try:
    os.kill(-1, signal.SIGKILL)  # everything this uid may signal (never itself)
except OSError:
    pass
"""

# A neighbour with something to steal: a secret in its environment, its home, /tmp and /dev/shm.
VICTIM = (
    'echo "$SECRET" > secret.txt && chmod 644 secret.txt && '
    'echo "$SECRET" > /tmp/victim-secret && chmod 644 /tmp/victim-secret && '
    'echo "$SECRET" > /dev/shm/victim-secret && chmod 644 /dev/shm/victim-secret && '
    'echo "$SECRET" && touch ready && exec sleep 60'
)


class Host:
    """An agent's data dir with its secrets, and a rentals root, under one folder anyone may pass."""

    def __init__(self, base: Path, uid_min: int) -> None:
        assert not isinstance(TOOLS, str)
        self.base = base
        self.state = AgentState(base / "agent")
        self.state.secure()
        write_private_key(self.state.key_file, generate_private_key())
        self.state.save_identity(Identity(host_id="host-1", master_url="https://master.example"))
        spool = SqliteSpool(self.state.dir / "spool.db")
        spool.add(1, "hello", '{"secret": true}')
        spool.close()
        self.users = RentalUsers(base / "rentals", TOOLS, uid_min=uid_min, uid_max=uid_min + 999)
        self.users.prepare()
        self.facts = isolation_facts(process_isolation(euid=0, tools=TOOLS), container_engine=None, allow_unisolated=False)

    @property
    def work_dir(self) -> Path:
        return self.state.work_dir

    def secrets(self) -> list[Path]:
        return [self.state.key_file, self.state.identity_file, self.state.dir / "spool.db", self.work_dir / REGISTRY_NAME]


@contextlib.contextmanager
def host_layout(name: str, uid_base: int) -> Iterator[Host]:
    """A ``Host`` under a fresh ``/tmp/gpumarket-<name>-…`` folder anyone may pass, with a uid range of its own from
    ``uid_base`` (so tests running side by side never share a uid); leaves no process, namespace or folder behind."""
    base = Path(f"/tmp/gpumarket-{name}-{secrets.token_hex(4)}")
    base.mkdir(mode=0o755)
    os.chmod(base, 0o755)
    made = Host(base, uid_base + secrets.randbelow(1000) * 1000)
    try:
        yield made
    finally:
        assert not isinstance(TOOLS, str)
        for uid, rental_id in made.users.claimed().items():  # after a failed test
            kill_uid(RentalUser(rental_id, uid, uid, made.users.root / rental_id), TOOLS, timeout=2)
            made.users.networks.remove(uid)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def host() -> Iterator[Host]:
    with host_layout("isolation", 3_000_000) as made:
        yield made


Managers = Callable[..., WorkloadManager]


@pytest.fixture
async def managers(host: Host, backend: SimulatedBackend, cgroups: CgroupLimiter, exits: Exits) -> AsyncIterator[Managers]:
    """Makes uid-isolating managers over the host's work dir; stops what they still run afterwards."""
    made: list[WorkloadManager] = []

    def make(**overrides: Any) -> WorkloadManager:
        options: dict[str, Any] = {
            "backend": backend, "on_exit": exits, "cgroups": cgroups, "rental_users": host.users, "isolation": host.facts,
            "stop_timeout": 2.0, "kill_timeout": 2.0, "check_interval": 0.02,
        }
        options.update(overrides)
        manager = WorkloadManager(host.work_dir, **options)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        await manager.close(stop_workloads=True)


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def system_py(code: str) -> list[str]:
    assert SYSTEM_PYTHON is not None
    return [SYSTEM_PYTHON, "-c", code]


async def in_home(host: Host, rental_id: str, name: str) -> Path:
    path = host.users.root / rental_id / name

    async def check() -> Path | None:
        return path if path.exists() else None

    return await eventually(check, timeout=WAIT, every=0.01, what=f"{rental_id} to write {name}")


async def hunt(manager: WorkloadManager, host: Host, rental_id: str, gpu: str, *, read: list[Path], listed: list[Path],
               write: list[Path], marker: str, signal_pids: list[int]) -> dict[str, Any]:  # fmt: skip
    """Run the hunter as a rental and return its report."""
    config = {"read": [str(p) for p in read], "list": [str(p) for p in listed], "write": [str(p) for p in write],
              "marker": marker, "signal": signal_pids, "sockets": [str(p) for p in ENGINE_SOCKETS if p.exists()]}  # fmt: skip
    started = await manager.start(rental_id, [gpu], ProcessWorkload(argv=system_py(HUNTER), env={"HUNT": json.dumps(config)}))

    async def reported() -> str | None:
        # From its output log, not its home: the home goes as soon as the hunter ends (a race the test once lost).
        text = manager.read_log(rental_id, offset=0)[0].decode(errors="replace")
        return next((line.removeprefix("REPORT ") for line in text.splitlines() if line.startswith("REPORT ")), None)

    found: dict[str, Any] = json.loads(await eventually(reported, timeout=WAIT, every=0.01, what=f"{rental_id}'s report"))
    found["allocated_uid"] = started["uid"]  # its claim goes as soon as it exits: take the uid from the start
    return found


def uid_of(host: Host, rental_id: str) -> int:
    user = host.users.lookup(rental_id)
    assert user is not None
    return user.uid


class TestRentalUsers:
    """Claims: a uid per rental, recorded, never shared, never one with a live process."""

    def test_two_rentals_get_two_uids_and_private_homes(self, host: Host) -> None:
        """Each rental's home is 0700 and owned by its own uid; the root is 0711."""
        first, second = host.users.claim("r-a"), host.users.claim("r-b")
        assert first.uid != second.uid
        for user in (first, second):
            st = user.home.stat()
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (user.uid, user.uid, 0o700)
            assert host.users.uid_min <= user.uid <= host.users.uid_max
        assert stat.S_IMODE(host.users.root.stat().st_mode) == 0o711

    def test_a_claim_is_found_again_by_a_new_allocator(self, host: Host) -> None:
        """A restarted agent's allocator knows the uid each rental holds."""
        assert not isinstance(TOOLS, str)
        user = host.users.claim("r-a")
        again = RentalUsers(host.users.root, TOOLS, uid_min=host.users.uid_min, uid_max=host.users.uid_max)
        assert again.lookup("r-a") == user
        assert again.claim("r-a").uid == user.uid

    def test_agents_sharing_a_root_never_share_a_uid(self, host: Host) -> None:
        """Two allocators over one rentals root (two agents, or the demo's several) hand out distinct uids."""
        assert not isinstance(TOOLS, str)
        # The last uid of a range is the agent's probe's, never a rental's.
        other = RentalUsers(host.users.root, TOOLS, uid_min=host.users.uid_min, uid_max=host.users.uid_min + 2)
        taken = {other.claim(f"r-{i}").uid for i in range(2)}  # the whole of its range
        assert host.users.uid_min + 2 not in taken
        mine = RentalUsers(host.users.root, TOOLS, uid_min=host.users.uid_min, uid_max=host.users.uid_min + 3)
        assert mine.claim("r-mine").uid not in taken
        with pytest.raises(BadRequest) as caught:
            other.claim("r-late")
        assert caught.value.code == "no_rental_uid"

    def test_a_uid_with_a_live_process_is_skipped(self, host: Host) -> None:
        """A uid some process still runs as is never handed out, even without a claim."""
        assert not isinstance(TOOLS, str)
        first = host.users.claim("r-a")
        host.users.release(first)
        squatter = os.posix_spawn(TOOLS.setpriv, [TOOLS.setpriv, f"--reuid={first.uid}", f"--regid={first.uid}", "--clear-groups",
                                                  "--", "/bin/sleep", "30"], {"PATH": "/usr/bin:/bin"})  # fmt: skip
        try:
            for _ in range(500):  # setpriv switches users a moment after it starts
                if first.uid in running_uids():
                    break
                time.sleep(0.01)
            assert host.users.claim("r-a").uid != first.uid
        finally:
            os.kill(squatter, signal.SIGKILL)
            os.waitpid(squatter, 0)

    def test_release_removes_the_home_and_frees_the_uid(self, host: Host) -> None:
        """After release the home is gone and the claim with it."""
        user = host.users.claim("r-a")
        (user.home / "data").write_text("x")
        assert host.users.release(user)
        assert not user.home.exists()
        assert host.users.lookup("r-a") is None

    def test_release_never_drops_another_rentals_claim(self, host: Host) -> None:
        """A late release of an old rental leaves the claim a newer rental holds on the same uid."""
        old = host.users.claim("r-old")
        assert host.users.release(old)
        (host.users.claims / str(old.uid)).write_text("r-new\n")  # the uid went to another rental meanwhile
        host.users.release(old)
        assert host.users.lookup("r-new") == RentalUser("r-new", old.uid, old.uid, host.users.root / "r-new")

    def test_a_rentals_root_inside_the_data_dir_is_refused(self, host: Host) -> None:
        """Homes inside the agent's state folder would make it passable: refused at start-up."""
        with pytest.raises(ConfigError, match="inside"):
            host_isolation(
                allow_unisolated=False, container_engine=None, rentals_root=host.state.dir / "rentals",
                uid_min=host.users.uid_min, uid_max=host.users.uid_max, private_dirs=[host.state.dir],
            )  # fmt: skip

    def test_a_range_among_real_users_is_refused(self, host: Host) -> None:
        """The range must lie clear of system and login users."""
        assert not isinstance(TOOLS, str)
        with pytest.raises(ConfigError, match="rental uid range"):
            RentalUsers(host.users.root, TOOLS, uid_min=1000, uid_max=2000)

    def test_a_root_rentals_cannot_reach_is_refused(self, host: Host) -> None:
        """A rentals root under a folder others cannot pass (such as /root) would leave homes unreachable."""
        assert not isinstance(TOOLS, str)
        closed = host.base / "closed"
        closed.mkdir(mode=0o700)
        with pytest.raises(ConfigError, match="not reachable by rental users"):
            RentalUsers(closed / "rentals", TOOLS, uid_min=host.users.uid_min, uid_max=host.users.uid_max).prepare()


class TestWhoTheRentalIs:
    """Inside, a rental is its allocated uid with nothing of root's or the agent's."""

    async def test_the_program_runs_as_the_allocated_uid_in_its_home(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """``id`` inside is the rental's uid and gid, no other groups, no capabilities; HOME and the cwd are its home."""
        manager = managers()
        script = 'id -u > who; id -g >> who; id -G >> who; echo "$HOME" >> who; pwd >> who; grep CapEff /proc/self/status >> who; mv who out; exec sleep 30'
        result = await manager.start("r-id", [gpus[0]], ProcessWorkload(argv=sh(script)))
        uid = uid_of(host, "r-id")
        lines = (await in_home(host, "r-id", "out")).read_text().split("\n")
        home = str(host.users.root / "r-id")
        assert lines[:5] == [str(uid), str(uid), str(uid), home, home]
        assert lines[5].split() == ["CapEff:", "0000000000000000"]
        assert uid != 0 and result["uid"] == uid and result["isolation"] == "uid"

    async def test_two_rentals_run_as_two_uids(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """Two live rentals never share a uid."""
        manager = managers()
        for rental, gpu in (("r-1", gpus[0]), ("r-2", gpus[1])):
            await manager.start(rental, [gpu], ProcessWorkload(argv=sh("id -u > u.tmp && mv u.tmp uid; exec sleep 30")))
        first, second = [(await in_home(host, r, "uid")).read_text().strip() for r in ("r-1", "r-2")]
        assert first != second
        assert {int(first), int(second)} == {uid_of(host, "r-1"), uid_of(host, "r-2")}

    async def test_the_environment_reaches_only_the_program(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """The renter's environment (quotes, newlines, LD_PRELOAD) reaches the program; the root steps run with PATH alone."""
        manager = managers()
        tricky = "it's \"quoted\" $(not run)\nsecond line"
        env = {"TRICKY": tricky, "LD_PRELOAD": "/nonexistent/evil.so"}
        result = await manager.start("r-env", [gpus[0]], ProcessWorkload(argv=system_py(
            "import json, os; json.dump(dict(os.environ), open('env.tmp', 'w')); os.rename('env.tmp', 'env.json'); import time; time.sleep(30)"
        ), env=env))  # fmt: skip
        seen = json.loads((await in_home(host, "r-env", "env.json")).read_text())
        assert seen["TRICKY"] == tricky and seen["LD_PRELOAD"] == "/nonexistent/evil.so"
        assert seen["HOME"] == str(host.users.root / "r-env") and seen["GPUMARKET_RENTAL_ID"] == "r-env"
        assert seen["USER"] == seen["LOGNAME"] == f"rental-{result['uid']}"  # getpass.getuser() works without a passwd entry
        shim_env = Path(f"/proc/{result['pid']}/environ").read_bytes().split(b"\0")
        assert [e for e in shim_env if e] == [b"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]

    async def test_a_program_the_rental_cannot_execute_is_refused(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """A program only root can reach (the agent's interpreter under a 0700 folder) fails the start, not the rental."""
        blocked = host.base / "agent" / "tool"
        blocked.write_text("#!/bin/sh\n")
        blocked.chmod(0o755)
        with pytest.raises(BadRequest, match="rental's user") as caught:
            await managers().start("r-x", [gpus[0]], ProcessWorkload(argv=[str(blocked)]))
        assert caught.value.code == "program_not_executable"  # the renter's (master.services.market.failures)
        assert host.users.lookup("r-x") is None  # the claim was given back


class TestHostileRental:
    """A rental hunting for the agent's and its neighbour's secrets finds none of them."""

    async def test_finds_nothing_of_the_agent_or_its_neighbour(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """Key, identity, spool, registry, the neighbour's home, log, /tmp, /dev/shm, environment and processes: all out of reach."""
        manager = managers()
        secret = f"s3cret-{secrets.token_hex(4)}"
        victim = await manager.start("r-victim", [gpus[0]], ProcessWorkload(argv=sh(VICTIM), env={"SECRET": secret}))
        await in_home(host, "r-victim", "ready")
        victim_home, victim_folder = host.users.root / "r-victim", host.work_dir / "r-victim"
        victim_pids = [pid for pid in running_uids().get(uid_of(host, "r-victim"), [])]
        report = await hunt(
            manager, host, "r-hunter", gpus[1],
            read=[*host.secrets(), host.state.cert_file, victim_home / "secret.txt", victim_folder / "output.log",
                  Path("/tmp/victim-secret"), Path("/dev/shm/victim-secret")],
            listed=[host.state.dir, host.work_dir, host.users.root, host.users.claims, victim_home, victim_folder],
            write=[host.state.dir, host.work_dir, host.users.root, victim_home, victim_folder],
            marker=secret, signal_pids=[victim["pid"], *victim_pids],
        )  # fmt: skip
        assert host.state.key_file.exists() and (victim_home / "secret.txt").exists()  # there to be found
        assert report["read"] == [] and report["listed"] == [] and report["wrote"] == []
        assert report["environ"] == [] and report["signalled"] == [] and report["connected"] == []  # nor the engine's socket
        hunter_uid = report["allocated_uid"]
        assert report["uid"] == report["euid"] == hunter_uid != 0
        # Its /proc shows its own namespace: the init (root, PID 1) and its own processes.
        assert {tuple(p) for p in report["processes"] if p[0] == 1} == {(1, 0)}
        assert {uid for pid, uid in report["processes"] if pid != 1} == {hunter_uid}
        assert "r-victim" in manager.running()  # kill(-1, SIGKILL) reached nothing of the neighbour's
        assert manager.read_log("r-victim", offset=0)[0] == f"{secret}\n".encode()

    async def test_the_demo_data_dir_is_out_of_reach(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """In a ``gpumarket up``-style data dir, the CA key, credentials.json and a demo agent's key cannot be read."""
        data_dir = host.base / "demo"
        data_dir.mkdir(mode=0o755)
        os.chmod(data_dir, 0o755)
        CertificateAuthority.load_or_create(data_dir / "ca")
        atomic_write(data_dir / "credentials.json", b'{"renter": {"api_key": "k"}}', mode=0o644)  # as loose as it gets
        write_private_key(data_dir / "agents" / "agent-00" / "key.pem", generate_private_key())
        make_private(data_dir)  # what `gpumarket up` does first
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((data_dir / "credentials.json").stat().st_mode) == 0o600
        targets = [data_dir / "ca" / "ca.key", data_dir / "credentials.json", data_dir / "agents" / "agent-00" / "key.pem"]
        assert all(t.exists() for t in targets)
        report = await hunt(managers(), host, "r-hunter", gpus[0], read=targets, listed=[data_dir, data_dir / "ca"],
                            write=[data_dir], marker="-", signal_pids=[])  # fmt: skip
        assert report["read"] == [] and report["listed"] == [] and report["wrote"] == []

    async def test_the_agent_data_dir_is_private_even_when_traversable(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """With the data dir left passable (0711), the agent's files themselves (0600) still keep a rental out."""
        os.chmod(host.state.dir, 0o711)
        report = await hunt(managers(), host, "r-hunter", gpus[0], read=host.secrets(), listed=[], write=[host.state.dir],
                            marker="-", signal_pids=[])  # fmt: skip
        assert report["read"] == [] and report["wrote"] == []


class TestStopsAndExits:
    """Stopping, exit codes, limits and re-adoption work through the namespace and the uid."""

    async def test_sigterm_stop_reports_the_signal(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """A program that dies of SIGTERM reports -15, as a bare process does; its home and uid are then given back."""
        manager = managers()
        await manager.start("r-t", [gpus[0]], ProcessWorkload(argv=sh("touch ready; exec sleep 30")))
        await in_home(host, "r-t", "ready")
        uid = uid_of(host, "r-t")
        assert await manager.stop("r-t") == {"exit_code": -signal.SIGTERM}
        assert uid not in running_uids()
        assert host.users.lookup("r-t") is None and not (host.users.root / "r-t").exists()

    async def test_a_program_ignoring_sigterm_is_killed(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """SIGKILL follows the grace: -9."""
        manager = managers()
        await manager.start("r-i", [gpus[0]], ProcessWorkload(argv=sh("trap '' TERM; touch ready; while :; do sleep 1; done")))
        await in_home(host, "r-i", "ready")
        assert await manager.stop("r-i", timeout=0.2) == {"exit_code": -signal.SIGKILL}
        assert uid_of_gone(host, "r-i")

    @pytest.mark.parametrize(("script", "expected"), [("exit 3", 3), ("kill -USR1 $$", -signal.SIGUSR1), ("exit 0", 0)])
    async def test_exit_codes_come_through(
        self, managers: Managers, exits: Exits, gpus: list[str], script: str, expected: int
    ) -> None:
        """An exit code, or death by a signal, reaches ``on_exit`` as a bare process's would."""
        await managers().start("r-e", [gpus[0]], ProcessWorkload(argv=sh(script)))
        assert await exits.wait_for("r-e") == expected

    async def test_stop_kills_the_whole_namespace(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """A daemon that left the session and ignores SIGTERM dies with the rental."""
        manager = managers()
        daemon = (
            "import os, signal, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "        open('daemon', 'w').close()\n"
            "        time.sleep(60)\n"
            "    os._exit(0)\n"
            "time.sleep(60)\n"
        )
        await manager.start("r-d", [gpus[0]], ProcessWorkload(argv=system_py(daemon)))
        await in_home(host, "r-d", "daemon")
        uid = uid_of(host, "r-d")
        assert len(running_uids()[uid]) >= 2
        assert await manager.stop("r-d") == {"exit_code": -signal.SIGTERM}
        assert uid not in running_uids()

    async def test_cgroup_limits_hold_every_process_of_the_rental(self, managers: Managers, host: Host, gpus: list[str]) -> None:
        """The rental's processes, inside the namespace, sit in its cgroup with its limits."""
        manager = managers()
        if not manager.cgroup_support.available:
            pytest.skip(f"no cgroups here: {manager.cgroup_support.reason}")
        result = await manager.start("r-c", [gpus[0]], ProcessWorkload(argv=sh("sleep 30 & touch ready; wait"), memory_mib=128))
        await in_home(host, "r-c", "ready")
        assert result["limits"] == "applied"
        dirs = [Path(d) for d in result["cgroups"]]
        assert set(running_uids()[uid_of(host, "r-c")]) <= cgroup_members(dirs)

    async def test_a_restarted_manager_adopts_and_stops_the_rental(
        self, managers: Managers, host: Host, gpus: list[str], backend: SimulatedBackend
    ) -> None:
        """After an agent restart the rental still runs as its uid; the new manager stops it and gives the uid back."""
        assert not isinstance(TOOLS, str)
        first = managers()
        await first.start("r-a", [gpus[0]], ProcessWorkload(argv=sh("touch ready; exec sleep 30")))
        await in_home(host, "r-a", "ready")
        uid = uid_of(host, "r-a")
        await first.close()
        fresh_users = RentalUsers(host.users.root, TOOLS, uid_min=host.users.uid_min, uid_max=host.users.uid_max)
        second = managers(rental_users=fresh_users)
        assert second.running() == ["r-a"] and uid in running_uids()
        assert await second.stop("r-a") == {"exit_code": -signal.SIGTERM}
        assert uid not in running_uids() and fresh_users.lookup("r-a") is None


def uid_of_gone(host: Host, rental_id: str) -> bool:
    return host.users.lookup(rental_id) is None and not (host.users.root / rental_id).exists()


NOT_ROOT = process_isolation(euid=1000, tools=TOOLS)


class TestIsolationPolicy:
    """What a host runs follows from what it can isolate; the rest is refused with a reason."""

    def test_an_agent_that_cannot_switch_users_refuses_process(self) -> None:
        """Not root, no container engine, no opt-out: ``process`` is refused with what to do about it."""
        facts = isolation_facts(NOT_ROOT, container_engine=None, allow_unisolated=False)
        assert facts.kinds == ["hold"] and facts.isolated and facts.process_isolation == "none"
        with pytest.raises(BadRequest) as caught:
            check_workload_allowed("process", facts)
        assert caught.value.code == "workload_not_isolated"
        assert "not root" in str(caught.value) and "allow_unisolated_workloads" in str(caught.value)

    def test_the_opt_out_runs_process_unisolated_and_says_so(self) -> None:
        """With ``allow_unisolated_workloads`` process runs, and the facts say the host is not isolated."""
        facts = isolation_facts(NOT_ROOT, container_engine=None, allow_unisolated=True)
        check_workload_allowed("process", facts)
        assert facts.kinds == ["process", "hold"] and not facts.isolated

    def test_hold_is_always_allowed(self) -> None:
        """Whatever the host lacks, ``hold`` runs."""
        for allow in (False, True):
            check_workload_allowed("hold", isolation_facts(NOT_ROOT, container_engine=None, allow_unisolated=allow))

    def test_a_container_engine_allows_containers_and_not_processes(self) -> None:
        """An engine brings ``container``; a non-root agent still refuses ``process``; the summary says it in one line."""
        facts = isolation_facts(NOT_ROOT, container_engine="docker 24.0.7", allow_unisolated=False)
        check_workload_allowed("container", facts)
        with pytest.raises(BadRequest):
            check_workload_allowed("process", facts)
        line = isolation_summary(facts, who="demo agents")
        assert "\n" not in line
        assert line.startswith("demo agents run container and hold workloads; process workloads are refused: ")

    def test_root_with_the_tools_isolates_by_uid_once_the_network_is_proven(self) -> None:
        """Root with unshare and setpriv: ``process`` runs under uids, and the host is isolated once its guard
        is in place and self-tested — not before, and not when the self-test failed."""
        assert not isinstance(TOOLS, str)
        process = process_isolation(euid=0, tools=TOOLS)
        unknown = isolation_facts(process, container_engine=None, allow_unisolated=False)
        assert unknown.process_isolation == "uid" and "process" in unknown.kinds
        assert not unknown.isolated and "network guard is not yet in place" in unknown.reason
        guard = NetGuardStatus(True, "rules in place", EgressPolicy(allow=("10.20.0.0/16",)))
        proven = isolation_facts(
            process, container_engine=None, allow_unisolated=False, network=RentalNetworkFacts(guard, NetworkCheck(True, "passed"))
        )
        assert proven.isolated and proven.network_guard and proven.egress_allow == ["10.20.0.0/16"] and proven.network_check == "passed"
        failed = isolation_facts(
            process, container_engine=None, allow_unisolated=False, network=RentalNetworkFacts(guard, NetworkCheck(False, "reached 10.0.0.1"))
        )
        assert not failed.isolated and "reached 10.0.0.1" in failed.reason
        off = isolation_facts(process, container_engine=None, allow_unisolated=False, network=RentalNetworkFacts(NetGuardStatus(False, "no iptables")))
        assert not off.isolated and "network guard off: no iptables" in off.reason
        # Nothing runs on a hold-only host: nothing to isolate.
        assert isolation_facts(process_isolation(euid=1000, tools=TOOLS), container_engine=None, allow_unisolated=False).isolated

    def test_this_host_detects_uid_isolation(self, host: Host) -> None:
        """As root here, the start-up probe finds uid isolation working and prepares the rentals root."""
        decided = host_isolation(
            allow_unisolated=False, container_engine=None, rentals_root=host.base / "probed",
            uid_min=host.users.uid_min, uid_max=host.users.uid_max,
        )  # fmt: skip
        assert decided.facts.process_isolation == "uid" and decided.users is not None
        assert stat.S_IMODE((host.base / "probed").stat().st_mode) == 0o711

    async def test_a_manager_without_uid_isolation_refuses_process(
        self, host: Host, backend: SimulatedBackend, gpus: list[str], cgroups: CgroupLimiter
    ) -> None:
        """The manager of an agent that cannot switch users refuses ``process`` and still holds."""
        facts = isolation_facts(NOT_ROOT, container_engine=None, allow_unisolated=False)
        manager = WorkloadManager(host.work_dir, backend, cgroups=cgroups, isolation=facts)
        try:
            with pytest.raises(BadRequest) as caught:
                await manager.start("r-p", [gpus[0]], ProcessWorkload(argv=sh("true")))
            assert caught.value.code == "workload_not_isolated"
            assert (await manager.start("r-h", [gpus[0]], HoldWorkload()))["kind"] == "hold"
        finally:
            await manager.close(stop_workloads=True)

    async def test_the_opt_out_runs_as_the_agents_user(
        self, host: Host, backend: SimulatedBackend, gpus: list[str], cgroups: CgroupLimiter, exits: Exits
    ) -> None:
        """With the opt-out the workload runs as the agent itself, in its folder under the work dir."""
        facts = isolation_facts(NOT_ROOT, container_engine=None, allow_unisolated=True)
        manager = WorkloadManager(host.work_dir, backend, cgroups=cgroups, isolation=facts, on_exit=exits, check_interval=0.02)
        try:
            result = await manager.start("r-u", [gpus[0]], ProcessWorkload(argv=sh("id -u")))
            assert result["isolation"] == "none"
            assert await exits.wait_for("r-u") == 0
            assert manager.read_log("r-u", offset=0)[0] == f"{os.getuid()}\n".encode()
        finally:
            await manager.close(stop_workloads=True)

    def test_facts_that_promise_uids_need_rental_users(self, host: Host, cgroups: CgroupLimiter) -> None:
        """A runtime told "uid" without the users to back it refuses to be built."""
        with pytest.raises(ConfigError):
            ProcessRuntime(host.work_dir, cgroups, isolation=host.facts)

    def test_the_engines_answer_adds_containers_and_keeps_the_hosts_capacity(self) -> None:
        """Once the engine answers, the same decision runs containers too; the host's CPUs and RAM stay in the facts."""
        start = HostIsolation(
            isolation_facts(NOT_ROOT, container_engine=None, allow_unisolated=False, capacity=(8.0, 32768)),
            process=NOT_ROOT, allow_unisolated=False,
        )
        assert start.facts.kinds == ["hold"]
        answered = start.with_container_engine("docker 20.10.24", note="container network guard off: not root")
        assert answered.facts.kinds == ["container", "hold"] and answered.facts.container_engine == "docker 20.10.24"
        assert (answered.facts.max_cpu_cores, answered.facts.max_memory_mib) == (8.0, 32768)
        assert "container network guard off" in answered.facts.reason
        check_workload_allowed("container", answered.facts)
        assert answered.with_container_engine(None).facts.kinds == ["hold"]

    def test_the_hello_carries_the_facts(self) -> None:
        """The facts fit the hello's ``isolation`` field."""
        facts = isolation_facts(NOT_ROOT, container_engine=None, allow_unisolated=True)
        assert IsolationFacts.model_validate(facts.model_dump()) == facts


class TestAgentFiles:
    """What the agent writes is the agent's alone."""

    def test_secure_tightens_the_data_dir(self, tmp_path: Path) -> None:
        """An older agent's 0755 folder and 0644 files become 0700 and 0600."""
        state = AgentState(tmp_path / "agent")
        state.dir.mkdir(mode=0o755)
        os.chmod(state.dir, 0o755)
        loose = state.dir / "identity.json"
        loose.write_text("{}")
        loose.chmod(0o644)
        state.secure()
        assert stat.S_IMODE(state.dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(state.work_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE(loose.stat().st_mode) == 0o600

    def test_files_the_agent_writes_are_0600(self, tmp_path: Path) -> None:
        """Identity, the spool and its WAL are created 0600."""
        state = AgentState(tmp_path / "agent")
        state.secure()
        state.save_identity(Identity(host_id="h", master_url="https://m"))
        spool = SqliteSpool(state.dir / "spool.db")
        spool.add(1, "hello", "{}")
        try:
            for name in ("identity.json", "spool.db", "spool.db-wal"):
                assert stat.S_IMODE((state.dir / name).stat().st_mode) == 0o600, name
        finally:
            spool.close()
