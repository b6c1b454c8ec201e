"""The ``gpumarket`` command: wires the components together (CLI and the embedded ``up`` mode).

The only package allowed to import every component.
"""

__version__ = "0.1.0"
