"""The files and options that make OpenSSH trust exactly a rental's pinned host key.

``known_hosts`` (``$XDG_CONFIG_HOME/gpumarket/known_hosts``, 0600) holds one line per rental
alias, ``<alias> <type> <base64> rental=<id>``, replaced (never duplicated) whenever the API
hands out the key again. ``ssh_config`` next to it holds ``gpumarket ssh-config --write``'s
``Host`` entries, for an ``Include`` in ``~/.ssh/config``. Every ssh and scp this CLI runs gets
the same options: the ProxyCommand through ``gpumarket tunnel``, that file as the only known
hosts, ``HostKeyAlias`` and ``StrictHostKeyChecking yes`` (no trust on first use), and AES-GCM
first among the ciphers (``shared.sshwire``: the agent's SSH server encrypts in Python).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from gpumarket.renter.api import UsageError, config_dir
from gpumarket.renter.connect import SshEndpoint
from shared.sshwire import openssh_ciphers

KNOWN_HOSTS = "known_hosts"
SSH_CONFIG = "ssh_config"
SERVER_ALIVE_INTERVAL_S = 30
RENTAL_TAG = "rental="


def known_hosts_path(environ: Mapping[str, str]) -> Path:
    return config_dir(environ) / KNOWN_HOSTS


def ssh_config_path(environ: Mapping[str, str]) -> Path:
    return config_dir(environ) / SSH_CONFIG


def proxy_command(rental_id: str, *, config: Path | None = None) -> str:
    """``gpumarket tunnel RENTAL`` as this very Python runs it (a venv's gpumarket needs no PATH;
    ``gpumarket.renter`` starts faster than the whole CLI), shell-quoted, ssh's ``%`` escaped."""
    argv = [sys.executable, "-m", "gpumarket.renter", "tunnel"]
    if config is not None:
        argv += ["--config", str(config.absolute())]
    argv.append(rental_id)
    return _escape_percent(shlex.join(argv))


def config_value(text: str) -> str:
    """``text`` as one ssh_config (or ``-o``) argument: double-quoted when it has spaces, ``%`` escaped."""
    if any(c in text for c in '"\r\n'):
        raise UsageError(f"{text!r} cannot go into an ssh option; use a path without quotes or newlines")
    text = _escape_percent(text)
    return f'"{text}"' if any(c.isspace() for c in text) else text


def _escape_percent(text: str) -> str:
    return text.replace("%", "%%")


def pinning_options(rental_id: str, endpoint: SshEndpoint, known_hosts: Path, *, config: Path | None = None) -> dict[str, str]:
    """The ssh options (name → value) that reach the rental through the relay and pin its host key."""
    return {
        "ProxyCommand": proxy_command(rental_id, config=config),
        "HostKeyAlias": endpoint.host_alias,
        "UserKnownHostsFile": config_value(str(known_hosts)),
        "GlobalKnownHostsFile": "/dev/null",
        "StrictHostKeyChecking": "yes",
        "UpdateHostKeys": "no",
        "CheckHostIP": "no",
        "ServerAliveInterval": str(SERVER_ALIVE_INTERVAL_S),
        "Ciphers": openssh_ciphers(),  # AES-GCM first: the agent's SSH server encrypts in Python (shared/sshwire.py)
    }


def option_args(options: Mapping[str, str]) -> list[str]:
    """``-o Name=value`` arguments (ssh uses the first value given for an option: these come first)."""
    args: list[str] = []
    for name, value in options.items():
        args += ["-o", f"{name}={value}"]
    return args


def host_entry(rental_id: str, endpoint: SshEndpoint, known_hosts: Path, *, config: Path | None = None) -> str:
    """One ``Host`` block of ``ssh_config``: reachable as its alias and as the rental's id."""
    names = [endpoint.host_alias] + ([rental_id] if rental_id != endpoint.host_alias else [])
    lines = [f"Host {' '.join(names)}", f"    HostName {endpoint.host_alias}", f"    User {endpoint.user}"]
    lines += [f"    {name} {value}" for name, value in pinning_options(rental_id, endpoint, known_hosts, config=config).items()]
    return "\n".join(lines) + "\n"


# ---- known_hosts --------------------------------------------------------------------------------


def known_host_line(rental_id: str, endpoint: SshEndpoint) -> str:
    return f"{endpoint.host_alias} {endpoint.host_key} {RENTAL_TAG}{rental_id}"


def update_known_hosts(
    path: Path, pinned: Mapping[str, str], *, drop: Callable[[str], bool] = lambda rental_id: False
) -> None:  # fmt: skip
    """Set ``pinned`` (alias → known_hosts line) in ``path``: the lines for those aliases are
    replaced, and our lines whose rental ``drop`` says is gone are removed; anything else stays.

    Under an exclusive lock (two ``gpumarket ssh`` at once both keep their line), written
    atomically with mode 0600.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _locked(path.with_name(f".{path.name}.lock")):
        try:
            old = path.read_text().splitlines()
        except FileNotFoundError:
            old = []
        kept = [line for line in old if not _replaced(line, pinned, drop)]
        _write_private(path, "".join(f"{line}\n" for line in [*kept, *pinned.values()]))


def _replaced(line: str, pinned: Mapping[str, str], drop: Callable[[str], bool]) -> bool:
    fields = line.split()
    if not fields or fields[0].startswith("#"):
        return False
    if fields[0] in pinned:
        return True
    tags = [f[len(RENTAL_TAG) :] for f in fields[3:] if f.startswith(RENTAL_TAG)]
    return bool(tags) and drop(tags[0])


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o600)  # whatever the umask
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_ssh_config(path: Path, entries: Sequence[str]) -> None:
    header = "# Written by `gpumarket ssh-config --write`; it is rewritten each time: edit ~/.ssh/config instead.\n"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_private(path, header + "".join(f"\n{entry}" for entry in entries))


def include_line(path: Path) -> str:
    home = str(Path.home())
    shown = "~" + str(path)[len(home) :] if str(path).startswith(home + os.sep) else str(path)
    return f"Include {config_value(shown)}"


def includes(user_config: Path, path: Path) -> bool:
    """Whether ``~/.ssh/config`` already has an ``Include`` naming ``path`` (a plain check, no globbing)."""
    try:
        text = user_config.read_text(errors="replace")
    except OSError:
        return False
    names = {str(path), include_line(path).split(" ", 1)[1].strip('"')}
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if len(words) == 2 and words[0].lower() == "include" and any(n in words[1] for n in names):
            return True
    return False
