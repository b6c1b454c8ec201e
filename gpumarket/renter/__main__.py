"""``python -m gpumarket.renter COMMAND``: the renter's commands alone, without the services'
imports (``gpumarket ssh``'s ProxyCommand starts this way, once per connection: it starts faster)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gpumarket import __version__
from gpumarket.renter.commands import add_parsers as add_renter_parsers
from gpumarket.renter.ports import add_parsers as add_port_parsers
from gpumarket.renter.sshcmds import add_parsers as add_ssh_parsers


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="gpumarket", description="The renter's commands of gpumarket alone (`gpumarket --help` lists every command).")
    parser.add_argument("--version", action="version", version=f"gpumarket {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_renter_parsers(sub)
    add_ssh_parsers(sub)
    add_port_parsers(sub)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
