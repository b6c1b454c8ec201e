"""The protocol's ground: its version, frame limit and websocket close codes, the field types
every message shares (``Timestamp``, ``HostId``, ``ShortText``, ``CommandId``) and the two base
models, ``StrictModel`` (envelopes, bodies, commands: an unknown field is refused) and
``LenientModel`` (GPU records and command replies: a newer agent may say more)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

PROTOCOL_VERSION: Literal[1] = 1
DEFAULT_MAX_FRAME = 1 << 20

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


# NaN and Infinity travel as JSON constants (Python's json reads them) instead of turning into
# null on the relay, so the master can see, refuse and count an impossible reading.
class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")


class LenientModel(BaseModel):
    """GPU and host records: newer agents may add fields; older masters keep what they know."""

    model_config = ConfigDict(extra="allow", frozen=True, ser_json_inf_nan="constants")
