"""The native API's per-request ``webhook_url``: who may send one, and which secret signs it.

A job's own ``webhook_url`` receives its terminal event (``job.completed``, ``job.failed``,
``job.cancelled`` or ``job.expired``) signed with the secret of the submitting API key's endpoint: a
receiver verifies every delivery of a key with that one secret, and a URL given in a request cannot
choose or learn a secret. So a ``webhook_url`` needs a request made with an API key that has an endpoint
(``POST /api/v1/webhooks``; create it disabled to sign per-request deliveries only), and is vetted as an
endpoint's URL is (:mod:`onepiece_platform.webhooks.ssrf`).
"""

from __future__ import annotations

from typing import Any

from onepiece_platform.jobs.services import Invalid
from onepiece_platform.webhooks import ssrf
from onepiece_platform.webhooks.models import WebhookEndpoint


def vet_webhook_url(api_key: Any, url: str) -> str:
    """``url`` if a job submitted with ``api_key`` may be delivered to it; raises Invalid on ``webhook_url``."""
    from onepiece_platform.accounts.models import ApiKey

    if not isinstance(api_key, ApiKey):
        raise Invalid("webhook_url", "webhook_url needs a request made with an API key (its endpoint's secret "
                                     "signs the delivery)")
    if not WebhookEndpoint.objects.filter(api_key=api_key).exists():
        raise Invalid("webhook_url", "this API key has no webhook endpoint, whose secret signs deliveries: create "
                                     "one with POST /api/v1/webhooks (enabled: false to use it for signing only)")
    try:
        ssrf.vet(url)
    except ssrf.UnsafeUrl as exc:
        raise Invalid("webhook_url", f"webhook_url: {exc}") from None
    return url
