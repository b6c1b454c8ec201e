"""Fuzzing the wire protocol decoder: any input is a valid message or a ``ProtocolError``, in bounded time and memory.

Inputs are arbitrary bytes and text, and structure-aware mutations of valid frames from
the encoder: a value anywhere in the JSON tree replaced by a hostile one (wrong type,
huge number, lone surrogate, deep nesting, thousands of items), keys deleted or added,
then the text flipped, truncated or extended. A decoded message must encode again, decode
to the same frame, and cross the bus as the relay sends it (``encode_bus_envelope``).
A refusal must carry a stable code, its close code from ``CLOSE_CODES`` and a bounded
message (the relay logs it). Each example runs under a generous deadline (a hang fails
it); ``tracemalloc`` bounds the memory of one decode relative to the frame's size.
"""

from __future__ import annotations

import contextlib
import json
import os
import tracemalloc
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from shared import protocol
from shared.errors import ProtocolError
from tests.fuzzing import FUZZ_DIR, run_atheris_harness
from tests.helpers import same_as_full_decoder

TS = datetime(2026, 1, 1, tzinfo=UTC)
MAX_ERROR_MESSAGE = 1024
MIB = 1 << 20
# A parsed JSON value costs more than its text: an empty object is 3 bytes of text ("{},")
# and ~70 bytes of Python. One decode may hold this many times its frame at its peak (it is
# freed at once, and decoding is synchronous, so one relay process holds one such peak).
WORST_AMPLIFICATION = 32
FUZZ = settings(
    max_examples=600,
    deadline=timedelta(seconds=2),  # generous: a decode takes microseconds to milliseconds; this catches hangs
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---- a corpus of valid frames, one per message type -----------------------------------


def _gpu(index: int) -> protocol.GpuInfoModel:
    return protocol.GpuInfoModel(
        index=index, uuid=f"GPU-{index:08x}-fuzz", name="NVIDIA H100 80GB HBM3", memory_total_mib=81_559,
        compute_capability="9.0", driver_version="550.54", power_limit_w=700.0, mig_mode=True,
        mig_instances=[protocol.GpuMigInstanceModel(uuid=f"MIG-{index}-0", gpu_instance_id=1, profile="1g.10gb")],
    )  # fmt: skip


def _agent_messages() -> list[protocol.AnyAgentMessage]:
    gpus = [_gpu(0), _gpu(1)]
    envelope: dict[str, Any] = {"host_id": "h-3f9a0c1d2b4e5f60", "seq": 42, "ts": TS}
    sample = protocol.GpuSampleModel(
        index=0, uuid=gpus[0].uuid, gpu_util_pct=97.5, memory_used_mib=40_000, temperature_c=71.0, power_draw_w=650.0,
        throttle_reasons=["sw_power_cap"], processes=[protocol.GpuProcessModel(pid=4242, used_memory_mib=39_000)],
    )  # fmt: skip
    return [
        protocol.Hello(**envelope, body=protocol.HelloBody(
            agent_version="0.1.0", gpu_backend="nvml", region="eu-west", host={"hostname": "gpu-1", "cpus": 64},
            gpus=gpus, running_rentals=["r-1"],
        )),
        protocol.Heartbeat(**envelope, body=protocol.HeartbeatBody(
            uptime_s=3600.5, running_rentals=["r-1"], spool=protocol.SpoolStats(pending=3, evicted={"telemetry": 2}),
        )),
        protocol.Telemetry(**envelope, body=protocol.TelemetryBody(
            sampled_at=TS, gpus=[sample], window_s=10.0,
            aggregates=[protocol.GpuAggregateModel(uuid=gpus[0].uuid, samples=10, gpu_util_avg=95.0, power_max_w=690.0)],
        )),
        protocol.CommandResult(**envelope, body=protocol.CommandResultBody(
            command_id="cmd-1", ok=True, detail="started", data={"limits": {"cpu": True}}, finished_at=TS,
        )),
        protocol.GpuEvents(**envelope, body=protocol.GpuEventsBody(
            events=[protocol.GpuEventModel(uuid=gpus[0].uuid, kind="xid", code=79, at=TS)],
        )),
        protocol.NetworkReport(**envelope, body=protocol.NetworkReportBody(
            relay_url="wss://relay-1.example.test:8443/v1/agent", measured_at=TS, download_mbps=940.5, latency_ms=12.5,
            loss=0.01, probes_sent=100, probes_answered=99, duration_s=4.2,
        )),
        protocol.WorkloadExited(**envelope, body=protocol.WorkloadExitedBody(rental_id="r-1", exit_code=137, at=TS, reason="oom")),
        protocol.WorkloadLogs(**envelope, body=protocol.WorkloadLogsBody(rental_id="r-1", offset=0, length=12, data="hello world\n")),
        protocol.RenewCertificate(**envelope, body=protocol.RenewCertificateBody(
            csr="-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 64 + "\n-----END CERTIFICATE REQUEST-----\n",
        )),
    ]  # fmt: skip


def _server_messages() -> list[protocol.Welcome | protocol.Ack | protocol.Command | protocol.Move]:
    return [
        protocol.Welcome(body=protocol.WelcomeBody(
            relay_id="relay-1", host_id="h-1", heartbeat_interval=10.0, telemetry_interval=10.0, max_frame=1 << 20,
            max_messages_per_second=50.0, message_burst=100,
        )),
        protocol.Ack(body=protocol.AckBody(seq=42)),
        protocol.Command(body=protocol.CommandBody(
            command_id="cmd-1", kind="start_workload",
            args={"rental_id": "r-1", "gpu_uuids": ["GPU-1"], "workload": {"kind": "process", "argv": ["python", "-c", "1"]}},
        )),
        protocol.Move(body=protocol.MoveBody(reason="draining", retry_after=1.5)),
    ]  # fmt: skip


AGENT_FRAMES = [protocol.encode(message) for message in _agent_messages()]
SERVER_FRAMES = [protocol.encode(message) for message in _server_messages()]
DECODERS: dict[str, Callable[..., BaseModel]] = {"agent": protocol.decode_agent_frame, "server": protocol.decode_server_frame}
FRAMES = {"agent": AGENT_FRAMES, "server": SERVER_FRAMES}
# Field names of every model, so that added keys hit real fields as well as unknown ones.
_MODELS: list[type[BaseModel]] = [
    *(type(message) for message in [*_agent_messages(), *_server_messages()]),
    *(type(message.body) for message in [*_agent_messages(), *_server_messages()]),
    protocol.GpuInfoModel, protocol.GpuSampleModel, protocol.GpuMigInstanceModel, protocol.GpuProcessModel,
    protocol.StartWorkload, protocol.StopWorkload, protocol.HealthCheck, protocol.InstallCertificate,
    protocol.ProcessWorkload, protocol.GpuShare,
]  # fmt: skip
KNOWN_KEYS = sorted({name for model in _MODELS for name in model.model_fields})


# ---- the property -------------------------------------------------------------------


def decode(side: str, data: str | bytes, *, max_frame: int = protocol.DEFAULT_MAX_FRAME) -> BaseModel | ProtocolError:
    """Decode one frame: a refusal must be a well-formed ``ProtocolError``; any other exception fails the test."""
    try:
        message = DECODERS[side](data, max_frame=max_frame)
    except ProtocolError as exc:
        assert exc.code in protocol.CLOSE_CODES, exc.code
        assert exc.close_code == protocol.CLOSE_CODES[exc.code]
        assert 0 < len(exc.message) <= MAX_ERROR_MESSAGE, exc.message[:200]
        return exc
    check_accepted(side, message)
    return message


def check_accepted(side: str, message: BaseModel) -> None:
    """What the decoder accepts encodes again, decodes to the same frame, and (agent side) crosses the bus."""
    frame = protocol.encode(message)
    assert protocol.encode(DECODERS[side](frame)) == frame
    if side == "agent":
        assert isinstance(message, protocol.Hello | protocol.Heartbeat | protocol.Telemetry | protocol.CommandResult
                          | protocol.GpuEvents | protocol.NetworkReport | protocol.WorkloadExited
                          | protocol.WorkloadLogs | protocol.RenewCertificate)  # fmt: skip
        payload = protocol.encode_bus_envelope("relay-fuzz", message, TS)
        envelope = protocol.decode_bus_envelope(payload)
        assert protocol.encode(envelope.message) == frame
        same_as_full_decoder(payload)  # the master's fast decoder, where it takes the record
    if isinstance(message, protocol.Command):
        check_command(message.body)


COMMAND_REFUSALS = frozenset({"unknown_command", "bad_command"})


def check_command(body: protocol.CommandBody) -> None:
    """The agent's second step: a command decodes to its typed model, which travels unchanged, or is refused with a command code."""
    try:
        command = protocol.decode_command(body)
    except ProtocolError as exc:
        assert exc.code in COMMAND_REFUSALS, exc.code
        assert 0 < len(exc.message) <= MAX_ERROR_MESSAGE, exc.message[:200]
        return
    again = protocol.CommandBody.of(body.command_id, command)
    assert protocol.decode_command(again) == command


# ---- strategies ---------------------------------------------------------------------


def _nested_lists(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _nested_objects(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


HOSTILE_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([-1, 0, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**4000]),
    st.floats(),  # NaN and ±Infinity included: they travel as JSON constants
    st.text(max_size=30),
    st.sampled_from([
        "\ud800", "\udfff\ud800", "2026-02-30T00:00:00Z", "9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59",
        "1e999", "NaN", "../etc", "", "x" * 5000, "nvml", "hello", "ack", "h-1", "2026-01-01T00:00:00Z",
    ]),
)  # fmt: skip
HOSTILE_VALUES = st.one_of(
    HOSTILE_SCALARS,
    st.lists(HOSTILE_SCALARS, max_size=4),
    st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=8), HOSTILE_SCALARS, max_size=4),
    st.integers(1, 400).map(_nested_lists),  # Python's json writes up to ~1000 levels; the decoder refuses past 200
    st.integers(1, 400).map(_nested_objects),
    st.integers(0, 3000).map(lambda n: [{}] * n),  # over every max_length
)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*path, index))
    return found


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        tree = tree[step]
    return tree


@st.composite
def mutated_tree(draw: st.DrawFn, frame: str) -> Any:
    """The frame's JSON tree with one to three structural mutations."""
    tree = json.loads(frame)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(tree)
        path = draw(st.sampled_from(paths))
        operation = draw(st.sampled_from(["replace", "replace", "delete", "add", "retype", "repeat"]))
        if not path:  # the root
            if operation in ("replace", "retype"):
                tree = draw(HOSTILE_VALUES)
            continue
        parent, last = _at(tree, path[:-1]), path[-1]
        node = parent[last]
        if operation == "replace":
            parent[last] = draw(HOSTILE_VALUES)
        elif operation == "delete":
            del parent[last]
        elif operation == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(KNOWN_KEYS) | st.text(max_size=300))] = draw(HOSTILE_VALUES)
        elif operation == "retype":
            parent[last] = list(node.values()) if isinstance(node, dict) else {str(i): v for i, v in enumerate(node)} \
                if isinstance(node, list) else [node]
        elif operation == "repeat" and isinstance(node, list) and node:
            node.extend(node * draw(st.integers(1, 200)))
    return tree


@st.composite
def mutated_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` flipped, truncated, cut into, extended or repeated at a few places."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, max(len(out) - 1, 0)))
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "extend", "repeat", "splice"]))
        if kind == "flip" and out:
            out[at] ^= draw(st.integers(1, 255))
        elif kind == "truncate":
            del out[at:]
        elif kind == "insert":
            out[at:at] = draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b"\xff", b"\xed\xa0\x80", b'"', b"{", b"[" * 300]))
        elif kind == "extend":
            out += draw(st.binary(max_size=32))
        elif kind == "repeat":
            out += bytes(out) * draw(st.integers(1, 3))
        elif kind == "splice":  # the tail of one valid frame after the head of another
            other = draw(st.sampled_from(AGENT_FRAMES + SERVER_FRAMES)).encode()
            out[at:] = other[draw(st.integers(0, len(other) - 1)) :]
    return bytes(out)


@st.composite
def hostile_frames(draw: st.DrawFn, side: str) -> str | bytes:
    """A valid frame of ``side``, mutated in structure, then maybe in bytes; as text or bytes."""
    frame = draw(st.sampled_from(FRAMES[side]))
    if draw(st.integers(0, 4)) > 0:
        frame = json.dumps(draw(mutated_tree(frame)), ensure_ascii=draw(st.booleans()))
    if draw(st.integers(0, 2)) == 0:
        data = frame.encode(errors="surrogatepass")
        return draw(mutated_bytes(data))
    return frame if draw(st.booleans()) else frame.encode(errors="surrogatepass")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=20,
)


@st.composite
def envelopes(draw: st.DrawFn, side: str) -> str:
    """Objects shaped like envelopes (the right version and a known type) with arbitrary fields."""
    known = sorted(protocol.AGENT_TYPES if side == "agent" else protocol.SERVER_TYPES)
    obj: dict[str, Any] = draw(st.dictionaries(st.sampled_from(KNOWN_KEYS), JSON_VALUES, max_size=6))
    obj |= {"v": 1, "type": draw(st.sampled_from(known))}
    return json.dumps(obj)


SIDES = st.sampled_from(["agent", "server"])


class TestDecoderFuzz:
    @FUZZ
    @given(data=st.binary(max_size=4096), side=SIDES)
    def test_arbitrary_bytes(self, data: bytes, side: str) -> None:
        """Random bytes are a refusal with a stable code, never another exception."""
        decode(side, data)

    @FUZZ
    @given(text=st.text(st.characters(codec=None, exclude_categories=()), max_size=2048), side=SIDES)
    def test_arbitrary_text_including_lone_surrogates(self, text: str, side: str) -> None:
        """Random text (surrogates included, which no UTF-8 frame can carry) is refused cleanly."""
        decode(side, text)

    @FUZZ
    @given(data=st.data(), side=SIDES)
    def test_envelope_shaped_objects(self, data: st.DataObject, side: str) -> None:
        """Objects with v=1, a known type and arbitrary fields: accepted only when they round-trip."""
        decode(side, data.draw(envelopes(side)))

    @FUZZ
    @given(data=st.data(), side=SIDES)
    def test_mutated_valid_frames(self, data: st.DataObject, side: str) -> None:
        """Valid frames with hostile values, missing and extra keys, deep nesting and corrupted bytes."""
        decode(side, data.draw(hostile_frames(side)))

    @FUZZ
    @given(data=st.data(), max_frame=st.integers(1, 4096))
    def test_the_size_limit_comes_first(self, data: st.DataObject, max_frame: int) -> None:
        """A frame longer than max_frame is refused as frame_too_big whatever it holds; a shorter one never is."""
        frame = data.draw(hostile_frames("agent"))
        outcome = decode("agent", frame, max_frame=max_frame)
        too_big = isinstance(outcome, ProtocolError) and outcome.code == "frame_too_big"
        assert too_big == (len(frame) > max_frame)

    def test_every_corpus_frame_decodes(self) -> None:
        """The corpus the mutations start from is valid (so the mutations start from real frames)."""
        for side, frames in FRAMES.items():
            for frame in frames:
                assert isinstance(decode(side, frame), BaseModel)

    @FUZZ
    @given(payload=st.binary(max_size=2048) | st.sampled_from(AGENT_FRAMES).flatmap(lambda f: mutated_bytes(f.encode())))
    def test_bus_records(self, payload: bytes) -> None:
        """The master's and the relay's bus decoders refuse anything malformed as bad_bus_record; the master's fast
        decoder takes nothing the full one refuses."""
        same_as_full_decoder(payload)
        for decoder in (protocol.decode_bus_envelope, protocol.decode_command_delivery):
            try:
                decoder(payload)
            except ProtocolError as exc:
                assert exc.code == "bad_bus_record"
                assert len(exc.message) <= MAX_ERROR_MESSAGE


# ---- memory ---------------------------------------------------------------------------


def _peak(side: str, data: str | bytes, *, max_frame: int = protocol.DEFAULT_MAX_FRAME) -> int:
    """The most memory one decode held at once (its result included)."""
    tracemalloc.start()
    try:
        with contextlib.suppress(ProtocolError):
            DECODERS[side](data, max_frame=max_frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def _hello_with_host(value: bytes) -> bytes:
    return (
        b'{"v":1,"type":"hello","host_id":"h-1","seq":1,"ts":"2026-01-01T00:00:00Z","body":{"agent_version":"x",'
        b'"gpu_backend":"sim","gpus":[],"host":{"a":' + value + b"}}}"
    )


def _fill(unit: bytes, size: int) -> bytes:
    return unit * (size // len(unit))


class TestMemory:
    @pytest.mark.parametrize(
        ("shape", "data", "bound"),
        [
            ("random bytes", os.urandom(MIB), 2 * MIB),
            ("one long string", b'"' + b"a" * (MIB - 2) + b'"', 2 * MIB),
            ("deep nesting", b"[" * MIB, 2 * MIB),
            ("empty objects", b"[" + _fill(b"{},", MIB - 8) + b"{}]", WORST_AMPLIFICATION * MIB),
            ("empty objects in a valid hello", _hello_with_host(b"[" + _fill(b"{},", MIB - 200) + b"{}]"), WORST_AMPLIFICATION * MIB),
            ("numbers", b"[" + _fill(b"0.5,", MIB - 8) + b"1]", WORST_AMPLIFICATION * MIB),
            ("many keys", b"{" + b",".join(b'"%d":0' % n for n in range(MIB // 12)) + b"}", WORST_AMPLIFICATION * MIB),
        ],
        ids=lambda value: value if isinstance(value, str) else "",
    )
    def test_one_mib_frame_peak_is_bounded(self, shape: str, data: bytes, bound: int) -> None:
        """Decoding a 1 MiB frame of any shape allocates at most a fixed multiple of it; garbage next to nothing."""
        assert len(data) <= MIB
        assert _peak("agent", data) <= bound

    @pytest.mark.parametrize("data", [b"[" + _fill(b"{},", 4 * MIB) + b"{}]", "é" * (2 * MIB)], ids=["bytes", "text"])
    def test_an_oversized_frame_is_refused_before_it_is_parsed(self, data: str | bytes) -> None:
        """A frame over max_frame is refused with frame_too_big allocating almost nothing (it is never parsed)."""
        outcome = decode("agent", data, max_frame=MIB)
        assert isinstance(outcome, ProtocolError) and outcome.code == "frame_too_big"
        assert _peak("agent", data, max_frame=MIB) < 64 << 10

    @settings(FUZZ, max_examples=100)
    @given(data=st.data(), side=SIDES)
    def test_mutated_frames_peak_is_bounded(self, data: st.DataObject, side: str) -> None:
        """No mutated frame makes a decode allocate more than the worst amplification of its size."""
        frame = data.draw(hostile_frames(side))
        assert _peak(side, frame) <= WORST_AMPLIFICATION * len(frame) + (256 << 10)


# ---- regressions ------------------------------------------------------------------------


def _hello(host: str) -> str:
    return (
        '{"v":1,"type":"hello","host_id":"h-1","seq":1,"ts":"2026-01-01T00:00:00Z","body":{"agent_version":"x",'
        '"gpu_backend":"sim","gpus":[],"host":' + host + "}}"
    )


class TestRegressions:
    @pytest.mark.parametrize(
        "frame",
        ["[" * 100_000, _hello('{"a":' + "[" * 5000 + "]" * 5000 + "}")],
        ids=["bare", "inside-a-hello"],
    )
    def test_deep_nesting_is_a_bad_frame(self, frame: str) -> None:
        """Regression: 100 000 '[' (or 5000 levels inside a hello) raised RecursionError out of json.loads, not ProtocolError."""
        outcome = decode("agent", frame)
        assert isinstance(outcome, ProtocolError) and outcome.code == "bad_frame"

    @pytest.mark.parametrize(
        "frame",
        [
            _hello('{"a":"\\ud800"}'),
            _hello("{}").replace('"gpus":[]', '"gpus":[{"index":0,"uuid":"u","name":"n","memory_total_mib":1,"z":"\\udc00"}]'),
            _hello('{"a":"\ud800"}'),
            _hello('{"a":' + "[" * 900 + "]" * 900 + "}"),
        ],
        ids=["escaped-surrogate", "surrogate-in-a-gpu-extra-field", "raw-surrogate-in-text", "900-levels"],
    )
    def test_what_is_accepted_can_be_forwarded(self, frame: str) -> None:
        """Regression: these hellos were accepted, then the relay's encode_bus_envelope raised PydanticSerializationError.

        A lone surrogate in a free-form field (host facts, extra GPU fields) cannot be written
        as UTF-8, and 900 levels of nesting exceed the serializer's depth: the relay's handler
        crashed instead of closing with 4000.
        """
        outcome = decode("agent", frame)
        assert isinstance(outcome, ProtocolError) and outcome.code == "bad_frame"

    @pytest.mark.parametrize("frame", ['{"v": 1, "type": [], "body": null}', '{"v": 1, "type": {}}'], ids=["list", "object"])
    @pytest.mark.parametrize("side", ["agent", "server"])
    def test_a_type_that_is_not_a_string_is_an_unknown_type(self, side: str, frame: str) -> None:
        """Regression: a list or object as "type" raised TypeError (unhashable type) out of the decoder."""
        outcome = decode(side, frame)
        assert isinstance(outcome, ProtocolError) and outcome.code == "unknown_type"

    @pytest.mark.parametrize(
        "frame",
        [
            json.dumps({"v": 1, "type": "heartbeat", "host_id": "h-1", "seq": 1, "ts": "2026-01-01T00:00:00Z",
                        "body": {"uptime_s": 1.0, "k" * 100_000: True}}),
            json.dumps({"v": "x" * 100_000}),
            json.dumps({"v": 1, "type": "t" * 100_000}),
        ],
        ids=["long-extra-key", "long-version", "long-type"],
    )  # fmt: skip
    def test_error_messages_stay_short(self, frame: str) -> None:
        """Regression: a 100 000-character field name, version or type was echoed whole into the error the relay logs."""
        outcome = decode("agent", frame)
        assert isinstance(outcome, ProtocolError) and len(outcome.message) <= MAX_ERROR_MESSAGE


class TestAtherisHarness:
    def test_fuzz_protocol_runs_clean(self, tmp_path: Path) -> None:
        """fuzz/fuzz_protocol.py decodes 100 000 libFuzzer inputs grown from valid frames without a failure."""
        run_atheris_harness("fuzz_protocol.py", tmp_path, runs=100_000, options=(f"-dict={FUZZ_DIR / 'protocol.dict'}",))
