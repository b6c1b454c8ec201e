"""Running renters' workloads on this host: one runtime per kind behind one manager.

``manager.WorkloadManager`` is what the agent uses; it dispatches each start to a runtime —
``hold`` (GPUs reserved, nothing run), ``process`` (a host process in a session, a folder
and a cgroup of its own; under a uid, a home and namespaces of its own from ``users`` when
the agent runs as root; ``base.Runtime``) or ``container`` (an image run through the
Docker Engine API with aiodocker: a container, a bridge network and a ``/workspace``
volume per rental, every capability dropped, a non-root user, pids/memory/CPU limits;
``container.ContainerRuntime``, with ``netguard`` keeping rental bridges off the host and
link-local metadata) — and owns watching, stopping and re-adoption through ``registry``
(``workloads.json``), ``pids`` (processes by pid and start time), ``containerlogs.ContainerHandle``
(containers through the engine: their output and exit; ``containeropts`` holds the options,
names and labels the container modules share), ``cgroups`` (CPU and memory limits of processes) and
``logs`` (capped output logs). ``isolation`` decides at start-up what the host runs
isolated (the hello's ``IsolationFacts``) and refuses the rest.

May import ``shared`` and the agent's own ``agent.gpu`` and ``agent.state``; nothing from
the master, the relay or billing. Workload specs are the wire protocol's models
(``shared.protocol.WorkloadSpec``, ``GpuShare``).
"""
