"""The renter, provider and admin web console, served by the master at ``/``.

A single-page app in ``console/static/`` (HTML, CSS, JavaScript modules; no build step),
a pure client of the REST API ``/api/v1``. Sits beside ``master.api`` in the layers: imports
``shared`` only; the master's app mounts ``console.routes.add_console_routes``.
"""
