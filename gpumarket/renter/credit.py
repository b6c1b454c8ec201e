"""``gpumarket credit add AMOUNT``: add prepaid credit through the master's payment provider (``POST /account/credit``).

With the demo provider the credit is there at once and the new balance is printed; with Stripe the
command prints the Checkout page to pay at (the balance grows when Stripe confirms the payment).
Each invocation is one top-up: it sends its own Idempotency-Key, so a retried request is never
credited twice.
"""

from __future__ import annotations

import argparse
import json
import uuid
from typing import Any

from gpumarket.renter.api import Client, UsageError
from gpumarket.renter.commands import finish
from gpumarket.renter.output import money
from shared.money import CENT_PLACES, amount_problem

CREDIT_EPILOG = """\
The amount is USD in whole cents ("25", "25.00"); the marketplace sets the smallest and largest
top-up (5.00 to 10000.00 unless its operator changed them). A demo marketplace (`gpumarket up`)
credits at once and charges no card; one taking card payments prints a Stripe Checkout link.

examples:
  gpumarket credit add 25.00
  gpumarket credit add 100 --json
"""


def _amount(text: str) -> str:
    problem, amount = amount_problem(text, places=CENT_PLACES, positive=True)
    if amount is None:
        raise UsageError(f"AMOUNT {problem}")
    return text


async def cmd_credit_add(args: argparse.Namespace, client: Client) -> int:
    amount = _amount(args.amount)
    key = f"cli-{uuid.uuid4()}"
    answer: dict[str, Any] = await client.request(
        "POST", "/account/credit", json_body={"amount": amount}, headers={"Idempotency-Key": key}, retry=True
    )
    if args.json:
        print(json.dumps(answer, indent=2))
    elif answer.get("checkout_url"):
        print(f"pay {money(answer['amount'])} at {answer['checkout_url']}\n"
              f"your balance ({money(answer.get('balance'))}) grows once the payment is confirmed")  # fmt: skip
    else:
        demo = " (demo payment: no card charged)" if answer.get("demo") else ""
        print(f"added {money(answer['amount'])}{demo}; balance {money(answer.get('balance'))}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``credit add`` to ``gpumarket``'s subparsers."""
    formatter = argparse.RawDescriptionHelpFormatter
    credit = sub.add_parser("credit", help="add prepaid credit", formatter_class=formatter, epilog=CREDIT_EPILOG,
                            description="Your prepaid credit: add some through the marketplace's payment provider.")  # fmt: skip
    credit_sub = credit.add_subparsers(dest="credit_command", required=True, metavar="ACTION")
    add = credit_sub.add_parser("add", help="add AMOUNT USD of credit", formatter_class=formatter, epilog=CREDIT_EPILOG,
                                description="Add prepaid credit: the new balance (demo), or the page to pay at.")  # fmt: skip
    add.add_argument("amount", metavar="AMOUNT", help='USD in whole cents, e.g. 25.00')
    finish(add, cmd_credit_add, json="the API's JSON")
