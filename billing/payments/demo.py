"""The demo payment provider: every top-up is paid at once and no card is charged (``gpumarket up``)."""

from __future__ import annotations

from billing.payments.base import Started, TopUp


class DemoPayments:
    """Credits at once under ``demo:<top-up id>``; the API's answer and the console say it was a demo."""

    name = "demo"
    demo = True

    async def start(self, topup: TopUp) -> Started:
        return Started(paid_reference=f"demo:{topup.id}")

    async def close(self) -> None:
        pass
