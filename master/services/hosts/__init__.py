"""Hosts, as providers and admins see them: enrollment, the host's views, its agent package and its power policy.

* ``enrollment.py``: enrollment tokens, a host's first certificate and its renewals.
* ``views.py``: hosts and GPUs as the API shows them (listings, state changes, network; a network test on demand).
* ``agent_package.py``: the agent's package the master serves to installers.
* ``power.py``, ``power_savings.py``: the off-peak power policy and the energy it saved.

The host state machine is ``master.services.lifecycle.hosts``. The highest of the aggregates: it may import
accounts, market and rentals (an enrolled host's rentals), and nothing imports it but the callers of this layer.
"""
