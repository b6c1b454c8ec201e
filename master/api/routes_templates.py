"""Templates (``/templates``): named container workloads a rental can start by name.

Anyone signed in reads them; admins create, replace and delete them. The rules live in
``master/services/rentals/templates.py``.
"""

from __future__ import annotations

from aiohttp import web

from master.api.base import Route, parse_body
from master.api.keys import MASTER
from master.api.responses import TemplateDeleted, TemplateList, TemplateView
from master.api.schemas import TemplatePut
from master.services import rentals


async def list_templates(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        rows = await rentals.list_templates(session)
        return web.json_response({"templates": [rentals.template_view(t) for t in rows]})


async def get_template(request: web.Request) -> web.Response:
    async with request.app[MASTER].db.session() as session:
        template = await rentals.get_template(session, request.match_info["name"])
        return web.json_response(rentals.template_view(template))


async def put_template(request: web.Request) -> web.Response:
    master = request.app[MASTER]
    name = rentals.check_name(request.match_info["name"])
    body = await parse_body(request, TemplatePut)
    async with master.db.session() as session:
        template, created = await rentals.put_template(
            session, name, description=body.description, workload=body.workload(), now=master.clock.now()
        )
        view = rentals.template_view(template)
    return web.json_response(view, status=201 if created else 200)


async def delete_template(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    async with request.app[MASTER].db.session() as session:
        await rentals.delete_template(session, name)
    return web.json_response({"name": name, "deleted": True})


ROUTES: tuple[Route, ...] = (
    Route("GET", "/templates", list_templates, "Templates a rental can name: image, command, ports and environment, by name.",
          response=TemplateList),
    Route("GET", "/templates/{name}", get_template, "One template.", response=TemplateView, errors=(404,)),
    Route("PUT", "/templates/{name}", put_template, "Create or replace a template (201 when new). Rentals made from it "
          "before keep what it was.", roles=("admin",), body=TemplatePut, response=TemplateView, also_success=(201,),
          errors=(422,)),
    Route("DELETE", "/templates/{name}", delete_template, "Delete a template; rentals made from it keep running.",
          roles=("admin",), response=TemplateDeleted, errors=(404,)),
)
