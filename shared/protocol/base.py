"""The protocol's ground: its version, frame limit and websocket close codes, the field types
every message shares (``Timestamp``, ``HostId``, ``ShortText``, ``CommandId``) and the two base
models, ``StrictModel`` (envelopes, bodies, commands: an unknown field is refused) and
``LenientModel`` (GPU records and command replies: a newer agent may say more)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from shared.errors import SequenceJump

PROTOCOL_VERSION: Literal[1] = 1
DEFAULT_MAX_FRAME = 1 << 20

MAX_SEQ_JUMP = 10**9
"""How far past the newest sequence number the master saw from a host a message may be numbered.
A real agent numbers its messages one by one (leasing blocks of 1000 across restarts): at its
normal cadence it would take over a century to go that far between two messages that arrive.
A message beyond it is refused (logged and dropped), so one absurd number (2**62) cannot pin the
host's state (its newest hello, its relay, its renewals) for good."""


def check_seq(seq: int, last_seen: int, *, host_id: str = "") -> None:
    """Raise ``SequenceJump`` when ``seq`` is more than ``MAX_SEQ_JUMP`` past ``last_seen`` (-1: none yet)."""
    if seq > max(last_seen, 0) + MAX_SEQ_JUMP:
        raise SequenceJump(
            f"host {host_id} sent sequence number {seq}, more than {MAX_SEQ_JUMP} past its newest ({last_seen}); refused",
        )

# Websocket close codes the relay uses, one table (4000–4999 are application codes).
CLOSE_GOING_AWAY = 1001  # relay shutting down: reconnect elsewhere
CLOSE_TOO_BIG = 1009  # frame larger than max_frame (sent by the websocket layer)
CLOSE_BAD_FRAME = 4000  # not JSON, or not a valid envelope/body
CLOSE_UNKNOWN_TYPE = 4001
CLOSE_UNSUPPORTED_VERSION = 4002
CLOSE_IDENTITY_MISMATCH = 4003  # message claims a host other than the certificate's
CLOSE_RATE_LIMITED = 4004
CLOSE_REVOKED = 4005
CLOSE_REPLACED = 4006  # a newer connection of the same host took over
CLOSE_SLOW_CONSUMER = 4007
CLOSE_BUS_UNAVAILABLE = 4008  # relay cannot reach the bus: try another relay
CLOSE_TOO_MANY_CONNECTIONS = 4009

CLOSE_CODES: dict[str, int] = {
    "bad_frame": CLOSE_BAD_FRAME,
    "unknown_type": CLOSE_UNKNOWN_TYPE,
    "unsupported_version": CLOSE_UNSUPPORTED_VERSION,
    "identity_mismatch": CLOSE_IDENTITY_MISMATCH,
    "rate_limited": CLOSE_RATE_LIMITED,
    "revoked": CLOSE_REVOKED,
    "replaced": CLOSE_REPLACED,
    "slow_consumer": CLOSE_SLOW_CONSUMER,
    "bus_unavailable": CLOSE_BUS_UNAVAILABLE,
    "frame_too_big": CLOSE_TOO_BIG,
    "too_many_connections": CLOSE_TOO_MANY_CONNECTIONS,
}

def _representable_in_utc(value: datetime) -> datetime:
    """Refuse a time that exists in its own offset but not in UTC (``9999-12-31T23:59:59-23:59``):
    every reader converts to UTC, and the conversion would raise ``OverflowError`` there."""
    if value.tzinfo is not None:
        try:
            value.astimezone(UTC)
        except OverflowError:
            raise ValueError("timestamp out of range once converted to UTC") from None
    return value


Timestamp = Annotated[datetime, AfterValidator(_representable_in_utc)]
HostId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
ShortText = Annotated[str, Field(max_length=256)]
CommandId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")]
CertSerial = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")]
"""A certificate serial as lowercase hex, the form revocations are recorded in."""


# NaN and Infinity travel as JSON constants (Python's json reads them) instead of turning into
# null on the relay, so the master can see, refuse and count an impossible reading.
class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class LenientModel(BaseModel):
    """GPU and host records: newer agents may add fields; older masters keep what they know."""

    model_config = ConfigDict(extra="allow", frozen=True, ser_json_inf_nan="constants")
