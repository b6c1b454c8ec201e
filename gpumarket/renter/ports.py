"""``gpumarket open RENTAL PORT``: the web address of a TCP port a running rental declared, printed, or opened in a
browser with ``--browser`` (``connect.port_lines`` are the addresses ``rent`` prints).

The address is the relay's ``web_url`` from ``POST /rentals/{id}/connect`` (docs/connect.md, "Web ports"): it carries
a connect token, so it opens the port for about two minutes; the relay then keeps a session cookie for the browser
that opened it. Running ``open`` again makes a new one.
"""

from __future__ import annotations

import argparse
import webbrowser

from gpumarket.renter.api import Client, CliError
from gpumarket.renter.commands import finish
from gpumarket.renter.connect import no_web_port, rental_arg, request_ticket
from gpumarket.renter.options import port


async def cmd_open(args: argparse.Namespace, client: Client) -> int:
    ticket = await request_ticket(client, args.rental, args.port)
    if ticket.web_url is None:
        raise CliError(f"rental {args.rental}'s port {args.port}: {no_web_port(args.rental, args.port)}")
    print(ticket.web_url, flush=True)
    if args.browser and not webbrowser.open(ticket.web_url):
        raise CliError("no web browser found here (set BROWSER to one); open the address above yourself within two minutes")
    return 0


OPEN_EPILOG = """\
PORT is a TCP port the rental declared when it was rented (--port with --image, or its
template's: 8888 for jupyter, 8000 for vllm). The address is the relay's, one host name per
rental and port (https://<rental>-<port>.<ports domain>/), with a token in it that opens the
port for about two minutes; the browser that opens it then keeps a session (8 hours). Run
`gpumarket open` again for a new address. Under `gpumarket up` the relay's certificate is from
the marketplace's own CA: accept it once, or import .gpumarket/ca/ca.crt.

examples:
  gpumarket open r-0123456789abcdef 8888
  gpumarket open r-0123456789abcdef 8000 --browser"""


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``open`` to ``gpumarket``'s subparsers."""
    opener = sub.add_parser("open", help="the web address of a port a rental serves (or open it in a browser)",
                            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=OPEN_EPILOG,
                            description="Print the web address of a TCP port a running rental declared, through its "
                            "relay; --browser opens it too.")  # fmt: skip
    opener.add_argument("rental", type=rental_arg, metavar="RENTAL", help="the rental's id")
    opener.add_argument("port", type=port, metavar="PORT", help="a TCP port the rental declared")
    opener.add_argument("--browser", action="store_true", help="open the address in this machine's web browser too")
    finish(opener, cmd_open)
