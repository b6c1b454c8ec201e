"""``gpumarket ssh-key add|list|delete`` (``gpumarket/renter/sshkeys.py``) against a real master on SQLite, and the
refusal ``gpumarket ssh`` and ``cp`` give, in one line naming the fix, when the account has no SSH key."""

from __future__ import annotations

import json
from pathlib import Path

import asyncssh
import pytest

from gpumarket.renter import sshkeys
from tests.apiclient import Api
from tests.test_cli_hints import relay_up, rented, started
from tests.test_renter_cli import Cli, cli, database_url, fast_polls, one_line

__all__ = ["cli", "database_url", "fast_polls"]  # the fixtures, shared with test_renter_cli


def public_key_file(folder: Path, name: str = "id_ed25519.pub", comment: str = "me@laptop") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    key = asyncssh.generate_private_key("ssh-ed25519", comment=comment)
    path = folder / name
    path.write_bytes(key.export_public_key())
    return path


async def test_add_list_delete_round_trip(cli: Cli, tmp_path: Path) -> None:
    path = public_key_file(tmp_path / "keys", "work.pub")
    code, out, err = await cli("ssh-key", "list")
    assert code == 0 and "no SSH keys" in out and "ssh-keygen -t ed25519" in out, err
    code, out, err = await cli("ssh-key", "add", str(path), "--name", "laptop")
    assert code == 0 and "added laptop (sshk-" in out and "ssh-ed25519 SHA256:" in out, err
    code, out, err = await cli("ssh-key", "list", "--json")
    [key] = json.loads(out)
    assert key["name"] == "laptop" and key["public_key"].split()[:2] == path.read_text().split()[:2]
    code, out, err = await cli("ssh-key", "list")
    assert code == 0 and key["id"] in out and key["fingerprint"] in out and "never" in out
    code, out, err = await cli("ssh-key", "add", str(path))  # again: idempotent, the key is there as asked
    assert code == 0 and "already on your account as 'laptop'" in out and "nothing to do" in out, err
    assert len(json.loads((await cli("ssh-key", "list", "--json"))[1])) == 1
    code, out, err = await cli("ssh-key", "delete", key["id"])
    assert code == 0 and f"deleted {key['id']}" in out, err
    code, _, err = await cli("ssh-key", "delete", key["id"])
    assert code == 1 and "(ssh_key_not_found)" in one_line(err), err


async def test_add_takes_the_key_openssh_would_offer_first(cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    code, _, err = await cli("ssh-key", "add")
    assert code == 2 and f"no SSH public key in {home / '.ssh'}" in one_line(err) and "ssh-keygen -t ed25519" in err
    public_key_file(home / ".ssh", "id_rsa.pub", comment="rsa-one")  # an Ed25519 key, named as an RSA one: the file is what counts
    public_key_file(home / ".ssh", "id_ed25519.pub", comment="ed-one")
    assert sshkeys.default_public_key(home) == home / ".ssh" / "id_ed25519.pub"
    code, out, err = await cli("ssh-key", "add")
    assert code == 0 and "added ed-one" in out, err


async def test_add_refuses_what_is_not_a_public_key_file(cli: Cli, tmp_path: Path) -> None:
    big = tmp_path / "big.pub"
    big.write_bytes(b"ssh-ed25519 " + b"A" * (sshkeys.MAX_PUBLIC_KEY_FILE + 1))
    code, _, err = await cli("ssh-key", "add", str(big))
    assert code == 2 and "larger than a public key" in one_line(err)
    binary = tmp_path / "binary.pub"
    binary.write_bytes(b"\xff\xfe\x00")
    code, _, err = await cli("ssh-key", "add", str(binary))
    assert code == 2 and "not a text file" in one_line(err)
    private = tmp_path / "id_ed25519"
    private.write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    code, _, err = await cli("ssh-key", "add", str(private))
    assert code == 1 and "private_key_pasted" in one_line(err)
    code, _, err = await cli("ssh-key", "add", str(tmp_path / "missing.pub"))
    assert code == 2 and "cannot read" in one_line(err)


async def test_ssh_and_cp_without_a_key_say_how_to_add_one_before_running_ssh(cli: Cli, api: Api, tmp_path: Path) -> None:
    await api.host(1)
    await relay_up(api)
    rid = await rented(cli, "--image", "ubuntu:24.04")
    await started(api, rid)
    for argv in (("ssh", "--dry-run", rid, "true"), ("cp", "--dry-run", "data", f"{rid}:in/")):
        code, out, err = await cli(*argv)
        assert code == 1 and out == "" and "no SSH key" in one_line(err) and "gpumarket ssh-key add" in err, (argv, err)
    code, out, err = await cli("ssh-config")
    assert code == 0 and f"{rid}.gpumarket" in out and "# your account has no SSH key" in err  # written all the same, noted
    code, _, err = await cli("ssh-key", "add", str(public_key_file(tmp_path / "keys")))
    assert code == 0, err
    code, out, err = await cli("ssh", "--dry-run", rid, "true")
    assert code == 0 and out.rstrip().endswith(f"{rid}.gpumarket true"), err
