"""The renter, provider and admin web console, served by the master at ``/``.

A single-page app in ``console/static/`` (HTML, CSS, JavaScript modules; no build step),
a pure client of the REST API ``/api/v1``. Imports nothing from master/agent/access: the
master mounts ``console.routes.add_console_routes`` on its app.
"""
