"""Matching GPU model names, as renters write them, against NVML names.

Both sides are compared after Unicode normalisation: NFKC (full-width ``ＲＴＸ ４０９０`` is
``RTX 4090``, a ligature its letters), then case folding. A word is then a run of letters and
digits of any script. Every word of the request must be a word of the NVML name or a run of
adjacent words ("RTX4090" matches "NVIDIA GeForce RTX 4090", "A100 80GB" matches "NVIDIA
A100-SXM4-80GB", but "A10" does not match "A100").

A filter must mean something: ``model_filter_problem`` refuses one with no word (empty, spaces,
symbols only: ``★★★``) — never read as "any model" — and one with a word that is not ASCII
letters and digits after normalisation (a Cyrillic ``Т`` in ``RТХ``): NVML names are ASCII,
so such a word is a look-alike that could never match. Which GPUs a rental gets is
``master/scheduler`` (the algorithms) and ``master/services/rentals/placement.py`` (candidates,
claims, preemption).
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["model_filter_problem", "model_matches", "model_words", "normalise_name"]

_WORD = re.compile(r"[^\W_]+")  # letters and digits, any script
_ASCII_WORD = re.compile(r"[a-z0-9]+", re.ASCII)


def normalise_name(text: str) -> str:
    """``text`` as it is compared and shown: NFKC, so full-width and compatibility forms become their plain letters."""
    return unicodedata.normalize("NFKC", text)


def model_words(text: str) -> list[str]:
    """The words of a model name or filter, after NFKC and case folding."""
    return _WORD.findall(normalise_name(text).casefold())


def model_filter_problem(text: str) -> str | None:
    """Why ``text`` is not a model filter (None: it is one); the words are compared after Unicode normalisation."""
    words = model_words(text)
    if not words:
        return "has no letter or digit after Unicode normalisation; give model words such as RTX 4090 or A100 80GB"
    foreign = next((w for w in words if not _ASCII_WORD.fullmatch(w)), None)
    if foreign is not None:
        return (f"has the word {foreign!r}, which is not ASCII letters and digits after Unicode normalisation (a look-alike "
                "letter of another script?); GPU model names are ASCII: write it as RTX 4090 or A100 80GB")  # fmt: skip
    return None


def model_matches(query: str | None, gpu_name: str) -> bool:
    """Whether ``gpu_name`` has every word of ``query``; None is no filter, and a filter without words matches nothing."""
    if query is None:
        return True
    wanted = model_words(query)
    if not wanted:
        return False
    name = model_words(gpu_name)
    runs = {"".join(name[i : j + 1]) for i in range(len(name)) for j in range(i, len(name))}
    return all(word in runs for word in wanted)
