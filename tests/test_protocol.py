"""The Sans-I/O wire protocol: encoding, validation, identity, the unacknowledged window."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent.state import SequenceLease
from shared import protocol
from shared.crypto import generate_private_key, sealed_to
from shared.errors import ProtocolError
from shared.outbound import MemoryStore, OutboundWindow
from shared.protocol import fastbus
from tests.factories import gpu_info, hello, telemetry
from tests.helpers import same_as_full_decoder


def _frame(**fields: object) -> str:
    base: dict[str, object] = {"v": 1, "type": "heartbeat", "host_id": "h-1", "seq": 1, "ts": "2026-01-01T00:00:00Z",
                               "body": {"uptime_s": 1.0}}
    base.update(fields)
    return json.dumps(base)


class TestDecoding:
    def test_round_trips_every_agent_message_type(self) -> None:
        """Each agent message type decodes back to an equal object."""
        gpus = [gpu_info(0), gpu_info(1)]
        for message in (hello("h-1", 1, gpus), telemetry("h-1", 2, gpus)):
            assert protocol.decode_agent_frame(protocol.encode(message)) == message

    def test_round_trips_server_messages(self) -> None:
        """Welcome, ack and command frames decode to the same values."""
        command = protocol.Command(body=protocol.CommandBody(command_id="cmd-1", kind="start_workload", args={"rental_id": "r-1"}))
        ack = protocol.Ack(body=protocol.AckBody(seq=7))
        for message in (command, ack):
            assert protocol.decode_server_frame(protocol.encode(message)) == message

    @pytest.mark.parametrize(
        ("frame", "code", "close_code"),
        [
            ("not json", "bad_frame", protocol.CLOSE_BAD_FRAME),
            ("[1, 2]", "bad_frame", protocol.CLOSE_BAD_FRAME),
            (_frame(type="launch_missiles"), "unknown_type", protocol.CLOSE_UNKNOWN_TYPE),
            (_frame(v=2), "unsupported_version", protocol.CLOSE_UNSUPPORTED_VERSION),
            (_frame(seq=-1), "bad_frame", protocol.CLOSE_BAD_FRAME),
            (_frame(host_id="../etc"), "bad_frame", protocol.CLOSE_BAD_FRAME),
            (_frame(body={"uptime_s": 1.0, "extra": True}), "bad_frame", protocol.CLOSE_BAD_FRAME),
            (_frame(type="ack"), "unknown_type", protocol.CLOSE_UNKNOWN_TYPE),
            # valid in its own offset, past year 9999 in UTC: would overflow wherever it is converted
            (_frame(ts="9999-12-31T23:59:59-23:59"), "bad_frame", protocol.CLOSE_BAD_FRAME),
            (_frame(ts="0001-01-01T00:00:00+23:59"), "bad_frame", protocol.CLOSE_BAD_FRAME),
        ],
    )
    def test_refuses_bad_frames_with_a_close_code(self, frame: str, code: str, close_code: int) -> None:
        """Malformed frames raise ProtocolError carrying the stable code and the close code."""
        with pytest.raises(ProtocolError) as caught:
            protocol.decode_agent_frame(frame)
        assert caught.value.code == code
        assert caught.value.close_code == close_code
        assert caught.value.message

    def test_refuses_frames_over_the_limit_before_parsing(self) -> None:
        """A frame longer than max_frame is refused with 1009 without being parsed."""
        with pytest.raises(ProtocolError) as caught:
            protocol.decode_agent_frame(_frame(), max_frame=20)
        assert caught.value.close_code == protocol.CLOSE_TOO_BIG

    def test_identity_must_match_the_certificate(self) -> None:
        """A message naming another host than the certificate is refused."""
        message = protocol.decode_agent_frame(_frame(host_id="h-2"))
        protocol.check_identity(message, "h-2")
        with pytest.raises(ProtocolError) as caught:
            protocol.check_identity(message, "h-1")
        assert caught.value.close_code == protocol.CLOSE_IDENTITY_MISMATCH

    def test_newer_agents_may_add_gpu_fields(self) -> None:
        """Unknown fields inside GPU records are kept, so older masters accept newer agents."""
        raw = json.loads(protocol.encode(hello("h-1", 0, [gpu_info(0)])))
        raw["body"]["gpus"][0]["nvlink_count"] = 4
        message = protocol.decode_agent_frame(json.dumps(raw))
        assert isinstance(message, protocol.Hello)
        assert message.body.gpus[0].model_dump()["nvlink_count"] == 4

    def test_bus_envelope_round_trip(self) -> None:
        """What the relay puts on the bus decodes back with provenance."""
        message = telemetry("h-1", 5, [gpu_info(0)])
        at = datetime.now(UTC)
        envelope = protocol.decode_bus_envelope(protocol.encode_bus_envelope("relay-9", message, at))
        assert (envelope.relay_id, envelope.received_at, envelope.message) == ("relay-9", at, message)
        with pytest.raises(ProtocolError):
            protocol.decode_bus_envelope(b"{}")


def _bus(message: protocol.AnyAgentMessage, **kwargs: str) -> bytes:
    return protocol.encode_bus_envelope("relay-9", message, datetime.now(UTC), **kwargs)


class TestFastBusDecoder:
    def test_heartbeats_and_telemetry_decode_to_the_same_values(self) -> None:
        """What relays put on the bus decodes in one pass to what decode_bus_envelope gives, provenance included."""
        heartbeat = protocol.Heartbeat(host_id="h-1", seq=3, ts=datetime.now(UTC), body=protocol.HeartbeatBody(
            uptime_s=12.5, running_rentals=["r-1"], spool=protocol.SpoolStats(pending=2, evicted={"telemetry": 1})))
        sample = protocol.GpuSampleModel(index=0, uuid="GPU-1", gpu_util_pct=97, memory_used_mib=1000, throttle_reasons=[],
                                         processes=[protocol.GpuProcessModel(pid=4, used_memory_mib=10)])
        report = protocol.Telemetry(host_id="h-1", seq=4, ts=datetime.now(UTC), body=protocol.TelemetryBody(
            sampled_at=datetime.now(UTC), gpus=[sample], window_s=10,
            aggregates=[protocol.GpuAggregateModel(uuid="GPU-1", samples=10, gpu_util_avg=90.5)]))
        for payload in (_bus(heartbeat), _bus(report, cert_serial="0a1b"), _bus(telemetry("h-2", 5, [gpu_info(0), gpu_info(1)]))):
            decoded = same_as_full_decoder(payload)
            assert decoded is not None and decoded.message.type in ("heartbeat", "telemetry")

    @pytest.mark.parametrize(
        ("change", "full_decoder_refuses"),
        [
            pytest.param(lambda r: r["message"].update(type="hello"), True, id="another message type"),
            pytest.param(lambda r: r["message"]["body"]["gpus"][0].update(nvlink_count=4), False, id="a GPU field it does not know"),
            pytest.param(lambda r: r["message"]["body"]["gpus"][0].update(memory_used_mib=5.0), False, id="an int given as 5.0"),
            pytest.param(lambda r: r["message"].update(host_id="h-1\n"), True, id="a host id with a final newline"),
            pytest.param(lambda r: r["message"]["body"]["gpus"][0].update(index=300), True, id="a GPU index out of bounds"),
            pytest.param(lambda r: r["message"].update(seq=1 << 63), True, id="a seq past 2**63"),
            pytest.param(lambda r: r.update(received_at="9999-12-31T23:59:59-23:59"), True, id="a time not representable in UTC"),
            pytest.param(lambda r: r.update(extra=1), True, id="an envelope field it does not know"),
        ],
    )
    def test_leaves_what_it_does_not_take_whole_to_the_full_decoder(self, change: Any, full_decoder_refuses: bool) -> None:
        """Anything but a plain heartbeat or telemetry record is None here, and decode_bus_envelope decides as before."""
        record = json.loads(_bus(telemetry("h-1", 5, [gpu_info(0)])))
        change(record)
        payload = json.dumps(record).encode()
        assert fastbus.decode_bus_report(payload) is None
        if full_decoder_refuses:
            with pytest.raises(ProtocolError):
                protocol.decode_bus_envelope(payload)
        else:
            protocol.decode_bus_envelope(payload)

    def test_nan_and_garbage_are_left_to_the_full_decoder(self) -> None:
        """NaN (a JSON constant on the bus) and bytes that are no record at all: None, never an exception."""
        nan = _bus(telemetry("h-1", 5, [gpu_info(0)])).replace(b'"gpu_util_pct":5.0', b'"gpu_util_pct":NaN')
        assert b"NaN" in nan and fastbus.decode_bus_report(nan) is None
        assert math.isnan(protocol.decode_bus_envelope(nan).message.body.gpus[0].gpu_util_pct)  # type: ignore[union-attr,arg-type]
        for garbage in (b"", b"not json", b"[]", b"{}", b"[" * 100_000):
            assert fastbus.decode_bus_report(garbage) is None


class TestOutboundWindow:
    def _body(self) -> protocol.HeartbeatBody:
        return protocol.HeartbeatBody(uptime_s=1.0)

    def _telemetry(self) -> protocol.TelemetryBody:
        return protocol.TelemetryBody(sampled_at=datetime.now(UTC), gpus=[])

    def test_numbers_messages_consecutively_from_the_lease(self) -> None:
        """Sequence numbers start at first_seq and increase by one."""
        window = OutboundWindow("h-1", first_seq=1000)
        seqs = [window.heartbeat(self._body())[0] for _ in range(3)]
        assert seqs == [1000, 1001, 1002]

    def test_keeps_unacknowledged_messages_in_order_for_replay(self) -> None:
        """Acknowledged messages leave; the rest replay in sequence order."""
        window = OutboundWindow("h-1", first_seq=0)
        frames = [window.heartbeat(self._body()) for _ in range(4)]
        assert window.ack(1) and window.ack(3)
        assert not window.ack(3)
        assert list(window.pending()) == [frames[0], frames[2]]

    def test_a_full_store_evicts_oldest_heartbeats_then_telemetry_and_counts_them(self) -> None:
        """When full, the oldest evictable frames make room; results and the newest telemetry are kept."""
        window = OutboundWindow("h-1", first_seq=0, store=MemoryStore(max_messages=3))
        result = protocol.CommandResultBody(command_id="cmd-1", ok=True, finished_at=datetime.now(UTC))
        result_seq, _ = window.command_result(result)
        old_telemetry, _ = window.telemetry(self._telemetry())
        beat, _ = window.heartbeat(self._body())
        newer, _ = window.telemetry(self._telemetry())  # evicts the heartbeat
        newest, _ = window.telemetry(self._telemetry())  # evicts the oldest telemetry
        assert [seq for seq, _ in window.pending()] == [result_seq, newer, newest]
        assert window.store.evicted == {"heartbeat": 1, "telemetry": 1}
        assert beat not in dict(window.pending()) and old_telemetry not in dict(window.pending())

    def test_a_new_hello_supersedes_unacknowledged_ones(self) -> None:
        """Old hellos are dropped from the window so they cannot replay stale facts after the new one."""
        window = OutboundWindow("h-1", first_seq=0)
        body = protocol.HelloBody(agent_version="t", gpu_backend="sim", gpus=[])
        window.hello(body)
        window.heartbeat(self._body())
        second, _ = window.hello(body)
        kinds = [json.loads(frame)["type"] for _, frame in window.pending()]
        assert kinds == ["heartbeat", "hello"] and max(dict(window.pending())) == second


class TestSequenceLease:
    def test_never_reuses_a_number_after_a_crash(self, tmp_path: Path) -> None:
        """A restarted agent starts above every number the previous run could have used."""
        path = tmp_path / "seq.lease"
        first = SequenceLease(path, block=10)
        used = first.start
        for seq in range(first.start, first.start + 25):
            first.reserve_through(seq + 1)
            used = seq
        # "crash": no clean shutdown; a new lease is read from disk
        second = SequenceLease(path, block=10)
        assert second.start > used

    def test_damaged_lease_is_a_clear_error(self, tmp_path: Path) -> None:
        """A lease file that is not a number is refused with advice."""
        path = tmp_path / "seq.lease"
        path.write_text("garbage")
        with pytest.raises(Exception, match="damaged"):
            SequenceLease(path)


class TestCommands:
    """Each command is one typed model: built by the master, sent as ``kind`` + ``args``, decoded by the agent."""

    COMMANDS: tuple[protocol.AnyCommand, ...] = (
        protocol.StartWorkload(rental_id="r-1", gpu_uuids=["GPU-1"], workload=protocol.ProcessWorkload(argv=["python", "train.py"])),
        protocol.StartWorkload(rental_id="r-2", gpu_uuids=["GPU-1"], share=protocol.GpuShare(milli=250, memory_mib=8192)),
        protocol.StopWorkload(rental_id="r-1", grace_s=30, reason="preempted by rental r-3"),
        protocol.MeasureNetwork(),
        protocol.InstallCertificate(certificate="C" * 64, ca_certificate="A" * 64),
        protocol.HealthCheck(gpu_uuids=["GPU-1", "GPU-2"]),
        protocol.SetPowerPolicy(targets=[protocol.PowerTarget(gpu_uuid="GPU-1", watts=250)],
                                off_peak_until=datetime(2026, 11, 27, 6, tzinfo=UTC)),
    )

    @pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.kind)
    def test_every_command_crosses_the_wire_unchanged(self, command: protocol.AnyCommand) -> None:
        """A command built on the master decodes on the agent to an equal model, its wire ``args`` free of ``kind`` and unset options."""
        body = protocol.CommandBody.of("cmd-1", command)
        frame = protocol.encode(protocol.Command(body=body))
        decoded = protocol.decode_server_frame(frame)
        assert isinstance(decoded, protocol.Command) and decoded.body.kind == command.kind
        assert "kind" not in decoded.body.args and None not in decoded.body.args.values()
        assert protocol.decode_command(decoded.body) == command

    @pytest.mark.parametrize(
        ("kind", "args", "code", "words"),
        [
            ("reformat_disk", {}, "unknown_command", "unknown command kind 'reformat_disk'"),
            ("start_workload", {"gpu_uuids": []}, "bad_command", "rental_id"),
            ("start_workload", {"rental_id": "r-1", "gpu_uuids": [], "workload": {"kind": "process", "argv": ["x"], "image": "u"}}, "bad_command", "image"),
            ("stop_workload", {"rental_id": "r-1", "grace_s": 601}, "bad_command", "grace"),
            ("measure_network", {"extra": 1}, "bad_command", "extra"),
            ("health_check", {"kind": "health_check"}, "bad_command", "kind"),
            ("set_power_policy", {"targets": [{"gpu_uuid": "GPU-1", "watts": -5}]}, "bad_command", "watts"),
            ("set_power_policy", {"targets": [{"gpu_uuid": "GPU-1", "watts": 250}, {"gpu_uuid": "GPU-1", "watts": 300}]},
             "bad_command", "names a GPU twice"),
        ],
    )
    def test_unknown_kinds_and_fields_are_refused_by_the_protocol(self, kind: str, args: dict[str, object], code: str, words: str) -> None:
        """An unknown kind, a missing or unknown field, or a value out of bounds is a ``ProtocolError`` naming it."""
        with pytest.raises(ProtocolError, match=words) as refused:
            protocol.decode_command(protocol.CommandBody(command_id="cmd-1", kind=kind, args=args))
        assert refused.value.code == code

    def test_a_start_carries_a_registry_login_only_sealed(self) -> None:
        """``sealed_registry_auth`` takes an ``ecies:v1`` token and nothing else: a login in the clear (the old
        ``registry_auth`` object, or a password where the token goes) is refused before anything runs."""
        start = {"rental_id": "r-1", "gpu_uuids": [], "workload": {"kind": "container", "image": "registry.example.com/a:1"}}
        key = generate_private_key()
        login = protocol.RegistryAuth(server="registry.example.com", username="robot", password="hunter2")
        context = protocol.registry_auth_context("h-1", "cmd-1")
        token = sealed_to.seal_to(key.public_key(), login.model_dump_json().encode(), context)
        command = protocol.decode_command(protocol.CommandBody(command_id="cmd-1", kind="start_workload",
                                                               args={**start, "sealed_registry_auth": token}))  # fmt: skip
        assert isinstance(command, protocol.StartWorkload) and command.sealed_registry_auth == token
        assert token not in repr(command) and "hunter2" not in repr(command)
        opened = protocol.RegistryAuth.model_validate_json(sealed_to.open_with(key, token, context))
        assert opened == login
        assert protocol.commands.SEALED_TOKEN_PATTERN == sealed_to.TOKEN_PATTERN
        for refused in ({"registry_auth": login.model_dump()}, {"sealed_registry_auth": "hunter2"},
                        {"sealed_registry_auth": login.model_dump()}, {"sealed_registry_auth": "sealed:v1:abc"}):  # fmt: skip
            with pytest.raises(ProtocolError) as error:
                protocol.decode_command(protocol.CommandBody(command_id="cmd-1", kind="start_workload", args={**start, **refused}))
            assert error.value.code == "bad_command" and "hunter2" not in str(error.value)

    def test_an_absent_workload_is_a_hold(self) -> None:
        """``start_workload`` without ``workload`` (or with one that names no kind) holds the GPUs."""
        for args in ({"rental_id": "r-1", "gpu_uuids": []}, {"rental_id": "r-1", "gpu_uuids": [], "workload": {}}):
            command = protocol.decode_command(protocol.CommandBody(command_id="c", kind="start_workload", args=args))
            assert isinstance(command, protocol.StartWorkload) and command.workload == protocol.HoldWorkload()

    def test_an_unlimited_process_workload_is_sent_without_limits(self) -> None:
        """No limit is no key: what the master stores and sends for a workload without limits is ``{kind, argv, env}``."""
        spec = protocol.ProcessWorkload(argv=["true"])
        assert spec.model_dump(mode="json") == {"kind": "process", "argv": ["true"], "env": {}}
        limited = protocol.ProcessWorkload(argv=["true"], cpu_cores=2, memory_mib=4096)
        assert limited.model_dump(mode="json")["cpu_cores"] == 2.0
