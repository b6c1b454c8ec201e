"""Per-rental users: a uid of its own for each ``process`` rental, a home only it can read,
and the namespaces it runs in.

``RentalUsers`` hands each rental a uid (and a gid of the same number) from a configured
range, never one that names a real user, that another live rental holds, or that still
runs a process. A claim is a file ``<root>/.claims/<uid>`` holding the rental id, created
with ``O_EXCL`` (so two agents sharing a rentals root never take one uid twice) and kept
until the rental's workload is over and its home removed: a restarted agent finds each
rental's uid there. The home, ``<root>/<rental_id>``, is owned by the uid and mode 0700;
the root itself is 0711 (nobody can list it) and outside the agent's data dir.

``isolated_argv`` builds the command that runs a program as that user: ``nsenter --net`` into
the rental's network namespace (``agent.runtimes.procnet``), then
``unshare --pid --fork --kill-child --mount-proc --ipc`` (its own PID namespace, a /proc
that shows only its processes, SysV IPC of its own), a tiny init as PID 1 (root, the
renter cannot signal it) that mounts a private ``/tmp``, ``/var/tmp`` and ``/dev/shm``,
sets ``umask 077`` and reaps orphans, then ``setpriv`` (the uid and gid, no supplementary
groups, ``no_new_privs``, no capabilities in any set). Every root step runs with a fixed,
clean environment: the renter's environment (which could carry ``LD_PRELOAD``) reaches
only the last step, already running as the rental's user, through an inherited memfd.
When the init's program ends the kernel kills whatever else runs in the namespace.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pwd
import re
import shlex
import shutil
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from agent.runtimes.netguard import DEFAULT_PROCESS_POOL
from agent.runtimes.procnet import RentalNetworks
from shared.errors import BadRequest, ConfigError

log = logging.getLogger(__name__)

DEFAULT_UID_MIN: Final = 2_000_000
DEFAULT_UID_MAX: Final = 2_065_535
UID_FLOOR: Final = 65_536  # below: system and login users, and nobody (65534)
UID_CEILING: Final = 2**31 - 2  # above: (uid_t)-1 and the tools' signed parsing
DEFAULT_RENTALS_ROOT: Final = Path("/var/lib/gpumarket/rentals")
CLAIMS: Final = ".claims"
ENV_FD: Final = 3  # the renter's environment, read by the last step as the rental's user
TRUSTED_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# PID 1 of the rental's namespace, as root: private temporary folders, a private umask,
# then the program as a background job (so this shell stays to reap orphans; ``env
# --default-signal`` undoes the SIGINT/SIGQUIT a non-interactive shell's job ignores),
# and its status as ours. Exit 124: a private mount failed (nothing of the renter ran).
_INIT: Final = (
    'm=$1; e=$2; shift 2; umask 077; '
    'for d in /tmp /var/tmp /dev/shm; do [ -d "$d" ] || continue; '
    '"$m" -t tmpfs -o nosuid,nodev,mode=1777 gpumarket-tmp "$d" || exit 124; done; '
    '"$e" --default-signal=INT,QUIT "$@" & wait $!'
)
# The same init for an SSH session (``session_argv``): its program keeps the session's stdin,
# kept aside in fd 9 (a background job's stdin is /dev/null, before its own redirections).
_SESSION_INIT: Final = "exec 9<&0; " + _INIT.replace('"$@" &', '"$@" <&9 9<&- &')
# The last step, already the rental's user: take the renter's environment from the memfd.
_LAST: Final = f'eval "$(cat <&{ENV_FD})"; exec {ENV_FD}<&-; exec "$@"'


@dataclass(frozen=True, slots=True)
class IsolationTools:
    """Absolute paths of the tools uid isolation runs (found on a trusted PATH, never the renter's)."""

    unshare: str
    setpriv: str
    mount: str
    env: str
    nsenter: str

    @classmethod
    def find(cls) -> IsolationTools | str:
        """The tools, or a line saying which are missing."""
        found = {name: shutil.which(name, path=TRUSTED_PATH) for name in ("unshare", "setpriv", "mount", "env", "nsenter")}
        missing = sorted(name for name, path in found.items() if path is None)
        if missing:
            return f"{' and '.join(missing)} not installed (util-linux and coreutils)"
        return cls(**{name: str(path) for name, path in found.items()})


@dataclass(frozen=True, slots=True)
class RentalUser:
    """The uid, gid and home of one rental."""

    rental_id: str
    uid: int
    gid: int
    home: Path


def check_uid_range(uid_min: int, uid_max: int) -> None:
    if not UID_FLOOR <= uid_min <= uid_max <= UID_CEILING:
        raise ConfigError(
            f"rental uid range {uid_min}-{uid_max} must lie within {UID_FLOOR}-{UID_CEILING} "
            "(clear of system and login users) with the first not above the last"
        )


def unreachable_ancestor(path: Path) -> Path | None:
    """The first folder above ``path`` that other users cannot pass through (no o+x), if any."""
    for folder in reversed(path.parents):
        try:
            mode = folder.stat().st_mode
        except FileNotFoundError:
            return None  # made by us with the right modes
        if not mode & stat.S_IXOTH:
            return folder
    return None


def running_uids() -> dict[int, list[int]]:
    """Every uid (real, effective, saved or filesystem) that some live process has, with its pids."""
    uids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                text = status.read()
        except OSError:
            continue
        state = uid_line = ""
        for line in text.splitlines():
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("Uid:"):
                uid_line = line
        if uid_line and state not in ("Z", "X"):
            for uid in {int(u) for u in uid_line.split()[1:]}:
                uids.setdefault(uid, []).append(int(entry.name))
    return uids


def kill_uid(user: RentalUser, tools: IsolationTools, *, timeout: float) -> None:
    """SIGKILL every process of the rental's uid at once (``kill(-1)`` as that uid: no fork slips by).

    Blocking (up to ``timeout``); raises ``OSError`` when the kill could not be run.
    """
    command = [tools.setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--", "/bin/sh", "-c", "kill -9 -1"]
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(command, env={"PATH": TRUSTED_PATH}, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)


def _in_netns(tools: IsolationTools, netns: Path | None) -> list[str]:
    # The rental's network namespace (agent.runtimes.procnet) is entered first, as root, by path.
    return [] if netns is None else [tools.nsenter, f"--net={netns}", "--"]


def isolated_argv(user: RentalUser, tools: IsolationTools, program: str, args: Sequence[str], *, netns: Path | None = None) -> list[str]:
    """The command that runs ``program`` as the rental's user in namespaces of its own (see the module),
    in the network namespace at ``netns`` when given."""
    return [
        *_in_netns(tools, netns),
        tools.unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--",
        "/bin/sh", "-c", _INIT, "gpumarket-init", tools.mount, tools.env,
        tools.setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--no-new-privs",
        "--inh-caps=-all", "--bounding-set=-all", "--",
        "/bin/sh", "-c", _LAST, "gpumarket-env", program, *args,
    ]  # fmt: skip


def session_argv(
    user: RentalUser, tools: IsolationTools, argv: Sequence[str], env: Mapping[str, str], *, netns: Path | None = None
) -> list[str]:
    """The command that runs ``argv`` as the rental's user like ``isolated_argv``, for an SSH session: it keeps
    stdin (a terminal or a pipe) and gets exactly ``env`` — variables the agent chose, handed to ``env -i``
    as arguments by the last step, already the rental's user; the root steps' environment stays the caller's."""
    return [
        *_in_netns(tools, netns),
        tools.unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--",
        "/bin/sh", "-c", _SESSION_INIT, "gpumarket-init", tools.mount, tools.env,
        tools.setpriv, f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--no-new-privs",
        "--inh-caps=-all", "--bounding-set=-all", "--",
        tools.env, "-i", *(f"{name}={value}" for name, value in env.items() if _NAME_RE.fullmatch(name)), *argv,
    ]  # fmt: skip


def environment_fd(env: Mapping[str, str]) -> int:
    """A memfd holding ``env`` as shell ``export`` lines, at offset 0, for ``ENV_FD``; the caller closes it."""
    lines = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env.items() if _NAME_RE.fullmatch(name))
    fd = os.memfd_create("gpumarket-env", os.MFD_CLOEXEC)
    try:
        os.write(fd, lines.encode())
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def executable_by(path: Path, uid: int, gid: int) -> bool:
    """Whether the user ``uid``/``gid`` (no supplementary groups) can reach and execute ``path``."""

    def allows(st: os.stat_result, bit: int) -> bool:
        if st.st_uid == uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid == gid:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)

    try:
        target = path.resolve(strict=True)
        for folder in reversed(target.parents):
            if not allows(folder.stat(), stat.S_IXOTH):
                return False
        st = target.stat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and allows(st, stat.S_IXOTH)


def resolve_program_for(name: str, *, path: str, home: Path, user: RentalUser) -> str:
    """Where ``name`` is, as the rental's user would find it on ``path`` (or in its ``home``)."""
    if "/" in name:
        candidate = Path(name) if os.path.isabs(name) else home / name
        if executable_by(candidate, user.uid, user.gid):
            return str(candidate)
        raise BadRequest(f"cannot start {name!r}: no file at {candidate} that the rental's user may execute", code="program_not_executable")
    for folder in path.split(os.pathsep):
        if folder and os.path.isabs(folder) and executable_by(Path(folder) / name, user.uid, user.gid):
            return str(Path(folder) / name)
    raise BadRequest(f"cannot start {name!r}: not found on PATH {path} (as the rental's user)", code="program_not_executable")


class RentalUsers:
    """Hands out rental uids from ``uid_min``..``uid_max`` and keeps their homes under ``root``;
    ``tools`` are what runs a program as one of them (``isolated_argv``).

    Call ``prepare()`` once (creates the root 0711 and its claims folder 0700, owned by the
    agent); ``claim`` and ``release`` never wait on anything but the local filesystem.
    """

    def __init__(
        self,
        root: Path,
        tools: IsolationTools,
        *,
        uid_min: int = DEFAULT_UID_MIN,
        uid_max: int = DEFAULT_UID_MAX,
        process_pool: str = DEFAULT_PROCESS_POOL,
    ) -> None:
        check_uid_range(uid_min, uid_max)
        if uid_max == uid_min:
            raise ConfigError(f"rental uid range {uid_min}-{uid_max} needs two uids at least: its last is the agent's probe's")
        # Each rental's network namespace is named by its uid (raises ConfigError without iproute2).
        self.networks = RentalNetworks(uid_min=uid_min, uid_max=uid_max, pool=process_pool)
        if not root.is_absolute():
            raise ConfigError(f"the rentals root {root} must be an absolute path")
        self.root = root
        self.tools = tools
        self.claims = root / CLAIMS
        self.uid_min = uid_min
        self.uid_max = uid_max

    def prepare(self) -> None:
        """Create the root (0711) and claims (0700); raises ``ConfigError`` if rentals could not reach their homes."""
        blocked = unreachable_ancestor(self.root)
        if blocked is not None:
            raise ConfigError(
                f"rentals root {self.root} is not reachable by rental users: {blocked} is mode "
                f"{stat.S_IMODE(blocked.stat().st_mode):o} (needs o+x); set rentals_root to a folder such as {DEFAULT_RENTALS_ROOT}"
            )
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.claims.mkdir(mode=0o700, exist_ok=True)
        for folder, mode in ((self.root, 0o711), (self.claims, 0o700)):
            st = folder.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise ConfigError(f"{folder} must be a folder owned by uid {os.geteuid()}")
            os.chmod(folder, mode)

    def claimed(self) -> dict[int, str]:
        """uid → rental id of every claim."""
        found: dict[int, str] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.claims):
                if entry.name.isdigit():
                    with contextlib.suppress(OSError):
                        found[int(entry.name)] = Path(entry.path).read_text().strip()
        return found

    def lookup(self, rental_id: str) -> RentalUser | None:
        """The rental's user, if it holds a claim."""
        for uid, owner in self.claimed().items():
            if owner == rental_id:
                return RentalUser(rental_id, uid, uid, self.root / rental_id)
        return None

    def claim(self, rental_id: str) -> RentalUser:
        """The rental's user (its existing claim, or a new uid) with its home made; raises
        ``BadRequest`` (``no_rental_uid``) when every uid of the range is taken."""
        existing = self.lookup(rental_id)
        user = existing or self._new_claim(rental_id)
        try:
            self._make_home(user)
        except OSError as exc:
            if existing is None:
                with contextlib.suppress(OSError):
                    os.unlink(self.claims / str(user.uid))
            raise BadRequest(f"cannot make the rental's home {user.home}: {exc.strerror or exc}", code="workload_start_failed") from None
        return user

    def _new_claim(self, rental_id: str) -> RentalUser:
        count = self.uid_max - self.uid_min  # the last uid is the agent's probe's (procnet.RentalNetworks.probe)
        # Where to start looking follows from the rental id: spread, and the same on every agent.
        start = int.from_bytes(hashlib.sha256(rental_id.encode()).digest()[:8], "big") % count
        busy = set(self.claimed()) | set(running_uids())
        for step in range(count):
            uid = self.uid_min + (start + step) % count
            if uid in busy or _names_a_user(uid):
                continue
            try:
                fd = os.open(self.claims / str(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                continue  # another agent sharing this root took it meanwhile
            except OSError as exc:
                raise BadRequest(f"cannot record a rental uid in {self.claims}: {exc.strerror or exc}", code="workload_start_failed") from None
            try:
                os.write(fd, f"{rental_id}\n".encode())
            finally:
                os.close(fd)
            return RentalUser(rental_id, uid, uid, self.root / rental_id)
        raise BadRequest(
            f"every rental uid of {self.uid_min}-{self.uid_max - 1} is in use on this host; stop a rental or widen the range",
            code="no_rental_uid",
        )

    def _make_home(self, user: RentalUser) -> None:
        home = user.home
        try:
            os.mkdir(home, 0o700)
        except FileExistsError:
            st = home.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (user.uid, os.geteuid()):
                # Someone else's leftovers (or a link): never hand them to this rental.
                _remove_tree(home)
                os.mkdir(home, 0o700)
        os.chown(home, user.uid, user.gid, follow_symlinks=False)
        os.chmod(home, 0o700, follow_symlinks=False)

    def release(self, user: RentalUser) -> bool:
        """Remove the rental's home and give its uid back — only once no process of the uid runs
        (else keep both and return ``False``). Blocking: the home may be large."""
        if user.uid in running_uids():
            log.warning("rental %s: processes of uid %d remain; its uid and home are kept", user.rental_id, user.uid)
            return False
        _remove_tree(user.home)
        claim = self.claims / str(user.uid)
        with contextlib.suppress(FileNotFoundError):
            if claim.read_text().strip() == user.rental_id:  # never another rental's claim of the same uid
                claim.unlink()
        return True


def _names_a_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _remove_tree(path: Path) -> None:
    # shutil.rmtree works through file descriptors here, so a link the renter planted is removed, not followed.
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - Linux always has the fd functions
        raise OSError(f"refusing to remove {path}: this platform's rmtree follows links")
    with contextlib.suppress(FileNotFoundError):
        if path.is_symlink() or not path.is_dir():
            path.unlink()
            return
        shutil.rmtree(path)
