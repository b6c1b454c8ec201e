"""``Multiplexer``: one side of a link's streams, a Sans-I/O state machine, and the events it reports (see ``shared.streams``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from shared.streams.frames import (
    HEADER,
    INITIAL_WINDOW,
    LARGE_DATA,
    MAX_DATA,
    MAX_OPEN_HEADER,
    MAX_STREAM_ID,
    MAX_WINDOW,
    RESET_FIELD,
    VERSION,
    WINDOW_FIELD,
    FrameType,
    ResetCode,
    StreamClosedError,
    StreamLimitError,
    StreamProtocolError,
    StreamState,
    encode_frame,
    parse_frame,
)


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
    window: int  # the most this side buffers unread on this stream (its share of max_link_buffer)
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
    buffers unread per stream: a stream gets it while the windows already given leave half of
    ``max_link_buffer`` free, the protocol's ``initial_window`` after that (so a link still opens
    as many streams as before, and the first ones run at the larger window).
    ``max_data``: the largest DATA payload on this link, both ways: ``MAX_DATA`` unless the link agreed more
    (``agree_max_data``); a larger one received is a link error. ``max_frame_payload``: the largest DATA
    this side sends (default ``max_data``); above ``MAX_DATA`` only while one stream alone has data to send.
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
        max_data: int = MAX_DATA,
        max_frame_payload: int | None = None,
        max_streams: int = 256,
        max_send_buffer: int = 256 * 1024,
        max_link_buffer: int = 64 * 1024 * 1024,
        max_pending_control: int = 4096,
    ) -> None:
        window = initial_window if window is None else window
        if not 0 < initial_window <= window <= MAX_WINDOW:
            raise ValueError("need 0 < initial_window <= window <= 2**31-1")
        max_frame_payload = max_data if max_frame_payload is None else max_frame_payload
        if not MAX_DATA <= max_data <= LARGE_DATA:
            raise ValueError(f"max_data must be {MAX_DATA} .. {LARGE_DATA}")
        if not 0 < max_frame_payload <= max_data:
            raise ValueError(f"max_frame_payload must be 1 .. {max_data}")
        if max_streams < 1 or max_send_buffer < 1 or max_pending_control < 1:
            raise ValueError("limits must be positive")
        if max_link_buffer < window:
            raise ValueError("max_link_buffer must hold at least one window")
        self.initiator = initiator
        self.initial_window = initial_window
        self.window = window
        self.max_data = max_data
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
            stream_id, send_credit=self.initial_window, recv_credit=self.initial_window, window=self._next_window()
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
            self._control.append(encode_frame(FrameType.RESET, stream_id, RESET_FIELD.pack(code)))

    def read(self, stream_id: int, max_bytes: int = MAX_DATA) -> bytes:
        """Take up to ``max_bytes`` received bytes and grant them back to the peer (a WINDOW frame once half
        the window is read). ``b""`` when none are buffered; after ``StreamClosed``, ``b""`` is the end."""
        stream = self._streams.get(stream_id)
        if stream is None or not stream.recv_buffer or max_bytes <= 0:
            return b""
        with memoryview(stream.recv_buffer) as view:  # one copy, not two (a slice, then bytes of it)
            chunk = bytes(view[:max_bytes])
        del stream.recv_buffer[:max_bytes]
        if not stream.fin_received:
            stream.unacked += len(chunk)
            if stream.unacked >= stream.window // 2:
                self._control.append(encode_frame(FrameType.WINDOW, stream_id, WINDOW_FIELD.pack(stream.unacked)))
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
        frame_type, stream_id, payload = parse_frame(message, self.max_data)  # a view: DATA is copied once, into the stream's buffer
        peer_parity = 0 if self.initiator else 1
        if frame_type is FrameType.OPEN:
            if stream_id % 2 != peer_parity:
                raise StreamProtocolError(
                    f"the peer opened stream {stream_id}, an id of this side's parity", code="stream_bad_id"
                )
            if stream_id <= self._peer_last_id:
                raise StreamProtocolError(f"the peer reopened stream id {stream_id}", code="stream_bad_id")
            self._peer_last_id = stream_id
            if not self._has_room():
                self._queue_control(encode_frame(FrameType.RESET, stream_id, RESET_FIELD.pack(ResetCode.REFUSED)))
                return
            self._streams[stream_id] = _Stream(
                stream_id, send_credit=self.initial_window, recv_credit=self.initial_window, window=self._next_window()
            )
            self._grant_extra(stream_id, by_peer=True)
            self._events.append(StreamOpened(stream_id, bytes(payload)))
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id % 2 == peer_parity:
                opened = stream_id <= self._peer_last_id
            else:
                opened = stream_id < self._next_id
            if not opened:
                raise StreamProtocolError(
                    f"{frame_type.name} for stream {stream_id}, which was never opened", code="stream_bad_id"
                )
            return  # a stream already reset or finished: frames still in flight are dropped
        if frame_type is FrameType.DATA:
            if stream.fin_received:
                self._reset_by_us(stream, ResetCode.STREAM_CLOSED)
            elif len(payload) > stream.recv_credit:
                self._reset_by_us(stream, ResetCode.FLOW_CONTROL)
            else:
                stream.recv_credit -= len(payload)
                stream.recv_buffer += payload
                self.bytes_received += len(payload)
                if stream_id not in self._readable:
                    self._readable.add(stream_id)
                    self._events.append(DataReceived(stream_id))
        elif frame_type is FrameType.WINDOW:
            (increment,) = WINDOW_FIELD.unpack(payload)
            if stream.send_credit + increment > MAX_WINDOW:
                raise StreamProtocolError(
                    f"stream {stream_id}'s credit would pass 2**31-1", code="stream_bad_window"
                )
            stream.send_credit += increment
            if stream.send_buffer or (stream.fin_wanted and not stream.fin_sent):
                self._mark_ready(stream_id)
        elif frame_type is FrameType.CLOSE:
            if stream.fin_received:
                self._reset_by_us(stream, ResetCode.STREAM_CLOSED)
                return
            stream.fin_received = True
            self._events.append(StreamClosed(stream_id))
            self._forget_if_done(stream)
        else:  # RESET
            (code,) = RESET_FIELD.unpack(payload)
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
            # Frames above protocol v1's size only while this stream is the only one sending: beside others, a
            # larger frame would put a keystroke behind more bulk at every hop.
            largest = self.max_frame_payload if len(self._ready_set) <= 1 else min(self.max_frame_payload, MAX_DATA)
            chunk_size = min(len(stream.send_buffer), stream.send_credit, largest)
            if chunk_size > 0:
                # The frame in one copy out of the send buffer (not a slice, bytes of it, then header + those).
                with memoryview(stream.send_buffer) as view:
                    frame = HEADER.pack(VERSION, FrameType.DATA, 0, stream_id, chunk_size) + view[:chunk_size]
                del stream.send_buffer[:chunk_size]
                stream.send_credit -= chunk_size
                self.bytes_sent += chunk_size
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

    def _reserved(self) -> int:
        return sum(stream.window for stream in self._streams.values())

    def _has_room(self) -> bool:
        return (
            len(self._streams) < self.max_streams
            and self._reserved() + self.initial_window <= self.max_link_buffer
        )

    def _next_window(self) -> int:
        """A new stream's window: ``window`` while the windows given leave half the link's buffer free."""
        if self._reserved() + self.window <= max(self.max_link_buffer // 2, self.window):
            return self.window
        return self.initial_window

    def _grant_extra(self, stream_id: int, *, by_peer: bool = False) -> None:
        extra = self._streams[stream_id].window - self.initial_window
        if extra > 0:
            frame = encode_frame(FrameType.WINDOW, stream_id, WINDOW_FIELD.pack(extra))
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
        self._queue_control(encode_frame(FrameType.RESET, stream.stream_id, RESET_FIELD.pack(code)))
        self._events.append(StreamReset(stream.stream_id, code, by_peer=False))

    def _forget_if_done(self, stream: _Stream) -> None:
        if stream.fin_sent and stream.fin_received and not stream.recv_buffer:
            self._streams.pop(stream.stream_id, None)
