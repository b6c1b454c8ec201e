"""Tests for access.forwarding: the relay's cheap per-message codec says and writes exactly what
``shared.protocol`` does (the master decodes the bus records it writes; agents read its acks)."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import msgspec
import pytest

from access import forwarding
from agent.gpu.sim import SimulatedBackend
from shared import protocol
from shared.errors import ProtocolError
from shared.outbound import OutboundWindow
from shared.protocol import fastframe

MAX_FRAME = 1 << 20


def _frames() -> list[str]:
    """A heartbeat, a full 8-GPU telemetry frame, a command result holding NaN and a tunnel report."""
    window = OutboundWindow("h-forward", first_seq=5)
    backend = SimulatedBackend("sim:8xH100", seed="forwarding")
    samples = backend.sample()
    telemetry = protocol.TelemetryBody(
        sampled_at=datetime(2026, 11, 26, 8, 0, 0, 123456, tzinfo=UTC),
        gpus=[protocol.GpuSampleModel.model_validate(s.to_wire()) for s in samples],
        window_s=10.0,
        aggregates=[protocol.GpuAggregateModel(uuid=s.uuid, samples=10, gpu_util_avg=s.gpu_util_pct) for s in samples],
    )
    frames = [
        window.heartbeat(protocol.HeartbeatBody(uptime_s=1.0))[1],
        window.telemetry(telemetry)[1],
    ]
    result = _object(frames[0], type="command_result", body={
        "command_id": "cmd-1", "ok": True, "detail": "é ✓", "data": {"x": math.nan, "y": [1, 2.5, None]},
        "finished_at": "2026-11-26T09:00:00+02:00",
    })
    usage = _object(frames[0], type="tunnel_usage", body={
        "at": "2026-11-26T09:00:00Z", "rentals": [{"rental_id": "r-1", "bytes_in": 1, "bytes_out": 2}],
    })
    return [*frames, json.dumps(result), json.dumps(usage)]


def _object(frame: str, **changes: Any) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(frame)
    obj.update(changes)
    return obj


class TestDecode:
    """The one-pass decoder returns what ``protocol.decode_agent_frame`` returns, and fails as it does."""

    @pytest.mark.parametrize("index", range(4))
    def test_a_valid_frame_decodes_to_the_same_message(self, index: int) -> None:
        """Heartbeat, telemetry, a command result and a tunnel report decode to equal messages (the first two
        as msgspec reports holding the model's values, and crossing the bus as the model's bytes)."""
        frame = _frames()[index]
        ours, theirs = forwarding.decode_agent_frame(frame, max_frame=MAX_FRAME), protocol.decode_agent_frame(frame)
        if isinstance(ours, fastframe.AgentReport):
            assert index < 2 and ours.type == theirs.type
            assert msgspec.to_builtins(ours, builtin_types=(datetime,)) == theirs.model_dump()
            at = datetime(2026, 11, 26, 8, 0, tzinfo=UTC)
            assert forwarding.encode_bus_envelope("r-1", ours, at) == protocol.encode_bus_envelope("r-1", theirs, at)
        else:
            assert index >= 2
            assert type(ours) is type(theirs) and ours.model_dump_json() == theirs.model_dump_json()  # NaN != NaN

    @pytest.mark.parametrize(
        "frame",
        [
            "not json",
            "[1, 2]",
            json.dumps({k: v for k, v in _object(_frames()[0]).items() if k != "v"}),  # the model defaults v
            json.dumps(_object(_frames()[0], v=2)),
            json.dumps(_object(_frames()[0], type="launch_missiles")),
            json.dumps(_object(_frames()[0], seq=-1)),
            json.dumps(_object(_frames()[0], extra="field")),
            _frames()[0].replace('"h-forward"', '"h-\\ud800"'),  # an escaped lone surrogate
            "[" * 300 + "]" * 300,
            json.dumps(_object(_frames()[0], body={"uptime_s": 1.0, "pad": "x" * 100})),
            # an integer past a float's range in a float field: pydantic's JSON validator read infinity
            _frames()[0].replace('"uptime_s":1.0', '"uptime_s":1' + "0" * 400),
        ],
    )
    def test_a_bad_frame_fails_with_the_protocols_error(self, frame: str) -> None:
        """Missing or wrong version, unknown type, schema violations, bad JSON: same code, close code and text."""
        with pytest.raises(ProtocolError) as expected:
            protocol.decode_agent_frame(frame, max_frame=MAX_FRAME)
        with pytest.raises(ProtocolError) as got:
            forwarding.decode_agent_frame(frame, max_frame=MAX_FRAME)
        assert (got.value.code, got.value.close_code, got.value.message) == (
            expected.value.code, expected.value.close_code, expected.value.message,
        )

    def test_a_frame_over_max_frame_is_refused_before_it_is_parsed(self) -> None:
        frame = _frames()[1]
        with pytest.raises(ProtocolError) as got:
            forwarding.decode_agent_frame(frame, max_frame=len(frame) - 1)
        assert got.value.close_code == protocol.CLOSE_TOO_BIG


class TestEncode:
    """The bus record and the ack are byte for byte what ``shared.protocol`` writes."""

    @pytest.mark.parametrize("index", range(4))
    @pytest.mark.parametrize("cert_serial", [None, "0a1b2c3d4e5f"])
    @pytest.mark.parametrize(
        "received_at",
        [
            datetime(2026, 11, 26, 8, 0, tzinfo=UTC),
            datetime(2026, 11, 26, 8, 0, 0, 1, tzinfo=UTC),
            datetime(2026, 11, 26, 8, 0, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
        ],
    )
    def test_the_bus_record_is_the_protocols_bytes(self, index: int, cert_serial: str | None, received_at: datetime) -> None:
        message = protocol.decode_agent_frame(_frames()[index])
        for relay_id in ("relay-1", 'relay "quoted" é'):
            ours = forwarding.encode_bus_envelope(relay_id, message, received_at, cert_serial=cert_serial)
            assert ours == protocol.encode_bus_envelope(relay_id, message, received_at, cert_serial=cert_serial)
            assert protocol.decode_bus_envelope(ours).message.model_dump_json() == message.model_dump_json()

    @pytest.mark.parametrize("seq", [0, 1, 42, (1 << 63) - 1])
    def test_the_ack_is_the_protocols_text(self, seq: int) -> None:
        assert forwarding.encode_ack(seq) == protocol.encode(protocol.Ack(body=protocol.AckBody(seq=seq)))
