"""``gpumarket ssh-key add|list|delete``: the SSH public keys your rentals accept (``/api/v1/account/ssh-keys``).

``gpumarket ssh``, ``cp`` and ``cluster ssh`` log in with one of these keys; with none registered they say so before
running ssh (``require_ssh_key``) instead of leaving the user with ssh's "Permission denied (publickey)".
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from gpumarket.renter.api import ApiError, Client, CliError, UsageError
from gpumarket.renter.commands import command_group, finish
from gpumarket.renter.output import short_time, table

# Where OpenSSH's client looks for a key by default, in its order (ssh(1), -i): the first that exists is added.
DEFAULT_PUBLIC_KEYS = ("id_ed25519.pub", "id_ecdsa.pub", "id_rsa.pub")
MAX_PUBLIC_KEY_FILE = 16 << 10  # a .pub file is one line; an RSA 16384-bit key is ~2.8 KB
MAKE_ONE = "make one with `ssh-keygen -t ed25519`, then register it with `gpumarket ssh-key add`"


def default_public_key(home: Path | None = None) -> Path:
    """The public key OpenSSH's client would offer first: ``~/.ssh/id_ed25519.pub``, ``id_ecdsa.pub``, ``id_rsa.pub``."""
    folder = (home or Path(os.path.expanduser("~"))) / ".ssh"
    for name in DEFAULT_PUBLIC_KEYS:
        if (folder / name).is_file():
            return folder / name
    raise UsageError(f"no SSH public key in {folder} ({', '.join(DEFAULT_PUBLIC_KEYS)}): {MAKE_ONE}")


def read_public_key(path: Path) -> str:
    """The file's one line, as the API takes it (it checks the key itself: type, size, not a private key)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_PUBLIC_KEY_FILE + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PUBLIC_KEY_FILE:
        raise UsageError(f"{path} is larger than a public key ({MAX_PUBLIC_KEY_FILE // 1024} KiB at most): give the .pub file")
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a text file: give the .pub file, e.g. ~/.ssh/id_ed25519.pub") from None


NO_KEY = f"your account has no SSH key, so your rentals accept no login: {MAKE_ONE}"


async def has_ssh_key(client: Client) -> bool:
    answer: dict[str, Any] = await client.request("GET", "/account/ssh-keys")
    return bool(answer["ssh_keys"])


async def require_ssh_key(client: Client) -> None:
    """Refuse, in one line that says what to do, when the account has no SSH key: ssh would only say
    "Permission denied (publickey)"."""
    if not await has_ssh_key(client):
        raise CliError(NO_KEY)


async def cmd_ssh_key_add(args: argparse.Namespace, client: Client) -> int:
    path: Path = args.file if args.file is not None else default_public_key()
    body: dict[str, Any] = {"public_key": read_public_key(path)}
    if args.name:
        body["name"] = args.name
    try:
        added: dict[str, Any] = await client.request("POST", "/account/ssh-keys", json_body=body)
    except ApiError as exc:
        if exc.code != "ssh_key_exists":
            raise
        # Idempotent: the key is registered, as asked (the API names it; nothing changed).
        print(f"{exc.api_message.rstrip('.')}: nothing to do" if not args.json else json.dumps({"exists": True, "message": exc.api_message}))
        return 0
    if args.json:
        print(json.dumps(added, indent=2))
    else:
        print(f"added {added['name'] or path.name} ({added['id']}, {added['algorithm']} {added['fingerprint']}): "
              "your rentals accept it within seconds, running ones too")  # fmt: skip
    return 0


async def cmd_ssh_key_list(args: argparse.Namespace, client: Client) -> int:
    keys: list[dict[str, Any]] = (await client.request("GET", "/account/ssh-keys"))["ssh_keys"]
    if args.json:
        print(json.dumps(keys, indent=2))
        return 0
    if not keys:
        print(f"no SSH keys: {MAKE_ONE}")
        return 0
    rows = [[k["id"], k["name"] or "", k["algorithm"], k["fingerprint"], short_time(k["created_at"]),
             short_time(k["last_used_at"]) if k["last_used_at"] else "never"] for k in keys]  # fmt: skip
    print(table(["ID", "NAME", "TYPE", "FINGERPRINT", "ADDED", "LAST USED"], rows))
    return 0


async def cmd_ssh_key_delete(args: argparse.Namespace, client: Client) -> int:
    deleted: dict[str, Any] = await client.request("DELETE", f"/account/ssh-keys/{args.key_id}")
    if args.json:
        print(json.dumps(deleted, indent=2))
    else:
        print(f"deleted {deleted['id']}: logins with it are refused within seconds and its open connections closed")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``ssh-key add|list|delete`` to ``gpumarket``'s subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter
    keys = command_group(sub, "ssh-key", help="the SSH public keys your rentals accept: add, list, delete",
                         description="The SSH public keys registered on your account (or the team you act for): "
                                     "`gpumarket ssh`, `cp`, `ssh-config` and plain ssh log in to your rentals with them.",
                         examples=["add", "add ~/.ssh/work.pub --name laptop", "list", "delete sshk-0123456789abcdef"])  # fmt: skip
    add = keys.add_parser("add", help="register a public key (default ~/.ssh/id_ed25519.pub, id_ecdsa.pub or id_rsa.pub)",
                          formatter_class=formatter,
                          description="Register an SSH public key: the .pub file's one line. Running rentals accept it "
                                      "within seconds. Never give the private key: the marketplace refuses one.")  # fmt: skip
    add.add_argument("file", metavar="FILE", nargs="?", type=Path,
                     help="the public key file (default: the first of ~/.ssh/id_ed25519.pub, id_ecdsa.pub, id_rsa.pub)")  # fmt: skip
    add.add_argument("--name", help="what you call it (default: the key's comment)")
    finish(add, cmd_ssh_key_add, json="the registered key as JSON")
    listing = keys.add_parser("list", help="your SSH keys and when each last logged in", formatter_class=formatter,
                              description="Your SSH keys: id, name, type, fingerprint, when added and last used.")
    finish(listing, cmd_ssh_key_list, json="the keys as JSON")
    delete = keys.add_parser("delete", help="delete a key: logins with it stop within seconds", formatter_class=formatter,
                             description="Delete an SSH key: your rentals stop accepting it within seconds and close "
                                         "the connections that logged in with it.")  # fmt: skip
    delete.add_argument("key_id", metavar="KEY_ID", help="the key's id, as `gpumarket ssh-key list` shows it")
    finish(delete, cmd_ssh_key_delete, json="the answer as JSON")
