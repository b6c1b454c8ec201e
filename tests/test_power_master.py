"""Off-peak power limits on the master (docs/power.md): the off-peak rule on synthetic forecasts, the provider's
opt-in and its validation, the pass that tells agents, and the energy saved folded from agents' counters."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select

from master.models import Command, Host, HostPowerPolicy, Rental
from master.services.hosts import power, power_savings
from master.services.market.forecast import hour_start
from shared import protocol
from shared.ids import new_id
from tests.apiclient import Api
from tests.factories import online_host

A100 = "NVIDIA A100-SXM4-80GB"
T0 = datetime(2030, 1, 1, 2, 0, tzinfo=UTC)


def daily_peak() -> list[float]:
    """The next 24 hours from 02:00: 2 GPUs wanted, 8 from 18:00 to 22:00 (hours 16-19 from now)."""
    return [8.0 if (2 + hour) % 24 in range(18, 22) else 2.0 for hour in range(24)]


def a100(index: int) -> protocol.GpuInfoModel:
    return protocol.GpuInfoModel(
        index=index, uuid=f"GPU-a100-{new_id('g')}", name=A100, memory_total_mib=81920, compute_capability="8.0",
        power_limit_w=400.0, power_limit_default_w=400.0, power_limit_min_w=100.0, power_limit_max_w=400.0,
    )


async def a100_host(api: Api, count: int = 2) -> tuple[str, list[str]]:
    gpus = [a100(i) for i in range(count)]
    return await online_host(api.master, api.provider, gpus), [g.uuid for g in gpus]


async def policy_commands(api: Api, host_id: str) -> list[Command]:
    async with api.master.db.session() as session:
        rows = await session.scalars(
            select(Command).where(Command.host_id == host_id, Command.kind == "set_power_policy").order_by(Command.created_at)
        )
        return list(rows.all())


class TestOffPeakRule:
    def test_off_peak_runs_until_the_first_hour_at_the_threshold(self) -> None:
        """At 02:00 the forecast is 2 of a peak of 8 (below 0.5 x 8): off-peak until 18:00, when the evening peak starts."""
        assert power.off_peak_until(daily_peak(), start=T0, threshold=0.5) == T0.replace(hour=18)

    def test_an_hour_at_or_above_the_threshold_is_not_off_peak(self) -> None:
        """At 19:00, in the peak, there is no window; with a threshold of 0.2 neither is 02:00 (2 >= 0.2 x 8)."""
        at_peak = daily_peak()[17:] + daily_peak()[:17]
        assert power.off_peak_until(at_peak, start=T0.replace(hour=19), threshold=0.5) is None
        assert power.off_peak_until(daily_peak(), start=T0, threshold=0.2) is None

    def test_no_demand_at_all_is_off_peak_for_the_whole_horizon(self) -> None:
        assert power.off_peak_until(None, start=T0, threshold=0.5) == T0 + timedelta(hours=24)
        assert power.off_peak_until([0.0] * 24, start=T0, threshold=0.5) == T0 + timedelta(hours=24)

    def test_a_host_with_two_models_is_off_peak_while_both_are(self) -> None:
        """Its window ends at the earlier end; one model in its peak means none."""
        early = [1.0] * 5 + [8.0] * 19
        ahead = {(A100, "eu"): daily_peak(), ("H100", "eu"): early}
        assert power.host_window([A100, "H100"], "eu", ahead, start=T0, threshold=0.5) == T0 + timedelta(hours=5)
        ahead[("H100", "eu")] = [8.0] * 24
        assert power.host_window([A100, "H100"], "eu", ahead, start=T0, threshold=0.5) is None


class TestOptIn:
    async def test_a_provider_opts_a_host_in_with_a_fraction_of_each_default(self, api: Api) -> None:
        """0.625 of the A100's 400 W default is 250 W per GPU, within its 100-400 W range; GET shows the same."""
        host_id, _ = await a100_host(api)
        status, body = await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json={"cap_fraction": 0.625})
        assert status == 200, body
        assert body["enabled"] and [g["target_w"] for g in body["gpus"]] == [250.0, 250.0]
        status, again = await api.as_provider("GET", f"/hosts/{host_id}/power-policy")
        assert status == 200 and again["gpus"] == body["gpus"] and again["energy_saved_wh"] == 0

    @pytest.mark.parametrize(
        ("policy", "words"),
        [
            ({"cap_watts": 450}, "outside its allowed range 100-400 W"),
            ({"cap_watts": 400}, "not below its default limit"),
            ({"cap_watts": 250, "cap_fraction": 0.5}, "exactly one of cap_watts"),
            ({}, "exactly one of cap_watts"),
            ({"cap_fraction": 1.5}, "cap_fraction"),
            ({"cap_watts": "lots"}, "cap_watts"),
            ({"cap_watts": 250, "off_peak_threshold": 0}, "off_peak_threshold"),
            ({"cap_watts": 250, "schedule": "nightly"}, "schedule"),
        ],
    )
    async def test_bad_input_is_a_400_saying_what_to_change(self, api: Api, policy: dict[str, Any], words: str) -> None:
        """Every malformed or ill-fitting cap is 400 invalid_power_policy naming the problem; nothing is stored."""
        host_id, _ = await a100_host(api)
        status, body = await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json=policy)
        assert status == 400 and body["code"] == "invalid_power_policy" and words in body["message"], body
        async with api.master.db.session() as session:
            assert await session.get(HostPowerPolicy, host_id) is None

    async def test_a_host_whose_gpus_report_no_range_cannot_opt_in_but_can_opt_out(self, api: Api) -> None:
        host_id, _ = await api.host(2)  # GPUs that report no adjustable range
        status, body = await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json={"cap_watts": 250})
        assert status == 400 and "none of the host's GPUs" in body["message"]
        status, body = await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json={"enabled": False})
        assert status == 200 and body["enabled"] is False


class TestPass:
    async def test_sends_the_policy_once_and_supersedes_it_on_opt_out(self, api: Api) -> None:
        """No demand history: off-peak for 24 hours, so the pass sends the targets and the window; a second pass sends
        nothing; an opt-out sends an empty policy (the agent restores every GPU)."""
        host_id, uuids = await a100_host(api)
        await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json={"cap_watts": 250})
        assert await power.power_pass(api.master) == 1
        assert await power.power_pass(api.master) == 0
        [first] = await policy_commands(api, host_id)
        command = protocol.decode_command(protocol.CommandBody(command_id=first.id, kind=first.kind, args=first.args))
        assert isinstance(command, protocol.SetPowerPolicy)
        assert {t.gpu_uuid: t.watts for t in command.targets} == dict.fromkeys(uuids, 250.0)
        assert command.off_peak_until == hour_start(api.master.clock.now()) + timedelta(hours=24)
        await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json={"enabled": False})
        assert await power.power_pass(api.master) == 1
        superseded, opt_out = await policy_commands(api, host_id)
        assert superseded.state == "failed" and "superseded" in (superseded.result or {})["detail"]
        assert opt_out.args == {"targets": []} and opt_out.state in ("pending", "sent")

    async def test_a_host_in_its_peak_hour_is_sent_nothing(self, api: Api) -> None:
        """Every day of the last week 2 A100s were rented in this very hour: it is the peak, so nothing is lowered."""
        host_id, uuids = await a100_host(api)
        now = api.master.clock.now()
        async with api.master.db.session() as session:
            for day in range(1, 8):
                start = hour_start(now) - timedelta(days=day)
                session.add(Rental(id=new_id("r"), renter_id=api.renter.account_id, host_id=host_id, gpu_model=A100, gpu_count=2,
                                   gpu_uuids=uuids, state="stopped", started_at=start, stopped_at=start + timedelta(hours=1),
                                   created_at=start))  # fmt: skip
        await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json={"cap_watts": 250})
        assert await power.power_pass(api.master) == 0 and await policy_commands(api, host_id) == []

    async def test_the_agent_s_answer_shows_in_the_policy(self, api: Api) -> None:
        host_id, uuids = await a100_host(api)
        await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json={"cap_watts": 250})
        await power.power_pass(api.master)
        [command] = await policy_commands(api, host_id)
        await api.agent_answers(command, data={"off_peak": True, "capped": dict.fromkeys(uuids, 250.0)})
        status, body = await api.as_provider("GET", f"/hosts/{host_id}/power-policy")
        assert status == 200 and body["agent"]["state"] == "succeeded" and body["off_peak_until"] is not None


class TestEnergySaved:
    async def _report(self, api: Api, host_id: str, counters: dict[str, float]) -> None:
        async with api.master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None
            host.latest_telemetry = {"gpus": [{"uuid": uuid, "energy_saved_wh": wh} for uuid, wh in counters.items()]}
            await power_savings.fold(session, [host], now=api.master.clock.now())

    async def test_counters_fold_into_days_and_show_per_host_and_account(self, api: Api) -> None:
        """10 then 15 Wh on one GPU (the same reading twice adds nothing), then an agent that counts again from 3 Wh:
        18 Wh saved, all today, on the host, the account and the day's figure."""
        host_id, uuids = await a100_host(api)
        await api.as_provider("PUT", f"/hosts/{host_id}/power-policy", json={"cap_watts": 250})
        for counters in ({uuids[0]: 10.0, uuids[1]: 0.0}, {uuids[0]: 15.0}, {uuids[0]: 15.0}, {uuids[0]: 3.0}):
            await self._report(api, host_id, counters)
        status, body = await api.as_provider("GET", "/provider/power?days=7")
        assert status == 200, body
        [host] = [h for h in body["hosts"] if h["host_id"] == host_id]
        assert host["energy_saved_wh"] == body["energy_saved_wh"] == 18.0 and host["enabled"]
        assert len(body["days"]) == 7 and body["days"][-1]["energy_saved_wh"] == 18.0
        status, policy = await api.as_provider("GET", f"/hosts/{host_id}/power-policy")
        assert policy["energy_saved_wh"] == 18.0 and [g["energy_saved_wh"] for g in policy["gpus"]] == [18.0, 0.0]

    async def test_without_a_policy_nothing_is_saved(self, api: Api) -> None:
        await a100_host(api)
        status, body = await api.as_provider("GET", "/provider/power")
        assert status == 200 and body["energy_saved_wh"] == 0 and all(d["energy_saved_wh"] == 0 for d in body["days"])
