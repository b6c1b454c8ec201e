"""The provider agent: runs on a provider's GPU host and speaks to the platform.

It reads the host's GPUs (``agent.gpu``) and host facts (``agent.hostfacts``),
reports them and their live state to an access relay, and runs the master's
commands. It imports ``shared`` only: never ``master``, ``access``, ``billing`` or
``console``, which run elsewhere and reach it only over the wire protocol.
"""
