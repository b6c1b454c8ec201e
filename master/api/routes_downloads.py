"""What a provider's host downloads to install the agent: ``GET /downloads/install-agent.sh`` and
``GET /downloads/agent`` (the gpumarket wheel; see ``master.services.hosts.agent_package``).

Both live outside ``/api/v1`` and are public, like the console: a host is admitted by its
one-time enrollment token, not by these files. HEAD answers too (aiohttp adds it to every GET
route). The wheel comes with its file name and sha256 in headers, so the installer can name it
for pip and check it arrived whole.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from master.api.base import RateClass, Route
from master.api.keys import MASTER
from master.services.hosts import AgentPackages, source_checkout
from shared.errors import NotFound

PACKAGE_HEADER = "X-Gpumarket-Package"
SHA256_HEADER = "X-Gpumarket-Sha256"
# Package data (deploy/install-agent.sh links here), so every master has the script it serves.
INSTALLER = Path(__file__).resolve().parents[1] / "data" / "install-agent.sh"

AGENT_PACKAGES = web.AppKey("agent_packages", AgentPackages)


async def download_agent(request: web.Request) -> web.StreamResponse:
    package = await request.app[AGENT_PACKAGES].get()
    return web.FileResponse(
        package.path,
        headers={
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f'attachment; filename="{package.filename}"',
            "Cache-Control": "no-cache",
            PACKAGE_HEADER: package.filename,
            SHA256_HEADER: package.sha256,
        },
    )


async def download_installer(request: web.Request) -> web.Response:
    try:
        script = INSTALLER.read_bytes()
    except OSError:
        raise NotFound(f"the agent installer is missing from {INSTALLER}; reinstall gpumarket", code="installer_unavailable") from None
    return web.Response(
        body=script,
        headers={
            "Content-Type": "text/plain; charset=utf-8",  # readable in a browser before it is run
            "Content-Disposition": 'inline; filename="install-agent.sh"',
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
        },
    )


async def packages_ctx(app: web.Application) -> AsyncIterator[None]:
    """The app's package finder, built from the master's settings."""
    settings = app[MASTER].settings
    app[AGENT_PACKAGES] = AgentPackages(
        configured=settings.agent_package, build_dir=settings.data_dir / "downloads", source_root=source_checkout()
    )
    yield


UNVERSIONED: tuple[Route, ...] = (
    Route("GET", "/downloads/agent", download_agent, "The agent's wheel, with its file name and sha256 in headers.",
          public=True, limit=RateClass.NONE, media_types=("application/octet-stream",)),
    Route("GET", "/downloads/install-agent.sh", download_installer, "The agent installer script.",
          public=True, limit=RateClass.NONE, media_types=("text/plain",)),
)  # fmt: skip
