"""Per-message cost of the wire protocol (``shared.protocol``) against plain ``json``, in one run.

Builds one realistic telemetry frame of an 8-GPU host (``SimulatedBackend("sim:8xH100")``,
every GPU busy with a process, as on a rented host) and measures, per message:

* agent: building the ``TelemetryBody`` from the samples and ``OutboundWindow.telemetry``
  (envelope + encode; the ack bookkeeping ``OutboundWindow.ack`` included), and
  ``OutboundWindow.telemetry`` alone with the body prebuilt;
* relay: ``decode_agent_frame`` (parse + validate); decode + ``encode_bus_envelope``; and the
  relay's whole per-message protocol work (decode, identity check, bus envelope, ack frame);
* master: ``decode_bus_envelope``.

Each is compared with plain ``json`` doing the same job on the same data, measured in the same
run: ``json.dumps`` of the frame's dict for encoding, ``json.loads`` of the frame for decoding,
``json.loads`` + ``json.dumps`` of the envelope dict for the relay, ``json.loads`` of the bus
envelope for the master. Every operation is timed ``--rounds`` times, interleaved, and reported
as the median. Nothing here does I/O; only the CPU counts.

Usage: ``python bench/bench_protocol.py [--messages N] [--rounds R] [--gpus SPEC] [--idle] [--quick]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from agent.gpu.sim import SimulatedBackend
from shared import protocol
from shared.outbound import OutboundWindow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, describe_machine, record

HOST_ID = "h-bench"
RELAY_ID = "relay-bench"
WARMUP = 200




# ---- the data -------------------------------------------------------------------------------


@dataclass
class Frames:
    samples: list[dict[str, object]]  # what the GPU backend hands the agent, as wire dicts
    body: protocol.TelemetryBody
    frame: str  # agent -> relay
    frame_obj: dict[str, object]  # the same frame as a plain dict
    message: protocol.Telemetry
    received_at: datetime
    envelope: bytes  # relay -> bus -> master
    envelope_obj: dict[str, object]


def build_frames(spec: str, *, busy: bool) -> Frames:
    backend = SimulatedBackend(spec, seed="bench")
    if busy:
        backend.set_busy([gpu.uuid for gpu in backend.gpus()], True)
    samples = [sample.to_wire() for sample in backend.sample()]
    body = protocol.TelemetryBody(
        sampled_at=datetime.now(UTC), gpus=[protocol.GpuSampleModel.model_validate(s) for s in samples]
    )
    _seq, frame = OutboundWindow(HOST_ID, first_seq=1_000).telemetry(body)
    message = protocol.decode_agent_frame(frame)
    assert isinstance(message, protocol.Telemetry)
    received_at = datetime.now(UTC)
    envelope = protocol.encode_bus_envelope(RELAY_ID, message, received_at)
    # Sanity: both directions give back what went in.
    assert message.body == body
    assert protocol.decode_bus_envelope(envelope).message == message
    return Frames(
        samples=samples,
        body=body,
        frame=frame,
        frame_obj=json.loads(frame),
        message=message,
        received_at=received_at,
        envelope=envelope,
        envelope_obj=json.loads(envelope),
    )


# ---- the operations -------------------------------------------------------------------------


@dataclass
class Operation:
    name: str
    run: Callable[[], object]
    baseline: str | None  # name of the baseline operation it is compared with; None: it is one
    verb: str = ""  # how the ratio reads, e.g. "json.loads"


def operations(data: Frames) -> list[Operation]:
    window = OutboundWindow(HOST_ID, first_seq=0)

    def agent_build_and_encode() -> object:
        body = protocol.TelemetryBody(
            sampled_at=datetime.now(UTC),
            gpus=[protocol.GpuSampleModel.model_validate(s) for s in data.samples],
        )
        seq, frame = window.telemetry(body)
        window.ack(seq)  # keep the window from filling up, as the relay's ack would
        return frame

    def agent_encode() -> object:
        seq, frame = window.telemetry(data.body)
        window.ack(seq)
        return frame

    def relay_decode_and_forward() -> object:
        message = protocol.decode_agent_frame(data.frame)
        return protocol.encode_bus_envelope(RELAY_ID, message, data.received_at)

    def relay_whole() -> object:
        message = protocol.decode_agent_frame(data.frame)
        protocol.check_identity(message, HOST_ID)
        envelope = protocol.encode_bus_envelope(RELAY_ID, message, data.received_at)
        ack = protocol.encode(protocol.Ack(body=protocol.AckBody(seq=message.seq)))
        return envelope, ack

    def json_relay() -> object:
        message = json.loads(data.frame)
        return json.dumps(
            {"relay_id": RELAY_ID, "received_at": data.received_at.isoformat(), "message": message}
        ).encode()

    return [
        Operation("json.dumps(frame dict)", lambda: json.dumps(data.frame_obj), None),
        Operation("json.loads(frame)", lambda: json.loads(data.frame), None),
        Operation("json.loads(frame) + json.dumps(envelope)", json_relay, None),
        Operation("json.loads(bus envelope)", lambda: json.loads(data.envelope), None),
        Operation(
            "agent: TelemetryBody + OutboundWindow.telemetry",
            agent_build_and_encode,
            "json.dumps(frame dict)",
            "json.dumps",
        ),
        Operation(
            "agent: OutboundWindow.telemetry (body prebuilt)",
            agent_encode,
            "json.dumps(frame dict)",
            "json.dumps",
        ),
        Operation(
            "relay: decode_agent_frame",
            lambda: protocol.decode_agent_frame(data.frame),
            "json.loads(frame)",
            "json.loads",
        ),
        Operation(
            "relay: decode + encode_bus_envelope",
            relay_decode_and_forward,
            "json.loads(frame) + json.dumps(envelope)",
            "json.loads+dumps",
        ),
        Operation(
            "relay: decode + identity + envelope + ack",
            relay_whole,
            "json.loads(frame) + json.dumps(envelope)",
            "json.loads+dumps",
        ),
        Operation(
            "master: decode_bus_envelope",
            lambda: protocol.decode_bus_envelope(data.envelope),
            "json.loads(bus envelope)",
            "json.loads",
        ),
    ]


def time_per_message(run: Callable[[], object], messages: int) -> float:
    """Seconds per call of ``run``, over ``messages`` calls."""
    started = time.perf_counter()
    for _ in range(messages):
        run()
    return (time.perf_counter() - started) / messages


# ---- report ---------------------------------------------------------------------------------


def print_table(ops: list[Operation], seconds: dict[str, list[float]]) -> None:
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"\n  {'operation':<49} {'µs/msg':>8} {'min':>8} {'max':>8} {'msgs/s':>10}  cost vs baseline")
    for number, op in enumerate(ops):
        if number and op.baseline is not None and ops[number - 1].baseline is None:
            print()  # baselines first, then ours
        per = median[op.name]
        if op.baseline is None:
            ratio = "(baseline)"
        else:
            factor = per / median[op.baseline]
            ratio = f"{factor:.1f}× {op.verb}" if factor >= 1 else f"{factor:.2f}× {op.verb}"
        print(
            f"  {op.name:<49} {per * 1e6:>8.1f} {min(seconds[op.name]) * 1e6:>8.1f} "
            f"{max(seconds[op.name]) * 1e6:>8.1f} {1 / per:>10,.0f}  {ratio}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=2_000, help="calls per measurement (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="measurements of each operation (default 5)")
    parser.add_argument(
        "--gpus", default="sim:8xH100", help="simulated GPUs of the host (default sim:8xH100)"
    )
    parser.add_argument("--idle", action="store_true", help="idle GPUs (no processes) instead of busy ones")
    parser.add_argument("--quick", action="store_true", help="200 calls × 2 rounds (seconds; for make bench QUICK=1)")
    args = parser.parse_args()
    messages: int = 200 if args.quick else args.messages
    rounds: int = 2 if args.quick else args.rounds
    if messages < 1 or rounds < 1:
        parser.error("--messages and --rounds must be at least 1")

    print(describe_machine())
    data = build_frames(args.gpus, busy=not args.idle)
    gpus = len(data.body.gpus)
    print(
        f"frame: one telemetry message of {gpus} GPUs ({args.gpus}, {'idle' if args.idle else 'all busy'}): "
        f"{len(data.frame.encode()):,} bytes on the websocket; bus envelope {len(data.envelope):,} bytes; "
        f"json.dumps of the same dict {len(json.dumps(data.frame_obj).encode()):,} bytes"
    )
    print(f"{rounds} rounds of {messages:,} calls per operation, interleaved; median per-message cost")

    ops = operations(data)
    for op in ops:  # warm up caches and pydantic's lazily built validators
        time_per_message(op.run, WARMUP)
    seconds: dict[str, list[float]] = {op.name: [] for op in ops}
    progress = Progress("calls", rounds * len(ops) * messages)
    done = 0
    for _ in range(rounds):
        for op in ops:
            gc.collect()
            seconds[op.name].append(time_per_message(op.run, messages))
            done += messages
            progress.update(done)
    progress.done()

    print_table(ops, seconds)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    for op in ops:
        if op.baseline is not None:
            record("protocol", f"{op.name} ({gpus}-GPU telemetry frame)", median[op.name] * 1e6, "µs/msg",
                   op.baseline, median[op.baseline] * 1e6)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
