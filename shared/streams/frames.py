"""The stream frames' codec: header layout, types, reset codes, errors, and the OPEN header (see ``shared.streams``)."""

from __future__ import annotations

import enum
import json
import re
import struct
from dataclasses import dataclass
from typing import Final

from shared.errors import GpumarketError, ProtocolError

VERSION: Final = 1
HEADER: Final = struct.Struct("!BBHII")
HEADER_SIZE: Final = HEADER.size  # 12
MAX_DATA: Final = 64 * 1024  # the largest DATA payload a receiver accepts (protocol version 1), unless its link agreed more
LARGE_DATA: Final = 256 * 1024  # the largest DATA a link may agree (``agree_max_data``): fewer frames per MB, each
# one a websocket message; larger would put a keystroke behind more bulk in the link's kernel buffer
MAX_DATA_HEADER: Final = "Gpumarket-Stream-Data"  # the agent's offer, in its websocket upgrade request
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


class TunnelCode(enum.IntEnum):
    """Why the agent refused or ended a renter's stream (reset codes of the upper layer)."""

    NOT_HERE = 256  # no such rental on this host
    NOT_OFFERED = 257  # the rental does not serve that: a port it did not declare, SSH into a hold
    RENTAL_STOPPED = 258  # the rental stopped (or was released) while the stream was open
    AGENT_LIMIT = 259  # the rental has as many streams open on the agent as it may
    ACCESS_REVOKED = 260  # the rental's account was disabled: none of its streams may stay open


TUNNEL_REASONS: Final = {
    TunnelCode.NOT_HERE: "the rental does not run on its host any more; check `gpumarket rentals`",
    TunnelCode.NOT_OFFERED: "the rental does not serve that port (declare it in the rental's ports) or runs nothing to log into",
    TunnelCode.RENTAL_STOPPED: "the rental stopped",
    TunnelCode.AGENT_LIMIT: "the rental has as many connections open as its host allows; close one first",
    TunnelCode.ACCESS_REVOKED: "the rental's account is disabled; ask the marketplace's support",
    ResetCode.CONNECT_FAILED: "nothing listens on that port in the rental (yet)",
}


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


WINDOW_FIELD = struct.Struct("!I")
RESET_FIELD = struct.Struct("!H")


def encode_frame(frame_type: FrameType, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame as the bytes of one websocket binary message. Checks what ``decode_frame`` checks."""
    if not 0 < stream_id <= MAX_STREAM_ID:
        raise ValueError(f"stream id {stream_id} out of range")
    _check_payload(FrameType(frame_type), payload, ValueError)
    return HEADER.pack(VERSION, frame_type, 0, stream_id, len(payload)) + payload


def decode_frame(message: bytes | bytearray | memoryview) -> Frame:
    """Parse one binary message; anything but exactly one valid frame raises ``StreamProtocolError``."""
    frame_type, stream_id, payload = parse_frame(message)
    return Frame(frame_type, stream_id, bytes(payload))


def parse_frame(message: bytes | bytearray | memoryview, max_data: int = MAX_DATA) -> tuple[FrameType, int, memoryview]:
    """``decode_frame`` without copying the payload: it is a view of ``message`` (which must not change
    while the view is in use). The multiplexer's receive path: a DATA payload is copied once, into the
    stream's buffer. ``max_data``: the largest DATA payload the link agreed (``agree_max_data``)."""
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
    payload = memoryview(message)[HEADER_SIZE:]
    _check_payload(frame_type, payload, StreamProtocolError, max_data)
    return frame_type, stream_id, payload


def _check_payload(frame_type: FrameType, payload: bytes | memoryview, error: type[Exception], max_data: int = MAX_DATA) -> None:
    size = len(payload)
    problem = None
    if frame_type is FrameType.OPEN:
        if size > MAX_OPEN_HEADER:
            problem = f"OPEN header of {size} bytes is over {MAX_OPEN_HEADER}"
    elif frame_type is FrameType.DATA:
        if not 0 < size <= max_data:
            problem = f"DATA of {size} bytes; 1 to {max_data} allowed"
    elif frame_type is FrameType.WINDOW:
        if size != WINDOW_FIELD.size:
            problem = f"WINDOW payload of {size} bytes; 4 expected"
        elif not 0 < WINDOW_FIELD.unpack(payload)[0] <= MAX_WINDOW:
            problem = "WINDOW increment must be 1 .. 2**31-1"
    elif frame_type is FrameType.CLOSE:
        if size:
            problem = f"CLOSE carries {size} bytes; none allowed"
    elif size != RESET_FIELD.size:
        problem = f"RESET payload of {size} bytes; 2 expected"
    if problem is not None:
        if error is StreamProtocolError:
            code = "stream_too_big" if size > max_data else "stream_bad_length"
            raise StreamProtocolError(problem, code=code)
        raise error(problem)


_DECIMAL: Final = re.compile(r"[0-9]{1,8}")


def agree_max_data(offered: str | int | None, ours: int) -> int | None:
    """The largest DATA payload a link agrees: the agent offers one (``MAX_DATA_HEADER`` in its upgrade request),
    the relay takes the smaller of that and ``ours`` and says it in its welcome. ``None`` (nothing to say: the
    link keeps ``MAX_DATA``) when the offer is absent, malformed (anything but 1–8 ASCII digits: no sign, ``_``,
    spaces or other scripts' digits, which ``int()`` would take) or not above ``MAX_DATA``."""
    if isinstance(offered, str):
        if not _DECIMAL.fullmatch(offered):
            return None
        offered = int(offered)
    value = min(offered, ours, LARGE_DATA) if offered is not None else 0
    return value if value > MAX_DATA else None


def welcomed_max_data(welcomed: int | None, offered: int) -> int:
    """The agent's side of ``agree_max_data``: the relay's answer, which may not pass what the agent offered."""
    if welcomed is None:
        return MAX_DATA
    if not MAX_DATA < welcomed <= offered:
        raise StreamProtocolError(f"the relay agreed DATA of {welcomed} bytes; {offered} was offered", code="stream_bad_frame")
    return welcomed


# ---- the OPEN header the relay and agent use -------------------------------------------------

STREAM_KINDS: Final = ("ssh", "tcp", "wg")
CONNECT_PATH: Final = "/v1/connect"  # the relay's websocket for streams opened with a connect token (renters; cluster peers)


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
