"""Alerts on SQLite and PostgreSQL: rules raise, dedupe, escalate and resolve; the webhook retries.

The fleet's state is set up through the ingest handlers (``master.telemetry.hosts``) or the
host state machine, exactly as the master would reach it. Evaluations and deliveries take an
explicit ``now``, so windows and back-off are walked through without sleeping. The webhook is
a real aiohttp server on 127.0.0.1 that fails its first deliveries (500 or a dropped
connection) before it accepts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy import select

from master.api.base import API
from master.app import create_app
from master.background.alerts import alert_loop
from master.context import Master
from master.models import Alert, AlertNotification, Host, Rental
from master.services.accounts.core import Principal
from master.services.alerts import delivery, rules
from master.services.alerts.rules import Condition, evaluate
from master.services.lifecycle.hosts import transition
from master.telemetry import hosts
from shared import protocol
from shared.bus import InProcessBus
from shared.ids import new_id
from shared.protocol import INGEST_GROUP as GROUP
from shared.registry import RelayRecord
from tests.factories import MS, create_principal, envelope, gpu_info, online_host
from tests.helpers import eventually

RELAY = "relay-t"  # the relay tests.factories.envelope() says messages came through

FailureMode = Literal["status_500", "drop_connection", "hang"]


# ---- the fleet ------------------------------------------------------------------------------


@dataclass
class Fleet:
    """A master with one live relay, a provider and a renter, and helpers to make trouble."""

    master: Master
    provider: Principal
    provider_key: str
    renter: Principal
    t0: datetime
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def host(self, gpus: int = 2) -> tuple[str, list[str]]:
        """An online host of the provider; returns its id and GPU uuids."""
        infos = [gpu_info(i) for i in range(gpus)]
        return await online_host(self.master, self.provider, infos), [g.uuid for g in infos]

    async def gpu_events(self, host_id: str, *events: tuple[str, str, int | None], at: datetime | None = None) -> None:
        """The agent reports ``(gpu uuid, kind, code)`` events, as the ingestor would apply them."""
        when = at or self.t0
        message = protocol.GpuEvents(
            host_id=host_id, seq=next(self._seq), ts=when,
            body=protocol.GpuEventsBody(events=[
                protocol.GpuEventModel(uuid=uuid, kind=kind, code=code, at=when) for uuid, kind, code in events
            ]),
        )
        async with self.master.db.session() as session:
            received = protocol.BusEnvelope(relay_id=RELAY, received_at=when, message=message)
            await hosts.handle_gpu_events(session, received)

    async def telemetry(self, host_id: str, *gpus: protocol.GpuSampleModel) -> None:
        message = protocol.Telemetry(
            host_id=host_id, seq=next(self._seq), ts=self.t0,
            body=protocol.TelemetryBody(sampled_at=self.t0, gpus=list(gpus)),
        )
        async with self.master.db.session() as session:
            await hosts.handle_telemetry(session, envelope(message, relay=RELAY))

    async def temperature(self, host_id: str, uuid: str, celsius: float) -> None:
        await self.telemetry(host_id, protocol.GpuSampleModel(index=0, uuid=uuid, temperature_c=celsius))

    async def set_state(self, host_id: str, state: str) -> None:
        async with self.master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None
            transition(session, host, state, cause="test", actor="test")

    async def rent(self, host_id: str) -> str:
        """A running rental on the host (written directly: placement is not under test here)."""
        rental_id = new_id("rent")
        async with self.master.db.session() as session:
            session.add(Rental(id=rental_id, renter_id=self.renter.account_id, host_id=host_id, gpu_count=1, state="running"))
        return rental_id

    async def alerts(self, rule: str | None = None) -> list[Alert]:
        async with self.master.db.session() as session:
            query = select(Alert).order_by(Alert.raised_at, Alert.id)
            if rule is not None:
                query = query.where(Alert.rule == rule)
            return list((await session.scalars(query)).all())

    async def firing(self, rule: str) -> list[Alert]:
        return [a for a in await self.alerts(rule) if a.state == "firing"]

    async def notifications(self) -> list[AlertNotification]:
        async with self.master.db.session() as session:
            return list((await session.scalars(select(AlertNotification).order_by(AlertNotification.id))).all())

    async def notification(self, notification_id: int) -> AlertNotification:
        async with self.master.db.session() as session:
            row = await session.get(AlertNotification, notification_id)
            assert row is not None
            return row

    def at(self, seconds: float) -> datetime:
        return self.t0 + timedelta(seconds=seconds)


def live_relay(relay_id: str) -> RelayRecord:
    return RelayRecord(relay_id=relay_id, region="local", url=f"wss://{relay_id}:8443/v1/agent", host=relay_id, port=8443,
                       connections=0, capacity=100, draining=False, updated_at=0.0)


def with_settings(master: Master, **changes: Any) -> Master:
    """The same master process with other settings (the database, bus and registry are shared)."""
    return dataclasses.replace(master, settings=master.settings.model_copy(update=changes))


async def make_fleet(master: Master) -> Fleet:
    await master.registry.put_relay(live_relay(RELAY), ttl=3600)
    provider, provider_key = await create_principal(master, "provider-1", "provider")
    renter, _ = await create_principal(master, "renter-1", "renter")
    return Fleet(master=master, provider=provider, provider_key=provider_key, renter=renter, t0=datetime.now(UTC))


@pytest.fixture
async def fleet(master: Master) -> Fleet:
    return await make_fleet(master)


# ---- a webhook that fails on purpose ---------------------------------------------------------


@dataclass
class Delivery:
    headers: dict[str, str]
    body: dict[str, Any]


class Webhook:
    """A real HTTP server on 127.0.0.1 that fails its first ``fail_first`` deliveries, then accepts."""

    def __init__(self, *, fail_first: int = 0, mode: FailureMode = "status_500") -> None:
        self.fail_first = fail_first
        self.mode = mode
        self.requests: list[Delivery] = []  # every request, failed or not
        self.accepted: list[Delivery] = []
        self.release = asyncio.Event()  # lets hanging handlers finish at teardown
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self.server = TestServer(app, host="127.0.0.1", port=0)

    @property
    def url(self) -> str:
        return str(self.server.make_url("/hook"))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        delivery = Delivery(dict(request.headers), await request.json())
        self.requests.append(delivery)
        if len(self.requests) <= self.fail_first:
            if self.mode == "status_500":
                return web.Response(status=500, text="webhook receiver is down")
            if self.mode == "hang":
                await self.release.wait()
                return web.Response(status=200)
            assert request.transport is not None
            request.transport.close()  # no answer at all: the client sees the connection drop
            return web.Response(status=200)
        self.accepted.append(delivery)
        return web.json_response({"ok": True})


@pytest.fixture
async def webhook_factory() -> AsyncIterator[Any]:
    started: list[Webhook] = []

    async def start(*, fail_first: int = 0, mode: FailureMode = "status_500") -> Webhook:
        hook = Webhook(fail_first=fail_first, mode=mode)
        await hook.server.start_server()
        started.append(hook)
        return hook

    yield start
    for hook in started:
        hook.release.set()
        await hook.server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


# ---- rules ------------------------------------------------------------------------------------


class TestRules:
    async def test_hardware_xid_raises_a_critical_alert_for_its_gpu(self, fleet: Fleet) -> None:
        """An XID 48 (double-bit ECC error) raises one critical alert keyed by host and GPU."""
        host_id, (gpu0, _) = await fleet.host()
        await fleet.gpu_events(host_id, (gpu0, "xid", 48))
        result = await evaluate(fleet.master, now=fleet.t0)
        assert result.raised == 1
        [alert] = await fleet.alerts("xid")
        assert (alert.key, alert.open_key, alert.state) == (f"xid:{host_id}:{gpu0}",) * 2 + ("firing",)
        assert alert.severity == "critical"
        assert alert.host_id == host_id
        assert alert.details["codes"] == {"48": 1} and alert.details["hardware"] is True
        assert "48" in alert.summary and gpu0 in alert.summary

    async def test_application_xid_only_warns(self, fleet: Fleet) -> None:
        """XID 13 and 31 are usually the program's fault: a warning, not a page."""
        host_id, (gpu0, _) = await fleet.host()
        await fleet.gpu_events(host_id, (gpu0, "xid", 13), (gpu0, "xid", 31))
        await evaluate(fleet.master, now=fleet.t0)
        [alert] = await fleet.alerts("xid")
        assert alert.severity == "warning"
        assert alert.details["codes"] == {"13": 1, "31": 1}
        assert alert.occurrences == 2

    async def test_events_older_than_the_window_raise_nothing(self, fleet: Fleet) -> None:
        """An XID from before alert_event_window_minutes is history, not an alert."""
        host_id, (gpu0, _) = await fleet.host()
        window = fleet.master.settings.alert_event_window_minutes
        await fleet.gpu_events(host_id, (gpu0, "xid", 48), at=fleet.t0 - timedelta(minutes=window + 1))
        assert (await evaluate(fleet.master, now=fleet.t0)).raised == 0
        assert await fleet.alerts("xid") == []

    async def test_double_bit_ecc_is_critical_and_single_bit_warns(self, fleet: Fleet) -> None:
        """ECC events raise one alert per GPU: critical with a double-bit error, a warning with single-bit ones only."""
        host_id, (gpu0, gpu1) = await fleet.host()
        await fleet.gpu_events(host_id, (gpu0, "double_bit_ecc", None), (gpu1, "single_bit_ecc", None))
        await evaluate(fleet.master, now=fleet.t0)
        by_key = {a.key: a for a in await fleet.alerts("ecc")}
        assert by_key[f"ecc:{host_id}:{gpu0}"].severity == "critical"
        assert by_key[f"ecc:{host_id}:{gpu1}"].severity == "warning"

    async def test_uncorrected_ecc_in_telemetry_is_critical(self, fleet: Fleet) -> None:
        """A GPU whose latest telemetry counts uncorrected ECC errors raises a critical ECC alert."""
        host_id, (gpu0, gpu1) = await fleet.host()
        await fleet.telemetry(
            host_id,
            protocol.GpuSampleModel(index=0, uuid=gpu0, ecc_volatile_uncorrected=3),
            protocol.GpuSampleModel(index=1, uuid=gpu1, ecc_volatile_uncorrected=0),
        )
        await evaluate(fleet.master, now=fleet.t0)
        [alert] = await fleet.alerts("ecc")
        assert alert.key == f"ecc:{host_id}:{gpu0}"
        assert alert.severity == "critical"
        assert alert.details["ecc_volatile_uncorrected"] == 3

    async def test_ecc_events_and_telemetry_of_one_gpu_make_one_alert(self, fleet: Fleet) -> None:
        """Single-bit events plus an uncorrected count in telemetry on the same GPU: one ECC alert, at the graver severity."""
        host_id, (gpu0, _) = await fleet.host()
        await fleet.gpu_events(host_id, (gpu0, "single_bit_ecc", None), (gpu0, "single_bit_ecc", None))
        await fleet.telemetry(host_id, protocol.GpuSampleModel(index=0, uuid=gpu0, ecc_volatile_uncorrected=1))
        await evaluate(fleet.master, now=fleet.t0)
        [alert] = await fleet.alerts("ecc")
        assert alert.severity == "critical"
        assert alert.details["single_bit_events"] == 2 and alert.details["ecc_volatile_uncorrected"] == 1
        assert alert.occurrences == 2

    async def test_hot_gpu_warns_and_a_much_hotter_one_is_critical(self, fleet: Fleet) -> None:
        """Above alert_temperature_c warns; 10 °C above it is critical; below it nothing fires."""
        host_id, (gpu0, gpu1) = await fleet.host()
        cool_host, (cool_gpu, _) = await fleet.host()
        await fleet.telemetry(
            host_id,
            protocol.GpuSampleModel(index=0, uuid=gpu0, temperature_c=88.0),
            protocol.GpuSampleModel(index=1, uuid=gpu1, temperature_c=96.0),
        )
        await fleet.temperature(cool_host, cool_gpu, 70.0)
        await evaluate(fleet.master, now=fleet.t0)
        by_key = {a.key: a for a in await fleet.alerts("temperature")}
        assert set(by_key) == {f"temperature:{host_id}:{gpu0}", f"temperature:{host_id}:{gpu1}"}
        assert by_key[f"temperature:{host_id}:{gpu0}"].severity == "warning"
        assert by_key[f"temperature:{host_id}:{gpu1}"].severity == "critical"
        assert by_key[f"temperature:{host_id}:{gpu1}"].details["temperature_c"] == 96.0

    async def test_offline_host_warns_and_is_critical_with_active_rentals(self, fleet: Fleet) -> None:
        """An offline host raises a warning, a critical alert when renters are on it."""
        idle, _ = await fleet.host()
        busy, _ = await fleet.host()
        await fleet.rent(busy)
        await fleet.set_state(idle, "offline")
        await fleet.set_state(busy, "offline")
        await evaluate(fleet.master, now=fleet.t0)
        by_key = {a.key: a for a in await fleet.alerts("host_offline")}
        assert by_key[f"host_offline:{idle}"].severity == "warning"
        assert by_key[f"host_offline:{busy}"].severity == "critical"
        assert by_key[f"host_offline:{busy}"].details["active_rentals"] == 1

    async def test_faulty_host_is_critical(self, fleet: Fleet) -> None:
        """A host the master marked faulty raises a critical alert."""
        host_id, _ = await fleet.host()
        await fleet.set_state(host_id, "faulty")
        await evaluate(fleet.master, now=fleet.t0)
        [alert] = await fleet.alerts("host_faulty")
        assert (alert.key, alert.severity, alert.host_id) == (f"host_faulty:{host_id}", "critical", host_id)

    async def test_ingestion_lag_fires_while_messages_wait_and_clears_when_consumed(self, fleet: Fleet) -> None:
        """Agent messages left unprocessed longer than alert_ingestion_lag_s raise a critical alert."""
        bus = fleet.master.bus
        await bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        await bus.publish(protocol.AGENT_EVENTS_STREAM, b"{}")
        published = datetime.now(UTC)
        threshold = fleet.master.settings.alert_ingestion_lag_s
        assert (await evaluate(fleet.master, now=published + timedelta(seconds=threshold / 2))).raised == 0
        await evaluate(fleet.master, now=published + timedelta(seconds=threshold * 2))
        [alert] = await fleet.firing("ingestion_lag")
        assert alert.severity == "critical" and alert.host_id is None
        assert alert.details["undelivered"] == 1 and alert.details["lag_s"] > threshold
        [message] = await bus.read(protocol.AGENT_EVENTS_STREAM, GROUP, "test", block=None)
        await bus.ack(protocol.AGENT_EVENTS_STREAM, GROUP, [message.id])
        await evaluate(fleet.master, now=published + timedelta(seconds=threshold * 3))
        assert await fleet.firing("ingestion_lag") == []

    async def test_relay_gone_from_the_registry_with_hosts_behind_it_is_critical(self, fleet: Fleet) -> None:
        """A relay hosts last spoke through that is missing from the registry raises relay_dead; it clears when it is back."""
        host_id, _ = await fleet.host()  # spoke through RELAY
        await fleet.master.registry.remove_relay(RELAY)
        async with fleet.master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None and host.last_seen_at is not None
            last_seen = host.last_seen_at
        # Within the heartbeat deadline the agents may just be moving to another relay: no alert yet (at the
        # instant the host was last heard: a busy machine may take longer than the test deadline to get here).
        assert (await evaluate(fleet.master, now=last_seen)).raised == 0
        await evaluate(fleet.master, now=fleet.at(60))
        [alert] = await fleet.firing("relay_dead")
        assert (alert.key, alert.relay_id, alert.severity) == (f"relay_dead:{RELAY}", RELAY, "critical")
        assert alert.details["hosts"] == 1
        await fleet.master.registry.put_relay(live_relay(RELAY), ttl=3600)
        await evaluate(fleet.master, now=fleet.at(70))
        assert await fleet.firing("relay_dead") == []

    async def test_an_unreadable_bus_skips_the_lag_rule_without_resolving_it(self, fleet: Fleet) -> None:
        """When the backlog cannot be read the lag alert stays as it was: unknown is not resolved."""
        await fleet.master.bus.ensure_group(protocol.AGENT_EVENTS_STREAM, GROUP)
        await fleet.master.bus.publish(protocol.AGENT_EVENTS_STREAM, b"{}")
        await evaluate(fleet.master, now=fleet.at(3600))
        broken = InProcessBus()
        await broken.close()
        result = await evaluate(dataclasses.replace(fleet.master, bus=broken), now=fleet.at(3610))
        assert result.skipped_rules == ("ingestion_lag",)
        assert len(await fleet.firing("ingestion_lag")) == 1


# ---- lifecycle: dedupe, occurrences, resolution, escalation ------------------------------------


@pytest.fixture
async def notifying(fleet: Fleet) -> Fleet:
    """The fleet with a webhook configured, so changes are queued as notifications."""
    fleet.master = with_settings(fleet.master, alert_webhook_url="http://127.0.0.1:9/unused")
    return fleet


class TestLifecycle:
    async def test_a_second_pass_refreshes_the_alert_without_a_new_one_or_a_new_notification(self, notifying: Fleet) -> None:
        """Evaluating again while the condition holds keeps one alert, moves last_seen_at, and notifies once."""
        fleet = notifying
        host_id, _ = await fleet.host()
        await fleet.set_state(host_id, "faulty")
        first = await evaluate(fleet.master, now=fleet.t0)
        second = await evaluate(fleet.master, now=fleet.at(10))
        assert (first.raised, second.raised, second.updated, second.resolved) == (1, 0, 1, 0)
        [alert] = await fleet.alerts("host_faulty")
        assert alert.raised_at == fleet.t0 and alert.last_seen_at == fleet.at(10)
        assert alert.occurrences == 1
        [notification] = await fleet.notifications()
        assert (notification.alert_id, notification.event) == (alert.id, "firing")
        assert notification.payload["alert"]["id"] == alert.id

    async def test_new_events_count_as_occurrences_of_the_same_alert(self, notifying: Fleet) -> None:
        """More XIDs on the same GPU while the alert fires add to its occurrences, not new alerts or notifications."""
        fleet = notifying
        host_id, (gpu0, _) = await fleet.host()
        await fleet.gpu_events(host_id, (gpu0, "xid", 13))
        await evaluate(fleet.master, now=fleet.t0)
        await fleet.gpu_events(host_id, (gpu0, "xid", 13), (gpu0, "xid", 13), at=fleet.at(5))
        await evaluate(fleet.master, now=fleet.at(10))
        await evaluate(fleet.master, now=fleet.at(20))  # nothing new: occurrences stay
        [alert] = await fleet.alerts("xid")
        assert alert.occurrences == 3
        assert alert.details["codes"] == {"13": 3}
        assert [n.event for n in await fleet.notifications()] == ["firing"]

    async def test_resolves_when_the_condition_clears(self, notifying: Fleet) -> None:
        """When the window has passed the XID alert resolves: open_key cleared, resolved_at set, one resolved notification."""
        fleet = notifying
        host_id, (gpu0, _) = await fleet.host()
        await fleet.gpu_events(host_id, (gpu0, "xid", 48))
        await evaluate(fleet.master, now=fleet.t0)
        window = fleet.master.settings.alert_event_window_minutes * 60
        assert (await evaluate(fleet.master, now=fleet.at(window - 1))).resolved == 0
        result = await evaluate(fleet.master, now=fleet.at(window + 1))
        assert result.resolved == 1
        [alert] = await fleet.alerts("xid")
        assert (alert.state, alert.open_key, alert.resolved_at) == ("resolved", None, fleet.at(window + 1))
        assert alert.last_seen_at == fleet.at(window - 1)
        firing, resolved = await fleet.notifications()
        assert (firing.event, resolved.event) == ("firing", "resolved")
        assert resolved.payload["alert"]["state"] == "resolved"
        assert (await evaluate(fleet.master, now=fleet.at(window + 10))).resolved == 0  # once only

    async def test_the_condition_coming_back_opens_a_new_alert(self, notifying: Fleet) -> None:
        """A host faulty again after recovering gets a new alert; the old one stays resolved."""
        fleet = notifying
        host_id, _ = await fleet.host()
        await fleet.set_state(host_id, "faulty")
        await evaluate(fleet.master, now=fleet.t0)
        await fleet.set_state(host_id, "online")
        await evaluate(fleet.master, now=fleet.at(10))
        await fleet.set_state(host_id, "faulty")
        await evaluate(fleet.master, now=fleet.at(20))
        old, new = await fleet.alerts("host_faulty")
        assert old.id != new.id and old.key == new.key
        assert (old.state, new.state, new.open_key) == ("resolved", "firing", new.key)
        assert [n.event for n in await fleet.notifications()] == ["firing", "resolved", "firing"]

    async def test_escalation_to_critical_notifies_again(self, notifying: Fleet) -> None:
        """An offline host's warning turns critical when a rental is found on it, and that is notified."""
        fleet = notifying
        host_id, _ = await fleet.host()
        await fleet.set_state(host_id, "offline")
        await evaluate(fleet.master, now=fleet.t0)
        await fleet.rent(host_id)
        result = await evaluate(fleet.master, now=fleet.at(10))
        assert (result.raised, result.escalated) == (0, 1)
        [alert] = await fleet.alerts("host_offline")
        assert alert.severity == "critical"
        firing, escalated = await fleet.notifications()
        assert (firing.event, escalated.event) == ("firing", "escalated")
        assert escalated.payload["previous_severity"] == "warning"
        assert escalated.payload["alert"]["severity"] == "critical"

    async def test_temperature_has_hysteresis(self, notifying: Fleet) -> None:
        """A GPU just under the threshold keeps its open alert, raises none when cool, and clears well below it."""
        fleet = notifying
        threshold = fleet.master.settings.alert_temperature_c
        host_id, (gpu0, _) = await fleet.host()
        await fleet.temperature(host_id, gpu0, threshold + 3)
        await evaluate(fleet.master, now=fleet.t0)
        await fleet.temperature(host_id, gpu0, threshold - 2)
        assert (await evaluate(fleet.master, now=fleet.at(10))).resolved == 0
        await fleet.temperature(host_id, gpu0, threshold - 10)
        assert (await evaluate(fleet.master, now=fleet.at(20))).resolved == 1
        await fleet.temperature(host_id, gpu0, threshold - 2)
        assert (await evaluate(fleet.master, now=fleet.at(30))).raised == 0
        assert [n.event for n in await fleet.notifications()] == ["firing", "resolved"]

    async def test_an_alert_opened_by_another_evaluator_is_kept_not_a_crash(self, fleet: Fleet) -> None:
        """A raise that hits the unique open_key of an alert another evaluator just opened is skipped."""
        host_id, _ = await fleet.host()
        condition = Condition(rule="host_faulty", key=f"host_faulty:{host_id}", severity="critical", summary="x", host_id=host_id)
        async with fleet.master.db.session() as session:
            first = await rules.reconcile(session, [condition], now=fleet.t0)
        # This pass does not see the open alert (as with a commit that landed after its read),
        # so it tries to open the same key again.
        async with fleet.master.db.session() as session:
            second = await rules.reconcile(session, [condition, dataclasses.replace(condition, key="other")],
                                            now=fleet.at(1), skipped_rules=("host_faulty",))
        assert (first.raised, second.raised) == (1, 1)
        assert [a.key for a in await fleet.alerts("host_faulty")] == [f"host_faulty:{host_id}", "other"]

    async def test_concurrent_passes_open_one_alert(self, fleet: Fleet) -> None:
        """Two masters evaluating at the same moment open the alert once (PostgreSQL: the unique open_key decides)."""
        if fleet.master.db.is_sqlite:
            pytest.skip("SQLite serialises writers: the second pass fails with 'database is locked' and retries next period")
        host_id, _ = await fleet.host()
        await fleet.set_state(host_id, "faulty")
        results = await asyncio.gather(*(evaluate(fleet.master, now=fleet.t0) for _ in range(3)))
        assert sum(r.raised for r in results) == 1
        assert len(await fleet.alerts("host_faulty")) == 1


# ---- webhook ----------------------------------------------------------------------------------


async def webhook_fleet(fleet: Fleet, url: str, **settings: Any) -> Fleet:
    fleet.master = with_settings(fleet.master, alert_webhook_url=url, **settings)
    host_id, _ = await fleet.host()
    await fleet.set_state(host_id, "faulty")
    return fleet


class TestWebhook:
    @pytest.mark.parametrize("mode", ["status_500", "drop_connection"])
    async def test_retries_with_backoff_then_delivers(
        self, fleet: Fleet, webhook_factory: Any, http: aiohttp.ClientSession, mode: FailureMode
    ) -> None:
        """Two failed deliveries are retried after 2 s and 4 s; the third lands, with the same Idempotency-Key each time."""
        hook: Webhook = await webhook_factory(fail_first=2, mode=mode)
        fleet = await webhook_fleet(fleet, hook.url)
        await evaluate(fleet.master, now=fleet.t0)
        [queued] = await fleet.notifications()

        assert await delivery.deliver_due(fleet.master, http, now=fleet.t0) == 0
        row = await fleet.notification(queued.id)
        assert (row.attempts, row.next_attempt_at, row.delivered_at) == (1, fleet.at(2), None)
        assert row.last_error and ("HTTP 500" in row.last_error if mode == "status_500" else "Disconnected" in row.last_error)

        assert await delivery.deliver_due(fleet.master, http, now=fleet.at(1)) == 0  # not due yet: no request
        assert len(hook.requests) == 1

        assert await delivery.deliver_due(fleet.master, http, now=fleet.at(2)) == 0
        row = await fleet.notification(queued.id)
        assert (row.attempts, row.next_attempt_at) == (2, fleet.at(2 + 4))

        assert await delivery.deliver_due(fleet.master, http, now=fleet.at(6)) == 1
        row = await fleet.notification(queued.id)
        assert (row.attempts, row.delivered_at, row.last_error, row.gave_up_at) == (3, fleet.at(6), None, None)
        assert {r.headers["Idempotency-Key"] for r in hook.requests} == {f"alert-notification-{queued.id}"}
        [accepted] = hook.accepted
        assert accepted.body["event"] == "firing"
        assert accepted.body["alert"]["rule"] == "host_faulty"
        assert accepted.body["alert"]["severity"] == "critical"
        assert accepted.body["alert"]["state"] == "firing"

        assert await delivery.deliver_due(fleet.master, http, now=fleet.at(3600)) == 0  # delivered once
        assert len(hook.requests) == 3

    async def test_gives_up_after_max_attempts(self, fleet: Fleet, webhook_factory: Any, http: aiohttp.ClientSession) -> None:
        """A webhook that keeps failing is tried alert_webhook_max_attempts times, then the notification is given up."""
        hook: Webhook = await webhook_factory(fail_first=1000)
        fleet = await webhook_fleet(fleet, hook.url, alert_webhook_max_attempts=3)
        await evaluate(fleet.master, now=fleet.t0)
        [queued] = await fleet.notifications()
        for seconds in (0, 2, 6):
            await delivery.deliver_due(fleet.master, http, now=fleet.at(seconds))
        row = await fleet.notification(queued.id)
        assert (row.attempts, row.gave_up_at, row.delivered_at) == (3, fleet.at(6), None)
        assert row.last_error is not None and "HTTP 500" in row.last_error
        await delivery.deliver_due(fleet.master, http, now=fleet.at(3600))
        assert len(hook.requests) == 3

    async def test_an_alerts_events_arrive_in_order(self, fleet: Fleet, webhook_factory: Any, http: aiohttp.ClientSession) -> None:
        """A resolved event waits for its alert's failed firing event, so the receiver never sees them reversed."""
        hook: Webhook = await webhook_factory(fail_first=1)
        fleet = await webhook_fleet(fleet, hook.url)
        await evaluate(fleet.master, now=fleet.t0)
        await delivery.deliver_due(fleet.master, http, now=fleet.t0)  # firing fails, retried at t0+2
        [host] = [a.host_id for a in await fleet.alerts("host_faulty")]
        assert host is not None
        await fleet.set_state(host, "online")
        await evaluate(fleet.master, now=fleet.at(1))  # resolved, due at once
        assert await delivery.deliver_due(fleet.master, http, now=fleet.at(1)) == 0
        assert len(hook.requests) == 1
        assert await delivery.deliver_due(fleet.master, http, now=fleet.at(2)) == 1  # the firing one
        assert await delivery.deliver_due(fleet.master, http, now=fleet.at(2)) == 1  # then the resolved one
        assert [d.body["event"] for d in hook.accepted] == ["firing", "resolved"]

    async def test_a_webhook_that_does_not_answer_times_out(
        self, fleet: Fleet, webhook_factory: Any, http: aiohttp.ClientSession
    ) -> None:
        """A delivery gets alert_webhook_timeout seconds, then counts as a failed attempt."""
        hook: Webhook = await webhook_factory(fail_first=1, mode="hang")
        fleet = await webhook_fleet(fleet, hook.url, alert_webhook_timeout=100 * MS)
        await evaluate(fleet.master, now=fleet.t0)
        [queued] = await fleet.notifications()
        assert await delivery.deliver_due(fleet.master, http, now=fleet.t0) == 0
        row = await fleet.notification(queued.id)
        assert row.attempts == 1 and row.last_error is not None and "no response within" in row.last_error

    async def test_without_a_webhook_nothing_is_queued_or_sent(self, fleet: Fleet, http: aiohttp.ClientSession) -> None:
        """With no alert_webhook_url the alert is recorded but no notification is queued."""
        host_id, _ = await fleet.host()
        await fleet.set_state(host_id, "faulty")
        assert (await evaluate(fleet.master, now=fleet.t0)).raised == 1
        assert await fleet.notifications() == []
        assert await delivery.deliver_due(fleet.master, http, now=fleet.t0) == 0

    async def test_the_loop_evaluates_and_delivers(self, fleet: Fleet, webhook_factory: Any) -> None:
        """alert_loop, as the app runs it, raises the alert and posts it to the webhook."""
        hook: Webhook = await webhook_factory()
        fleet = await webhook_fleet(fleet, hook.url, alert_interval=20 * MS)

        async def delivered() -> list[Delivery]:
            return hook.accepted

        task = asyncio.create_task(alert_loop(fleet.master))
        try:
            await eventually(delivered, what="a delivered notification")
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert hook.accepted[0].body["alert"]["rule"] == "host_faulty"


# ---- API ----------------------------------------------------------------------------------------


@dataclass
class AlertsApi:
    fleet: Fleet
    client: TestClient[Any, Any]
    keys: dict[str, str]

    async def get(self, path: str, who: str, **params: str) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.keys[who]}"}
        async with self.client.get(API + path, headers=headers, params=params) as response:
            assert response.content_type == "application/json", await response.text()
            return response.status, await response.json()


@pytest.fixture
async def api(fleet: Fleet) -> AsyncIterator[AlertsApi]:
    """The app, an admin, the fleet's provider (whose host is faulty), another provider, and a renter.

    Open alerts: ``host_faulty`` on the provider's host and a fleet-wide ``relay_dead``.
    """
    _, admin_key = await create_principal(fleet.master, "admin-1", "admin")
    _, other_key = await create_principal(fleet.master, "provider-2", "provider")
    _, renter_key = await create_principal(fleet.master, "renter-2", "renter")
    host_id, _ = await fleet.host()
    await fleet.set_state(host_id, "faulty")
    await fleet.master.registry.remove_relay(RELAY)
    await evaluate(fleet.master, now=fleet.at(60))
    client: TestClient[Any, Any] = TestClient(TestServer(create_app(fleet.master, background=False)))
    await client.start_server()
    try:
        yield AlertsApi(fleet, client, {"admin": admin_key, "provider": fleet.provider_key, "other": other_key, "renter": renter_key})
    finally:
        await client.close()


class TestApi:
    async def test_admins_see_every_alert_newest_first(self, api: AlertsApi) -> None:
        """An admin lists host and fleet-wide alerts in a paged listing."""
        status, body = await api.get("/alerts", "admin")
        assert status == 200, body
        assert {a["rule"] for a in body["items"]} == {"host_faulty", "relay_dead"}
        assert (body["total"], body["limit"], body["offset"]) == (2, 50, 0)
        first = body["items"][0]
        assert set(first) == {"id", "rule", "key", "severity", "state", "host_id", "relay_id", "summary", "details",
                              "raised_at", "last_seen_at", "resolved_at", "occurrences"}

    async def test_providers_see_only_their_own_hosts_alerts(self, api: AlertsApi) -> None:
        """A provider sees the alert on its host, not fleet-wide ones; another provider sees nothing."""
        status, body = await api.get("/alerts", "provider")
        assert status == 200, body
        [item] = body["items"]
        assert item["rule"] == "host_faulty"
        status, one = await api.get(f"/alerts/{item['id']}", "provider")
        assert status == 200 and one == item
        status, body = await api.get("/alerts", "other")
        assert (status, body["items"], body["total"]) == (200, [], 0)
        status, body = await api.get(f"/alerts/{item['id']}", "other")
        assert (status, body["code"]) == (404, "alert_not_found")

    async def test_renters_are_refused(self, api: AlertsApi) -> None:
        """Renters have no alerts to see: 403."""
        status, body = await api.get("/alerts", "renter")
        assert (status, body["code"]) == (403, "forbidden")
        [alert] = await api.fleet.alerts("host_faulty")
        status, body = await api.get(f"/alerts/{alert.id}", "renter")
        assert (status, body["code"]) == (403, "forbidden")

    async def test_filters(self, api: AlertsApi) -> None:
        """state, severity, rule and host_id narrow the listing; resolved alerts show with state=resolved or all."""
        [alert] = await api.fleet.alerts("host_faulty")
        assert alert.host_id is not None
        await api.fleet.set_state(alert.host_id, "online")
        await evaluate(api.fleet.master, now=api.fleet.at(70))
        _, firing = await api.get("/alerts", "admin")
        assert [a["rule"] for a in firing["items"]] == ["relay_dead"]
        _, resolved = await api.get("/alerts", "admin", state="resolved")
        assert [a["id"] for a in resolved["items"]] == [alert.id]
        _, everything = await api.get("/alerts", "admin", state="all", limit="1")
        assert (everything["total"], len(everything["items"])) == (2, 1)
        _, by_rule = await api.get("/alerts", "admin", state="all", rule="host_faulty", severity="critical", host_id=alert.host_id)
        assert [a["id"] for a in by_rule["items"]] == [alert.id]
        _, warnings = await api.get("/alerts", "admin", state="all", severity="warning")
        assert warnings["items"] == []

    @pytest.mark.parametrize(
        ("params", "word"),
        [({"state": "open"}, "state"), ({"severity": "fatal"}, "severity"), ({"rule": "cpu"}, "rule"), ({"limit": "0"}, "limit")],
    )
    async def test_bad_query_values_are_400(self, api: AlertsApi, params: dict[str, str], word: str) -> None:
        """An unknown filter value is a 400 that names the parameter."""
        status, body = await api.get("/alerts", "admin", **params)
        assert (status, body["code"]) == (400, "invalid_query"), body
        assert word in body["message"]

    async def test_unknown_alert_is_404(self, api: AlertsApi) -> None:
        """An alert id that does not exist is a 404 with a stable code."""
        status, body = await api.get("/alerts/alert-0000000000000000", "admin")
        assert (status, body["code"]) == (404, "alert_not_found")
