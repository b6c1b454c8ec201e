"""``gpumarket ssh | ssh-config | cp | tunnel``: OpenSSH's own client to a rental, through the relay.

``ssh`` and ``cp`` ask the API for the rental's SSH endpoint first (so a stopped rental or an
offline host is one clear line, before ssh runs), pin its host key in gpumarket's
``known_hosts`` and exec the system ``ssh`` / ``scp`` with ``gpumarket tunnel`` as ProxyCommand.
``ssh-config`` writes the same as ``Host`` entries, for plain ``ssh``, ``scp``, ``rsync -e ssh``
and editors' remote SSH. ``tunnel`` (``tunnel.py``) is the ProxyCommand itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from gpumarket.renter.api import ApiError, Client, UsageError
from gpumarket.renter.commands import all_pages, all_rentals, set_command
from gpumarket.renter.connect import NAME_RE, SSH, Ticket, rental_arg, request_ticket
from gpumarket.renter.options import common_options
from gpumarket.renter.sshfiles import (
    host_entry,
    include_line,
    includes,
    known_host_line,
    known_hosts_path,
    option_args,
    pinning_options,
    ssh_config_path,
    update_known_hosts,
    write_ssh_config,
)
from gpumarket.renter.sshkeys import NO_KEY, has_ssh_key, require_ssh_key
from gpumarket.renter.tunnel import port_arg, run_tunnel

# ssh's and scp's options that take a value (OpenSSH 9's getopt strings), to tell their options from the rest.
SSH_OPTIONS_WITH_VALUE = frozenset("BDEFIJLOPQRSWbceilmopw")
SCP_OPTIONS_WITH_VALUE = frozenset("DFJPSXcilo")
# `gpumarket ssh-config` asks for this many rentals' tickets at once.
CONNECT_CONCURRENCY = 8
# What `ssh-config` skips with a note rather than failing on: the rental has no SSH to offer now.
NO_SSH_NOW = ("nothing_to_log_into", "no_ssh_host_key", "host_offline", "rental_not_running", "rental_not_found",
              "volume_not_ready", "volume_opening", "volume_unsupported", "volume_not_found")
INSTALL_SSH = "install OpenSSH's client (apt install openssh-client)"


def err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def find_program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise UsageError(f"`{name}` is not installed (or not on PATH): {INSTALL_SSH}")
    return path


async def ssh_ticket(client: Client, rental_id: str) -> Ticket:
    """A ticket to the rental's SSH server, its host key pinned in gpumarket's known_hosts; refused in one line when
    the account has no SSH key to log in with."""
    ticket = await request_ticket(client, rental_id, SSH)  # first: why there is nothing to log into comes before keys
    await require_ssh_key(client)
    assert ticket.ssh is not None
    update_known_hosts(known_hosts_path(os.environ), {ticket.ssh.host_alias: known_host_line(ticket.rental_id, ticket.ssh)})
    return ticket


def _pinning(args: argparse.Namespace, ticket: Ticket) -> list[str]:
    assert ticket.ssh is not None
    options = pinning_options(ticket.rental_id, ticket.ssh, known_hosts_path(os.environ), config=args.config)
    return option_args(options)


def add_ssh_options(parser: argparse.ArgumentParser, program: str) -> None:
    """The options ``ssh``, ``cluster ssh`` and ``cp`` take alike, before their RENTAL (or SRC): ``-i KEY``,
    ``-o OPTION``, ``-q``, ``-v`` and ``--dry-run``; ``ssh_option_args`` hands the first four to ``program``."""
    parser.add_argument("-i", dest="identity", type=Path, metavar="KEY", help=f"the SSH private key to log in with ({program} -i)")
    parser.add_argument("-o", dest="ssh_options", action="append", default=[], metavar="OPTION",
                        help="an ssh option, e.g. -o IdentitiesOnly=yes (repeatable)")  # fmt: skip
    parser.add_argument("-q", dest="quiet", action="store_true", help=f"{program} -q: no warnings" + (" or progress meter" if program == "scp" else ""))
    parser.add_argument("-v", dest="verbose", action="count", default=0, help=f"{program} -v: debug output (-vv, -vvv: more)")
    parser.add_argument("--dry-run", action="store_true", help=f"ask for the ticket and pin the host key, then print the {program} "
                        "command line instead of running it")  # fmt: skip


def ssh_option_args(args: argparse.Namespace) -> list[str]:
    """The options of ``add_ssh_options`` as ssh's and scp's own arguments."""
    extra = ["-i", str(args.identity)] if args.identity else []
    extra += ["-q"] if args.quiet else []
    extra += ["-" + "v" * args.verbose] if args.verbose else []
    for option in args.ssh_options:
        extra += ["-o", option]
    return extra


def hand_over(args: argparse.Namespace, argv: list[str]) -> None:
    """Exec ``argv`` once the command returns (``run``), or with ``--dry-run`` print it as a shell would read it."""
    if args.dry_run:
        print(shlex.join(argv))
    else:
        args.exec_argv = argv


# ---- ssh ----------------------------------------------------------------------------------------


def split_ssh_args(args: list[str]) -> tuple[list[str], list[str]]:
    """ssh's options, and the remote command after them (or after ``--``), as ssh's getopt sees them."""
    return split_options(args, SSH_OPTIONS_WITH_VALUE, "ssh")


def split_options(args: list[str], with_value: frozenset[str], program: str) -> tuple[list[str], list[str]]:
    """``program``'s options (``with_value``: the letters that take a value), and the words after them (or after
    ``--``), as its getopt sees them."""
    options: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return options, args[i + 1 :]
        if not arg.startswith("-") or arg == "-":
            return options, args[i:]
        options.append(arg)
        for j, letter in enumerate(arg[1:], start=1):
            if letter in with_value:
                if j == len(arg) - 1:  # `-i KEY`, not `-iKEY`
                    if i + 1 >= len(args):
                        raise UsageError(f"{program}'s option -{letter} needs a value; see `man {program}`")
                    i += 1
                    options.append(args[i])
                break
        i += 1
    return options, []


async def cmd_ssh(args: argparse.Namespace, client: Client) -> int:
    ssh = find_program("ssh")
    passed = args.ssh_args[1:] if args.ssh_args[:1] == ["--"] else args.ssh_args
    options, command = split_ssh_args(passed)
    ticket = await ssh_ticket(client, args.rental)
    assert ticket.ssh is not None
    hand_over(args, [ssh, *_pinning(args, ticket), *ssh_option_args(args), *options, "-o", f"User={ticket.ssh.user}",
                     ticket.ssh.host_alias, *command])  # fmt: skip
    return 0


# ---- ssh-config ---------------------------------------------------------------------------------


async def cmd_ssh_config(args: argparse.Namespace, client: Client) -> int:
    running = [r["id"] for r in await all_rentals(client) if r.get("state") == "running"]
    running += await ready_volumes(client)  # their file-only sessions (docs/volumes.md): sftp, scp, rsync by name
    gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def ticket_or_none(rental_id: str) -> Ticket | None:
        async with gate:
            try:
                return await request_ticket(client, rental_id, SSH)
            except ApiError as exc:
                if exc.code not in NO_SSH_NOW:
                    raise
                err(f"# {rental_id}: skipped, {exc.message}")
                return None

    tickets = [t for t in await asyncio.gather(*(ticket_or_none(r) for r in running)) if t is not None and t.ssh]
    known_hosts = known_hosts_path(os.environ)
    pinned = {t.ssh.host_alias: known_host_line(t.rental_id, t.ssh) for t in tickets if t.ssh}
    alive = set(running)
    update_known_hosts(known_hosts, pinned, drop=lambda rental_id: rental_id not in alive)
    entries = [host_entry(t.rental_id, t.ssh, known_hosts, config=args.config) for t in tickets if t.ssh]
    if entries and not await has_ssh_key(client):
        err(f"# {NO_KEY}")
    if not args.write:
        print("\n".join(entries), end="")
        if not entries:
            err("# no running rental serves SSH; `gpumarket rentals` lists yours")
        return 0
    path = ssh_config_path(os.environ)
    write_ssh_config(path, entries)
    print(f"wrote {len(entries)} host{'s' if len(entries) != 1 else ''} to {path}: "
          + (", ".join(t.ssh.host_alias for t in tickets if t.ssh) or "none serves SSH"))  # fmt: skip
    user_config = Path.home() / ".ssh" / "config"
    if not includes(user_config, path):
        print(f"add this line at the top of {user_config} (before any Host or Match line):\n  {include_line(path)}")
    return 0


async def ready_volumes(client: Client) -> list[str]:
    """The ids of the account's ready volumes (none where the master keeps no volumes)."""
    try:
        volumes = await all_pages(client, "/volumes")
    except ApiError as exc:
        if exc.http_status == 404:
            return []
        raise
    return [str(v["id"]) for v in volumes if v.get("state") == "ready" and isinstance(v.get("id"), str)]


# ---- cp -----------------------------------------------------------------------------------------

REMOTE_RE = re.compile(rf"({NAME_RE.pattern}):(.*)", re.DOTALL)


@dataclass(frozen=True)
class Location:
    path: str
    rental: str | None = None

    @classmethod
    def parse(cls, text: str) -> Location:
        """``RENTAL:path`` (relative to the rental's /workspace) or a local path."""
        match = REMOTE_RE.fullmatch(text)
        return cls(match[2], match[1]) if match else cls(text)

    def for_scp(self, alias: str) -> str:
        if self.rental is not None:
            return f"{alias}:{self.path}"
        return self.path if ":" not in self.path.split("/", 1)[0] else f"./{self.path}"


async def cmd_cp(args: argparse.Namespace, client: Client) -> int:
    src, dst = Location.parse(args.src), Location.parse(args.dst)
    rentals = {loc.rental for loc in (src, dst) if loc.rental is not None}
    if not rentals:
        raise UsageError("neither SRC nor DST is RENTAL:path; e.g. `gpumarket cp data.tar r-0123:data/`")
    if len(rentals) > 1:
        raise UsageError("copy between two rentals in two steps, through a local folder")
    passed = args.scp_args[1:] if args.scp_args[:1] == ["--"] else args.scp_args
    scp_options, rest = split_options(passed, SCP_OPTIONS_WITH_VALUE, "scp")
    if rest:
        raise UsageError(f"one SRC and one DST, then only scp's options (after `--`), not {rest[0][:60]!r}")
    scp = find_program("scp")
    ticket = await ssh_ticket(client, rentals.pop())
    assert ticket.ssh is not None
    hand_over(args, [
        scp, "-r", *_pinning(args, ticket), *ssh_option_args(args), *scp_options, "-o", f"User={ticket.ssh.user}",
        src.for_scp(ticket.ssh.host_alias), dst.for_scp(ticket.ssh.host_alias),
    ])  # fmt: skip
    return 0


# ---- parsers ------------------------------------------------------------------------------------

SSH_EPILOG = """\
Options before RENTAL are gpumarket's (-i, -o, -q, -v: handed to ssh, as `gpumarket cp` takes
them; --dry-run). Everything after RENTAL goes to ssh: its own options first (-L, -A, …), then
the remote command; a `--` may separate them. The host key is the one the rental's host
reported, pinned in $XDG_CONFIG_HOME/gpumarket/known_hosts: ssh refuses any other
(StrictHostKeyChecking yes). You log in with an SSH key registered on your account
(POST /api/v1/account/ssh-keys); -i picks one. A rental that holds GPUs and runs nothing has
nothing to log into.

examples:
  gpumarket ssh r-0123456789abcdef
  gpumarket ssh r-0123456789abcdef nvidia-smi
  gpumarket ssh -i ~/.ssh/id_ed25519 r-0123456789abcdef -- -L 8888:localhost:8888
  gpumarket ssh -v r-0123456789abcdef 'cd /workspace && python train.py'
  gpumarket ssh --dry-run r-0123456789abcdef"""

SSH_CONFIG_EPILOG = """\
Each running rental with SSH gets a `Host <alias> <rental id>` entry whose ProxyCommand is
`gpumarket tunnel`, pinned to the host key the API reports (refreshed in
$XDG_CONFIG_HOME/gpumarket/known_hosts each run). --write puts them in
$XDG_CONFIG_HOME/gpumarket/ssh_config (default ~/.config/gpumarket/ssh_config); it never
touches ~/.ssh/config: add this line at its top once, then run --write again whenever your
rentals change:

  Include ~/.config/gpumarket/ssh_config

Then plain ssh, scp, sftp, rsync -e ssh and editors' Remote-SSH reach the rentals by name.
Rentals with nothing to log into now (a hold, a host offline, no SSH host key) are skipped
with a note on stderr; the others are printed or written all the same (exit status 0).

examples:
  gpumarket ssh-config
  gpumarket ssh-config --write && ssh r-0123456789abcdef.gpumarket nvidia-smi
  rsync -a -e ssh data/ r-0123456789abcdef.gpumarket:data/"""

CP_EPILOG = """\
One side is RENTAL:PATH, like scp's HOST:PATH; the other a local path (write a local path with a
colon as ./name:x). A relative remote path is relative to the rental's /workspace (the SFTP
server's root); directories are copied recursively. It runs the system scp with the same
pinned host key as `gpumarket ssh`; scp shows the progress. Options before SRC are gpumarket's
(-i, -o, -q, -v, as `gpumarket ssh` takes them; --dry-run); scp's own options go after DST and
`--`.

examples:
  gpumarket cp train.py r-0123456789abcdef:
  gpumarket cp data/ r-0123456789abcdef:data
  gpumarket cp r-0123456789abcdef:checkpoints/last.pt .
  gpumarket cp -i ~/.ssh/gpu_ed25519 -o IdentitiesOnly=yes results.csv r-0123456789abcdef:out/
  gpumarket cp big.tar r-0123456789abcdef: -- -l 100000"""

TUNNEL_EPILOG = """\
Bytes on stdin go to the port, the port's bytes come out on stdout: ssh's ProxyCommand (what
`gpumarket ssh`, `cp` and `ssh-config` set up), or a pipe to any TCP port the rental declared.
Errors are one line on stderr and exit status 255, as ssh's.

examples:
  ssh -o ProxyCommand='gpumarket tunnel r-0123456789abcdef' gpumarket@r-0123456789abcdef.gpumarket
  gpumarket tunnel r-0123456789abcdef --port 8888 < request.bin > reply.bin"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``ssh``, ``ssh-config``, ``cp`` and ``tunnel`` to ``gpumarket``'s subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter

    ssh = sub.add_parser("ssh", help="open a shell (or run a command) on a rental with OpenSSH", formatter_class=formatter,
                         description="Run the system ssh to a running rental through its relay, with the rental's "
                         "host key pinned.", epilog=SSH_EPILOG)  # fmt: skip
    common_options(ssh)
    add_ssh_options(ssh, "ssh")
    ssh.add_argument("rental", type=rental_arg, metavar="RENTAL", help="the rental's id")
    ssh.add_argument("ssh_args", nargs=argparse.REMAINDER, metavar="SSH ARGS", help="ssh's own options, then a command")
    set_command(ssh, cmd_ssh)

    config = sub.add_parser("ssh-config", help="ssh_config entries for your running rentals", formatter_class=formatter,
                            description="Print (or --write) OpenSSH Host entries for your running rentals, and pin "
                            "their host keys.", epilog=SSH_CONFIG_EPILOG)  # fmt: skip
    common_options(config)
    config.add_argument("--write", action="store_true", help="write them to $XDG_CONFIG_HOME/gpumarket/ssh_config for an Include")
    set_command(config, cmd_ssh_config)

    cp = sub.add_parser("cp", help="copy files to or from a rental (scp)", formatter_class=formatter,
                        description="Copy files and folders between here and a rental's /workspace with the system "
                        "scp, through the relay.", epilog=CP_EPILOG)  # fmt: skip
    common_options(cp)
    add_ssh_options(cp, "scp")
    cp.add_argument("src", metavar="SRC", help="RENTAL:PATH or a local path")
    cp.add_argument("dst", metavar="DST", help="RENTAL:PATH or a local path")
    cp.add_argument("scp_args", nargs=argparse.REMAINDER, metavar="-- SCP OPTIONS", help="scp's own options, after `--`")
    set_command(cp, cmd_cp)

    tunnel = sub.add_parser("tunnel", help="stdin/stdout to a rental's SSH or TCP port (ssh's ProxyCommand)",
                            formatter_class=formatter, description="Connect stdin and stdout to a port of a running "
                            "rental through its relay.", epilog=TUNNEL_EPILOG)  # fmt: skip
    common_options(tunnel)
    tunnel.add_argument("rental", type=rental_arg, metavar="RENTAL", help="the rental's id")
    tunnel.add_argument("--port", type=port_arg, default=SSH, metavar="ssh|N",
                        help="the rental's SSH server (default) or a TCP port it declared")  # fmt: skip
    tunnel.set_defaults(func=run_tunnel)
