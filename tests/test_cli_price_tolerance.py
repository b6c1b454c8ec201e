"""``--price-tolerance`` on ``gpumarket rent``, ``cluster create`` and ``service create``: what each sends as the request's
``price_tolerance`` (docs/placement.md, "The renter's price first"), and the values refused before the API is asked."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from gpumarket.cli import build_parser
from gpumarket.renter.clusters import cluster_body
from gpumarket.renter.renting import rental_body
from gpumarket.renter.services import service_body


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(("given", "sent"), [("0.05", "0.05"), ("5%", "0.05"), ("12.5%", "0.125"), ("0", "0"), ("1000%", "10")])
async def test_every_command_sends_the_tolerance_as_a_fraction(given: str, sent: str) -> None:
    assert rental_body(parse("rent", "--price-tolerance", given))["price_tolerance"] == sent
    assert cluster_body(parse("cluster", "create", "--nodes", "2", "--price-tolerance", given))["price_tolerance"] == sent
    client: Any = None  # an image's port is given: the body needs nothing from the API
    body = await service_body(parse("service", "create", "chat", "--image", "vllm/vllm:1", "--port", "8000",
                                    "--price-tolerance", given), client)  # fmt: skip
    assert body["price_tolerance"] == sent


def test_left_out_it_is_not_sent() -> None:
    assert "price_tolerance" not in rental_body(parse("rent"))
    assert "price_tolerance" not in cluster_body(parse("cluster", "create", "--nodes", "2"))


@pytest.mark.parametrize("bad", ["-0.1", "11", "1001%", "nan", "1e-2", "0.00001", "5 %", "", "0,05"])
def test_a_bad_tolerance_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse("rent", "--price-tolerance", bad)
    assert exited.value.code == 2 and "--price-tolerance" in capsys.readouterr().err
