"""Matching GPU model names, as renters write them, against NVML names.

Every word of the request must be a word of the NVML name or a run of adjacent words
("RTX4090" matches "NVIDIA GeForce RTX 4090", "A100 80GB" matches "NVIDIA A100-SXM4-80GB",
but "A10" does not match "A100"). Which GPUs a rental gets is ``master/scheduler`` (the
algorithms) and ``master/services/rental_placement.py`` (candidates, claims, preemption).
"""

from __future__ import annotations

import re

_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def model_matches(query: str | None, gpu_name: str) -> bool:
    if not query:
        return True
    name = _words(gpu_name)
    runs = {"".join(name[i : j + 1]) for i in range(len(name)) for j in range(i, len(name))}
    return all(word in runs for word in _words(query))
