"""Request bodies of the REST API (pydantic); they also feed the OpenAPI document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProcessWorkload(_Body):
    kind: Literal["process"] = "process"
    argv: list[str] = Field(min_length=1, max_length=256, description="Program and arguments, run with the rented GPUs visible.")
    env: dict[str, str] = Field(default_factory=dict, max_length=256)


class HoldWorkload(_Body):
    kind: Literal["hold"] = "hold"


class RentalCreate(_Body):
    gpu_count: int = Field(1, ge=1, le=64, description="Whole GPUs, all on one host.")
    gpu_model: str | None = Field(None, max_length=128, description="Model words, e.g. 'RTX 4090' or 'A100 80GB'.")
    workload: ProcessWorkload | HoldWorkload = Field(default_factory=HoldWorkload, discriminator="kind")
    restart_on_failure: bool = Field(False, description="If the host is lost, start the workload again on another host "
                                                          "(a new rental, named in this one's events).")


class EnrollRequest(_Body):
    token: str = Field(min_length=8, max_length=256)
    csr: str = Field(min_length=64, max_length=16384, description="PEM certificate signing request of the agent's own key.")
    hostname: str = Field("", max_length=255)


class ErrorBody(BaseModel):
    code: str
    message: str
    details: dict[str, Any] | None = None
