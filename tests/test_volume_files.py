"""A volume's files without a rental, end to end on ``gpumarket up`` with two real agents (root, loop disks):
``POST /volumes/{id}/connect``, the relay, the agent's file-only session (SFTP, scp, jailed rsync, no shell), and
``gpumarket volume copy`` from one host's volume to the other's, resumed, with both trees' SHA-256 compared: driven by
the CLI (``--via-client``) and host to host (the destination's agent pulls through the relays: ``copy_volume``).

The volumes are made on each agent's own ``VolumeStore`` and their rows written directly (making them through the
API is another part of issue 41); everything after that goes the renter's way.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from cryptography.hazmat.primitives.asymmetric import ec
from sqlalchemy import select

from agent.reach.volumefiles import NOT_A_SHELL, rsync_argv, tree_sha256
from agent.volumecopy import VolumeCopyError, open_login
from gpumarket.renter.connect import SshEndpoint, is_volume
from gpumarket.renter.sshfiles import option_args, pinning_options
from gpumarket.up import start_marketplace
from master.models import Command as CommandRow
from master.models import Volume
from master.services.volumes.copy import mint_key
from shared import protocol
from shared.crypto import sealed_to
from tests.helpers import eventually
from tests.test_e2e_up import MISSED, NO_RATE_LIMITS, TICK, Api, _hosts_online

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def setting(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    if os.geteuid() != 0:
        pytest.fail("volumes need the agent as root (loop disks); run the suite as root")
    mp = pytest.MonkeyPatch()
    for name, value in NO_RATE_LIMITS.items():
        mp.setenv(name, value)
    home = Path(tmp_path_factory.mktemp("volfiles"))
    key = home / "id_ed25519"
    await asyncio.to_thread(
        subprocess.run, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True
    )
    market = await start_marketplace(home / "data", agents=2, http_port=0, relay_port=0, heartbeat_interval=TICK,
                                     telemetry_interval=TICK, missed_heartbeats_offline=MISSED)  # fmt: skip
    http = aiohttp.ClientSession()
    volumes: dict[str, Any] = {}
    try:
        renter = Api(http, market.api_url, market.credentials["renter"]["api_key"])
        await eventually(lambda: _hosts_online(renter, 2), timeout=120, what="both hosts online")
        status, _ = await renter.call(
            "POST", "/account/ssh-keys", json={"public_key": (home / "id_ed25519.pub").read_text()}
        )
        assert status == 201
        account_id = (await renter.get("/account"))["id"]
        placed = (("data-a", market.agents[0]), ("data-b", market.agents[1]), ("data-c", market.agents[1]))
        for name, agent in placed:
            volume_id = f"vol-{secrets.token_hex(8)}"
            assert agent.volumes.unavailable is None, agent.volumes.unavailable
            await asyncio.to_thread(agent.volumes.create, volume_id, 1)
            async with market.master.db.session() as session:
                session.add(Volume(id=volume_id, account_id=account_id, name=name, size_gib=1, host_id=agent.host_id,
                                   state="ready", price_per_gib_hour=Decimal("0.0001")))  # fmt: skip
                await session.commit()
            volumes[name] = {"id": volume_id, "agent": agent, "root": agent.volumes.path(volume_id)}
        env = {**os.environ, "GPUMARKET_API_URL": market.api_url.removesuffix("/api/v1"),
               "GPUMARKET_API_KEY": market.credentials["renter"]["api_key"], "XDG_CONFIG_HOME": str(home / "config"),
               "HOME": str(home)}  # fmt: skip
        yield {"market": market, "renter": renter, "env": env, "key": key, "home": home, "volumes": volumes}
    finally:
        await http.close()
        await market.stop()
        for volume in volumes.values():
            await asyncio.to_thread(volume["agent"].volumes.delete, volume["id"])
        mp.undo()


def _cli(setting: dict[str, Any], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "gpumarket", *args], capture_output=True, env=setting["env"],
                          timeout=timeout, check=False)  # fmt: skip


async def _ticket(setting: dict[str, Any], ref: str) -> dict[str, Any]:
    async def ticket() -> dict[str, Any] | None:
        status, view = await setting["renter"].call("POST", f"/volumes/{ref}/connect", json={})
        if status == 409 and view.get("code") in ("host_offline", "volume_opening"):
            return None
        assert status == 200, view
        return dict(view)

    # A hang guard, not a speed: each try waits up to 15 s for the host (volume_opening), longer on a loaded machine.
    return await eventually(ticket, timeout=120, every=0.5, what=f"a connect ticket to volume {ref}")


async def _ssh_options(setting: dict[str, Any], ref: str) -> tuple[list[str], str]:
    """The ssh options that reach the volume's session (as `gpumarket ssh-config` writes them) and its host name."""
    view = await _ticket(setting, ref)
    endpoint = SshEndpoint(**view["ssh"])
    known = setting["home"] / "known_hosts"
    known.write_text(f"{endpoint.host_alias} {endpoint.host_key}\n")
    options = option_args(pinning_options(view["volume_id"], endpoint, known))
    return [
        *options,
        "-i",
        str(setting["key"]),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        "BatchMode=yes",
    ], f"gpumarket@{endpoint.host_alias}"


class TestConnect:
    async def test_only_the_renters_ready_volume_gets_a_ticket(self, setting: dict[str, Any]) -> None:
        """Another account's volume is 404 like an unknown one; the ticket pins the host key the agent serves."""
        view = await _ticket(setting, "data-a")
        assert view["volume_id"] == setting["volumes"]["data-a"]["id"] and view["ssh"]["host_key"].startswith(
            "ssh-ed25519 "
        )
        again = await _ticket(setting, view["volume_id"])
        assert again["ssh"]["host_key"] == view["ssh"]["host_key"]  # made once, kept
        provider = Api(
            setting["renter"].http,
            setting["market"].api_url,
            setting["market"].credentials["provider"]["api_key"],
        )
        status, body = await provider.call("POST", "/volumes/data-a/connect", json={})
        assert (status, body["code"]) == (404, "volume_not_found")

    async def test_the_cli_tells_volumes_from_rentals(self) -> None:
        assert is_volume("vol-0123456789abcdef") and is_volume("data") and not is_volume("r-0123456789abcdef")


class TestFileOnlySession:
    async def test_a_file_written_without_a_rental_is_read_back(self, setting: dict[str, Any]) -> None:
        """`gpumarket cp` to and from a volume with no rental: the file lands in the volume, owned by the volume's user."""
        home, volume = setting["home"], setting["volumes"]["data-a"]
        payload = home / "payload.bin"
        payload.write_bytes(os.urandom(3 << 20))
        key = ("-i", str(setting["key"]), "-q")
        up = await asyncio.to_thread(_cli, setting, "cp", *key, str(payload), "data-a:/in/payload.bin")
        assert up.returncode != 0  # no folder /in yet: scp does not make it
        up = await asyncio.to_thread(_cli, setting, "cp", *key, str(payload), "data-a:/payload.bin")
        assert up.returncode == 0, up.stderr.decode()
        stored = volume["root"] / "payload.bin"
        assert stored.read_bytes() == payload.read_bytes() and stored.stat().st_uid == 1000
        back = home / "back.bin"
        down = await asyncio.to_thread(_cli, setting, "cp", *key, "data-a:payload.bin", str(back))
        assert down.returncode == 0, down.stderr.decode()
        assert back.read_bytes() == payload.read_bytes()

    async def test_no_shell_and_no_command(self, setting: dict[str, Any]) -> None:
        options, where = await _ssh_options(setting, "data-a")
        done = await asyncio.to_thread(subprocess.run, ["ssh", *options, where, "id; cat /etc/hostname"], capture_output=True, env=setting["env"],
                                       timeout=180, check=False)  # fmt: skip
        assert done.returncode == 1 and NOT_A_SHELL in done.stderr.decode() and not done.stdout

    async def test_no_path_leads_outside_the_volume(self, setting: dict[str, Any]) -> None:
        """`..`, absolute paths and a link planted to /etc all stay in the volume, over SFTP and over rsync."""
        root = setting["volumes"]["data-a"]["root"]
        (root / "escape").unlink(missing_ok=True)
        os.symlink("/etc", root / "escape")
        (root / "marker.txt").write_text(
            "in the volume\n"
        )  # this test's own: another test's files may be elsewhere
        options, where = await _ssh_options(setting, "data-a")
        batch = f"lcd {setting['home']}\nls /../../..\n-get /../../etc/hostname leaked1\n-get escape/hostname leaked2\n-get /escape/passwd leaked3\n"
        done = await asyncio.to_thread(subprocess.run, ["sftp", "-b", "-", *options, where], input=batch.encode(),
                                       capture_output=True, env=setting["env"], timeout=180, check=False)  # fmt: skip
        assert done.returncode == 0, (
            done.stderr.decode()
        )  # each get fails ("-": and goes on): no /etc in the volume
        assert done.stderr.decode().count("not found") == 3, done.stderr.decode()
        assert "marker.txt" in done.stdout.decode()  # "/../../.." is the volume's root
        assert not any((setting["home"] / f"leaked{i}").exists() for i in (1, 2, 3))
        # rsync: absolute paths are the volume's; its --server runs jailed, as the volume's user.
        pulled = setting["home"] / "pulled"
        ssh = "ssh " + shlex.join(options)
        got = await asyncio.to_thread(subprocess.run, ["rsync", "-a", "-e", ssh, f"{where}:/../../etc/", f"{pulled}/"],
                                      capture_output=True, env=setting["env"], timeout=180, check=False)  # fmt: skip
        assert got.returncode != 0 and not pulled.exists(), got
        source = setting["home"] / "tree"
        (source / "sub").mkdir(parents=True)
        (source / "sub" / "a.txt").write_text("rsync'd\n")
        pushed = await asyncio.to_thread(subprocess.run, ["rsync", "-a", "-e", ssh, f"{source}/", f"{where}:/synced/"],
                                         capture_output=True, env=setting["env"], timeout=180, check=False)  # fmt: skip
        assert pushed.returncode == 0, pushed.stderr.decode()
        assert (root / "synced" / "sub" / "a.txt").read_text() == "rsync'd\n"
        assert (root / "synced" / "sub" / "a.txt").stat().st_uid == 1000
        (root / "escape").unlink()


class TestCopy:
    async def test_a_copy_between_two_hosts_matches_and_resumes(self, setting: dict[str, Any]) -> None:
        """`gpumarket volume copy` from one agent's volume to the other's: the trees' SHA-256 equal; a second run
        after the destination lost a file and kept a half-written one copies only that file."""
        src = setting["volumes"]["data-a"]["root"]
        dst = setting["volumes"]["data-b"]["root"]
        (src / "ckpt" / "deep").mkdir(parents=True, exist_ok=True)
        for i in range(20):
            (src / "ckpt" / f"shard-{i:02}.bin").write_bytes(os.urandom(64 << 10 if i else 5 << 20))
        (src / "ckpt" / "deep" / "empty").write_bytes(b"")
        os.symlink("shard-00.bin", src / "ckpt" / "latest")
        args = ("volume", "copy", "data-a", "data-b", "--via-client", "-i", str(setting["key"]))
        first = await asyncio.to_thread(_cli, setting, *args, timeout=300)
        assert first.returncode == 0, first.stderr.decode()
        digest = await asyncio.to_thread(tree_sha256, src)
        assert await asyncio.to_thread(tree_sha256, dst) == digest
        assert f"sha256 {digest.sha256} on both" in first.stdout.decode()
        assert (dst / "ckpt" / "latest").readlink() == Path("shard-00.bin")
        # Interrupted: one file missing, another half-written under its partial name.
        (dst / "ckpt" / "shard-07.bin").unlink()
        (dst / "ckpt" / "shard-00.bin").unlink()
        (dst / "ckpt" / "shard-00.bin.gmpart").write_bytes(b"half")
        second = await asyncio.to_thread(_cli, setting, *args, timeout=300)
        assert second.returncode == 0, second.stderr.decode()
        assert "copied 2 files" in second.stdout.decode()
        assert await asyncio.to_thread(tree_sha256, dst) == digest
        assert not (dst / "ckpt" / "shard-00.bin.gmpart").exists()


async def _copy_row(setting: dict[str, Any], copy_id: str) -> Any:
    async with setting["market"].master.db.session() as session:
        rows = (await session.scalars(select(CommandRow).where(CommandRow.kind == "copy_volume"))).all()
    return next(row for row in rows if row.args["copy_id"] == copy_id)


class TestHostCopy:
    async def test_the_destination_host_pulls_a_copy_that_matches_and_resumes(
        self, setting: dict[str, Any]
    ) -> None:
        """`gpumarket volume copy` host to host: data-c's agent pulls data-a through the relay; the trees' SHA-256
        equal, progress and the end are volume events, and a second run after the destination lost a file and kept
        a half-written one copies only that file."""
        src = setting["volumes"]["data-a"]["root"]
        dst = setting["volumes"]["data-c"]["root"]
        (src / "hc" / "deep").mkdir(parents=True, exist_ok=True)
        for i in range(12):
            (src / "hc" / f"part-{i:02}.bin").write_bytes(os.urandom(32 << 10 if i else 24 << 20))
        (src / "hc" / "deep" / "empty").write_bytes(b"")
        (src / "hc" / "latest").unlink(missing_ok=True)
        os.symlink("part-00.bin", src / "hc" / "latest")
        first = await asyncio.to_thread(_cli, setting, "volume", "copy", "data-a", "data-c", timeout=300)
        assert first.returncode == 0, first.stderr.decode() + first.stdout.decode()
        digest = await asyncio.to_thread(tree_sha256, src)
        assert await asyncio.to_thread(tree_sha256, dst) == digest
        assert f"sha256 tree {digest.sha256} {digest.files} {digest.bytes} on both" in first.stdout.decode()
        assert (dst / "hc" / "latest").readlink() == Path("part-00.bin")
        assert (dst / "hc" / "part-03.bin").stat().st_uid == 1000
        view = await setting["renter"].get("/volumes/data-c/copy")
        assert view["state"] == "succeeded" and view["events"][0]["phase"] == "started"
        assert view["events"][-1]["phase"] == "succeeded" and "progress" in {
            e["phase"] for e in view["events"]
        }
        # The private key crossed the commands table and the bus sealed to data-c's host only.
        row = await _copy_row(setting, view["copy_id"])
        assert row.args["sealed_login"].startswith("ecies:v1:") and "PRIVATE KEY" not in json.dumps(row.args)
        carried = [
            entry
            for stream in setting["market"].master.bus._streams.values()
            for entry in stream.entries.values()
        ]
        assert any(row.args["sealed_login"].encode() in entry for entry in carried)  # the delivery, as sealed
        assert not any(b"PRIVATE KEY" in entry for entry in carried)
        # Interrupted: one file missing, another half-written under its partial name.
        (dst / "hc" / "part-07.bin").unlink()
        (dst / "hc" / "part-00.bin").unlink()
        (dst / "hc" / "part-00.bin.gmpart").write_bytes(b"half")
        second = await asyncio.to_thread(
            _cli, setting, "volume", "copy", "data-a", "data-c", "-q", timeout=300
        )
        assert second.returncode == 0, second.stderr.decode()
        assert "2 files, " in second.stdout.decode() and await asyncio.to_thread(tree_sha256, dst) == digest
        assert not (dst / "hc" / "part-00.bin.gmpart").exists()

    async def test_a_copy_that_does_not_match_fails_loudly(self, setting: dict[str, Any]) -> None:
        """A destination file changed with its size and time kept is skipped as complete: the trees differ, and the
        copy fails with volume_copy_mismatch (exit 1, saying so)."""
        src = setting["volumes"]["data-a"]["root"]
        dst = setting["volumes"]["data-c"]["root"]
        (src / "tamper.txt").write_bytes(b"the source's bytes\n")
        done = await asyncio.to_thread(_cli, setting, "volume", "copy", "data-a", "data-c", "-q", timeout=300)
        assert done.returncode == 0, done.stderr.decode()
        info = (dst / "tamper.txt").stat()
        (dst / "tamper.txt").write_bytes(b"the altered bytes!\n")
        os.utime(dst / "tamper.txt", ns=(info.st_atime_ns, info.st_mtime_ns))
        again = await asyncio.to_thread(
            _cli, setting, "volume", "copy", "data-a", "data-c", "-q", timeout=300
        )
        assert again.returncode == 1 and "volume_copy_mismatch" in again.stderr.decode(), again
        view = await setting["renter"].get("/volumes/data-c/copy")
        assert view["state"] == "failed" and view["detail"].startswith("volume_copy_mismatch")
        (dst / "tamper.txt").unlink()  # the next run copies it again

    async def test_refusals(self, setting: dict[str, Any]) -> None:
        """Same host, same volume, unknown volume: refused before anything is sent."""
        renter = setting["renter"]
        status, body = await renter.call("POST", "/volumes/data-c/copy", json={"from": "data-b"})
        assert (status, body["code"]) == (409, "volume_copy_same_host")
        status, body = await renter.call("POST", "/volumes/data-c/copy", json={"from": "data-c"})
        assert (status, body["code"]) == (422, "volume_copy_same_volume")
        status, body = await renter.call("POST", "/volumes/data-c/copy", json={"from": "nope"})
        assert (status, body["code"]) == (404, "volume_not_found")


class TestCopyLogin:
    async def test_only_the_destination_host_opens_it_for_its_copy(self) -> None:
        """The login sealed to one host's key for one copy opens there only: not with another key, not for another
        copy; and the command's repr never shows it."""
        host_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        private_key, public_key = mint_key("vcp-0123456789abcdef")
        login = protocol.CopyLogin(private_key=private_key, token="t0ken")
        context = protocol.volume_copy_context("h-1", "vcp-0123456789abcdef")
        sealed = sealed_to.seal_to(host_key.public_key(), login.model_dump_json().encode(), context)
        assert open_login(sealed, "h-1", "vcp-0123456789abcdef", [other_key, host_key]) == login
        for host, copy_id, keys in (("h-1", "vcp-0123456789abcdef", [other_key]), ("h-2", "vcp-0123456789abcdef", [host_key]),
                                    ("h-1", "vcp-fedcba9876543210", [host_key])):  # fmt: skip
            with pytest.raises(VolumeCopyError) as caught:
                open_login(sealed, host, copy_id, keys)
            assert caught.value.code == "volume_copy_login_unreadable"
        assert "PRIVATE" not in repr(login) and public_key.startswith("ssh-ed25519 ")
        command = protocol.decode_command(protocol.CommandBody(command_id="cmd-1", kind="copy_volume", args={
            "copy_id": "vcp-0123456789abcdef", "volume_id": "vol-0123456789abcdef", "source_volume_id": "vol-fedcba9876543210",
            "relay_url": "wss://relay:1/connect", "source_host_key": "ssh-ed25519 AAAA", "sealed_login": sealed}))  # fmt: skip
        assert isinstance(command, protocol.CopyVolume) and command.sealed_login == sealed


class TestTreeDigest:
    async def test_content_names_and_links_change_it_and_nothing_outside_counts(self, tmp_path: Path) -> None:
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "f").write_bytes(b"x")
        (tmp_path / "lost+found").mkdir()
        first = tree_sha256(tmp_path)
        assert (first.files, first.bytes) == (1, 1)
        (tmp_path / "lost+found" / "junk").write_bytes(b"y")
        assert tree_sha256(tmp_path) == first
        (tmp_path / "a" / "f").write_bytes(b"z")
        assert tree_sha256(tmp_path) != first
        (tmp_path / "a" / "f").write_bytes(b"x")
        os.symlink("/etc", tmp_path / "a" / "etc")
        assert (
            tree_sha256(tmp_path).files == 1 and tree_sha256(tmp_path) != first
        )  # the link counts, never followed

    async def test_rsync_server_only_with_the_volumes_paths(self) -> None:
        assert rsync_argv("rsync --server -logDtpre.iLsfxCIvu . /x/../y") == [
            "--server",
            "-logDtpre.iLsfxCIvu",
            ".",
            "/data/y",
        ]
        assert rsync_argv("rsync --server --sender -e.LsfxCIvu . rel") == [
            "--server",
            "--sender",
            "-e.LsfxCIvu",
            ".",
            "rel",
        ]
        for refused in (
            "sh -c id",
            "rsync --daemon",
            "rsync --server --daemon .",
            "rsync /etc /tmp",
            "'unbalanced",
        ):
            assert rsync_argv(refused) is None
