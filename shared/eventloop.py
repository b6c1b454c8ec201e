"""The event loop a gpumarket process runs on: uvloop where it is installed, asyncio's own otherwise.

uvloop (libuv under a Cython event loop, made for exactly this) runs the relay's and the agent's
byte streams at a fraction of the CPU asyncio's pure-Python transports and TLS protocol take per
byte (docs/performance.md, "Issue 42: the stream path"). It is a dependency, but a process must
still start where it cannot import (an unusual platform, a stripped install): ``run`` then uses
asyncio's loop and says so once in the log.

``kind`` picks one: ``"auto"`` (uvloop if it imports), ``"uvloop"`` (the same, but an import
failure is an error: a benchmark that must measure it) or ``"asyncio"`` (the standard loop: tests,
and what ``access.tls``'s per-connection memory savings need, which are CPython's asyncio's). The
CLI's relay and agent (``gpumarket access``, ``gpumarket agent run``) read it from
``GPUMARKET_EVENT_LOOP`` (default ``auto``); the master and ``gpumarket up`` stay on asyncio's loop
(``master.app`` reads its server's bound port through asyncio's ``Server``). ``gpumarket tunnel``
(ssh's ProxyCommand) runs on uvloop when its stdin and stdout are pipes or sockets, as ssh gives them, and on
asyncio's otherwise (``gpumarket.renter.stdio.loop_kind``): under uvloop 0.23 it aborts (SIGABRT) when its stdout
is a regular file, which it writes from a worker thread. ``GPUMARKET_EVENT_LOOP=asyncio`` keeps it on asyncio's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from shared.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")
LOOP_KINDS: Final = ("auto", "uvloop", "asyncio")
LOOP_ENV: Final = "GPUMARKET_EVENT_LOOP"
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def loop_factory(kind: str = "auto") -> LoopFactory | None:
    """The factory for ``asyncio.Runner`` (``None``: asyncio's default loop). Raises ``ConfigError`` for an
    unknown ``kind`` and ``ImportError`` for ``"uvloop"`` when uvloop does not import."""
    if kind not in LOOP_KINDS:
        raise ConfigError(f"{LOOP_ENV} must be one of {', '.join(LOOP_KINDS)}, not {kind!r}")
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise
        log.info("uvloop does not import here; running on asyncio's own event loop")
        return None
    factory: LoopFactory = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], *, kind: str | None = None) -> T:
    """``asyncio.run(main)`` on the loop ``kind`` names (see the module docstring; ``None``: the
    environment's ``GPUMARKET_EVENT_LOOP``, else ``"auto"``)."""
    if kind is None:
        kind = os.environ.get(LOOP_ENV, "auto")
    with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``"uvloop"`` or ``"asyncio"``: what ``loop`` (default: the running one) is."""
    loop = loop or asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
