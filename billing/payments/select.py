"""The provider ``MasterSettings.payments`` names: ``None`` (off), the demo, or Stripe Checkout."""

from __future__ import annotations

from billing.payments.base import PaymentProvider
from billing.payments.demo import DemoPayments
from billing.payments.stripe import StripePayments
from shared.settings import MasterSettings


def provider_for(settings: MasterSettings) -> PaymentProvider | None:
    if settings.payments == "demo":
        return DemoPayments()
    if settings.payments == "stripe":
        assert settings.stripe_secret_key is not None  # the settings refuse stripe without it
        return StripePayments(settings.stripe_secret_key.get_secret_value(), api_base=settings.stripe_api_base,
                              timeout=settings.stripe_timeout)  # fmt: skip
    return None
