"""A cluster tunnel's datagrams over a byte stream (``agent/cluster/relay.py``): framing that survives any chunking,
and the pump between ``wireguard-go``'s UDP socket and a stream. The whole path through a real relay runs in
``tests/test_cluster_allreduce.py`` (``GPUMARKET_CLUSTER_DIRECT=false``)."""

from __future__ import annotations

import asyncio
import socket

from hypothesis import given
from hypothesis import strategies as st

from agent.cluster.probe import PROBE_BYTES, Run, UdpEcho, loss, respond, throughput
from agent.cluster.relay import Deframer, frame, serve_stream


@given(st.lists(st.binary(max_size=2000), max_size=20), st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=50))
def test_datagrams_survive_any_chunking(datagrams: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frame(d) for d in datagrams)
    deframer, out, at, i = Deframer(), [], 0, 0
    while at < len(stream):
        size = cuts[i % len(cuts)]
        out += deframer.feed(stream[at:at + size])
        at, i = at + size, i + 1
    assert out == datagrams


def _udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def test_a_stream_carries_datagrams_both_ways_and_only_wireguards() -> None:
    """The receiving side: datagrams from the stream reach ``wireguard-go``'s port; its answers (and only its) go back."""
    loop = asyncio.get_running_loop()
    wireguard, stranger = _udp(), _udp()
    incoming: asyncio.Queue[bytes] = asyncio.Queue()
    outgoing: asyncio.Queue[bytes] = asyncio.Queue()

    async def write(data: bytes) -> None:
        outgoing.put_nowait(data)

    served = asyncio.create_task(serve_stream(wireguard.getsockname()[1], incoming.get, write))
    try:
        incoming.put_nowait(frame(b"handshake") + frame(b"data")[:3])
        incoming.put_nowait(frame(b"data")[3:])
        first, relay_side = await asyncio.wait_for(loop.sock_recvfrom(wireguard, 100), 5)
        second, _ = await asyncio.wait_for(loop.sock_recvfrom(wireguard, 100), 5)
        assert (first, second) == (b"handshake", b"data")
        await loop.sock_sendto(stranger, b"not from wireguard", relay_side)  # dropped: not wireguard-go's address
        await loop.sock_sendto(wireguard, b"answer", relay_side)
        deframer = Deframer()
        got: list[bytes] = []
        while not got:
            got = deframer.feed(await asyncio.wait_for(outgoing.get(), 5))
        assert got == [b"answer"] and outgoing.empty()
        incoming.put_nowait(b"")  # the stream ended: the pump ends
        await asyncio.wait_for(served, 5)
    finally:
        served.cancel()
        wireguard.close()
        stranger.close()


async def test_loss_counts_the_probes_that_did_not_come_back() -> None:
    """``clusterprobe.loss``: 0 % against a UDP echo, 100 % against a socket that never answers."""
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(UdpEcho, local_addr=("127.0.0.1", 0))
    silent = _udp()
    try:
        for target, expected in ((transport.get_extra_info("sockname"), 0.0), (silent.getsockname(), 100.0)):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setblocking(False)
            sock.connect(target)
            try:
                assert await loss(sock, probes=20) == expected
            finally:
                sock.close()
    finally:
        transport.close()
        silent.close()



async def test_a_slow_link_gets_a_throughput_figure_from_a_run_sized_to_its_rate() -> None:
    """``clusterprobe.throughput`` against the responder behind a link of about 2 Mbit/s: the second run is sized from the
    first's rate, far below the 8 MiB limit (which would take ~34 s there), and the figure comes back without an error."""
    limit = 8 << 20
    responder = await asyncio.start_server(respond, "127.0.0.1", 0)
    target = responder.sockets[0].getsockname()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:  # at most 2 Mbit/s towards the responder
        up_reader, up_writer = await asyncio.open_connection(*target)
        header = await reader.readexactly(9)  # b"S" and the run's size
        sizes.append(int.from_bytes(header[1:], "big"))
        up_writer.write(header)

        async def down() -> None:
            while data := await up_reader.read(1 << 16):
                writer.write(data)
                await writer.drain()

        answers = asyncio.create_task(down())
        try:
            while data := await reader.read(4096):
                up_writer.write(data)
                await up_writer.drain()
                await asyncio.sleep(4096 * 8 / 2e6)
            await answers
        finally:
            answers.cancel()
            up_writer.close()
            writer.close()

    link = await asyncio.start_server(slow, "127.0.0.1", 0)
    sizes: list[int] = []

    async def attempt(run: Run) -> tuple[float | None, str | None]:
        reader, writer = await asyncio.open_connection(*link.sockets[0].getsockname())
        try:
            return await run(reader, writer), None
        finally:
            writer.close()

    try:
        mbit_s, error = await throughput(attempt, limit)
    finally:
        link.close()
        responder.close()
    assert error is None and mbit_s is not None and 0 < mbit_s <= 2.5, (mbit_s, error)
    assert len(sizes) == 2 and sizes[0] == PROBE_BYTES and PROBE_BYTES <= sizes[1] < limit // 8, sizes
