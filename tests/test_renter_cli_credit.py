"""`gpumarket credit add AMOUNT` against a real master on loopback: the demo's new balance, Stripe's checkout link,
and refusals as one line that credit nothing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import pytest

from billing import ledger
from gpumarket.cli import main
from tests.apiclient import Api
from tests.stripefake import StripeFake, stripe_fake
from tests.test_payments import market
from tests.test_renter_cli import Cli, one_line


@pytest.fixture
async def demo(tmp_path: Path) -> AsyncIterator[Api]:
    async with market(tmp_path, f"sqlite:///{tmp_path / 'test.db'}", payments="demo") as api:
        yield api


async def balance(api: Api) -> Decimal:
    async with api.master.db.session() as session:
        return await ledger.balance(session, ledger.renter_credit(api.renter.account_id))


def test_credit_add_has_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["credit", "add", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: gpumarket credit add" in out and "examples:" in out and "gpumarket credit add 25.00" in out


class TestDemo:
    async def test_prints_the_new_balance_and_says_it_was_a_demo(
        self, demo: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        cli = Cli(demo, capsys, monkeypatch, tmp_path / "home")
        code, out, err = await cli("credit", "add", "25.00")
        assert (code, err) == (0, ""), err
        assert out == "added $25.00 (demo payment: no card charged); balance $25.00\n"
        code, out, _ = await cli("credit", "add", "7", "--json")
        assert code == 0 and json.loads(out)["balance"] == "32.000000" and json.loads(out)["provider"] == "demo"
        assert await balance(demo) == Decimal("32.00")

    @pytest.mark.parametrize(("amount", "status", "says"), [
        ("25.001", 2, "at most 2 decimals"),  # refused before any request
        ("1,000", 2, "no sign, exponent, spaces or separators"),
        ("4.99", 1, "invalid_amount"),  # the API's bounds
        ("10000.01", 1, "invalid_amount"),
    ])  # fmt: skip
    async def test_a_bad_amount_is_one_line_and_credits_nothing(
        self, demo: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        amount: str, status: int, says: str,
    ) -> None:  # fmt: skip
        cli = Cli(demo, capsys, monkeypatch, tmp_path / "home")
        code, out, err = await cli("credit", "add", amount)
        assert (code, out) == (status, "")
        assert says in one_line(err)
        assert await balance(demo) == 0

    async def test_a_provider_account_is_refused(
        self, demo: Api, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        cli = Cli(demo, capsys, monkeypatch, tmp_path / "home")
        cli.env(url=cli.url, key=demo.provider_key)
        code, out, err = await cli("credit", "add", "25.00")
        assert code != 0 and out == "" and "forbidden" in one_line(err).lower()


async def test_with_payments_off_it_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with market(tmp_path, f"sqlite:///{tmp_path / 'test.db'}") as api:
        cli = Cli(api, capsys, monkeypatch, tmp_path / "home")
        code, out, err = await cli("credit", "add", "25.00")
        assert code == 1 and out == "" and "payments_disabled" in one_line(err)


async def test_with_stripe_it_prints_the_checkout_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stripe (its real package against the local fake): the link to pay at; nothing credited yet."""
    async with stripe_fake() as fake:
        fake_: StripeFake = fake
        async with market(tmp_path, f"sqlite:///{tmp_path / 'test.db'}", payments="stripe", stripe_secret_key="sk_test_cli",
                          stripe_webhook_secret="whsec_cli", stripe_api_base=fake_.url) as api:  # fmt: skip
            cli = Cli(api, capsys, monkeypatch, tmp_path / "home")
            code, out, err = await cli("credit", "add", "42.50")
            assert (code, err) == (0, ""), err
            (sent,) = fake_.sent
            assert out.splitlines()[0] == f"pay $42.50 at {sent.session['url']}"
            assert sent.form["line_items[0][price_data][unit_amount]"] == "4250"
            assert sent.headers["Idempotency-Key"].startswith("gpumarket-tu_")
            assert await balance(api) == 0
