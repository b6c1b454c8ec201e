"""Demand forecasts: hourly demand from rentals, the seasonal baseline on a history with a daily peak, and the API.

The baseline's error on a held-out day is measured against a flat forecast (the history's mean), the yardstick a
learned model must beat too (issue 26, part 3).
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from master.models import Host, Rental
from master.services.forecast import hourly_demand, mean_absolute_error, seasonal_forecast
from shared.ids import new_id
from tests.apiclient import Api

T0 = datetime(2030, 1, 1, tzinfo=UTC)
KEY = ("NVIDIA GeForce RTX 4090", "eu-west")
PEAK_HOURS = range(18, 22)


def daily_peak(days: int, *, seed: int) -> list[float]:
    """GPUs wanted per hour: 2 at night and off-peak, 8 from 18:00 to 22:00, with noise."""
    rng = random.Random(seed)
    return [max(0.0, (8.0 if hour % 24 in PEAK_HOURS else 2.0) + rng.gauss(0, 0.7)) for hour in range(days * 24)]


class TestHourlyDemand:
    def test_a_rental_is_spread_over_the_hours_it_overlaps(self) -> None:
        start = T0 + timedelta(minutes=30)
        series = hourly_demand([(KEY, start, start + timedelta(minutes=90), 2.0)], since=T0, hours=3)
        assert series[KEY] == [1.0, 2.0, 0.0]

    def test_demand_outside_the_window_is_cut_and_shares_count_as_fractions(self) -> None:
        series = hourly_demand([(KEY, T0 - timedelta(hours=5), T0 + timedelta(minutes=15), 0.5),
                                (("any", "any"), T0 + timedelta(hours=1), T0 + timedelta(hours=9), 1.0)], since=T0, hours=2)  # fmt: skip
        assert series == {KEY: [0.125, 0.0], ("any", "any"): [0.0, 1.0]}


class TestSeasonalBaseline:
    def test_it_repeats_the_same_hour_s_mean(self) -> None:
        history = [float(hour % 24) for hour in range(3 * 24)]
        assert seasonal_forecast(history, horizon=24) == [float(h) for h in range(24)]
        assert seasonal_forecast([], horizon=2) == [0.0, 0.0]

    @pytest.mark.parametrize("seed", [1, 2, 3])
    def test_on_a_held_out_day_it_beats_a_flat_forecast_by_far(self, seed: int) -> None:
        """Fourteen days of a daily peak: the next (held-out) day forecast from the first fourteen."""
        series = daily_peak(15, seed=seed)
        history, held_out = series[:-24], series[-24:]
        seasonal = mean_absolute_error(seasonal_forecast(history), held_out)
        flat = mean_absolute_error([sum(history) / len(history)] * 24, held_out)
        assert seasonal < 1.0 < flat and seasonal < flat / 2, (seasonal, flat)  # the noise alone costs ≈ 0.56
        peak = seasonal_forecast(history)
        assert max(range(24), key=peak.__getitem__) in PEAK_HOURS


class TestApi:
    async def test_providers_see_the_forecast_per_model_and_region_with_its_peak(self, api: Api) -> None:
        host_id, uuids = await api.host(8)
        now = api.master.clock.now()
        today = now.replace(minute=0, second=0, microsecond=0)
        async with api.master.db.session() as session:
            host = await session.get(Host, host_id)
            assert host is not None
            host.region = "eu-west"
            for day in range(1, 8):  # every evening of the last week, 19:00 to 21:00 (UTC), 4 GPUs
                start = (today - timedelta(days=day)).replace(hour=19)
                if start >= today:
                    continue
                session.add(Rental(id=new_id("r"), renter_id=api.renter.account_id, host_id=host_id, gpu_model=KEY[0], gpu_count=4,
                                   gpu_uuids=uuids[:4], state="stopped", started_at=start, stopped_at=start + timedelta(hours=2),
                                   created_at=start))  # fmt: skip
        status, body = await api.as_provider("GET", "/demand-forecast?hours=24")
        assert status == 200, body
        [series] = [s for s in body["series"] if (s["gpu_model"], s["region"]) == KEY]
        assert len(series["forecast"]) == 24 and max(series["forecast"]) == pytest.approx(4.0, abs=0.6)
        assert datetime.fromisoformat(series["peak_at"]).hour in (19, 20)
        status, _ = await api.as_renter("GET", "/demand-forecast")
        assert status == 403
