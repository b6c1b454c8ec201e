"""libFuzzer harness (atheris) for the wire protocol decoders in ``shared/protocol/``.

Each input goes to both frame decoders and both bus decoders. A frame decoder either returns
a message, which must encode again, decode to the same frame and cross the bus as the relay
sends it, or raises ``ProtocolError`` with a code from ``CLOSE_CODES``; a command frame's body
must then decode to its typed command or be refused as ``unknown_command``/``bad_command``;
anything else is a crash. libFuzzer's ``-timeout`` (seconds per input) and ``-rss_limit_mb`` turn a hang or a
memory blow-up into a failure too.

Run from the repository root, with the test extras installed::

    mkdir -p /tmp/corpus-protocol
    .venv/bin/python fuzz/fuzz_protocol.py -max_total_time=600 -timeout=5 -rss_limit_mb=2048 /tmp/corpus-protocol

An empty corpus directory is first seeded with one valid frame of every message type.
``tests/test_fuzz_protocol.py`` runs this harness for a bounded number of runs.
"""

from __future__ import annotations

from datetime import UTC, datetime

import atheris
from harness import fuzz  # fuzz/harness.py: this script's folder is first on sys.path

with atheris.instrument_imports(include=["shared"]):
    from shared import protocol
    from shared.errors import ProtocolError

AT = datetime(2026, 1, 1, tzinfo=UTC)
AGENT_TYPES = (
    protocol.Hello, protocol.Heartbeat, protocol.Telemetry, protocol.CommandResult, protocol.GpuEvents,
    protocol.NetworkReport, protocol.WorkloadExited, protocol.WorkloadLogs, protocol.RenewCertificate,
)  # fmt: skip


def seeds() -> list[bytes]:
    """One valid frame of each message type, from the encoder."""
    gpu = protocol.GpuInfoModel(index=0, uuid="GPU-0", name="NVIDIA H100", memory_total_mib=81_559)
    envelope = {"host_id": "h-1", "seq": 1, "ts": AT}
    messages = [
        protocol.Hello(**envelope, body=protocol.HelloBody(agent_version="1", gpu_backend="nvml", host={"cpus": 8}, gpus=[gpu])),
        protocol.Heartbeat(**envelope, body=protocol.HeartbeatBody(uptime_s=1.0, spool=protocol.SpoolStats(pending=1))),
        protocol.Telemetry(**envelope, body=protocol.TelemetryBody(
            sampled_at=AT, gpus=[protocol.GpuSampleModel(index=0, uuid="GPU-0", gpu_util_pct=50.0)])),
        protocol.CommandResult(**envelope, body=protocol.CommandResultBody(command_id="c-1", ok=True, finished_at=AT)),
        protocol.GpuEvents(**envelope, body=protocol.GpuEventsBody(
            events=[protocol.GpuEventModel(uuid="GPU-0", kind="xid", code=79, at=AT)])),
        protocol.NetworkReport(**envelope, body=protocol.NetworkReportBody(
            relay_url="wss://r", measured_at=AT, loss=0.0, probes_sent=1, probes_answered=1, duration_s=1.0)),
        protocol.WorkloadExited(**envelope, body=protocol.WorkloadExitedBody(rental_id="r-1", exit_code=0, at=AT)),
        protocol.WorkloadLogs(**envelope, body=protocol.WorkloadLogsBody(rental_id="r-1", offset=0, length=3, data="hi\n")),
        protocol.RenewCertificate(**envelope, body=protocol.RenewCertificateBody(csr="C" * 64)),
        protocol.Welcome(body=protocol.WelcomeBody(
            relay_id="r", host_id="h-1", heartbeat_interval=1.0, telemetry_interval=1.0, max_frame=1 << 20)),
        protocol.Ack(body=protocol.AckBody(seq=1)),
        protocol.Command(body=protocol.CommandBody(command_id="c-1", kind="stop_workload", args={"rental_id": "r-1"})),
        protocol.Move(body=protocol.MoveBody(reason="drain")),
    ]  # fmt: skip
    return [protocol.encode(message).encode() for message in messages]


def check_command(body: protocol.CommandBody) -> None:
    """The agent's second step: a typed command that builds the same body again, or a command refusal."""
    try:
        command = protocol.decode_command(body)
    except ProtocolError as exc:
        if exc.code not in ("unknown_command", "bad_command") or len(exc.message) > 1024:
            raise AssertionError(f"malformed command refusal: {exc.code} {exc.message[:200]!r}") from exc
        return
    if protocol.decode_command(protocol.CommandBody.of(body.command_id, command)) != command:
        raise AssertionError(f"accepted command does not round-trip: {body!r:.200}")


def test_one_input(data: bytes) -> None:
    for decode in (protocol.decode_agent_frame, protocol.decode_server_frame):
        try:
            message = decode(data)
        except ProtocolError as exc:
            if protocol.CLOSE_CODES.get(exc.code) != exc.close_code or len(exc.message) > 1024:
                raise AssertionError(f"malformed refusal: {exc.code} {exc.close_code} {exc.message[:200]!r}") from exc
            continue
        frame = protocol.encode(message)
        if protocol.encode(decode(frame)) != frame:
            raise AssertionError(f"accepted frame does not round-trip: {frame[:200]!r}")
        if isinstance(message, AGENT_TYPES):
            protocol.decode_bus_envelope(protocol.encode_bus_envelope("relay-fuzz", message, AT))
        if isinstance(message, protocol.Command):
            check_command(message.body)
    for decode_record in (protocol.decode_bus_envelope, protocol.decode_command_delivery):
        try:
            decode_record(data)
        except ProtocolError as exc:
            if exc.code != "bad_bus_record":
                raise AssertionError(f"unexpected bus refusal code {exc.code}") from exc


if __name__ == "__main__":
    fuzz(seeds, test_one_input)
