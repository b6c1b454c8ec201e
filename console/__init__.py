"""The renter and provider web console, served by the master at ``/``.

Only a placeholder page for now. Imports nothing from master/agent/access: the master
mounts ``console.routes.add_console_routes`` on its app.
"""
