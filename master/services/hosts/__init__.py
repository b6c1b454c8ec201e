"""Hosts, as providers and admins see them: enrollment, the host's views, its agent package and its power policy.

* ``enrollment.py``: enrollment tokens, a host's first certificate and its renewals.
* ``views.py``: hosts and GPUs as the API shows them (listings, state changes, network; a network test on demand).
* ``agent_package.py``: the agent's package the master serves to installers.
* ``power.py``, ``power_savings.py``: the off-peak power policy and the energy it saved.
* ``verification.py``: GPU verification's flow: challenges issued, answered, verified; what a verdict does.
* ``challenge.py``: the challenge's rules, Sans-I/O: sizes, deadlines, the reveal and the verdict (over
  ``shared.verification.compute``, the host's arithmetic).

The host state machine is ``master.services.lifecycle.hosts``. The highest of the aggregates: it may import
accounts, market and rentals (an enrolled host's rentals), and nothing imports it but the callers of this layer.
"""

from master.services.hosts.agent_package import AgentPackages, source_checkout
from master.services.hosts.enrollment import (
    certificate_row,
    check_token,
    create_token,
    enroll,
    known_regions,
    publish_revocations,
    renew,
    retire_superseded,
    revoke_host,
)
from master.services.hosts.power import (
    DEFAULT_THRESHOLD,
    POWER_LEASE,
    PolicyInput,
    get_policy,
    power_pass,
    put_policy,
)
from master.services.hosts.power_savings import account_view
from master.services.hosts.verification import KINDS as VERIFICATION_KINDS
from master.services.hosts.verification import LEASE as VERIFICATION_LEASE
from master.services.hosts.verification import after_result as after_verification_result
from master.services.hosts.verification import at_hello as verification_at_hello
from master.services.hosts.verification import issued_commands as verification_commands
from master.services.hosts.verification import list_verifications, verification_pass, verification_view
from master.services.hosts.verification import request as request_verification
from master.services.hosts.views import (
    get_host,
    host_events,
    host_network,
    list_hosts,
    request_network_test,
    visible_host,
)

__all__ = [
    "DEFAULT_THRESHOLD",
    "POWER_LEASE",
    "VERIFICATION_KINDS",
    "VERIFICATION_LEASE",
    "AgentPackages",
    "PolicyInput",
    "account_view",
    "after_verification_result",
    "certificate_row",
    "check_token",
    "create_token",
    "enroll",
    "get_host",
    "get_policy",
    "host_events",
    "host_network",
    "known_regions",
    "list_hosts",
    "list_verifications",
    "power_pass",
    "publish_revocations",
    "put_policy",
    "renew",
    "request_network_test",
    "request_verification",
    "retire_superseded",
    "revoke_host",
    "source_checkout",
    "verification_at_hello",
    "verification_commands",
    "verification_pass",
    "verification_view",
    "visible_host",
]
