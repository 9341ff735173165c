"""The outbox: a finished job's events are rows written in the transaction that finished it.

Called by :func:`onepiece_platform.jobs.ledger.finish` inside its ``transaction.atomic()``, after the
conditional UPDATE that moved the job to its terminal state: either both commit or neither does, so
no event is lost with a crash between the two and none exists for a state that was rolled back. A
job finishes once, and the unique constraint (job, target) makes a second call harmless anyway.

Destinations: the endpoint of the API key that submitted the job (if enabled and subscribed to the
event) and the job's own ``webhook_url`` (native API), which gets every terminal event of its job;
both signed with that endpoint's secret. A job submitted without an API key (a signed-in session) has
no endpoint and makes no event.
"""

from __future__ import annotations

import datetime as dt

from django.utils import timezone

from onepiece_platform import conf
from onepiece_platform.jobs.models import Job
from onepiece_platform.webhooks import events
from onepiece_platform.webhooks.models import ENDPOINT, REQUEST, WebhookDelivery, WebhookEndpoint


def enqueue(job: Job) -> int:
    """Queue ``job``'s terminal event for its destinations (inside the finishing transaction); the count."""
    if job.api_key_id is None:
        return 0
    endpoint = WebhookEndpoint.objects.filter(api_key_id=job.api_key_id).first()
    if endpoint is None:
        return 0
    type_ = events.event_type(job)
    event_id = events.new_event_id()
    body = events.body(event_id, type_, job)
    now = timezone.now()
    give_up = now + dt.timedelta(seconds=float(conf.get("WEBHOOK_MAX_AGE_S")))
    common = {"event_id": event_id, "event_type": type_, "job": job, "endpoint": endpoint, "body": body,
              "next_attempt_at": now, "give_up_at": give_up}
    rows = []
    if endpoint.enabled and type_ in endpoint.events:
        rows.append(WebhookDelivery(msg_id=events.new_message_id(), target=ENDPOINT, **common))
    if job.webhook_url:
        rows.append(WebhookDelivery(msg_id=events.new_message_id(), target=REQUEST, url=job.webhook_url, **common))
    if rows:
        WebhookDelivery.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows)
