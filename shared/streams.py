"""Byte streams multiplexed over one agent link: a binary frame codec and a Sans-I/O state machine.

The agent's websocket to its relay carries the JSON protocol (``shared.protocol``) as *text*
messages and stream frames as *binary* messages, one frame per message, so the two never mix.
This module owns the stream frames and the per-link state; it does no I/O, keeps no clock and
imports only ``shared`` and the standard library. The shape follows hashicorp/yamux's spec.

Frame (all integers big-endian)::

    0       1       2               4                       8                      12
    +-------+-------+---------------+-----------------------+-----------------------+---------
    |version| type  | flags (= 0)   | stream id (u32, != 0) | payload length (u32)  | payload
    +-------+-------+---------------+-----------------------+-----------------------+---------

=========  ====================================================================================
type       payload
=========  ====================================================================================
OPEN  0    what the stream is for: opaque bytes the upper layer defines, at most
           ``MAX_OPEN_HEADER`` (see ``encode_open_header`` for the relay's JSON)
DATA  1    1 .. ``MAX_DATA`` bytes of the stream
WINDOW 2   u32 credit increment, >= 1: the sender may send that many more DATA bytes
CLOSE 3    empty: the sender's half is finished (FIN); it still reads
RESET 4    u16 code (``ResetCode`` or an application code >= 256): abort both halves
=========  ====================================================================================

Stream ids: the side that dialled the link (the agent; ``initiator=True``) opens odd ids, the
other side (the relay, which opens streams towards the agent for renters) even ids. Ids only
grow and are never reused; id 0 is never valid.

States of one stream (``StreamState``), local = this side's sending half::

    (idle) --open_stream / peer OPEN-->  OPEN
    OPEN   --close() and buffer sent, CLOSE emitted--> HALF_CLOSED_LOCAL
    OPEN   --peer CLOSE-->               HALF_CLOSED_REMOTE
    HALF_CLOSED_LOCAL  --peer CLOSE-->   CLOSED
    HALF_CLOSED_REMOTE --our CLOSE-->    CLOSED
    any    --reset() / peer RESET / violation--> RESET (forgotten at once)
    CLOSED --everything received read--> forgotten

In HALF_CLOSED_REMOTE or CLOSED a peer DATA or CLOSE is a violation *of that stream*: it is
reset with ``ResetCode.STREAM_CLOSED``. DATA beyond the credit this side gave is reset with
``ResetCode.FLOW_CONTROL``. Frames for a forgotten stream (a reset crossing data on the wire)
are ignored. A malformed frame, an OPEN of the wrong parity or of a reused id, or a frame for
an id that was never opened is a *link* error: ``receive_frame`` raises ``StreamProtocolError``
and the caller closes the websocket with its ``close_code``.

Flow control: each direction of each stream starts with ``initial_window`` bytes of credit
(part of the protocol: both ends of a link use the same; the default ``INITIAL_WINDOW`` is
protocol version 1's). A receiver with a larger ``window`` grants the difference by a WINDOW
frame when the stream opens. ``read`` consumes received bytes and grants them back, by one
WINDOW frame once at least half the window is consumed. The bytes received but not yet read
are therefore at most ``window`` per stream; the link reserves ``window`` per open stream and
refuses a stream (RESET ``REFUSED``) whose reservation would pass ``max_link_buffer``.

Sending: ``send`` copies into the stream's send buffer up to ``max_send_buffer`` and returns
how many bytes it took; the caller keeps the rest and retries on ``Writable``.
``data_to_send`` hands out frames: first control frames (OPEN, WINDOW, RESET), then DATA and
CLOSE round-robin, one frame of at most ``max_frame_payload`` per stream per round, the
rotation kept across calls. As in fq_codel, a stream that had nothing to send and now has
(a keystroke on an idle shell) goes before the rotation for its first frame, then joins its
end, and leaves the rotation only when its turn finds it empty: a write on an idle stream
waits behind no bulk frame, one on a busy stream at most one round, and no stream gets more
than one frame per round however it writes. Its ``max_bytes`` bounds one turn: a caller that
sends at most ``max_bytes`` of stream frames, then its own JSON messages (heartbeats, acks),
then the next turn, keeps those on time whatever the streams carry.
"""

from __future__ import annotations

import enum
import json
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Final

from shared.errors import GpumarketError, ProtocolError

__all__ = [
    "HEADER",
    "INITIAL_WINDOW",
    "MAX_DATA",
    "MAX_OPEN_HEADER",
    "VERSION",
    "DataReceived",
    "Event",
    "Frame",
    "FrameType",
    "Multiplexer",
    "OpenRequest",
    "ResetCode",
    "StreamClosed",
    "StreamClosedError",
    "StreamLimitError",
    "StreamOpened",
    "StreamProtocolError",
    "StreamReset",
    "StreamState",
    "Writable",
    "decode_frame",
    "decode_open_header",
    "encode_frame",
    "encode_open_header",
]

VERSION: Final = 1
HEADER: Final = struct.Struct("!BBHII")
HEADER_SIZE: Final = HEADER.size  # 12
MAX_DATA: Final = 64 * 1024  # the largest DATA payload a receiver accepts (protocol version 1)
MAX_OPEN_HEADER: Final = 4096
INITIAL_WINDOW: Final = 256 * 1024
MAX_WINDOW: Final = 2**31 - 1
MAX_STREAM_ID: Final = 2**32 - 1
CLOSE_BAD_FRAME: Final = 4000  # shared.protocol's close code for an invalid frame


class FrameType(enum.IntEnum):
    OPEN = 0
    DATA = 1
    WINDOW = 2
    CLOSE = 3
    RESET = 4


class ResetCode(enum.IntEnum):
    """Why a stream was reset. Codes 0..255 are this module's; 256 and up are the upper layer's."""

    CANCEL = 0  # the application aborted it
    REFUSED = 1  # too many streams or no buffer left on this link, or nobody takes that kind
    FLOW_CONTROL = 2  # the peer sent beyond the credit it was given
    STREAM_CLOSED = 3  # DATA or CLOSE after the peer's own CLOSE
    LINK_LOST = 4  # the link went away (local only: never on the wire)
    CONNECT_FAILED = 5  # the target (a port in the rental) could not be reached


class StreamState(enum.Enum):
    OPEN = "open"
    HALF_CLOSED_LOCAL = "half_closed_local"
    HALF_CLOSED_REMOTE = "half_closed_remote"
    CLOSED = "closed"


class StreamProtocolError(ProtocolError):
    """The peer broke the stream framing or the link's rules; close the link with ``close_code``."""

    code = "stream_bad_frame"
    close_code = CLOSE_BAD_FRAME


class StreamClosedError(GpumarketError, BrokenPipeError):
    """``send`` or ``close`` on a stream this side finished, that was reset, or never existed."""

    code = "stream_closed"
    http_status = 409


class StreamLimitError(GpumarketError):
    """``open_stream`` would pass ``max_streams`` or ``max_link_buffer``; retry after a stream ends."""

    code = "stream_limit"
    http_status = 503


# ---- codec ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    stream_id: int
    payload: bytes = b""


_WINDOW = struct.Struct("!I")
_RESET = struct.Struct("!H")


def encode_frame(frame_type: FrameType, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame as the bytes of one websocket binary message. Checks what ``decode_frame`` checks."""
    if not 0 < stream_id <= MAX_STREAM_ID:
        raise ValueError(f"stream id {stream_id} out of range")
    _check_payload(FrameType(frame_type), payload, ValueError)
    return HEADER.pack(VERSION, frame_type, 0, stream_id, len(payload)) + payload


def decode_frame(message: bytes | bytearray | memoryview) -> Frame:
    """Parse one binary message; anything but exactly one valid frame raises ``StreamProtocolError``."""
    if len(message) < HEADER_SIZE:
        raise StreamProtocolError(
            f"stream frame of {len(message)} bytes is shorter than its header", code="stream_bad_frame"
        )
    version, raw_type, flags, stream_id, length = HEADER.unpack_from(message)
    if version != VERSION:
        raise StreamProtocolError(
            f"stream frame version {version}; this side speaks {VERSION}", code="stream_bad_version"
        )
    try:
        frame_type = FrameType(raw_type)
    except ValueError:
        raise StreamProtocolError(
            f"unknown stream frame type {raw_type}", code="stream_unknown_type"
        ) from None
    if flags != 0:
        raise StreamProtocolError(
            f"stream frame flags {flags:#x}; version 1 has none", code="stream_bad_frame"
        )
    if stream_id == 0:
        raise StreamProtocolError("stream id 0", code="stream_bad_id")
    if length != len(message) - HEADER_SIZE:
        raise StreamProtocolError(
            f"stream frame says {length} payload bytes and carries {len(message) - HEADER_SIZE}",
            code="stream_bad_length",
        )
    payload = bytes(message[HEADER_SIZE:])
    _check_payload(frame_type, payload, StreamProtocolError)
    return Frame(frame_type, stream_id, payload)


def _check_payload(frame_type: FrameType, payload: bytes, error: type[Exception]) -> None:
    size = len(payload)
    problem = None
    if frame_type is FrameType.OPEN:
        if size > MAX_OPEN_HEADER:
            problem = f"OPEN header of {size} bytes is over {MAX_OPEN_HEADER}"
    elif frame_type is FrameType.DATA:
        if not 0 < size <= MAX_DATA:
            problem = f"DATA of {size} bytes; 1 to {MAX_DATA} allowed"
    elif frame_type is FrameType.WINDOW:
        if size != _WINDOW.size:
            problem = f"WINDOW payload of {size} bytes; 4 expected"
        elif not 0 < _WINDOW.unpack(payload)[0] <= MAX_WINDOW:
            problem = "WINDOW increment must be 1 .. 2**31-1"
    elif frame_type is FrameType.CLOSE:
        if size:
            problem = f"CLOSE carries {size} bytes; none allowed"
    elif size != _RESET.size:
        problem = f"RESET payload of {size} bytes; 2 expected"
    if problem is not None:
        if error is StreamProtocolError:
            code = "stream_too_big" if size > MAX_DATA else "stream_bad_length"
            raise StreamProtocolError(problem, code=code)
        raise error(problem)


# ---- the OPEN header the relay and agent use -------------------------------------------------

STREAM_KINDS: Final = ("ssh", "tcp")


@dataclass(frozen=True, slots=True)
class OpenRequest:
    """What a renter's stream reaches: the rental, a port in it, and how (the agent's SSH or raw TCP)."""

    rental_id: str
    port: int
    kind: str


def encode_open_header(rental_id: str, port: int, kind: str) -> bytes:
    request = _checked_request(rental_id, port, kind, ValueError)
    return json.dumps(
        {"rental_id": request.rental_id, "port": request.port, "kind": request.kind}, separators=(",", ":")
    ).encode()


def decode_open_header(header: bytes) -> OpenRequest:
    """Parse an OPEN header made by ``encode_open_header``; refuse anything else with ``StreamProtocolError``
    (code ``stream_bad_header``: reset that stream with ``REFUSED``, the link stays)."""
    try:
        value = json.loads(header)
    except (ValueError, RecursionError):
        raise StreamProtocolError("OPEN header is not JSON", code="stream_bad_header") from None
    if not isinstance(value, dict) or set(value) != {"rental_id", "port", "kind"}:
        raise StreamProtocolError(
            "OPEN header needs exactly rental_id, port and kind", code="stream_bad_header"
        )
    return _checked_request(value["rental_id"], value["port"], value["kind"], StreamProtocolError)


def _checked_request(rental_id: object, port: object, kind: object, error: type[Exception]) -> OpenRequest:
    def refuse(problem: str) -> Exception:
        return (
            StreamProtocolError(problem, code="stream_bad_header")
            if error is StreamProtocolError
            else error(problem)
        )

    if not isinstance(rental_id, str) or not 0 < len(rental_id) <= 128 or not rental_id.isprintable():
        raise refuse("rental_id must be 1 to 128 printable characters")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise refuse("port must be 1 .. 65535")
    if kind not in STREAM_KINDS:
        raise refuse(f"kind must be one of {', '.join(STREAM_KINDS)}")
    assert isinstance(kind, str)
    return OpenRequest(rental_id, port, kind)


# ---- events ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamOpened:
    """The peer opened a stream; ``header`` is its OPEN payload. Read, send or reset it."""

    stream_id: int
    header: bytes


@dataclass(frozen=True, slots=True)
class DataReceived:
    """The stream has bytes to ``read`` (one event per stream per ``events()``, however many frames).

    It is not repeated for bytes left unread: read until ``read`` returns ``b""``, or keep track."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class Writable:
    """A stream whose ``send`` came up short has room again (its buffer is at most half full)."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamClosed:
    """The peer finished its half: after what ``read`` still returns, nothing more comes."""

    stream_id: int


@dataclass(frozen=True, slots=True)
class StreamReset:
    """The stream is gone, unread data dropped: ``by_peer`` says who reset it; ``code`` why."""

    stream_id: int
    code: int
    by_peer: bool


Event = StreamOpened | DataReceived | Writable | StreamClosed | StreamReset


# ---- the state machine -----------------------------------------------------------------------


@dataclass(slots=True)
class _Stream:
    stream_id: int
    send_credit: int  # DATA bytes the peer lets us send now
    recv_credit: int  # DATA bytes we let the peer send now
    send_buffer: bytearray = field(default_factory=bytearray)
    recv_buffer: bytearray = field(default_factory=bytearray)
    unacked: int = 0  # bytes read and not yet granted back
    fin_wanted: bool = False  # close() called; CLOSE goes out after the buffer
    fin_sent: bool = False
    fin_received: bool = False
    blocked: bool = False  # a send() came up short: tell the caller when there is room

    @property
    def state(self) -> StreamState:
        if self.fin_sent and self.fin_received:
            return StreamState.CLOSED
        if self.fin_sent:
            return StreamState.HALF_CLOSED_LOCAL
        if self.fin_received:
            return StreamState.HALF_CLOSED_REMOTE
        return StreamState.OPEN


class Multiplexer:
    """One side of a link's streams. Feed it frames with ``receive_frame``, drain ``data_to_send``
    and ``events``; nothing here blocks or does I/O. Not thread-safe: one task owns it.

    ``initiator``: this side dialled the link (the agent: odd ids); the relay passes ``False``.
    ``initial_window``: the credit each stream starts with in each direction; equal on both ends.
    ``window``: this side's receive window per stream (default ``initial_window``), the most it
    buffers unread per stream. ``max_frame_payload``: the largest DATA this side sends.
    ``max_streams``, ``max_link_buffer``: open streams, and the sum of their windows, per link.
    ``max_send_buffer``: unsent bytes ``send`` takes per stream. ``max_pending_control``:
    control frames the peer may make this side queue before the caller drains them.

    A typical turn of the link's owner::

        for message in received_binary_messages:
            mux.receive_frame(message)          # StreamProtocolError: close the link
        for event in mux.events():
            ...                                 # accept/refuse, read, resume writes, end splices
        for frame in mux.data_to_send(max_bytes=256 * 1024):
            send_binary(frame)
        send_due_json_messages()                # heartbeats, acks: between turns
    """

    def __init__(
        self,
        *,
        initiator: bool,
        # Flow control (``initial_window`` must be equal on both ends of a link)
        initial_window: int = INITIAL_WINDOW,
        window: int | None = None,
        # Limits
        max_frame_payload: int = MAX_DATA,
        max_streams: int = 256,
        max_send_buffer: int = 256 * 1024,
        max_link_buffer: int = 64 * 1024 * 1024,
        max_pending_control: int = 4096,
    ) -> None:
        window = initial_window if window is None else window
        if not 0 < initial_window <= window <= MAX_WINDOW:
            raise ValueError("need 0 < initial_window <= window <= 2**31-1")
        if not 0 < max_frame_payload <= MAX_DATA:
            raise ValueError(f"max_frame_payload must be 1 .. {MAX_DATA}")
        if max_streams < 1 or max_send_buffer < 1 or max_pending_control < 1:
            raise ValueError("limits must be positive")
        if max_link_buffer < window:
            raise ValueError("max_link_buffer must hold at least one window")
        self.initiator = initiator
        self.initial_window = initial_window
        self.window = window
        self.max_frame_payload = max_frame_payload
        self.max_streams = max_streams
        self.max_send_buffer = max_send_buffer
        self.max_link_buffer = max_link_buffer
        self.max_pending_control = max_pending_control
        self._streams: dict[int, _Stream] = {}
        self._next_id = 1 if initiator else 2
        self._peer_last_id = 0  # the highest id the peer opened
        self._control: deque[bytes] = deque()
        self._ready: deque[int] = deque()  # streams with DATA or CLOSE to go, in round-robin order
        self._fresh: deque[int] = deque()  # streams that were idle: their next frame goes before the rotation
        self._ready_set: set[int] = set()
        self._events: list[Event] = []
        self._readable: set[int] = set()  # DataReceived already queued since the last events()
        self.bytes_sent = 0  # DATA payload bytes handed out by data_to_send
        self.bytes_received = 0  # DATA payload bytes accepted from the peer

    # ---- what the application calls ----

    def open_stream(self, header: bytes = b"") -> int:
        """Open a stream; its OPEN frame comes first out of ``data_to_send``. Raises ``StreamLimitError``."""
        if len(header) > MAX_OPEN_HEADER:
            raise ValueError(f"OPEN header over {MAX_OPEN_HEADER} bytes")
        if not self._has_room():
            raise StreamLimitError(f"this link has {len(self._streams)} streams open; the limit is reached")
        stream_id = self._next_id
        if stream_id > MAX_STREAM_ID:
            raise StreamLimitError("this link used all its stream ids; open a new link")
        self._next_id += 2
        self._streams[stream_id] = _Stream(
            stream_id, send_credit=self.initial_window, recv_credit=self.initial_window
        )
        self._control.append(encode_frame(FrameType.OPEN, stream_id, header))
        self._grant_extra(stream_id)
        return stream_id

    def send(self, stream_id: int, data: bytes | bytearray | memoryview) -> int:
        """Buffer what fits of ``data`` (up to ``max_send_buffer`` unsent bytes) and return how many bytes
        were taken; the caller keeps the rest and retries on ``Writable``. Raises ``StreamClosedError``
        after ``close``, a reset, or for an unknown id."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.fin_wanted:
            raise StreamClosedError(f"stream {stream_id} is closed for sending")
        taken = min(len(data), self.max_send_buffer - len(stream.send_buffer))
        if taken < len(data):
            stream.blocked = True
        if taken > 0:
            stream.send_buffer += data[:taken]
            if stream.send_credit > 0:
                self._mark_ready(stream_id, fresh=True)
        return taken

    def writable(self, stream_id: int) -> int:
        """How many bytes ``send`` would take now (0 for a closed, reset or unknown stream)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.fin_wanted:
            return 0
        return self.max_send_buffer - len(stream.send_buffer)

    def close(self, stream_id: int) -> None:
        """Finish this side's half: CLOSE follows the buffered data. Idempotent; a no-op for a gone stream."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.fin_wanted:
            return
        stream.fin_wanted = True
        self._mark_ready(stream_id)

    def reset(self, stream_id: int, code: int = ResetCode.CANCEL) -> None:
        """Abort both halves now: buffered data in both directions is dropped. A no-op for a gone stream."""
        if not 0 <= code <= 0xFFFF:
            raise ValueError("reset code must fit 16 bits")
        if self._streams.pop(stream_id, None) is not None:
            self._control.append(encode_frame(FrameType.RESET, stream_id, _RESET.pack(code)))

    def read(self, stream_id: int, max_bytes: int = MAX_DATA) -> bytes:
        """Take up to ``max_bytes`` received bytes and grant them back to the peer (a WINDOW frame once half
        the window is read). ``b""`` when none are buffered; after ``StreamClosed``, ``b""`` is the end."""
        stream = self._streams.get(stream_id)
        if stream is None or not stream.recv_buffer or max_bytes <= 0:
            return b""
        chunk = bytes(stream.recv_buffer[:max_bytes])
        del stream.recv_buffer[:max_bytes]
        if not stream.fin_received:
            stream.unacked += len(chunk)
            if stream.unacked >= self.window // 2:
                self._control.append(encode_frame(FrameType.WINDOW, stream_id, _WINDOW.pack(stream.unacked)))
                stream.recv_credit += stream.unacked
                stream.unacked = 0
        self._forget_if_done(stream)
        return chunk

    def readable(self, stream_id: int) -> int:
        """Bytes received on the stream and not yet read."""
        stream = self._streams.get(stream_id)
        return len(stream.recv_buffer) if stream is not None else 0

    def state(self, stream_id: int) -> StreamState | None:
        """The stream's state, or ``None`` once it is reset or forgotten."""
        stream = self._streams.get(stream_id)
        return stream.state if stream is not None else None

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def stream_ids(self) -> list[int]:
        """The streams not yet reset or forgotten, in the order they opened."""
        return list(self._streams)

    @property
    def buffered(self) -> int:
        """Bytes received on this link and not yet read, over all streams (at most ``max_link_buffer``)."""
        return sum(len(stream.recv_buffer) for stream in self._streams.values())

    def connection_lost(self) -> None:
        """The link is gone: every stream ends with ``StreamReset(code=LINK_LOST, by_peer=True)``."""
        for stream_id in list(self._streams):
            del self._streams[stream_id]
            self._events.append(StreamReset(stream_id, ResetCode.LINK_LOST, by_peer=True))
        self._control.clear()
        self._ready.clear()
        self._fresh.clear()
        self._ready_set.clear()

    # ---- what the link calls ----

    def receive_frame(self, message: bytes | bytearray | memoryview) -> None:
        """Feed one binary websocket message. Raises ``StreamProtocolError`` for a link error (close the
        link); a stream's violation resets that stream only."""
        frame = decode_frame(message)
        stream_id = frame.stream_id
        peer_parity = 0 if self.initiator else 1
        if frame.type is FrameType.OPEN:
            if stream_id % 2 != peer_parity:
                raise StreamProtocolError(
                    f"the peer opened stream {stream_id}, an id of this side's parity", code="stream_bad_id"
                )
            if stream_id <= self._peer_last_id:
                raise StreamProtocolError(f"the peer reopened stream id {stream_id}", code="stream_bad_id")
            self._peer_last_id = stream_id
            if not self._has_room():
                self._queue_control(encode_frame(FrameType.RESET, stream_id, _RESET.pack(ResetCode.REFUSED)))
                return
            self._streams[stream_id] = _Stream(
                stream_id, send_credit=self.initial_window, recv_credit=self.initial_window
            )
            self._grant_extra(stream_id, by_peer=True)
            self._events.append(StreamOpened(stream_id, frame.payload))
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id % 2 == peer_parity:
                opened = stream_id <= self._peer_last_id
            else:
                opened = stream_id < self._next_id
            if not opened:
                raise StreamProtocolError(
                    f"{frame.type.name} for stream {stream_id}, which was never opened", code="stream_bad_id"
                )
            return  # a stream already reset or finished: frames still in flight are dropped
        if frame.type is FrameType.DATA:
            if stream.fin_received:
                self._reset_by_us(stream, ResetCode.STREAM_CLOSED)
            elif len(frame.payload) > stream.recv_credit:
                self._reset_by_us(stream, ResetCode.FLOW_CONTROL)
            else:
                stream.recv_credit -= len(frame.payload)
                stream.recv_buffer += frame.payload
                self.bytes_received += len(frame.payload)
                if stream_id not in self._readable:
                    self._readable.add(stream_id)
                    self._events.append(DataReceived(stream_id))
        elif frame.type is FrameType.WINDOW:
            (increment,) = _WINDOW.unpack(frame.payload)
            if stream.send_credit + increment > MAX_WINDOW:
                raise StreamProtocolError(
                    f"stream {stream_id}'s credit would pass 2**31-1", code="stream_bad_window"
                )
            stream.send_credit += increment
            if stream.send_buffer or (stream.fin_wanted and not stream.fin_sent):
                self._mark_ready(stream_id)
        elif frame.type is FrameType.CLOSE:
            if stream.fin_received:
                self._reset_by_us(stream, ResetCode.STREAM_CLOSED)
                return
            stream.fin_received = True
            self._events.append(StreamClosed(stream_id))
            self._forget_if_done(stream)
        else:  # RESET
            (code,) = _RESET.unpack(frame.payload)
            del self._streams[stream_id]
            self._events.append(StreamReset(stream_id, code, by_peer=True))

    def data_to_send(self, max_bytes: int | None = None) -> list[bytes]:
        """Frames to send, each one binary websocket message, in order: control frames, then DATA and CLOSE
        round-robin across streams. With ``max_bytes``, stops once that many bytes are handed out (at
        least one frame when any is due); the rest waits for the next call."""
        budget = max_bytes if max_bytes is not None else -1
        out: list[bytes] = []
        while self._control and budget != 0:
            frame = self._control.popleft()
            out.append(frame)
            budget = max(budget - len(frame), 0) if budget > 0 else budget
        while (self._fresh or self._ready) and budget != 0:
            stream_id = self._fresh.popleft() if self._fresh else self._ready.popleft()
            stream = self._streams.get(stream_id)
            if stream is None:
                self._ready_set.discard(stream_id)
                continue
            chunk_size = min(len(stream.send_buffer), stream.send_credit, self.max_frame_payload)
            if chunk_size > 0:
                chunk = bytes(stream.send_buffer[:chunk_size])
                del stream.send_buffer[:chunk_size]
                stream.send_credit -= chunk_size
                self.bytes_sent += chunk_size
                frame = encode_frame(FrameType.DATA, stream_id, chunk)
            elif stream.fin_wanted and not stream.fin_sent and not stream.send_buffer:
                stream.fin_sent = True
                frame = encode_frame(FrameType.CLOSE, stream_id)
            else:  # nothing to send, or no credit: it rejoins on send() or WINDOW
                self._ready_set.discard(stream_id)
                continue
            out.append(frame)
            budget = max(budget - len(frame), 0) if budget > 0 else budget
            if (
                stream.blocked
                and len(stream.send_buffer) <= self.max_send_buffer // 2
                and not stream.fin_wanted
            ):
                stream.blocked = False
                self._events.append(Writable(stream_id))
            if not stream.fin_sent:
                # A stream stays in the rotation, even drained, until its turn finds nothing to send:
                # writing again before then does not make it fresh and let it jump the queue.
                self._ready.append(stream_id)
            else:
                self._ready_set.discard(stream_id)
                self._forget_if_done(stream)
        return out

    def events(self) -> list[Event]:
        """What happened since the last call, in order."""
        events, self._events = self._events, []
        self._readable.clear()
        return events

    # ---- internals ----

    def _has_room(self) -> bool:
        return (
            len(self._streams) < self.max_streams
            and (len(self._streams) + 1) * self.window <= self.max_link_buffer
        )

    def _grant_extra(self, stream_id: int, *, by_peer: bool = False) -> None:
        extra = self.window - self.initial_window
        if extra > 0:
            frame = encode_frame(FrameType.WINDOW, stream_id, _WINDOW.pack(extra))
            if by_peer:
                self._queue_control(frame)
            else:
                self._control.append(frame)
            self._streams[stream_id].recv_credit += extra

    def _mark_ready(self, stream_id: int, *, fresh: bool = False) -> None:
        if stream_id not in self._ready_set:
            self._ready_set.add(stream_id)
            (self._fresh if fresh else self._ready).append(stream_id)

    def _queue_control(self, frame: bytes) -> None:
        if len(self._control) >= self.max_pending_control:
            raise StreamProtocolError(
                "the peer makes this side queue more control frames than it sends", code="stream_flood"
            )
        self._control.append(frame)

    def _reset_by_us(self, stream: _Stream, code: ResetCode) -> None:
        del self._streams[stream.stream_id]
        self._queue_control(encode_frame(FrameType.RESET, stream.stream_id, _RESET.pack(code)))
        self._events.append(StreamReset(stream.stream_id, code, by_peer=False))

    def _forget_if_done(self, stream: _Stream) -> None:
        if stream.fin_sent and stream.fin_received and not stream.recv_buffer:
            self._streams.pop(stream.stream_id, None)
