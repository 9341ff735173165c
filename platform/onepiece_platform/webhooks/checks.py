"""System check ``onepiece.E010``: a delivery's lease must outlast its attempt, or a slow attempt's row
would be claimed and sent by a second worker while the first is still waiting for the receiver."""

from __future__ import annotations

from typing import Any

from django.core.checks import Error, register

from onepiece_platform import conf


@register()
def check_webhook_lease(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    lease, timeout = float(conf.get("WEBHOOK_LEASE_S")), float(conf.get("WEBHOOK_TIMEOUT_S"))
    if lease > timeout:
        return []
    return [Error(f"WEBHOOK_LEASE_S ({lease:g}) must be longer than WEBHOOK_TIMEOUT_S ({timeout:g})",
                  hint="a lease of a few times the timeout leaves room for the database", id="onepiece.E010")]
