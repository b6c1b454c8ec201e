"""Off-peak power limits (docs/power.md): a host's power policy (``/hosts/{host_id}/power-policy``) and the energy
the provider's policies saved (``/provider/power``). The rules live in ``master/services/hosts/power.py`` and
``master/services/hosts/power_savings.py``; the master tells agents in its ``power-policy`` pass, never in the request.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, Field

from master.api.base import QueryParam, Route, int_query, parse_body
from master.api.keys import MASTER
from master.api.middleware import principal
from master.services import hosts
from shared.errors import BadRequest, ValidationFailed


class PowerPolicyPut(BaseModel):
    """A host's power policy: lower its idle GPUs off-peak to ``cap_watts``, or to ``cap_fraction`` of each GPU's
    default limit (exactly one of them), while the forecast demand is below ``off_peak_threshold`` of its peak."""

    model_config = {"extra": "forbid"}

    enabled: bool = Field(True, description="false: opt out (every lowered GPU is restored).")
    cap_watts: float | None = Field(None, gt=0, le=5000, description="The limit off-peak, W, within every GPU's allowed range; e.g. 250.")
    cap_fraction: float | None = Field(None, gt=0, lt=1, description="The limit off-peak as a share of each GPU's default limit, e.g. 0.6.")
    off_peak_threshold: float = Field(hosts.DEFAULT_THRESHOLD, gt=0, le=1, description="An hour is off-peak when its forecast demand is below this share of the next 24 hours' peak.")


async def put_power_policy(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    try:
        body = await parse_body(request, PowerPolicyPut)
    except ValidationFailed as exc:  # every malformed policy is the caller's 400, as the service's own checks
        raise BadRequest(exc.message, code="invalid_power_policy", details=exc.details) from None
    asked = hosts.PolicyInput(enabled=body.enabled, cap_watts=body.cap_watts, cap_fraction=body.cap_fraction,
                              off_peak_threshold=body.off_peak_threshold)  # fmt: skip
    async with master.db.session() as session:
        view = await hosts.put_policy(session, principal(request), request.match_info["host_id"], asked, now=master.clock.now())
    return web.json_response(view)


async def get_power_policy(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    async with master.db.session() as session:
        view = await hosts.get_policy(session, principal(request), request.match_info["host_id"], now=master.clock.now())
    return web.json_response(view)


async def get_provider_power(request: web.Request) -> web.Response:
    days = int_query(request, "days", 30, minimum=1, maximum=400)
    master = request.app[MASTER]
    async with master.db.session() as session:
        view = await hosts.account_view(session, principal(request), now=master.clock.now(), days=days)
    return web.json_response(view)


ROUTES: tuple[Route, ...] = (
    Route("PUT", "/hosts/{host_id}/power-policy", put_power_policy,
          "Opt a host in to off-peak power limits (or out): its idle GPUs are lowered to the cap while the demand forecast "
          "for its GPU model and region is below the threshold of its peak, and restored before any rental starts on them. "
          "400 invalid_power_policy when the cap is outside a GPU's allowed range or not below its default.",
          roles=("provider",), body=PowerPolicyPut, errors=(400, 404, 409)),
    Route("GET", "/hosts/{host_id}/power-policy", get_power_policy,
          "A host's power policy, each GPU's target and limit now, the off-peak window its agent holds and the energy saved.",
          roles=("provider",), errors=(404,)),
    Route("GET", "/provider/power", get_provider_power,
          "Your hosts' power policies and the energy they saved (Wh), in all and per UTC day.",
          roles=("provider",), query=(QueryParam("days", "integer", "Days of the per-day series.", 1, 400),)),
)
