"""The agent's SFTP files (``agent.reach.openfile``): writes done behind the session, in order, whose failure the client
still hears of; reads from the page cache. Then the SFTP server over them (``agent.reach.sftp``) through a real asyncssh
client on loopback: what a path shows while a file's writes are still queued.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import asyncssh
import pytest

from agent.reach.openfile import OpenFile, read_cached, write_at
from agent.reach.sftp import WorkspaceSFTPServer

WAIT = 30.0  # a hang guard for one SFTP session's work


class TestOpenFile:
    async def test_queued_writes_land_in_order_and_a_read_sees_them(self, tmp_path: Path) -> None:
        """Writes answer at once, overlapping ones land in the order they came, and a read through the file waits for them."""
        path = tmp_path / "f"
        file = OpenFile(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), max_pending=1 << 20)
        await file.write(0, b"a" * 1000)
        await file.write(1000, b"b" * 1000)
        await file.write(500, b"c" * 1000)  # over both: must land after them
        assert await file.read(0, 4000) == b"a" * 500 + b"c" * 1000 + b"b" * 500
        await file.close()
        assert path.read_bytes() == b"a" * 500 + b"c" * 1000 + b"b" * 500
        assert file.fd == -1

    async def test_more_than_the_bound_waits_for_room(self, tmp_path: Path) -> None:
        """Past ``max_pending`` bytes queued, a write waits until the earlier ones are written; nothing is lost."""
        path = tmp_path / "f"
        file = OpenFile(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), max_pending=4096, max_writes=4)
        chunks = [bytes([i]) * 3000 for i in range(20)]
        for i, chunk in enumerate(chunks):
            await file.write(i * 3000, chunk)
            assert file._pending <= 4096 + 3000 and len(file._queue) <= 4
        await file.close()
        assert path.read_bytes() == b"".join(chunks)

    async def test_a_failed_write_is_raised_by_the_next_request_and_then_refused(self, tmp_path: Path) -> None:
        """A write that fails in the background (here EBADF: the file is read-only) fails the next write; close does
        not raise it a second time, and closes the descriptor."""
        path = tmp_path / "f"
        path.write_bytes(b"x")
        file = OpenFile(os.open(path, os.O_RDONLY))
        await file.write(0, b"data")
        await file.settled()
        with pytest.raises(OSError) as raised:
            await file.write(4, b"more")
        assert raised.value.errno == errno.EBADF
        with pytest.raises(OSError):
            await file.flush()
        await file.close()
        assert file.fd == -1

    async def test_a_failure_first_seen_at_close_is_raised_by_close(self, tmp_path: Path) -> None:
        """The client hears of a failed write at the latest when it closes the file (scp and sftp check it)."""
        path = tmp_path / "f"
        path.write_bytes(b"x")
        file = OpenFile(os.open(path, os.O_RDONLY))
        await file.write(0, b"data")
        with pytest.raises(OSError):
            await file.close()
        assert file.fd == -1

    def test_write_at_writes_every_chunk_and_read_cached_reads_them_back(self, tmp_path: Path) -> None:
        """``write_at`` joins chunks at an offset; ``read_cached`` returns what the page cache holds (or None where the
        file system cannot say), short at the end of the file."""
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            write_at(fd, [b"12", b"", b"345"], 3)
            assert os.pread(fd, 10, 0) == b"\0\0\x0012345"
            cached = read_cached(fd, 100, 3)
            assert cached in (b"12345", None)
        finally:
            os.close(fd)


@pytest.fixture
async def sftp(tmp_path: Path) -> AsyncIterator[asyncssh.SFTPClient]:
    """An asyncssh client's SFTP session into ``tmp_path / "root"``, served by ``WorkspaceSFTPServer`` on loopback."""
    root = tmp_path / "root"
    root.mkdir()
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    server = await asyncssh.listen(
        "127.0.0.1", 0, server_host_keys=[host_key], authorized_client_keys=asyncssh.import_authorized_keys(
            client_key.export_public_key().decode()),
        sftp_factory=lambda chan: WorkspaceSFTPServer(chan, root, alias="/workspace", owner=None),
    )  # fmt: skip
    port = server.sockets[0].getsockname()[1]
    try:
        async with (
            asyncssh.connect("127.0.0.1", port, known_hosts=([asyncssh.import_public_key(host_key.export_public_key())], [], []), client_keys=[client_key],
                             username="renter", agent_path=None, config=None) as conn,
            conn.start_sftp_client() as client,
        ):  # fmt: skip
            yield client
    finally:
        server.close()
        await server.wait_closed()


class TestSftpWhileWritesAreQueued:
    async def test_a_path_shows_every_write_answered_before_the_file_is_closed(self, sftp: asyncssh.SFTPClient) -> None:
        """sshfs-like use: writes on an open file, then a stat, a listing and a second handle's read of its path —
        each sees every write already answered, though the first handle is still open."""
        block = os.urandom(256 << 10)
        async with asyncio.timeout(WAIT):
            async with sftp.open("/workspace/data.bin", "wb") as writer:
                for i in range(16):
                    await writer.write(block, i * len(block))
                assert (await sftp.stat("/workspace/data.bin")).size == 16 * len(block)
                names = {n.filename: n.attrs.size for n in await sftp.readdir("/")}
                assert names["data.bin"] == 16 * len(block)
                async with sftp.open("/workspace/data.bin", "rb", encoding=None) as reader:
                    tail = await reader.read(len(block), 15 * len(block))
                    assert cast(bytes, tail) == block  # encoding=None: bytes (the stubs say str)
                await sftp.truncate("/workspace/data.bin", len(block))  # a setstat by path: after the queued writes
            assert (await sftp.stat("/data.bin")).size == len(block)

    async def test_a_large_file_goes_up_and_down_whole(self, sftp: asyncssh.SFTPClient, tmp_path: Path) -> None:
        """A put and a get of 8 MiB with asyncssh's pipelined requests (64 of 256 KiB in flight) keep every byte."""
        local = tmp_path / "local.bin"
        local.write_bytes(os.urandom(8 << 20))
        async with asyncio.timeout(WAIT):
            await sftp.put(str(local), "/up.bin", block_size=256 << 10, max_requests=64)
            await sftp.get("/up.bin", str(tmp_path / "down.bin"), block_size=256 << 10, max_requests=64)
        assert (tmp_path / "root" / "up.bin").read_bytes() == local.read_bytes()
        assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
