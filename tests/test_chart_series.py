"""The charts' series: spend, earnings, occupancy and the marketplace per UTC day, on SQLite and PostgreSQL.

Postings are made here at chosen times (around midnight UTC, to the microsecond) and the series are
checked against sums worked out from those postings, exactly; the routes' roles are checked too.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import select

from billing import ledger, series
from billing.ledger import Leg
from master.models import Gpu, GpuAllocation, Host, HostEvent
from master.services.platform import fleet as fleet_series
from tests.apiclient import Api, assert_error
from tests.factories import create_principal
from tests.helpers import ManualClock
from tests.test_billing import make_rental

# "Now" for every test: noon on 10 January 2030, so that the window's days are known exactly.
NOW = datetime(2030, 1, 10, 12, 0, tzinfo=UTC)
JAN = {day: datetime(2030, 1, day, tzinfo=UTC) for day in range(1, 12)}
JUST_BEFORE = timedelta(microseconds=1)
FEE_RATE = Decimal("0.15")


async def charge(
    api: Api, key: str, rental_id: str, renter_id: str, provider_id: str, amount: str, at: datetime
) -> None:
    """A usage posting as rating makes one: the renter charged ``amount``, the provider earns 85 %, the platform 15 %."""
    total = Decimal(amount)
    fee = ledger.quantize(total * FEE_RATE)
    legs = [
        Leg(ledger.renter_credit(renter_id), total),
        Leg(ledger.provider_payable(provider_id), -(total - fee)),
        Leg(ledger.FEES, -fee),
    ]
    async with api.master.db.session() as session:
        assert await ledger.post(session, key=key, kind="usage", legs=legs, at=at, rental_id=rental_id)


async def top_up(api: Api, account_id: str, amount: str, at: datetime) -> None:
    async with api.master.db.session() as session:
        await ledger.post(session, key=f"topup:{account_id}:{at.isoformat()}", kind="top_up", at=at,
                          legs=[Leg(ledger.CASH, Decimal(amount)), Leg(ledger.renter_credit(account_id), -Decimal(amount))])  # fmt: skip


def by_day(points: list[dict[str, str]], field: str = "amount") -> dict[str, Decimal]:
    return {point["day"]: Decimal(point[field]) for point in points}


class TestSpend:
    async def test_sums_charges_per_utc_day_and_per_rental_exactly(self, api: Api) -> None:
        """A rental rated on both sides of midnight counts on each day; top-ups and other renters' charges never count."""
        host_id, _ = await api.host(2)
        spans = await make_rental(
            api, host_id, price="1.5", start=JAN[9] - timedelta(hours=1), end=JAN[10] + timedelta(hours=1)
        )
        short = await make_rental(api, host_id, price="2", start=JAN[7], end=JAN[7] + timedelta(hours=1))
        renter, provider = api.renter.account_id, api.provider.account_id
        await charge(
            api, "a1", spans, renter, provider, "0.123457", JAN[10] - JUST_BEFORE
        )  # 23:59:59.999999 on the 9th
        await charge(api, "a2", spans, renter, provider, "0.000001", JAN[10])  # midnight: the 10th
        await charge(api, "a3", spans, renter, provider, "1.100000", JAN[10] + timedelta(hours=1))
        await charge(api, "b1", short, renter, provider, "2.000000", JAN[7] + timedelta(hours=1))
        await charge(
            api, "old", short, renter, provider, "9.000000", JAN[4] - JUST_BEFORE
        )  # the day before the window
        await top_up(api, renter, "50.00", JAN[9])
        other, _ = await create_principal(api.master, "renter-2", "renter")
        await charge(api, "o1", spans, other.account_id, provider, "7.000000", JAN[9])

        async with api.master.db.session() as session:
            view = await series.spend(session, renter, days=7, now=NOW)

        assert [point["day"] for point in view["days"]] == [f"2030-01-{d:02d}" for d in range(4, 11)]
        assert by_day(view["days"]) == {
            "2030-01-04": 0, "2030-01-05": 0, "2030-01-06": 0, "2030-01-07": Decimal("2"), "2030-01-08": 0,
            "2030-01-09": Decimal("0.123457"), "2030-01-10": Decimal("1.100001"),
        }  # fmt: skip
        assert {r["rental_id"]: Decimal(r["amount"]) for r in view["rentals"]} == {
            spans: Decimal("1.223458"),
            short: Decimal("2"),
        }
        assert view["rentals"][0]["rental_id"] == short  # the largest first
        assert view["total"] == "3.223458"
        assert view["from"] == JAN[4].isoformat() and view["to"] == JAN[11].isoformat()


class TestEarnings:
    async def test_sums_earnings_per_day_and_per_host(self, api: Api) -> None:
        """The provider's payable credits per day, split by the rentals' hosts; payouts are not earnings."""
        first, _ = await api.host(1)
        second, _ = await api.host(1)
        async with api.master.db.session() as session:
            (await session.get(Host, second)).name = "second-host"  # type: ignore[union-attr]
        a = await make_rental(api, first, price="1", start=JAN[8], end=JAN[10])
        b = await make_rental(api, second, price="1", start=JAN[8], end=JAN[10])
        renter, provider = api.renter.account_id, api.provider.account_id
        await charge(api, "a1", a, renter, provider, "1.000000", JAN[9] - JUST_BEFORE)
        await charge(api, "a2", a, renter, provider, "0.333333", JAN[9] + timedelta(hours=5))
        await charge(api, "b1", b, renter, provider, "2.000000", JAN[10] + timedelta(hours=11))
        async with api.master.db.session() as session:
            await ledger.post(session, key="payout:1", kind="payout", at=JAN[10],
                              legs=[Leg(ledger.provider_payable(provider), Decimal("1")), Leg(ledger.CASH, Decimal("-1"))])  # fmt: skip
            view = await series.earnings(session, provider, days=3, now=NOW)

        earned = {key: total - ledger.quantize(total * FEE_RATE) for key, total in
                  {"a1": Decimal("1"), "a2": Decimal("0.333333"), "b1": Decimal("2")}.items()}  # fmt: skip
        assert by_day(view["days"]) == {
            "2030-01-08": earned["a1"],
            "2030-01-09": earned["a2"],
            "2030-01-10": earned["b1"],
        }
        hosts = {one["host_id"]: one for one in view["hosts"]}
        assert Decimal(hosts[first]["amount"]) == earned["a1"] + earned["a2"]
        assert by_day(hosts[second]["days"]) == {"2030-01-08": 0, "2030-01-09": 0, "2030-01-10": earned["b1"]}
        assert hosts[second]["name"] == "second-host"
        assert Decimal(view["total"]) == sum(earned.values())


async def hold(
    api: Api, gpu_uuid: str, rental_id: str, start: datetime, end: datetime | None, milli: int = 1000
) -> None:
    async with api.master.db.session() as session:
        gpu_id = await session.scalar(select(Gpu.id).where(Gpu.uuid == gpu_uuid))
        session.add(
            GpuAllocation(
                rental_id=rental_id,
                gpu_id=gpu_id,
                milli=milli,
                whole=milli == 1000,
                created_at=start,
                released_at=end,
            )
        )


class TestOccupancy:
    async def test_share_of_each_day_each_gpu_was_held(self, api: Api) -> None:
        """A half share held from noon to 06:00 the next day is 0.25 then 0.125; today counts up to now; free GPUs are 0."""
        host_id, uuids = await api.host(2)
        rental = await make_rental(api, host_id, price="1", start=JAN[8], end=None, state="running")
        await hold(
            api, uuids[0], rental, JAN[8] + timedelta(hours=12), JAN[9] + timedelta(hours=6), milli=500
        )
        await hold(
            api, uuids[0], rental, JAN[10] + timedelta(hours=6), None
        )  # still held: 6 of today's 12 hours
        await hold(api, uuids[0], rental, JAN[1], JAN[2])  # long before the window

        async with api.master.db.session() as session:
            view = await fleet_series.gpu_occupancy(session, api.provider.account_id, days=3, now=NOW)
            other = await fleet_series.gpu_occupancy(session, api.renter.account_id, days=3, now=NOW)

        assert view["days"] == ["2030-01-08", "2030-01-09", "2030-01-10"]
        gpus = {gpu["uuid"]: gpu for gpu in view["gpus"]}
        assert gpus[uuids[0]]["occupancy"] == [0.25, 0.125, 0.5]
        assert gpus[uuids[0]]["average"] == round((0.25 * 24 + 0.125 * 24 + 0.5 * 12) / 60, 4)
        assert gpus[uuids[1]]["occupancy"] == [0.0, 0.0, 0.0]
        assert other["gpus"] == []  # only the caller's own hosts


class TestMarketplace:
    async def test_gmv_fees_occupancy_and_hosts_online_per_day(self, api: Api) -> None:
        """GMV is every renter's charges; hosts online is the mean count over the day, from the state changes."""
        flaky, uuids = await api.host(1)
        await api.host(1)  # online all along
        rental = await make_rental(api, flaky, price="1", start=JAN[9], end=JAN[10])
        other, _ = await create_principal(api.master, "renter-2", "renter")
        await charge(api, "a", rental, api.renter.account_id, api.provider.account_id, "1.000000", JAN[9])
        await charge(
            api,
            "b",
            rental,
            other.account_id,
            api.provider.account_id,
            "0.500001",
            JAN[9] + timedelta(hours=23),
        )
        await top_up(api, other.account_id, "10.00", JAN[9])
        await hold(api, uuids[0], rental, JAN[9], JAN[10])
        async with api.master.db.session() as session:
            session.add(
                HostEvent(
                    host_id=flaky,
                    at=JAN[8] + timedelta(hours=12),
                    from_state="online",
                    to_state="offline",
                    cause="t",
                    actor="t",
                )
            )
            session.add(
                HostEvent(
                    host_id=flaky,
                    at=JAN[9] + timedelta(hours=6),
                    from_state="offline",
                    to_state="online",
                    cause="t",
                    actor="t",
                )
            )
            view = await series.marketplace(session, days=3, now=NOW)

        days = {point["day"]: point for point in view["days"]}
        assert Decimal(days["2030-01-09"]["gmv"]) == Decimal("1.500001")
        assert Decimal(days["2030-01-09"]["fees"]) == ledger.quantize(Decimal("0.15")) + ledger.quantize(
            Decimal("0.500001") * FEE_RATE
        )
        assert Decimal(days["2030-01-08"]["gmv"]) == 0 and view["total_gmv"] == "1.500001"
        assert [days[d]["hosts_online"] for d in ("2030-01-08", "2030-01-09", "2030-01-10")] == [
            1.5,
            1.75,
            2.0,
        ]
        assert [days[d]["occupancy"] for d in ("2030-01-08", "2030-01-09", "2030-01-10")] == [0.0, 0.5, 0.0]
        assert [days[d]["hosts_online_max"] for d in ("2030-01-08", "2030-01-09", "2030-01-10")] == [2, 2, 2]


class TestRoutes:
    async def test_each_role_reads_its_own_series_and_not_the_admins(self, api: Api) -> None:
        """Renters read spend, providers earnings and occupancy, admins the marketplace; anyone else is 403."""
        api.master.clock = ManualClock(NOW)
        host_id, _ = await api.host(1)
        rental = await make_rental(api, host_id, price="1", start=JAN[9], end=JAN[10])
        await charge(
            api,
            "a",
            rental,
            api.renter.account_id,
            api.provider.account_id,
            "0.250000",
            JAN[10] + timedelta(hours=1),
        )
        _, admin_key = await create_principal(api.master, "admin-1", "admin")

        status, body = await api.as_renter("GET", "/account/spend?days=2")
        assert status == 200 and by_day(body["days"]) == {"2030-01-09": 0, "2030-01-10": Decimal("0.25")}
        status, body = await api.as_provider("GET", "/provider/earnings?days=1")
        assert status == 200 and body["total"] == ledger.money(
            Decimal("0.25") - ledger.quantize(Decimal("0.25") * FEE_RATE)
        )
        status, body = await api.as_provider("GET", "/provider/occupancy")
        assert status == 200 and len(body["days"]) == 7 and len(body["gpus"]) == 1
        status, body = await api.call("GET", "/admin/marketplace?days=5", admin_key)
        assert status == 200 and len(body["days"]) == 5 and body["total_gmv"] == "0.250000"

        for path in ("/admin/marketplace", "/provider/earnings", "/provider/occupancy"):
            status, body = await api.as_renter("GET", path)
            assert_error(status, body, 403, body.get("code", "?"))
        status, body = await api.as_provider("GET", "/admin/marketplace")
        assert status == 403, body
        status, body = await api.as_provider("GET", "/account/spend")
        assert status == 403, body

    @pytest.mark.parametrize("query", ["days=0", "days=367", "days=x"])
    async def test_days_out_of_range_is_400(self, api: Api, query: str) -> None:
        status, body = await api.as_renter("GET", f"/account/spend?{query}")
        assert_error(status, body, 400, "invalid_query")

    async def test_occupancy_window_is_at_most_31_days(self, api: Api) -> None:
        status, body = await api.as_provider("GET", "/provider/occupancy?days=32")
        assert_error(status, body, 400, "invalid_query")


class TestVendoredUplot:
    def test_committed_files_match_their_checksums_and_the_pinned_version(self) -> None:
        """The uPlot files served are the ones SHA256SUMS names, of the version package-lock.json pins with its integrity."""
        root = Path(__file__).resolve().parents[1] / "console"
        folder = root / "static" / "vendor" / "uplot"
        lines = (folder / "SHA256SUMS").read_text().splitlines()
        sums = {name: digest for digest, name in (line.split("  ", 1) for line in lines)}
        assert set(sums) == {"uPlot.esm.js", "uPlot.min.css", "LICENSE.txt"}
        for name, digest in sums.items():
            assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
        pinned = json.loads((root / "vendor" / "package.json").read_text())["dependencies"]["uplot"]
        locked = json.loads((root / "vendor" / "package-lock.json").read_text())["packages"][
            "node_modules/uplot"
        ]
        assert locked["version"] == pinned and locked["integrity"].startswith("sha512-")
        assert "MIT" in (folder / "LICENSE.txt").read_text()

    async def test_the_console_serves_them_itself(self, api: Api) -> None:
        async with api.client.get("/static/vendor/uplot/uPlot.esm.js") as response:
            assert response.status == 200
            assert response.content_type == "text/javascript"
            assert "export { uPlot as default }" in await response.text()
