"""The stream multiplexer of the agent link (``shared.streams``): codec, state, flow control, fairness, bounds."""

from __future__ import annotations

import json
import os
import struct
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.errors import ProtocolError
from shared.streams import (
    HEADER,
    HEADER_SIZE,
    LARGE_DATA,
    MAX_DATA,
    MAX_OPEN_HEADER,
    DataReceived,
    Event,
    Frame,
    FrameType,
    Multiplexer,
    OpenRequest,
    ResetCode,
    StreamClosed,
    StreamClosedError,
    StreamLimitError,
    StreamOpened,
    StreamProtocolError,
    StreamReset,
    StreamState,
    Writable,
    agree_max_data,
    decode_frame,
    decode_open_header,
    encode_frame,
    encode_open_header,
    welcomed_max_data,
)
from tests.fuzzing import run_atheris_harness

KIB = 1024


def pair(**limits: int) -> tuple[Multiplexer, Multiplexer]:
    """The agent's side (the initiator: odd ids) and the relay's (even ids), with the same limits."""
    return Multiplexer(initiator=True, **limits), Multiplexer(initiator=False, **limits)


def deliver(sender: Multiplexer, receiver: Multiplexer, max_bytes: int | None = None) -> list[bytes]:
    """Move one turn of frames from ``sender`` to ``receiver``; returns them."""
    frames = sender.data_to_send(max_bytes)
    for frame in frames:
        receiver.receive_frame(frame)
    return frames


def settle(a: Multiplexer, b: Multiplexer) -> None:
    """Move frames both ways until neither side has any."""
    for _ in range(10_000):
        if not deliver(a, b) and not deliver(b, a):
            return
    raise AssertionError("the two sides never settled")


def read_all(mux: Multiplexer, stream_id: int) -> bytes:
    out = bytearray()
    while chunk := mux.read(stream_id):
        out += chunk
    return bytes(out)


def filled_stream(window: int) -> tuple[Multiplexer, int]:
    """The agent's side with ``window`` (both sides start at 4 KiB) and a stream the relay sent it ``window`` bytes on."""
    agent = Multiplexer(initiator=True, initial_window=4 * KIB, window=window)
    relay = Multiplexer(initiator=False, initial_window=4 * KIB)
    stream_id = agent.open_stream()
    settle(agent, relay)
    relay.send(stream_id, b"x" * window)
    settle(agent, relay)
    return agent, stream_id


def opened(events: list[Event]) -> list[int]:
    return [event.stream_id for event in events if isinstance(event, StreamOpened)]


class TestCodec:
    def test_round_trips_every_frame_type(self) -> None:
        """Each frame type decodes to what was encoded."""
        for frame in (
            Frame(FrameType.OPEN, 1, b'{"kind":"ssh"}'),
            Frame(FrameType.OPEN, 2, b""),
            Frame(FrameType.DATA, 3, b"x" * MAX_DATA),
            Frame(FrameType.WINDOW, 4, struct.pack("!I", 1234)),
            Frame(FrameType.CLOSE, 2**32 - 1, b""),
            Frame(FrameType.RESET, 6, struct.pack("!H", 999)),
        ):
            assert decode_frame(encode_frame(frame.type, frame.stream_id, frame.payload)) == frame

    @pytest.mark.parametrize(
        ("message", "code"),
        [
            (b"", "stream_bad_frame"),
            (HEADER.pack(1, 1, 0, 1, 1)[:11], "stream_bad_frame"),
            (HEADER.pack(2, 1, 0, 1, 1) + b"x", "stream_bad_version"),
            (HEADER.pack(1, 9, 0, 1, 1) + b"x", "stream_unknown_type"),
            (HEADER.pack(1, 1, 1, 1, 1) + b"x", "stream_bad_frame"),
            (HEADER.pack(1, 1, 0, 0, 1) + b"x", "stream_bad_id"),
            (HEADER.pack(1, 1, 0, 1, 2) + b"x", "stream_bad_length"),
            (HEADER.pack(1, 1, 0, 1, 0), "stream_bad_length"),
            (HEADER.pack(1, 1, 0, 1, MAX_DATA + 1) + b"x" * (MAX_DATA + 1), "stream_too_big"),
            (
                HEADER.pack(1, 0, 0, 1, MAX_OPEN_HEADER + 1) + b"x" * (MAX_OPEN_HEADER + 1),
                "stream_bad_length",
            ),
            (HEADER.pack(1, 2, 0, 1, 3) + b"xxx", "stream_bad_length"),
            (HEADER.pack(1, 2, 0, 1, 4) + struct.pack("!I", 0), "stream_bad_length"),
            (HEADER.pack(1, 2, 0, 1, 4) + struct.pack("!I", 2**31), "stream_bad_length"),
            (HEADER.pack(1, 3, 0, 1, 1) + b"x", "stream_bad_length"),
            (HEADER.pack(1, 4, 0, 1, 0), "stream_bad_length"),
        ],
    )
    def test_refuses_a_malformed_frame_with_a_code(self, message: bytes, code: str) -> None:
        """A short, versioned-wrong, unknown, flagged, zero-id, mis-sized or oversized frame is a ProtocolError."""
        with pytest.raises(StreamProtocolError) as raised:
            decode_frame(message)
        assert raised.value.code == code
        assert isinstance(raised.value, ProtocolError)
        assert raised.value.close_code == 4000

    def test_encoder_refuses_what_the_decoder_would(self) -> None:
        """The encoder never produces a frame the decoder refuses."""
        with pytest.raises(ValueError):
            encode_frame(FrameType.DATA, 1, b"")
        with pytest.raises(ValueError):
            encode_frame(FrameType.DATA, 0, b"x")

    def test_open_header_round_trips_and_refuses_junk(self) -> None:
        """The relay's OPEN header names a rental, a port and a kind, and nothing else passes."""
        header = encode_open_header("r-123", 22, "ssh")
        assert decode_open_header(header) == OpenRequest("r-123", 22, "ssh")
        for bad in (
            b"not json",
            b"[]",
            json.dumps({"rental_id": "r", "port": 0, "kind": "ssh"}).encode(),
            json.dumps({"rental_id": "r", "port": True, "kind": "ssh"}).encode(),
            json.dumps({"rental_id": "", "port": 22, "kind": "ssh"}).encode(),
            json.dumps({"rental_id": "r", "port": 22, "kind": "udp"}).encode(),
            json.dumps({"rental_id": "r", "port": 22, "kind": "ssh", "x": 1}).encode(),
        ):
            with pytest.raises(StreamProtocolError) as raised:
                decode_open_header(bad)
            assert raised.value.code == "stream_bad_header"
        with pytest.raises(ValueError):
            encode_open_header("r", 70000, "tcp")


class TestExchange:
    def test_many_streams_carry_their_bytes_both_ways(self) -> None:
        """Fifty streams opened from both sides each deliver their bytes, in order, to the other side."""
        agent, relay = pair(initial_window=8 * KIB, max_send_buffer=1 << 20)
        sent: dict[int, bytes] = {}
        for index in range(50):
            side = relay if index % 2 else agent
            stream_id = side.open_stream(encode_open_header(f"r-{index}", 22, "ssh"))
            payload = bytes([index]) * (1000 * index + 1)
            assert side.send(stream_id, payload) == len(payload)
            side.close(stream_id)
            sent[stream_id] = payload
        received: dict[int, bytearray] = {}
        for _ in range(1000):
            moved = deliver(agent, relay) + deliver(relay, agent)
            for side in (agent, relay):
                for event in side.events():
                    if isinstance(event, StreamOpened):
                        assert decode_open_header(event.header).port == 22
                        side.close(event.stream_id)
                    if isinstance(event, DataReceived | StreamClosed):
                        received.setdefault(event.stream_id, bytearray()).extend(
                            read_all(side, event.stream_id)
                        )
            if not moved:
                break
        assert {key: bytes(value) for key, value in received.items()} == sent
        assert agent.open_streams == relay.open_streams == 0

    def test_ids_have_the_sides_parity(self) -> None:
        """The initiator opens odd ids, the other side even ids, both growing."""
        agent, relay = pair()
        assert [agent.open_stream() for _ in range(3)] == [1, 3, 5]
        assert [relay.open_stream() for _ in range(3)] == [2, 4, 6]

    def test_a_larger_window_is_granted_at_open(self) -> None:
        """A side with ``window`` above the initial one grants the difference in one WINDOW frame."""
        agent, stream_id = filled_stream(64 * KIB)
        assert agent.readable(stream_id) == 64 * KIB


class TestFlowControl:
    def test_sender_never_exceeds_the_window_and_a_slow_reader_stops_it(self) -> None:
        """With nothing read, exactly one window crosses and the rest stays in the sender's buffer."""
        agent, relay = pair(initial_window=16 * KIB, max_send_buffer=1 << 20)
        stream_id = agent.open_stream()
        agent.send(stream_id, b"a" * 100 * KIB)
        settle(agent, relay)
        assert relay.readable(stream_id) == 16 * KIB
        assert agent.data_to_send() == []
        assert agent.bytes_sent == 16 * KIB

    def test_reading_restores_credit(self) -> None:
        """Reading half the window sends it back; the sender then continues, and everything arrives."""
        agent, relay = pair(initial_window=16 * KIB, max_send_buffer=1 << 20)
        stream_id = agent.open_stream()
        payload = bytes(range(256)) * 400
        agent.send(stream_id, payload)
        settle(agent, relay)
        relay.read(stream_id, 7 * KIB)
        assert relay.data_to_send() == []  # under half the window: no WINDOW yet
        got = relay.read(stream_id, 1 * KIB)
        window_frames = [decode_frame(frame) for frame in relay.data_to_send()]
        assert window_frames == [Frame(FrameType.WINDOW, stream_id, struct.pack("!I", 8 * KIB))]
        received = bytearray(payload[: 7 * KIB]) + got
        for frame in window_frames:
            agent.receive_frame(encode_frame(frame.type, frame.stream_id, frame.payload))
        for _ in range(100):
            settle(agent, relay)
            received += read_all(relay, stream_id)
        assert bytes(received) == payload

    def test_send_takes_what_fits_and_says_when_there_is_room(self) -> None:
        """``send`` returns how much it buffered; ``Writable`` comes once the buffer is half drained."""
        agent, relay = pair(initial_window=64 * KIB, max_send_buffer=32 * KIB)
        stream_id = agent.open_stream()
        assert agent.send(stream_id, b"x" * 40 * KIB) == 32 * KIB
        assert agent.writable(stream_id) == 0
        assert agent.send(stream_id, b"y") == 0
        assert agent.events() == []
        deliver(agent, relay)
        assert Writable(stream_id) in agent.events()
        assert agent.writable(stream_id) == 32 * KIB


class TestFairness:
    def test_an_interactive_write_waits_at_most_one_round_behind_twenty_bulk_streams(self) -> None:
        """With 20 streams full of bulk data, a 64-byte write on an idle stream is the next frame out."""
        agent, relay = pair(initial_window=1 << 20, max_send_buffer=1 << 20, max_link_buffer=1 << 30)
        bulk = [agent.open_stream() for _ in range(20)]
        interactive = agent.open_stream()
        for stream_id in bulk:
            agent.send(stream_id, b"b" * (1 << 20))
        deliver(agent, relay, max_bytes=1500 * KIB)  # every bulk stream sent once; the rotation is mid-round
        agent.send(interactive, b"k" * 64)
        frames = [decode_frame(frame) for frame in agent.data_to_send(max_bytes=2 << 20)]
        assert frames[0] == Frame(FrameType.DATA, interactive, b"k" * 64)  # an idle stream goes first
        assert {frame.stream_id for frame in frames[1:21]} == set(bulk)  # then one frame each, round-robin

    def test_a_stream_that_keeps_writing_gets_one_frame_per_round(self) -> None:
        """A stream that writes again as soon as it drains still waits its turn behind the others."""
        agent, _relay = pair(initial_window=1 << 20, max_send_buffer=1 << 20, max_link_buffer=1 << 30)
        bulk = [agent.open_stream() for _ in range(5)]
        for stream_id in bulk:
            agent.send(stream_id, b"b" * (1 << 20))
        eager = agent.open_stream()
        assert len(agent.data_to_send(max_bytes=6 * HEADER.size)) == 6  # the OPEN frames only
        seen: list[int] = []
        for _ in range(30):
            agent.send(eager, b"e" * 100)
            seen += [decode_frame(frame).stream_id for frame in agent.data_to_send(max_bytes=1)]
        assert seen.count(eager) <= 30 // 6 + 1
        assert all(seen.count(stream_id) >= 30 // 6 - 1 for stream_id in bulk)

    def test_max_bytes_bounds_one_turn(self) -> None:
        """``data_to_send(max_bytes)`` hands out about that many bytes and keeps the rest for the next turn."""
        agent, _relay = pair(initial_window=1 << 20, max_send_buffer=1 << 20, max_link_buffer=1 << 30)
        for _ in range(4):
            agent.send(agent.open_stream(), b"z" * (1 << 20))
        turn = agent.data_to_send(max_bytes=100 * KIB)
        assert 100 * KIB <= sum(map(len, turn)) < 100 * KIB + MAX_DATA + 100
        assert agent.data_to_send(max_bytes=100 * KIB)


class TestBounds:
    def test_too_many_streams_are_refused(self) -> None:
        """Past ``max_streams`` a local open raises and a peer's open is reset with REFUSED."""
        agent, relay = pair(max_streams=3)
        for _ in range(3):
            relay.open_stream()
        with pytest.raises(StreamLimitError):
            relay.open_stream()
        agent.open_stream()
        settle(agent, relay)  # relay already holds 3: the agent's stream 1 is refused
        assert StreamReset(1, ResetCode.REFUSED, by_peer=True) in agent.events()
        assert agent.state(1) is None

    def test_the_link_buffer_bounds_how_many_windows_are_promised(self) -> None:
        """A stream whose window would pass ``max_link_buffer`` is refused."""
        agent = Multiplexer(initiator=True, initial_window=64 * KIB)
        relay = Multiplexer(initiator=False, initial_window=64 * KIB, max_link_buffer=128 * KIB)
        for _ in range(3):
            agent.open_stream()
        settle(agent, relay)
        assert opened(relay.events()) == [1, 3]
        assert StreamReset(5, ResetCode.REFUSED, by_peer=True) in agent.events()

    def test_the_larger_window_goes_to_streams_while_half_the_link_buffer_is_free(self) -> None:
        """Streams get ``window`` while the windows given leave half of ``max_link_buffer`` free, then the
        initial window, and the link still admits streams until their windows fill it."""
        agent = Multiplexer(initiator=True, initial_window=4 * KIB)
        relay = Multiplexer(initiator=False, initial_window=4 * KIB, window=16 * KIB, max_link_buffer=40 * KIB)
        for _ in range(8):
            stream_id = agent.open_stream()
            agent.send(stream_id, b"x" * 32 * KIB)
        for _ in range(4):
            settle(agent, relay)
        # 16 KiB (24 left free), then 4 KiB windows (16 + 16 would leave less than half): 7 streams fill 40 KiB.
        assert [relay.readable(stream_id) for stream_id in range(1, 15, 2)] == [16 * KIB] + [4 * KIB] * 6
        assert StreamReset(15, ResetCode.REFUSED, by_peer=True) in agent.events()

    def test_a_stream_grants_back_half_of_its_own_window(self) -> None:
        """A stream with the larger window sends WINDOW after reading half of it, not half of the initial one."""
        agent, stream_id = filled_stream(16 * KIB)
        agent.read(stream_id, 4 * KIB)
        assert agent.data_to_send() == []  # a quarter read: nothing granted yet
        agent.read(stream_id, 4 * KIB)
        assert agent.data_to_send() == [encode_frame(FrameType.WINDOW, stream_id, struct.pack("!I", 8 * KIB))]

    def test_a_peer_that_overruns_its_window_is_reset(self) -> None:
        """DATA beyond the credit given resets that stream with FLOW_CONTROL; the link and other streams go on."""
        agent, relay = pair(initial_window=4 * KIB)
        stream_id, other = agent.open_stream(), agent.open_stream()
        settle(agent, relay)
        relay.events()
        relay.receive_frame(encode_frame(FrameType.DATA, stream_id, b"x" * 4 * KIB))
        relay.receive_frame(encode_frame(FrameType.DATA, stream_id, b"x"))
        assert StreamReset(stream_id, ResetCode.FLOW_CONTROL, by_peer=False) in relay.events()
        assert relay.readable(stream_id) == 0
        deliver(relay, agent)
        assert StreamReset(stream_id, ResetCode.FLOW_CONTROL, by_peer=True) in agent.events()
        agent.send(other, b"fine")
        settle(agent, relay)
        assert relay.read(other) == b"fine"

    def test_buffers_never_pass_their_bounds(self) -> None:
        """However much is sent and nothing read, each stream holds at most a window and the link its bound."""
        agent, relay = pair(initial_window=32 * KIB, max_send_buffer=64 * KIB, max_link_buffer=256 * KIB)
        streams = [agent.open_stream() for _ in range(8)]
        for _ in range(5):
            for stream_id in streams:
                agent.send(stream_id, b"q" * 100 * KIB)
            settle(agent, relay)
            assert all(relay.readable(stream_id) <= 32 * KIB for stream_id in streams)
            assert relay.buffered <= 256 * KIB
            assert all(agent.writable(stream_id) >= 0 for stream_id in streams)

    def test_a_flood_of_refused_opens_that_nobody_drains_is_a_link_error(self) -> None:
        """A peer that makes this side queue more than ``max_pending_control`` frames gets the link closed."""
        relay = Multiplexer(initiator=False, max_streams=1, max_pending_control=10)
        with pytest.raises(StreamProtocolError) as raised:
            for stream_id in range(1, 100, 2):
                relay.receive_frame(encode_frame(FrameType.OPEN, stream_id))
        assert raised.value.code == "stream_flood"


class TestLinkErrors:
    @pytest.mark.parametrize(
        ("frame", "code"),
        [
            (encode_frame(FrameType.OPEN, 2), "stream_bad_id"),  # the relay's parity, from the agent
            (encode_frame(FrameType.DATA, 7, b"x"), "stream_bad_id"),  # never opened
            (encode_frame(FrameType.WINDOW, 4, struct.pack("!I", 1)), "stream_bad_id"),  # ours, never opened
        ],
    )
    def test_frames_for_ids_the_peer_may_not_use_close_the_link(self, frame: bytes, code: str) -> None:
        """An OPEN of the wrong parity or a frame for a never-opened id raises."""
        relay = Multiplexer(initiator=False)
        with pytest.raises(StreamProtocolError) as raised:
            relay.receive_frame(frame)
        assert raised.value.code == code

    def test_reopening_an_id_closes_the_link(self) -> None:
        """Ids only grow: an OPEN of an id already used raises."""
        relay = Multiplexer(initiator=False)
        relay.receive_frame(encode_frame(FrameType.OPEN, 3))
        with pytest.raises(StreamProtocolError):
            relay.receive_frame(encode_frame(FrameType.OPEN, 1))

    def test_credit_past_the_maximum_closes_the_link(self) -> None:
        """WINDOW increments that push the credit past 2**31-1 raise."""
        agent, relay = pair()
        stream_id = agent.open_stream()
        settle(agent, relay)
        with pytest.raises(StreamProtocolError):
            agent.receive_frame(encode_frame(FrameType.WINDOW, stream_id, struct.pack("!I", 2**31 - 1)))


class TestAgreedFrameSize:
    """A link may agree DATA frames above protocol v1's 64 KiB (the agent offers, the relay's welcome says)."""

    def test_a_link_that_agreed_larger_frames_sends_them_and_delivers_every_byte(self) -> None:
        """With ``max_data=LARGE_DATA`` a full stream goes in LARGE_DATA frames, read back intact."""
        agent, relay = pair(max_data=LARGE_DATA, window=1 << 20, max_send_buffer=1 << 20)
        stream_id = agent.open_stream()
        settle(agent, relay)
        payload = os.urandom(1 << 20)
        assert agent.send(stream_id, payload) == len(payload)
        frames = deliver(agent, relay, max_bytes=1 << 20)
        sizes = [len(frame) - HEADER_SIZE for frame in frames if frame[1] == FrameType.DATA]
        assert sizes == [LARGE_DATA] * 4
        assert read_all(relay, stream_id) == payload

    def test_beside_another_sending_stream_frames_keep_protocol_v1s_size(self) -> None:
        """Two bulk streams share the link in 64 KiB frames (a keystroke waits behind no larger one); once one
        is done, the other goes on in the agreed size."""
        agent, relay = pair(max_data=LARGE_DATA, window=1 << 20, max_send_buffer=1 << 20)
        first, second = agent.open_stream(), agent.open_stream()
        settle(agent, relay)
        agent.send(first, b"a" * (512 * KIB))
        agent.send(second, b"b" * (128 * KIB))
        frames = [HEADER.unpack_from(frame)[3:] for frame in deliver(agent, relay)]  # (stream id, payload size)
        last_of_second = max(index for index, (stream_id, _) in enumerate(frames) if stream_id == second)
        assert all(size <= MAX_DATA for _, size in frames[: last_of_second + 1]), frames
        assert (first, LARGE_DATA) in frames[last_of_second + 1 :], frames
        assert read_all(relay, first) == b"a" * (512 * KIB) and read_all(relay, second) == b"b" * (128 * KIB)

    @pytest.mark.parametrize("max_data", [MAX_DATA, LARGE_DATA])
    def test_a_frame_over_the_agreed_size_closes_the_link(self, max_data: int) -> None:
        """DATA of exactly the agreed size is taken; one byte more is a link error, whatever was agreed."""
        relay = Multiplexer(initiator=False, max_data=max_data, initial_window=1 << 20)
        relay.receive_frame(encode_frame(FrameType.OPEN, 1))
        relay.receive_frame(HEADER.pack(1, FrameType.DATA, 0, 1, max_data) + b"x" * max_data)
        assert relay.readable(1) == max_data
        with pytest.raises(StreamProtocolError) as raised:
            relay.receive_frame(HEADER.pack(1, FrameType.DATA, 0, 1, max_data + 1) + b"x" * (max_data + 1))
        assert raised.value.code == "stream_too_big"

    @pytest.mark.parametrize("limits", [{"max_data": MAX_DATA - 1}, {"max_data": LARGE_DATA + 1},
                                        {"max_frame_payload": MAX_DATA + 1}])  # fmt: skip
    def test_sizes_outside_the_protocol_are_refused(self, limits: dict[str, int]) -> None:
        """``max_data`` lies in MAX_DATA .. LARGE_DATA, and a side sends no frame above it."""
        with pytest.raises(ValueError):
            Multiplexer(initiator=True, **limits)

    @pytest.mark.parametrize(
        ("offered", "ours", "agreed"),
        [
            (str(LARGE_DATA), LARGE_DATA, LARGE_DATA),
            ("131072", LARGE_DATA, 131072),  # the agent's smaller offer
            (str(4 * LARGE_DATA), LARGE_DATA, LARGE_DATA),  # the relay's limit
            (str(4 * LARGE_DATA), 4 * LARGE_DATA, LARGE_DATA),  # never above the protocol's
            (str(LARGE_DATA), MAX_DATA, None),  # a relay that keeps 64 KiB says nothing
            (str(MAX_DATA), LARGE_DATA, None),
            ("-1", LARGE_DATA, None),
            ("lots", LARGE_DATA, None),
            ("+262144", LARGE_DATA, None),  # what int() would take, our grammar does not
            ("262_144", LARGE_DATA, None),
            (" 262144", LARGE_DATA, None),
            ("262144\n", LARGE_DATA, None),
            ("\u0662\u0666\u0662\u0661\u0664\u0664", LARGE_DATA, None),  # Arabic-Indic digits
            ("9" * 400, LARGE_DATA, None),
            (None, LARGE_DATA, None),  # an agent that offers nothing: an older one
        ],
    )
    def test_the_relay_agrees_the_smaller_offer_or_nothing(self, offered: str | None, ours: int, agreed: int | None) -> None:
        assert agree_max_data(offered, ours) == agreed

    def test_the_agent_takes_what_the_welcome_says_within_its_offer(self) -> None:
        """No field: 64 KiB (an older relay). A size outside (64 KiB, offer] is a protocol error."""
        assert welcomed_max_data(None, LARGE_DATA) == MAX_DATA
        assert welcomed_max_data(131072, LARGE_DATA) == 131072
        for wrong in (LARGE_DATA + 1, MAX_DATA, 1):
            with pytest.raises(StreamProtocolError):
                welcomed_max_data(wrong, LARGE_DATA)


class TestHalfCloseAndReset:
    def test_each_half_closes_on_its_own(self) -> None:
        """After the agent's CLOSE the relay still sends; the stream is forgotten once both halves end."""
        agent, relay = pair()
        stream_id = agent.open_stream()
        agent.send(stream_id, b"request")
        agent.close(stream_id)
        assert agent.state(stream_id) is StreamState.OPEN  # CLOSE not sent yet
        settle(agent, relay)
        assert agent.state(stream_id) is StreamState.HALF_CLOSED_LOCAL
        assert relay.state(stream_id) is StreamState.HALF_CLOSED_REMOTE
        assert relay.events() == [
            StreamOpened(stream_id, b""),
            DataReceived(stream_id),
            StreamClosed(stream_id),
        ]
        assert read_all(relay, stream_id) == b"request"
        with pytest.raises(StreamClosedError):
            agent.send(stream_id, b"more")
        relay.send(stream_id, b"response")
        relay.close(stream_id)
        settle(agent, relay)
        assert relay.state(stream_id) is None
        assert agent.state(stream_id) is StreamState.CLOSED  # until its data is read
        assert read_all(agent, stream_id) == b"response"
        assert agent.state(stream_id) is None

    def test_data_after_the_peers_close_resets_the_stream(self) -> None:
        """DATA (or a second CLOSE) after the peer's CLOSE resets that stream with STREAM_CLOSED."""
        agent, relay = pair()
        stream_id = agent.open_stream()
        agent.close(stream_id)
        settle(agent, relay)
        relay.events()
        relay.receive_frame(encode_frame(FrameType.DATA, stream_id, b"late"))
        assert relay.events() == [StreamReset(stream_id, ResetCode.STREAM_CLOSED, by_peer=False)]
        assert decode_frame(relay.data_to_send()[0]) == Frame(
            FrameType.RESET, stream_id, struct.pack("!H", ResetCode.STREAM_CLOSED)
        )

    def test_reset_drops_both_directions_and_late_frames_are_ignored(self) -> None:
        """A reset forgets the stream at once; frames still in flight for it are dropped without error."""
        agent, relay = pair()
        stream_id = agent.open_stream()
        agent.send(stream_id, b"x" * 1000)
        settle(agent, relay)
        relay.send(stream_id, b"in flight")
        in_flight = relay.data_to_send()
        agent.reset(stream_id, 300)
        for frame in in_flight:
            agent.receive_frame(frame)
        assert agent.readable(stream_id) == 0 and agent.state(stream_id) is None
        deliver(agent, relay)
        assert StreamReset(stream_id, 300, by_peer=True) in relay.events()
        assert relay.state(stream_id) is None
        with pytest.raises(StreamClosedError):
            relay.send(stream_id, b"x")

    def test_losing_the_link_resets_every_stream(self) -> None:
        """``connection_lost`` ends each open stream with LINK_LOST."""
        agent, _relay = pair()
        ids = [agent.open_stream() for _ in range(3)]
        assert agent.stream_ids() == ids
        agent.connection_lost()
        assert agent.events() == [StreamReset(i, ResetCode.LINK_LOST, by_peer=True) for i in ids]
        assert agent.data_to_send() == []


# ---- properties -------------------------------------------------------------------------------

PROPERTY = settings(
    max_examples=300,
    deadline=timedelta(seconds=2),
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def pattern(stream_id: int, offset: int, size: int) -> bytes:
    """Bytes that say which stream and offset they belong to, so a lost, doubled or swapped chunk shows."""
    return bytes((stream_id * 7 + offset + index) % 251 for index in range(size))


class _Side:
    """One multiplexer with what its application wrote and read, per stream."""

    def __init__(self, mux: Multiplexer) -> None:
        self.mux = mux
        self.written: dict[int, int] = {}
        self.received: dict[int, bytearray] = {}
        self.closed: set[int] = set()
        self.eof: set[int] = set()
        self.resets: list[StreamReset] = []

    def drain_events(self) -> None:
        for event in self.mux.events():
            if isinstance(event, StreamOpened):
                self.written.setdefault(event.stream_id, 0)
                self.received.setdefault(event.stream_id, bytearray())
            elif isinstance(event, StreamClosed):
                self.eof.add(event.stream_id)
            elif isinstance(event, StreamReset):
                self.resets.append(event)


# Weighted by repetition: writes, reads and deliveries are what move bytes.
ACTIONS = (
    ["open"] * 2
    + ["write"] * 5
    + ["read"] * 3
    + ["close", "reset", "turn_a"]
    + ["deliver_a", "deliver_b"] * 2
)


class TestProperties:
    @PROPERTY
    @given(
        steps=st.lists(
            st.tuples(
                st.sampled_from(ACTIONS),
                st.integers(0, 7),
                st.integers(1, 6000),
            ),
            min_size=10,
            max_size=200,
        ),
        window=st.sampled_from([1000, 4 * KIB, 10_000]),
        max_frame=st.integers(1, 3000),
    )
    def test_every_byte_arrives_once_in_order_and_no_window_is_exceeded(
        self, steps: list[tuple[str, int, int]], window: int, max_frame: int
    ) -> None:
        """Random opens, writes, reads, closes, resets and partial deliveries lose, double or reorder no byte,
        and no stream is reset but those asked for (so no window was ever exceeded)."""
        a = _Side(
            Multiplexer(
                initiator=True, initial_window=window, max_send_buffer=8 * KIB, max_frame_payload=max_frame
            )
        )
        b = _Side(
            Multiplexer(
                initiator=False, initial_window=window, max_send_buffer=8 * KIB, max_frame_payload=max_frame
            )
        )
        in_flight: dict[str, list[bytes]] = {"a": [], "b": []}
        aborted: set[int] = set()
        sides = {"a": a, "b": b}

        def check_windows() -> None:
            for side in (a, b):
                for stream_id in side.received:
                    assert side.mux.readable(stream_id) <= window

        def deliver_some(name: str, count: int) -> None:
            other = b if name == "a" else a
            queue = in_flight[name]
            for frame in queue[:count]:
                other.mux.receive_frame(frame)
            del queue[:count]
            other.drain_events()
            check_windows()

        def read_some(side: _Side, stream_id: int, size: int) -> None:
            if stream_id in side.received:
                side.received[stream_id] += side.mux.read(stream_id, size)

        for action, pick, size in steps:
            side = a if pick < 4 else b
            ids = sorted(side.written)
            stream_id = ids[pick % len(ids)] if ids else None
            if action == "open" and side.mux.open_streams < 6:
                new = side.mux.open_stream()
                side.written[new] = 0
                side.received[new] = bytearray()
            elif (
                action == "write"
                and stream_id is not None
                and stream_id not in side.closed
                and side.mux.state(stream_id) is not None
            ):
                offset = side.written[stream_id]
                side.written[stream_id] += side.mux.send(stream_id, pattern(stream_id, offset, size))
            elif action == "read" and stream_id is not None:
                read_some(side, stream_id, size)
            elif action == "close" and stream_id is not None:
                side.mux.close(stream_id)
                side.closed.add(stream_id)
            elif action == "reset" and stream_id is not None and size % 8 == 0:  # rarely: most streams finish
                side.mux.reset(stream_id, 300)
                aborted.add(stream_id)
            elif action in ("deliver_a", "deliver_b"):
                name = action[-1]
                in_flight[name] += sides[name].mux.data_to_send(max_bytes=size)
                deliver_some(name, pick + 1)
            elif action == "turn_a":
                in_flight["a"] += a.mux.data_to_send()
            a.drain_events()
            b.drain_events()

        # Then everything is read and delivered until the two sides settle.
        for _ in range(10_000):
            moved = False
            for name, side in sides.items():
                in_flight[name] += side.mux.data_to_send()
                if in_flight[name]:
                    moved = True
                    deliver_some(name, len(in_flight[name]))
            for side in (a, b):
                for stream_id in side.received:
                    before = len(side.received[stream_id])
                    read_some(side, stream_id, 1 << 20)
                    moved = moved or len(side.received[stream_id]) != before
            if not moved:
                break
        for reset in a.resets + b.resets:  # only the resets asked for, never a flow-control one
            assert reset.stream_id in aborted and reset.code == 300 and reset.by_peer
        for writer, reader in ((a, b), (b, a)):
            for stream_id, count in writer.written.items():
                got = bytes(reader.received[stream_id])
                if stream_id in aborted:  # a prefix of what was written, nothing doubled or reordered
                    assert got == pattern(stream_id, 0, len(got)) and len(got) <= count
                    continue
                assert got == pattern(stream_id, 0, count)
                if stream_id in writer.closed:
                    assert stream_id in reader.eof

    @PROPERTY
    @given(
        st.lists(
            st.binary(max_size=64)
            | st.builds(
                lambda t, i, p: HEADER.pack(1, t, 0, i, len(p)) + p,
                st.integers(0, 5),
                st.integers(0, 9),
                st.binary(max_size=8),
            ),
            max_size=30,
        )
    )
    def test_receive_frame_raises_only_its_protocol_error(self, messages: list[bytes]) -> None:
        """Random bytes and near-valid frames fed to a multiplexer raise nothing but StreamProtocolError."""
        mux = Multiplexer(initiator=False, initial_window=16, max_streams=3)
        for message in messages:
            try:
                mux.receive_frame(message)
            except StreamProtocolError as error:
                assert error.code.startswith("stream_") and len(error.message) < 200
            mux.data_to_send()
            for event in mux.events():
                if isinstance(event, DataReceived):
                    assert mux.readable(event.stream_id) <= 16
                    mux.read(event.stream_id)


class TestAtherisHarness:
    def test_fuzz_streams_runs_clean(self, tmp_path: Path) -> None:
        """fuzz/fuzz_streams.py feeds 50 000 libFuzzer conversations grown from valid ones without a failure."""
        run_atheris_harness("fuzz_streams.py", tmp_path, runs=50_000)
