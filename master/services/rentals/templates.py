"""Templates: named container workloads ("base", "pytorch", "jupyter", "vllm") a rental can start by name.

A template is a ``shared.protocol.ContainerWorkload`` with a name and a description. Anyone
signed in reads them; admins create, replace and delete them. A rental that names a template
copies its workload when it is created (``workload_of``), so a later edit or deletion never
changes a rental that exists. The first templates are seeded by migration 0014.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from master.models import Template
from shared import protocol
from shared.errors import NotFound, ValidationFailed

NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"
MAX_DESCRIPTION_CHARS = 500
_NAME_RE = re.compile(NAME_PATTERN)


def check_name(name: str) -> str:
    """``name`` if it is a valid template name; ``ValidationFailed`` (field ``name``) otherwise."""
    if not _NAME_RE.fullmatch(name):
        raise ValidationFailed(
            f"name: a template name is 1 to 40 lower-case letters, digits or '-', starting with a letter or digit, not {name[:60]!r}",
            code="invalid_template_name",
            details={"problems": [{"field": "name", "problem": f"must match {NAME_PATTERN}"}]},
        )
    return name


def not_found(name: str) -> NotFound:
    return NotFound(f"no template {name[:60]!r}; GET /api/v1/templates lists them", code="template_not_found")


async def list_templates(session: AsyncSession) -> Sequence[Template]:
    return (await session.scalars(select(Template).order_by(Template.name))).all()


async def get_template(session: AsyncSession, name: str) -> Template:
    template = await session.get(Template, name) if _NAME_RE.fullmatch(name) else None
    if template is None:
        raise not_found(name)
    return template


async def put_template(
    session: AsyncSession, name: str, *, description: str, workload: protocol.ContainerWorkload, now: datetime
) -> tuple[Template, bool]:
    """Create or replace the template ``name``; returns it and whether it is new."""
    check_name(name)
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise ValidationFailed(f"description: at most {MAX_DESCRIPTION_CHARS} characters", code="validation_failed")
    template = await session.get(Template, name, with_for_update=True)
    stored = workload.model_dump(mode="json")
    created = template is None
    if template is None:
        template = Template(name=name, description=description, workload=stored, created_at=now, updated_at=now)
        session.add(template)
    else:
        template.description, template.workload, template.updated_at = description, stored, now
    await session.flush()
    return template, created


async def delete_template(session: AsyncSession, name: str) -> None:
    """Delete the template ``name`` (rentals made from it keep their copy of its workload)."""
    template = await get_template(session, name)
    await session.delete(template)


async def workload_of(session: AsyncSession, name: str) -> dict[str, Any]:
    """The container workload a new rental of template ``name`` runs (a copy); 404 ``template_not_found``."""
    template = await get_template(session, name)
    # Validated again: a row edited by hand must not reach an agent as something it would refuse.
    return protocol.ContainerWorkload.model_validate(template.workload).model_dump(mode="json")


def template_view(template: Template) -> dict[str, Any]:
    workload = template.workload or {}
    return {
        "name": template.name,
        "description": template.description,
        "image": workload.get("image"),
        "command": workload.get("command"),
        "args": workload.get("args"),
        "env": workload.get("env") or {},
        "ports": workload.get("ports") or [],
        "shm_mib": workload.get("shm_mib"),
        "workload": workload,
        "updated_at": template.updated_at.isoformat(),
    }
