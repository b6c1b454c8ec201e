"""The ``gpumarket`` command: wires the components together (CLI, the embedded ``up`` mode and the
production topology as processes, ``cluster``).

The top layer: the only package allowed to import every component.
"""

__version__ = "0.1.0"
