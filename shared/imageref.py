"""Container image references: one strict grammar, shared by the REST API, the templates and the agent.

The grammar is the distribution project's (``docker/distribution/reference``), ASCII only, so a
look-alike letter (a Cyrillic ``а`` in ``ubuntu``) is refused rather than pulled from some
other repository: ``[registry[:port]/]path[:tag][@digest]``, lower-case path components,
at most 255 characters in the name. A reference without a registry is Docker Hub's
(``docker.io``), and a one-component Docker Hub path is ``library/...`` — the same names the
engine pulls, so that an image policy says exactly what will be fetched.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Final

DEFAULT_REGISTRY: Final = "docker.io"
MAX_REFERENCE_CHARS: Final = 512
MAX_NAME_CHARS: Final = 255

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]{{1,5}})?)"
_PATH_COMPONENT = r"(?:[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*)"
_TAG = r"(?:[\w][\w.-]{0,127})"
_DIGEST = r"(?:[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})"
_REFERENCE_RE: Final = re.compile(
    rf"^(?P<name>(?:(?P<domain>{_DOMAIN})/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?$",
    re.ASCII,
)

IMAGE_HINT: Final = "an image reference such as 'ubuntu:24.04' or 'nvcr.io/nvidia/pytorch:24.05-py3'"


@dataclass(frozen=True, slots=True)
class ImageReference:
    """A parsed reference: ``registry`` is explicit (``docker.io`` when none was written)."""

    registry: str
    repository: str  # the path, with ``library/`` for a one-component Docker Hub name
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        """``registry/repository``: what an image policy matches."""
        return f"{self.registry}/{self.repository}"

    @property
    def canonical(self) -> str:
        """The full reference, with the tag ``latest`` when neither tag nor digest was given."""
        tag = f":{self.tag}" if self.tag else ("" if self.digest else ":latest")
        return f"{self.name}{tag}" + (f"@{self.digest}" if self.digest else "")


def parse_image_reference(text: str) -> ImageReference:
    """Parse ``text``; raises ``ValueError`` saying what a valid reference looks like."""
    if not isinstance(text, str) or not text or len(text) > MAX_REFERENCE_CHARS:
        raise ValueError(f"'image' must be {IMAGE_HINT} (1 to {MAX_REFERENCE_CHARS} characters)")
    match = _REFERENCE_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text[:80]!r} is not a valid image reference: write {IMAGE_HINT} (lower-case ASCII path)")
    name = match.group("name")
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"image name is longer than {MAX_NAME_CHARS} characters")
    domain = match.group("domain")
    # As the engine reads it: a first component is a registry only with a '.', a ':' or 'localhost'.
    if domain is not None and ("." in domain or ":" in domain or domain == "localhost"):
        registry, path = domain, name[len(domain) + 1 :]
    else:
        registry, path = DEFAULT_REGISTRY, name
    if registry == DEFAULT_REGISTRY and "/" not in path:
        path = f"library/{path}"
    return ImageReference(registry=registry.lower(), repository=path, tag=match.group("tag"), digest=match.group("digest"))


def image_allowed(reference: ImageReference, patterns: list[str] | tuple[str, ...]) -> bool:
    """Whether ``reference`` matches one of a provider's ``patterns`` (empty: every image).

    A pattern is a registry (``nvcr.io``: every image it serves), or a name with shell
    wildcards (``docker.io/library/*``, ``nvcr.io/nvidia/pytorch``). Names are compared in
    their canonical form, so ``ubuntu`` and ``docker.io/library/ubuntu`` are the same image.
    """
    if not patterns:
        return True
    for pattern in patterns:
        pattern = pattern.strip().lower()
        if not pattern:
            continue
        if "/" not in pattern and not any(c in pattern for c in "*?["):
            if reference.registry == pattern:
                return True
        elif fnmatch.fnmatchcase(reference.name, pattern):
            return True
    return False
