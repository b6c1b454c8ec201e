"""``python -m gpumarket``: the ``gpumarket`` command, for a venv whose scripts are not on PATH
(``gpumarket ssh`` runs its ProxyCommand this way)."""

from gpumarket.cli import main

main()
