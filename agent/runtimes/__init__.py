"""Running renters' workloads on this host: one runtime per kind behind one manager.

``manager.WorkloadManager`` is what the agent uses; it dispatches each start to a
``base.Runtime`` — ``hold`` (GPUs reserved, nothing run), ``process`` (a host process in a
session, a folder and a cgroup of its own) or ``container`` (docker/podman; not on the
wire yet) — and owns watching, stopping and re-adoption through ``registry``
(``workloads.json``), ``pids`` (processes by pid and start time), ``cgroups`` (CPU and
memory limits) and ``logs`` (capped output logs). ``isolation`` decides at start-up what the
host runs isolated (the hello's ``IsolationFacts``) and refuses the rest; ``users`` gives
each process rental a uid, a home and namespaces of its own when the agent runs as root.

May import ``shared`` and the agent's own ``agent.gpu`` and ``agent.state``; nothing from
the master, the relay or billing. Workload specs are the wire protocol's models
(``shared.protocol.WorkloadSpec``, ``GpuShare``).
"""
