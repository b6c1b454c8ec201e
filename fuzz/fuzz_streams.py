"""libFuzzer harness (atheris) for the agent link's stream multiplexer: ``Multiplexer.receive_frame`` in
``shared/streams/``.

Each input is a sequence of binary websocket messages, each prefixed by its length (u16,
big-endian), fed in turn to the relay's side of a link with small limits. Nothing but
``StreamProtocolError`` may escape (it closes the link, so the input ends there); after each
message every frame the multiplexer sends must decode, no stream may hold more unread bytes
than its window, and the link no more streams or bytes than its bounds.

Run from the repository root, with the test extras installed::

    mkdir -p /tmp/corpus-streams
    .venv/bin/python fuzz/fuzz_streams.py -max_total_time=600 -timeout=5 -rss_limit_mb=2048 -keep_seed=1 /tmp/corpus-streams

An empty corpus directory is first seeded with valid conversations (open, data, window, close,
reset). ``tests/test_streams.py`` runs this harness for a bounded number of runs.
"""

from __future__ import annotations

import struct

import atheris
from harness import fuzz  # fuzz/harness.py: this script's folder is first on sys.path

with atheris.instrument_imports(include=["shared"]):
    from shared.streams import (
        DataReceived,
        FrameType,
        Multiplexer,
        StreamProtocolError,
        decode_frame,
        encode_frame,
    )

WINDOW = 64
MAX_STREAMS = 4
LENGTH = struct.Struct("!H")


def messages(data: bytes) -> list[bytes]:
    out = []
    while len(data) >= LENGTH.size:
        (size,) = LENGTH.unpack_from(data)
        out.append(data[LENGTH.size : LENGTH.size + size])
        data = data[LENGTH.size + size :]
    return out


def conversation(*frames: bytes) -> bytes:
    return b"".join(LENGTH.pack(len(frame)) + frame for frame in frames)


def seeds() -> list[bytes]:
    window = struct.pack("!I", 32)
    return [
        conversation(encode_frame(FrameType.OPEN, 1, b'{"rental_id":"r-1","port":22,"kind":"ssh"}')),
        conversation(
            encode_frame(FrameType.OPEN, 1),
            encode_frame(FrameType.DATA, 1, b"x" * 40),
            encode_frame(FrameType.WINDOW, 1, window),
            encode_frame(FrameType.DATA, 1, b"y" * 30),
            encode_frame(FrameType.CLOSE, 1),
        ),
        conversation(
            encode_frame(FrameType.OPEN, 1),
            encode_frame(FrameType.OPEN, 3),
            encode_frame(FrameType.RESET, 1, struct.pack("!H", 0)),
            encode_frame(FrameType.DATA, 1, b"late"),
            encode_frame(FrameType.WINDOW, 2, window),
        ),
        conversation(*(encode_frame(FrameType.OPEN, stream_id) for stream_id in range(1, 12, 2))),
    ]


def test_one_input(data: bytes) -> None:
    mux = Multiplexer(initiator=False, initial_window=WINDOW, window=2 * WINDOW, max_streams=MAX_STREAMS,
                      max_link_buffer=MAX_STREAMS * 2 * WINDOW, max_pending_control=64)  # fmt: skip
    mux.open_stream(b"relay's own")  # so that frames for an even id have a stream to hit
    for number, message in enumerate(messages(data)):
        try:
            mux.receive_frame(message)
        except StreamProtocolError:
            return
        if mux.open_streams > MAX_STREAMS or mux.buffered > MAX_STREAMS * 2 * WINDOW:
            raise AssertionError("a bound of the link was passed")
        for event in mux.events():
            if isinstance(event, DataReceived):
                if mux.readable(event.stream_id) > 2 * WINDOW:
                    raise AssertionError(f"stream {event.stream_id} holds more than its window")
                if number % 2:  # read half the time, so that windows both fill and return
                    mux.read(event.stream_id)
        for frame in mux.data_to_send():
            decode_frame(frame)


if __name__ == "__main__":
    fuzz(seeds, test_one_input)
