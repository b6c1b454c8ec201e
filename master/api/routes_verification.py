"""GPU verification (docs/verification.md): an admin's challenge of a host's GPUs on demand
(``POST /admin/hosts/{host_id}/verify``) and a host's challenges for its provider and admins
(``GET /hosts/{host_id}/verifications``). The flow lives in ``master/services/hosts/verification.py``; the
challenge's commands go out with the request, its verdict comes with the agent's answers.
"""

from __future__ import annotations

from aiohttp import web

from master.api.base import QueryParam, Route, int_query
from master.api.keys import MASTER
from master.api.middleware import principal
from master.services import hosts


async def start_verification(request: web.Request) -> web.Response:
    row = await hosts.request_verification(request.app[MASTER], principal(request), request.match_info["host_id"])
    return web.json_response(hosts.verification_view(row), status=202)


async def list_verifications(request: web.Request) -> web.Response:
    limit = int_query(request, "limit", 50, minimum=1, maximum=500)
    items = await hosts.list_verifications(request.app[MASTER], principal(request), request.match_info["host_id"], limit=limit)
    return web.json_response({"items": items, "total": len(items)})


ROUTES: tuple[Route, ...] = (
    Route("POST", "/admin/hosts/{host_id}/verify", start_verification,
          "Challenge every present GPU of the host now (docs/verification.md): 202 with the challenge (the open one if "
          "there is one); its verdict follows the agent's answers. 409 host_busy while a rental holds the host (a "
          "challenge never interrupts one), host_not_connected while its agent is away.",
          roles=("admin",), success=202, errors=(404, 409)),
    Route("GET", "/hosts/{host_id}/verifications", list_verifications,
          "The host's GPU challenges, newest first: trigger, state, deadline, the verdict per GPU with its reason, "
          "throughput measured and memory proven.",
          roles=("provider",), query=(QueryParam("limit", "integer", "How many.", 1, 500),), errors=(404,)),
)
