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
DATA  1    1 .. ``MAX_DATA`` bytes of the stream (64 KiB; up to ``LARGE_DATA`` where the link agreed more:
           the agent offers it in its upgrade request's ``MAX_DATA_HEADER``, the relay's welcome says
           the size agreed, ``max_stream_data``; a link whose welcome says none keeps 64 KiB)
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
frame when the stream opens (the relay and the agent use 1 MiB: a stream moves at most a window
per round trip, and 256 KiB over a 20 ms path is 13 MB/s). ``read`` consumes received bytes and
grants them back, by one WINDOW frame once at least half the stream's window is consumed. The
bytes received but not yet read are therefore at most the stream's window; the link reserves
each open stream's window and refuses a stream (RESET ``REFUSED``) whose reservation would pass
``max_link_buffer``. A stream gets the larger window while the windows already given leave half
of ``max_link_buffer`` free and ``initial_window`` after that, so a link holds as many streams
as it would at ``initial_window`` less the few large ones.

Sending: ``send`` copies into the stream's send buffer up to ``max_send_buffer`` and returns how
many bytes it took; the caller keeps the rest and retries on ``Writable``. ``data_to_send``
hands out frames: first control frames (OPEN, WINDOW, RESET), then DATA and CLOSE round-robin,
one frame of at most ``max_frame_payload`` (``MAX_DATA`` beside other sending streams) per
stream per round, the rotation kept across calls. As in fq_codel, a stream that had nothing to
send and now has (a keystroke on an idle shell) goes before the rotation for its first frame,
then joins its end, and leaves the rotation only when its turn finds it empty: a write on an
idle stream waits behind no bulk frame, one on a busy stream at most one round, and no stream
gets more than one frame per round however it writes. Its ``max_bytes`` bounds one turn: a
caller that sends at most ``max_bytes`` of stream frames, then its own JSON messages
(heartbeats, acks), then the next turn, keeps those on time whatever the streams carry.
"""

from __future__ import annotations

from shared.streams.frames import (
    CONNECT_PATH,
    HEADER,
    HEADER_SIZE,
    INITIAL_WINDOW,
    LARGE_DATA,
    MAX_DATA,
    MAX_DATA_HEADER,
    MAX_OPEN_HEADER,
    TUNNEL_REASONS,
    VERSION,
    Frame,
    FrameType,
    OpenRequest,
    ResetCode,
    StreamClosedError,
    StreamLimitError,
    StreamProtocolError,
    StreamState,
    TunnelCode,
    agree_max_data,
    decode_frame,
    decode_open_header,
    encode_frame,
    encode_open_header,
    welcomed_max_data,
)
from shared.streams.mux import (
    DataReceived,
    Event,
    Multiplexer,
    StreamClosed,
    StreamOpened,
    StreamReset,
    Writable,
)

__all__ = [
    "CONNECT_PATH",
    "HEADER",
    "HEADER_SIZE",
    "INITIAL_WINDOW",
    "LARGE_DATA",
    "MAX_DATA",
    "MAX_DATA_HEADER",
    "MAX_OPEN_HEADER",
    "TUNNEL_REASONS",
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
    "TunnelCode",
    "Writable",
    "agree_max_data",
    "decode_frame",
    "decode_open_header",
    "encode_frame",
    "encode_open_header",
    "welcomed_max_data",
]
