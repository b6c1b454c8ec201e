"""One grammar for money and quantity strings (``shared/money.py``), generated from both sides with hypothesis.

Strings of the grammar are accepted and read exactly; strings outside it — signs, exponents,
digit-group separators, non-ASCII digits, padding, NaN and Infinity, too many decimals, random
Unicode — are refused by ``parse_amount``, by the pydantic type, by the CLI, and with 422
through the API (a bid, a spend cap, a listing's price) on SQLite and PostgreSQL.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Annotated, Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from gpumarket.renter import options
from shared.errors import ValidationFailed
from shared.money import CENT_PLACES, MAX_PRICE, PRICE_PLACES, Amount, amount_pattern, parse_amount
from tests.apiclient import Api, assert_error
from tests.factories import create_principal

T = TypeVar("T")
DIGITS = "0123456789"
WHITESPACE = [" ", "\t", "\n", "\r", "\u00a0", "\u2003", "\u3000", "\u200b", "\ufeff"]


def amounts(places: int = PRICE_PLACES, *, whole_digits: int = 6) -> st.SearchStrategy[str]:
    """Strings of the grammar: ``12``, ``12.5``, ``.5``, ``007.10`` (leading and trailing zeros are allowed)."""
    whole = st.text(DIGITS, min_size=1, max_size=whole_digits)
    fraction = st.text(DIGITS, min_size=1, max_size=places)
    return st.one_of(whole, st.builds(lambda w, f: f"{w}.{f}", whole, fraction), fraction.map(lambda f: f".{f}"))


def _swap_in(text: str, index: int, char: str) -> str:
    index %= len(text)
    return text[:index] + char + text[index + 1 :]


def hostile(places: int = PRICE_PLACES) -> st.SearchStrategy[str]:
    """Strings outside the grammar, each built from one forbidden shape (or random Unicode with a non-digit in it)."""
    valid = amounts(places)
    foreign_digit = st.characters(categories=["Nd"]).filter(lambda c: c not in DIGITS)  # ١, ０, ๓, ...
    separator = st.sampled_from([",", "_", "'", " ", "\u202f", "\u066c"])
    pad = st.sampled_from(WHITESPACE)
    return st.one_of(
        st.builds(lambda s, v: s + v, st.sampled_from(["+", "-", "\u2212", "--"]), valid),  # signs
        st.builds(lambda v, e: v + e, valid, st.sampled_from(["e3", "E-2", "e+1", "e0", "E"])),  # exponents
        st.builds(lambda a, s, b: f"{a}{s}{b}", st.text(DIGITS, min_size=1, max_size=3), separator,
                  st.text(DIGITS, min_size=3, max_size=3)),  # 1,000 1_000
        st.builds(_swap_in, valid, st.integers(0, 40), foreign_digit).filter(lambda s: any(c not in DIGITS + "." for c in s)),
        st.builds(lambda p, v: p + v, pad, valid), st.builds(lambda v, p: v + p, valid, pad),  # padding
        st.sampled_from(["NaN", "nan", "sNaN", "Infinity", "inf", "-Infinity", "+Inf", "", ".", "1.", "1..2", "1.2.3", "0x10", "$1"]),
        st.builds(lambda w, f: f"{w}.{f}", st.text(DIGITS, min_size=1, max_size=3), st.text(DIGITS, min_size=places + 1, max_size=places + 4)),
        st.text(max_size=40).filter(lambda s: s == "" or any(c not in DIGITS + "." for c in s)),  # random Unicode
    )


def canonical(text: str) -> str:
    """What ``format(Decimal, "f")`` writes for an amount of the grammar: no leading zeros, "0" before a lone fraction."""
    whole, _, fraction = text.partition(".")
    whole = whole.lstrip("0") or "0"
    return f"{whole}.{fraction}" if fraction else whole


def drawn(strategy: st.SearchStrategy[T], count: int = 60) -> list[T]:
    """``count`` examples of ``strategy``, deterministically: for the API cases, which share one master per test."""
    seen: list[T] = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(value: T) -> None:
        seen.append(value)

    collect()
    return seen


class TestTheFunction:
    @given(text=amounts())
    def test_every_string_of_the_grammar_is_read_exactly(self, text: str) -> None:
        """An amount of the grammar is its exact decimal value: digits are kept, never rounded through a float."""
        value = parse_amount(text, field="bid")
        assert format(value, "f") == canonical(text)
        assert value == Decimal(text)

    @given(text=amounts(CENT_PLACES, whole_digits=4))
    def test_cents_are_read_exactly(self, text: str) -> None:
        """With two places, ``12.34`` is read as it is written."""
        assert format(parse_amount(text, places=CENT_PLACES), "f") == canonical(text)

    @given(text=hostile())
    def test_every_string_outside_the_grammar_is_refused_with_what_to_write(self, text: str) -> None:
        """Signs, exponents, separators, non-ASCII digits, padding, NaN, too many decimals and random Unicode are refused."""
        with pytest.raises(ValidationFailed) as refused:
            parse_amount(text, field="bid")
        assert refused.value.http_status == 422
        assert refused.value.message.startswith("'bid' must be a plain amount like 0.45 (ASCII digits and at most one dot, at most 6 decimals")
        assert refused.value.details["problems"][0]["field"] == "bid"

    @pytest.mark.parametrize("text", ["1,000", "1_000", "١٢٣", "１２３", " 1", "1 ", "NaN", "Infinity", "+1", "-1", "1e3", "0.1234567", "１.５"])
    def test_the_shapes_named_in_the_issue_are_refused(self, text: str) -> None:
        """Regression (issue 21): strings a person never means as money (most of them read by Python's Decimal()) were credited."""
        with pytest.raises(ValidationFailed):
            parse_amount(text)

    def test_json_numbers_integers_exact_fractions_refused(self) -> None:
        """A JSON integer is exact and accepted; a JSON number with a fraction (a float by then) or a bool is refused."""
        assert parse_amount(25) == Decimal(25)
        for value in (0.45, 1e2, float("nan"), True, None, -1, [1], {"v": 1}):
            with pytest.raises(ValidationFailed):
                parse_amount(value)
        with pytest.raises(ValidationFailed, match="sent as a JSON string"):
            parse_amount(0.45, field="bid")

    def test_bounds(self) -> None:
        """``positive`` refuses 0; ``maximum`` refuses more; 40 digits are refused before they are read."""
        with pytest.raises(ValidationFailed, match="more than 0"):
            parse_amount("0.000", positive=True)
        with pytest.raises(ValidationFailed, match=r"at most 999999\.999999"):
            parse_amount("1000000", maximum=MAX_PRICE)
        with pytest.raises(ValidationFailed):
            parse_amount("9" * 40)
        assert parse_amount("999999.999999", maximum=MAX_PRICE) == MAX_PRICE

    def test_the_console_mirrors_the_pattern(self) -> None:
        """console/static/money.js holds the same regular expression as the JSON Schema and the server."""
        from pathlib import Path

        script = (Path(__file__).parents[1] / "console/static/money.js").read_text(encoding="utf-8")
        assert "ASCII digits and at most one dot" in script
        for places in (PRICE_PLACES, CENT_PLACES):
            js = amount_pattern(places).replace("{1," + str(places) + "}", "{1,${places}}")
            assert js in script, js


class Body(BaseModel):
    bid: Annotated[Decimal, Amount(maximum=MAX_PRICE, positive=True)]


class TestThePydanticType:
    @given(text=amounts().filter(lambda t: Decimal(t) > 0))
    def test_accepts_the_grammar(self, text: str) -> None:
        """The request-model type reads what ``parse_amount`` reads."""
        assert Body.model_validate({"bid": text}).bid == Decimal(text)
        assert Body.model_validate_json(json.dumps({"bid": text})).bid == Decimal(text)

    @given(text=hostile())
    def test_refuses_the_rest(self, text: str) -> None:
        """...and refuses what it refuses, with the same words."""
        with pytest.raises(ValidationError, match=r"must be a plain amount like 0\.45"):
            Body.model_validate({"bid": text})

    def test_json_schema_names_the_pattern(self) -> None:
        """The OpenAPI document says a string of the pattern, or a JSON integer."""
        schema = Body.model_json_schema()["properties"]["bid"]
        assert schema["anyOf"][0]["pattern"] == amount_pattern(PRICE_PLACES)
        assert schema["anyOf"][1] == {"type": "integer", "minimum": 0, "maximum": 999999}


class TestTheCli:
    @given(text=hostile())
    def test_cli_refuses_the_same_strings(self, text: str) -> None:
        """``gpumarket rent --bid`` / ``--max-price`` refuse what the API refuses, with the same message."""
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be a plain amount like 0\.45"):
            options.usd(text)

    @given(text=amounts().filter(lambda t: Decimal(t) > 0))
    def test_cli_sends_a_valid_amount_as_typed(self, text: str) -> None:
        """A valid amount goes to the API as it was typed."""
        assert options.usd(text) == text


# What the body reader refuses before any grammar (master/api/characters.py): 400 invalid_character, naming the field.
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


async def _expect_refused(api: Api, send: Callable[[Any], Any], strings: list[str], code: str) -> None:
    for text in strings:
        status, body = await send(text)
        if CONTROL.search(text):
            assert (status, body["code"]) == (400, "invalid_character"), (text, body)
            continue
        assert status == 422, (text, body)
        assert body["code"] == code, (text, body)
        assert "must be a plain amount like" in body["message"] or "must be more than 0" in body["message"], (text, body)


class TestThroughTheApi:
    """Through three representative endpoints, each reading the grammar under its own error code."""

    async def test_a_bid_outside_the_grammar_is_422(self, api: Api) -> None:
        """POST /rentals: a bid outside the grammar is 422 validation_failed naming the field; nothing is rented."""
        await api.host(1)

        async def send(text: Any) -> Any:
            return await api.as_renter("POST", "/rentals", json={"gpu_count": 1, "kind": "interruptible", "bid": text})

        await _expect_refused(api, send, drawn(hostile()), "validation_failed")
        status, body = await send("1,000")
        assert body["details"]["problems"][0]["field"] == "bid"
        assert body["message"].startswith("bid: must be a plain amount like 0.45"), body
        status, body = await send(0.45)
        assert_error(status, body, 422, "validation_failed")
        assert "JSON string" in body["message"]
        status, rental = await send("0.45")
        assert status == 201, rental

    async def test_a_spend_cap_outside_the_grammar_is_422_and_one_inside_is_kept_exactly(self, api: Api) -> None:
        """PUT /account/spend-cap: refused with 422 invalid_amount; accepted amounts read back exactly."""

        async def send(text: Any) -> Any:
            return await api.as_renter("PUT", "/account/spend-cap", json={"monthly_spend_cap": text})

        await _expect_refused(api, send, drawn(hostile(CENT_PLACES)), "invalid_amount")
        accepted = drawn(amounts(CENT_PLACES, whole_digits=6).filter(lambda t: 0 < Decimal(t) <= 1_000_000), 30)
        for text in accepted:
            status, body = await send(text)
            assert status == 200, (text, body)
            assert Decimal(body["monthly_spend_cap"]) == Decimal(text), (text, body)
        status, body = await send(25)
        assert (status, body["monthly_spend_cap"]) == (200, "25.00")

    async def test_a_listing_price_outside_the_grammar_is_422_invalid_price(self, api: Api) -> None:
        """PUT /hosts/{id}/listing: refused with 422 invalid_price (invalid_min_bid for the minimum bid); the listing is unchanged."""
        host_id, _ = await api.host(1)
        status, _ = await api.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": "0.45"})
        assert status == 201

        async def send(text: Any) -> Any:
            return await api.as_provider("PUT", f"/hosts/{host_id}/listing", json={"price_per_gpu_hour": text})

        await _expect_refused(api, send, drawn(hostile()), "invalid_price")
        status, body = await api.as_provider("PUT", f"/hosts/{host_id}/listing",
                                             json={"price_per_gpu_hour": "0.45", "min_bid_per_gpu_hour": "0,2"})  # fmt: skip
        assert_error(status, body, 422, "invalid_min_bid")
        _, listing = await api.as_provider("GET", f"/hosts/{host_id}/listing")
        assert (listing["price_per_gpu_hour"], listing["min_bid_per_gpu_hour"]) == ("0.450000", None)

    async def test_a_top_up_with_separators_or_foreign_digits_credits_nothing(self, api: Api) -> None:
        """Regression (issue 21): "1,000", "١٠٠" and " 5" were credited; now 422 invalid_amount and the balance stays 0."""
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        for number, text in enumerate(["1,000", "1_000", "١٠٠", "１００", " 5", "5 ", "+5", "5e2", "NaN"]):
            body = {"account_id": api.renter.account_id, "amount": text, "reference": f"pay-{number}"}
            status, answer = await api.call("POST", "/account/credits", admin_key, json=body)
            assert_error(status, answer, 422, "invalid_amount")
        _, account = await api.as_renter("GET", "/account")
        assert account["credit"]["balance"] == "0.000000"

    async def test_quotas_take_the_grammar_with_three_places(self, api: Api) -> None:
        """PUT /accounts/{id}/quota: 1.5 GPUs and a JSON integer are fine; 1.2345 GPUs and "1,5" are 422."""
        _, admin_key = await create_principal(api.master, "admin-1", "admin")
        path = f"/accounts/{api.renter.account_id}/quota"
        status, body = await api.call("PUT", path, admin_key, json={"max_gpus": "1.5", "max_spend_per_hour": 3})
        assert status == 200, body
        for bad in ({"max_gpus": "1.2345"}, {"max_gpus": "1,5"}, {"max_gpus": 1.5}, {"max_spend_per_hour": "-1"}):
            status, body = await api.call("PUT", path, admin_key, json=bad)
            assert_error(status, body, 422, "validation_failed")


def test_strategies_are_what_they_say() -> None:
    """The hostile strategy never yields a string of the grammar (so the refusal tests test refusals)."""
    import re

    grammar = re.compile(amount_pattern(PRICE_PLACES).removeprefix("^").removesuffix("$"))

    @settings(max_examples=300, database=None)
    @given(text=hostile())
    def check(text: str) -> None:
        assert not grammar.fullmatch(text)

    check()
