"""The platform's own coordination: leases held by one master at a time."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    String,
)
from sqlalchemy.orm import Mapped, mapped_column

from master.models.base import Base


class Lease(Base):
    """A named, expiring lock held by one master process (for work only one may do at a time)."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime]
