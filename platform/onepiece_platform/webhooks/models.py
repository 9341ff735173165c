"""Webhook endpoints, and the outbox of deliveries with a record of every attempt.

An API key has at most one endpoint: its URL receives the events of the jobs submitted with that key,
and its ``whsec_`` secret signs every delivery of those jobs, also to a per-request ``webhook_url``
(the native API's), so a receiver needs one secret per key. The secret is stored as it is (an HMAC
key must be known to sign with it) and shown to the client once, when the endpoint is created.

A :class:`WebhookDelivery` is written in the transaction that finishes its job
(:func:`onepiece_platform.webhooks.outbox.enqueue`), so an event exists exactly when the terminal
state does; its body is frozen there, and its ``msg_id`` (the ``webhook-id`` header) never changes.
The delivery worker (``manage.py deliver_webhooks``) claims due rows, sends them and records each try
as a :class:`WebhookAttempt`.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from onepiece_platform.webhooks import signing

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
ENDPOINT, REQUEST = "endpoint", "request"


class WebhookEndpoint(models.Model):
    api_key = models.OneToOneField("accounts.ApiKey", on_delete=models.CASCADE, related_name="webhook_endpoint",
                                   help_text="events of the jobs submitted with this key are sent here")
    url = models.CharField(max_length=2000)
    events = models.JSONField(default=list, help_text="the event types sent to the URL")
    secret = models.CharField(max_length=100, editable=False, help_text="whsec_...: signs every delivery")
    enabled = models.BooleanField(default=True, help_text="off: nothing is sent to the URL (deliveries to "
                                                          "per-request webhook_urls still are)")
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.url} ({self.api_key})"

    @property
    def secret_hint(self) -> str:
        return signing.hint(self.secret)


class WebhookDelivery(models.Model):
    """One event for one destination: the outbox row, pending until a receiver answers 2xx."""

    msg_id = models.CharField(max_length=40, unique=True, editable=False, help_text="the webhook-id header")
    event_id = models.CharField(max_length=40, db_index=True, editable=False, help_text="the body's id")
    event_type = models.CharField(max_length=32)
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="webhook_deliveries")
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries",
                                 help_text="whose secret signs it (and, for target=endpoint, whose URL)")
    target = models.CharField(max_length=8, choices=[(ENDPOINT, ENDPOINT), (REQUEST, REQUEST)])
    url = models.CharField(max_length=2000, blank=True, help_text="the per-request webhook_url (target=request); "
                                                                  "endpoint deliveries go to its current URL")
    body = models.TextField(editable=False, help_text="the exact JSON sent and signed on every attempt")
    state = models.CharField(max_length=10, default=PENDING,
                             choices=[(s, s) for s in (PENDING, DELIVERED, FAILED)])
    attempt_count = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(help_text="due from then (a claim pushes it by the lease)")
    give_up_at = models.DateTimeField(help_text="no retry is scheduled after this; then the delivery fails")
    claim_token = models.CharField(max_length=32, blank=True, editable=False,
                                   help_text="the claim of the worker sending it now")
    last_status = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "webhook deliveries"
        constraints = [
            # a replayed terminal transition can never queue the same event twice for one destination
            models.UniqueConstraint(fields=["job", "target"], name="one_webhook_delivery_per_job_and_target"),
        ]
        indexes = [
            models.Index(fields=["state", "next_attempt_at"], name="webhook_due",
                         condition=Q(state=PENDING)),
        ]

    def __str__(self) -> str:
        return f"{self.msg_id} {self.event_type} {self.state}"

    @property
    def destination(self) -> str:
        return self.url if self.target == REQUEST else self.endpoint.url


class WebhookAttempt(models.Model):
    """One try of a delivery: what the receiver answered, how long it took, or why it failed."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField(help_text="1 for the first try")
    at = models.DateTimeField(help_text="when the try started")
    url = models.CharField(max_length=2000)
    address = models.CharField(max_length=64, blank=True, help_text="the vetted address it connected to")
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(default=0)
    error = models.CharField(max_length=500, blank=True)
    worker = models.CharField(max_length=100, blank=True, help_text="host:pid of the worker that made it")

    class Meta:
        ordering = ["delivery", "number", "id"]

    def __str__(self) -> str:
        return f"{self.delivery_id}#{self.number} {self.status_code or self.error[:40]}"

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300
