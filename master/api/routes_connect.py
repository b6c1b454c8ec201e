"""Connecting to a rental (``/rentals/{rental_id}/connect``): a short-lived token and the relay to use it at.

The rules live in ``master/services/rentals/connect.py``; the relay's side in ``access/tunnels.py``.
"""

from __future__ import annotations

from aiohttp import web

from master.api.base import Route, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.api.responses import ConnectView
from master.api.schemas import ConnectBody
from master.services import rentals


async def connect_rental(request: web.Request) -> web.Response:
    body = await parse_body(request, ConnectBody)
    view = await rentals.connect(request.app[MASTER], principal(request), request.match_info["rental_id"], body.port)
    return web.json_response(view)


ROUTES: tuple[Route, ...] = (
    Route("POST", "/rentals/{rental_id}/connect", connect_rental,
          "Connect to your running rental: a token (about two minutes) for the relay its host is on, to its SSH server "
          "(with the pinned host key) or a port it declared. 404 rental_not_found (also another account's rental); 409 "
          "rental_not_running, host_offline, nothing_to_log_into or no_ssh_host_key; 422 port_not_declared.",
          body=ConnectBody, response=ConnectView, errors=(404, 409, 422)),
)
