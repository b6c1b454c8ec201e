"""Choosing GPUs for a rental. First-fit for now; the pluggable scheduler replaces this module.

Matching GPU model names: every word of the request must be a word of the NVML name
or a run of adjacent words ("RTX4090" matches "NVIDIA GeForce RTX 4090", "A100 80GB"
matches "NVIDIA A100-SXM4-80GB", but "A10" does not match "A100").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def model_matches(query: str | None, gpu_name: str) -> bool:
    if not query:
        return True
    name = _words(gpu_name)
    runs = {"".join(name[i : j + 1]) for i in range(len(name)) for j in range(i, len(name))}
    return all(word in runs for word in _words(query))


@dataclass(frozen=True)
class FreeGpu:
    gpu_id: str
    host_id: str
    index: int
    uuid: str
    name: str


def first_fit(free: list[FreeGpu], *, count: int, model: str | None) -> list[list[FreeGpu]]:
    """Candidate placements in preference order: for each host with enough matching free GPUs, its lowest-index ones."""
    by_host: dict[str, list[FreeGpu]] = {}
    for gpu in free:
        if model_matches(model, gpu.name):
            by_host.setdefault(gpu.host_id, []).append(gpu)
    options = []
    for host_id in sorted(by_host):
        gpus = sorted(by_host[host_id], key=lambda g: g.index)
        if len(gpus) >= count:
            options.append(gpus[:count])
    return options
