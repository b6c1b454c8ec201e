"""The platform itself: whether its database and bus answer, its live relays (``views.py``), and the fleet's use
over time for the admin's charts (``fleet.py``: occupancy and hosts online per day). Imports no other part of
``master.services``.
"""
