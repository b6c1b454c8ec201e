"""Offered ⇒ rentable: whatever an offer row says is free rents, on its host, and not one more.

Random fleets (whole GPUs, GPUs in MIG mode carved into instances, listings that rent shares, hosts offline, draining,
in maintenance or past their listing's end) are written through the agents' hellos and the providers' listings, part
of them rented first (whole GPUs, shares, MIG instances). Then for every row of ``GET /api/v1/offers``: renting its
``num_gpus`` whole GPUs by its ``offer_id`` succeeds on its host and one more fails; each MIG profile it lists rents
exactly its ``free`` instances and not one more; a host and model with no row rents nothing by ``offer_id``. Driven on
SQLite and PostgreSQL (the ``api`` fixture, shared by the examples: each starts by taking the earlier ones' hosts
offline and renting as a new renter).

Regression test for issue 39: the demo's A100 in MIG mode was offered as a free whole GPU (``FREE 1``) and renting
it answered ``insufficient_capacity``.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from master.models import Host, HostListing
from shared import protocol
from tests.apiclient import A100, RTX, Api
from tests.factories import create_principal, gpu_info, online_host

# The api fixture is built once per test and shared by its examples (each takes the earlier ones' hosts offline).
EXAMPLES = settings(
    max_examples=12, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb")

gpus = st.fixed_dictionaries({
    "model": st.sampled_from([RTX, A100]),
    # None: MIG mode off (rents whole, or in shares where the listing allows); a list: in MIG mode, these instances.
    "mig": st.none() | st.none() | st.lists(st.sampled_from(PROFILES), max_size=3),
})  # fmt: skip
hosts = st.fixed_dictionaries({
    "state": st.sampled_from(["online", "online", "online", "offline", "draining", "maintenance"]),
    "gpus": st.lists(gpus, min_size=1, max_size=4),
    # None: unlisted (tier default price, whole GPUs); else the listing's price, unit, and whether its end has passed.
    "listing": st.none() | st.fixed_dictionaries({
        "price": st.sampled_from(["0.40", "0.75", "1.50"]),
        "unit": st.sampled_from(["gpu", "milli:250"]),
        "ended": st.sampled_from([False, False, True]),
    }),
})  # fmt: skip
# Rentals made before the offers are read: whole GPUs of a model, a share of one GPU, one MIG instance.
uses = st.lists(
    st.one_of(
        st.tuples(st.just("whole"), st.sampled_from([RTX, A100]), st.integers(1, 2)),
        st.tuples(st.just("share"), st.sampled_from([RTX, A100]), st.sampled_from([250, 500])),
        st.tuples(st.just("mig"), st.sampled_from([RTX, A100]), st.sampled_from(PROFILES)),
    ),
    max_size=4,
)
_examples = itertools.count()


async def _write_fleet(api: Api, example: int, fleet: list[dict[str, Any]]) -> list[str]:
    """The example's hosts, online by hello, then listed and put in their state; returns their ids."""
    async with api.master.db.session() as session:
        await session.execute(update(Host).values(state="offline"))  # the earlier examples' hosts
    host_ids = []
    for number, host in enumerate(fleet):
        infos = []
        for index, gpu in enumerate(host["gpus"]):
            info = gpu_info(index, name=gpu["model"], memory=81920 if gpu["model"] == A100 else 24564)
            if gpu["mig"] is not None:
                instances = [protocol.GpuMigInstanceModel(uuid=f"MIG-{example}-{number}-{index}-{n}", profile=p)
                             for n, p in enumerate(gpu["mig"])]  # fmt: skip
                info = info.model_copy(update={"mig_mode": True, "mig_instances": instances})
            infos.append(info)
        host_id = await online_host(api.master, api.provider, infos)
        listing = host["listing"]
        if listing is not None:
            status, body = await api.as_provider(
                "PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": listing["price"], "smallest_unit": listing["unit"]}
            )
            assert status in (200, 201), body
        async with api.master.db.session() as session:
            if listing is not None and listing["ended"]:
                await session.execute(
                    update(HostListing).where(HostListing.host_id == host_id).values(available_until=datetime.now(UTC) - timedelta(hours=1))
                )  # fmt: skip
            if host["state"] != "online":
                await session.execute(update(Host).where(Host.id == host_id).values(state=host["state"]))
        host_ids.append(host_id)
    return host_ids


async def _rent(api: Api, key: str, **body: Any) -> tuple[int, Any]:
    return await api.call("POST", "/rentals", key, json={"gpu_count": 1, **body})


async def _offers(api: Api, key: str, host_ids: list[str]) -> list[dict[str, Any]]:
    status, body = await api.call("GET", "/offers", key, params={"limit": 500})
    assert status == 200, body
    return [offer for offer in body["items"] if offer["host_id"] in host_ids]


def _refused(status: int, body: Any, what: str) -> None:
    assert status != 201, f"{what} was rented: {body}"
    assert 400 <= status < 500, body


class TestOfferedIsRentable:
    @EXAMPLES
    @given(fleet=st.lists(hosts, min_size=1, max_size=4), before=uses)
    async def test_every_offer_rents_what_it_says_and_not_one_more(
        self, api: Api, fleet: list[dict[str, Any]], before: list[tuple[str, str, Any]]
    ) -> None:
        """Each offer rents exactly its free whole GPUs and its free MIG instances per profile; nothing else rents."""
        example = next(_examples)
        host_ids = await _write_fleet(api, example, fleet)
        _, key = await create_principal(api.master, f"renter-rentable-{example}", "renter")
        for kind, model, amount in before:
            words = "A100" if model == A100 else "RTX 4090"
            request = {"whole": {"gpu_count": amount}, "share": {"gpu_milli": amount}, "mig": {"mig_profile": amount}}[kind]
            await _rent(api, key, gpu_model=words, **request)  # whatever fits; refusals change nothing

        offers = await _offers(api, key, host_ids)
        assert all(o["host_state"] in ("online", "rented") for o in offers), offers
        for offer in offers:
            assert offer["num_gpus"] > 0 or offer["mig_instances_free"] > 0, offer
            assert sum(m["free"] for m in offer["mig"]) == offer["mig_instances_free"], offer
            free = offer["num_gpus"]
            status, body = await _rent(api, key, offer_id=offer["id"], gpu_count=free + 1)
            _refused(status, body, f"{free + 1} whole GPUs of offer {offer['id']} (it says {free} free)")
            if free:
                status, rental = await _rent(api, key, offer_id=offer["id"], gpu_count=free)
                assert status == 201, (offer, rental)
                assert (rental["host_id"], rental["gpu_model"]) == (offer["host_id"], offer["gpu_name"])
            for mig in offer["mig"]:
                for _ in range(mig["free"]):
                    status, rental = await _rent(api, key, offer_id=offer["id"], mig_profile=mig["profile"])
                    assert status == 201, (offer, mig, rental)
                    assert rental["host_id"] == offer["host_id"]
                status, body = await _rent(api, key, offer_id=offer["id"], mig_profile=mig["profile"])
                _refused(status, body, f"one more MIG {mig['profile']} instance of offer {offer['id']}")

        # Everything offered is rented now: no offer is left, and no host and model rents a whole GPU or an instance.
        assert await _offers(api, key, host_ids) == []
        for host_id, host in zip(host_ids, fleet, strict=True):
            for model in {gpu["model"] for gpu in host["gpus"]}:
                status, body = await _rent(api, key, offer_id=f"{host_id}:{model}")
                _refused(status, body, f"a whole GPU of {host_id}:{model}, which no offer lists")
                for profile in PROFILES:
                    status, body = await _rent(api, key, offer_id=f"{host_id}:{model}", mig_profile=profile)
                    _refused(status, body, f"a MIG {profile} instance of {host_id}:{model}, which no offer lists")
