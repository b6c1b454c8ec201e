"""The relay's msgspec decoder of heartbeats and telemetry (``shared.protocol.fastframe``, used by
``access.forwarding``) agrees with the protocol's pydantic models: it accepts nothing they refuse, what it
accepts carries the same values (types included) and crosses the bus as the same record, and every frame it
leaves to them is decided (and refused, with the same words and close code) as before."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from access import forwarding
from agent.gpu.sim import SimulatedBackend
from shared import protocol
from shared.errors import ProtocolError
from shared.outbound import OutboundWindow
from shared.protocol import fastframe
from tests.helpers import same_as_full_decoder
from tests.test_fuzz_protocol import FUZZ, HOSTILE_VALUES, mutated_bytes, mutated_tree

MAX_FRAME = 1 << 20
AT = datetime(2026, 11, 30, 12, 0, 0, 250000, tzinfo=UTC)


def _reports() -> list[str]:
    """A bare heartbeat, a heartbeat with every field, and telemetry of 8 simulated H100s as the agent writes them."""
    window = OutboundWindow("h-fast-01", first_seq=7)
    samples = SimulatedBackend("sim:8xH100", seed="fastframe").sample()
    telemetry = protocol.TelemetryBody(
        sampled_at=AT, gpus=[protocol.GpuSampleModel.model_validate(s.to_wire()) for s in samples], window_s=10.0,
        aggregates=[protocol.GpuAggregateModel(uuid=s.uuid, samples=10, gpu_util_avg=s.gpu_util_pct, power_max_w=700)
                    for s in samples],
    )  # fmt: skip
    full = protocol.HeartbeatBody(uptime_s=1e16, running_rentals=["r-1", "r:2"],
                                  spool=protocol.SpoolStats(pending=3, evicted={"telemetry": 2, "heartbeat": 0}))
    return [
        window.heartbeat(protocol.HeartbeatBody(uptime_s=0.0))[1],
        window.heartbeat(full)[1],
        window.telemetry(telemetry)[1],
    ]


REPORTS = _reports()


def _same_typed(ours: Any, theirs: Any, where: str = "") -> None:
    """Equal JSON trees with the same type at every leaf (1 is not 1.0 here)."""
    assert type(ours) is type(theirs), (where, ours, theirs)
    if isinstance(ours, dict):
        assert list(ours) == list(theirs), where
        for key in ours:
            _same_typed(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(ours, list):
        assert len(ours) == len(theirs), where
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same_typed(a, b, f"{where}[{index}]")
    else:
        assert ours == theirs or (isinstance(ours, float) and math.isnan(ours) and math.isnan(theirs)), where


def _same_message(ours: Any, theirs: Any) -> None:
    """The same message type with the same fields; a NaN equals a NaN here (the protocol takes "NaN" for a float, and
    NaN != NaN would fail ``==`` on two equal messages)."""
    assert type(ours) is type(theirs), (ours, theirs)

    def tree(message: Any) -> Any:
        return message.model_dump() if hasattr(message, "model_dump") else msgspec.to_builtins(message, builtin_types=(datetime,))

    _same_typed(tree(ours), tree(theirs))


def agrees(frame: str | bytes) -> fastframe.AgentReport | None:
    """The property: the fast decoder takes nothing the protocol refuses, and what it takes is the same message,
    forwarded as the same bus record; the relay's decoder says what the protocol says either way."""
    report = fastframe.decode_agent_report(frame)
    try:
        expected = protocol.decode_agent_frame(frame, max_frame=MAX_FRAME)
    except ProtocolError as refused:
        assert report is None, f"accepted what the protocol refuses: {refused.message}"
        with pytest.raises(ProtocolError) as got:
            forwarding.decode_agent_frame(frame, max_frame=MAX_FRAME)
        assert (got.value.code, got.value.close_code, got.value.message) == (refused.code, refused.close_code, refused.message)
        return None
    decoded = forwarding.decode_agent_frame(frame, max_frame=MAX_FRAME)
    if report is None:
        _same_message(decoded, expected)
        return None
    _same_message(decoded, report)
    assert report.type == expected.type
    assert msgspec.to_builtins(report, builtin_types=(datetime,)) == expected.model_dump()
    ours = forwarding.encode_bus_envelope("relay-fast", report, AT, cert_serial="0a1b")
    theirs = protocol.encode_bus_envelope("relay-fast", expected, AT, cert_serial="0a1b")
    _same_typed(json.loads(ours), json.loads(theirs))
    assert protocol.decode_bus_envelope(ours) == protocol.decode_bus_envelope(theirs)
    assert same_as_full_decoder(ours) is not None  # the master's fast decoder takes the record whole
    return report


class TestReports:
    @pytest.mark.parametrize("index", range(len(REPORTS)))
    def test_an_agents_report_takes_the_fast_path_and_crosses_the_bus_as_the_same_bytes(self, index: int) -> None:
        """The agent's own heartbeats and telemetry: msgspec decodes them, and the bus record is the protocol's,
        byte for byte but for a float's exponent (``1e16`` where pydantic writes ``1e+16``)."""
        frame = REPORTS[index]
        for data in (frame, frame.encode()):
            report = agrees(data)
            assert report is not None
            expected = protocol.decode_agent_frame(data)
            ours = forwarding.encode_bus_envelope("relay-fast", report, AT)
            assert ours == protocol.encode_bus_envelope("relay-fast", expected, AT).replace(b"1e+16", b"1e16")

    def test_floats_with_many_digits_stay_on_the_fast_path(self) -> None:
        """Only a time's fraction past the microsecond is left to pydantic, not a float's digits."""
        frame = json.loads(REPORTS[2])
        frame["body"]["aggregates"][0]["gpu_util_avg"] = 37.61234567891
        frame["body"]["gpus"][0]["power_draw_w"] = 612.3456789
        frame["body"]["gpus"][0]["uuid"] = "GPU-10:59.123456"
        assert agrees(json.dumps(frame)) is not None
        frame["body"]["sampled_at"] = "2026-01-01T10:59:59.1234567Z"
        assert agrees(json.dumps(frame)) is None

    def test_other_message_types_keep_the_pydantic_path(self) -> None:
        frame = json.loads(REPORTS[0]) | {"type": "tunnel_usage", "body": {"at": "2026-11-26T09:00:00Z", "rentals": [{"rental_id": "r-1", "bytes_in": 1, "bytes_out": 2}]}}
        assert fastframe.decode_agent_report(json.dumps(frame)) is None
        assert isinstance(forwarding.decode_agent_frame(json.dumps(frame), max_frame=MAX_FRAME), protocol.TunnelUsage)

    @pytest.mark.parametrize(
        ("change", "protocol_accepts"),
        [
            pytest.param(lambda f: f.pop("v"), False, id="no version: the model defaults it, a frame must state it"),
            pytest.param(lambda f: f.update(v=1.0), True, id="version as a float"),
            pytest.param(lambda f: f.update(seq=1 << 63), False, id="seq past 2**63"),
            pytest.param(lambda f: f.update(seq="5"), True, id="seq as a string"),
            pytest.param(lambda f: f.update(host_id="h-1\n"), False, id="host id with a final newline"),
            pytest.param(lambda f: f.update(ts="2026-01-01T00:00:00.1234567Z"), True, id="seven digits of fraction"),
            pytest.param(lambda f: f.update(ts="2026-01-01T00:00:00.9999999Z"), True, id="a fraction msgspec would round up"),
            pytest.param(lambda f: f.update(ts="2026-01-01"), True, id="a date for a time"),
            pytest.param(lambda f: f.update(ts="9999-12-31T23:59:59-23:59"), False, id="a time past 9999 in UTC"),
            pytest.param(lambda f: f.update(ts="2026-01-01T00:00:00+00:00"), True, id="an explicit zero offset"),
            pytest.param(lambda f: f["body"].update(uptime_s=-1), False, id="a negative uptime"),
            pytest.param(lambda f: f["body"].update(uptime_s=3), True, id="an int for a float"),
            pytest.param(lambda f: f["body"].update(extra=1), False, id="a body field it does not know"),
            pytest.param(lambda f: f["body"].update(running_rentals=["r"] * 1025), False, id="too many rentals"),
        ],
    )
    def test_edge_cases_are_decided_as_the_protocol_decides(self, change: Any, protocol_accepts: bool) -> None:
        frame = json.loads(REPORTS[1])
        change(frame)
        text = json.dumps(frame)
        agrees(text)
        try:
            protocol.decode_agent_frame(text)
        except ProtocolError:
            assert not protocol_accepts
        else:
            assert protocol_accepts

    @pytest.mark.parametrize(
        "text",
        [
            REPORTS[0].replace('"h-fast-01"', '"h-\\u0066ast-01"'),  # an escape: the full decoder reads it
            REPORTS[0].replace('"h-fast-01"', '"h-\\ud800"'),  # an escaped lone surrogate
            REPORTS[0].replace('"body"', '"bo\\u0064y"'),  # a key spelt with an escape
            REPORTS[0][:-1] + ',"type":"telemetry"}',  # the type twice: pydantic reads the last one
            REPORTS[0][:-1] + ',"seq":8}',  # a field twice
            REPORTS[0].replace('"uptime_s":0.0', '"uptime_s":-1,"uptime_s":1.0'),
            REPORTS[0].replace('"uptime_s":0.0', '"uptime_s":1e400'),
            REPORTS[0].replace('"uptime_s":0.0', '"uptime_s":NaN'),
            REPORTS[0].replace('"ts":"', '"ts":"x'),
            REPORTS[0] + " ",
            REPORTS[0] + "x",
        ],
    )
    def test_escapes_duplicates_and_odd_numbers_are_decided_as_the_protocol_decides(self, text: str) -> None:
        agrees(text)
        agrees(text.encode())


TIME_TEXTS = st.builds(
    lambda day, sep, fraction, zone: day.replace(microsecond=0).isoformat(sep) + fraction + zone,
    st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30)),  # noqa: DTZ001 (hypothesis: naive bounds)
    st.sampled_from(["T", "t", " ", "_"]),
    st.sampled_from(["", "."]) | st.text("0123456789", min_size=1, max_size=12).map(lambda d: "." + d),
    st.sampled_from(["", "Z", "z", "+00:00", "-00:00", "+0530", "+05:30", "-23:59", "+24:00", "+00:00:05"])
    | st.builds(lambda h, m, s: f"{s}{h:02d}:{m:02d}", st.integers(0, 25), st.integers(0, 61), st.sampled_from("+-")),
)


@st.composite
def mutated_reports(draw: st.DrawFn) -> str | bytes:
    """A heartbeat or telemetry frame with hostile values, missing or extra keys, then maybe corrupted bytes."""
    frame = draw(st.sampled_from(REPORTS))
    if draw(st.integers(0, 3)) > 0:
        frame = json.dumps(draw(mutated_tree(frame)), ensure_ascii=draw(st.booleans()))
    if draw(st.integers(0, 3)) == 0:
        return draw(mutated_bytes(frame.encode(errors="surrogatepass")))
    return frame


class TestAgreementFuzz:
    @FUZZ
    @given(frame=mutated_reports())
    def test_mutated_reports(self, frame: str | bytes) -> None:
        agrees(frame)

    @FUZZ
    @given(ts=TIME_TEXTS, sampled_at=TIME_TEXTS, index=st.integers(0, len(REPORTS) - 1))
    def test_timestamps(self, ts: str, sampled_at: str, index: int) -> None:
        """Every spelling of a time either decoder might read differently: separators, fractions, offsets."""
        frame = json.loads(REPORTS[index]) | {"ts": ts}
        if frame["type"] == "telemetry":
            frame["body"]["sampled_at"] = sampled_at
        agrees(json.dumps(frame))

    @FUZZ
    @given(value=HOSTILE_VALUES | st.floats(allow_nan=False) | st.integers(-(2**70), 2**70),
           key=st.sampled_from(["seq", "uptime_s", "pending", "index", "gpu_util_pct", "memory_used_mib", "samples",
                                "window_s", "retired_pages_pending", "pid", "throttle_reasons", "uuid", "host_id"]))
    def test_a_value_anywhere_a_field_of_that_name_is(self, value: Any, key: str) -> None:
        """One field, wherever it occurs in a report, given a hostile value (numbers of every size and type)."""
        for frame in REPORTS:
            tree = json.loads(frame)
            _replace(tree, key, value)
            agrees(json.dumps(tree))


def _replace(tree: Any, key: str, value: Any) -> None:
    if isinstance(tree, dict):
        for name in tree:
            if name == key:
                tree[name] = value
            else:
                _replace(tree[name], key, value)
    elif isinstance(tree, list):
        for item in tree:
            _replace(item, key, value)


def test_the_frames_timestamps_are_the_protocols() -> None:
    """A time with an offset keeps it (msgspec and pydantic agree on the instant and the offset)."""
    frame = json.loads(REPORTS[0]) | {"ts": "2026-01-01T05:30:00.5+05:30"}
    report = agrees(json.dumps(frame))
    assert report is not None and report.ts == datetime(2026, 1, 1, 0, 0, 0, 500000, tzinfo=UTC)
    assert report.ts.utcoffset() == timedelta(hours=5, minutes=30)
