"""API keys, users' priority tiers and the audit log.

A key is ``op_<prefix>_<secret>``: the prefix (public, unique) finds the row,
the secret is stored only as its SHA-256 and compared in constant time. A
plain SHA-256 is enough because the secret is 256 random bits (no dictionary
to attack); a slow password hash would cost every API request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import datetime

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db import models
from django.utils import timezone

from engine.workflow.options import Priority

KEY_PREFIX = "op"
# a request's priority: the engine's vocabulary (engine.workflow.options.Priority), lowest first
Priorities = models.TextChoices("Priorities", [(p.name, (p.value, p.value)) for p in Priority])
PRIORITIES: tuple[str, ...] = tuple(Priorities.values)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def default_tier(user: object) -> str:
    """The tier of a user no operator has set one for: high for staff, normal for everyone else."""
    return "high" if getattr(user, "is_staff", False) else "normal"


class PriorityTier(models.Model):
    """A user's tier: the highest request priority the user may ask for, from a signed-in session or with
    any of the user's API keys (a key may be set lower, never higher). Users without a row get
    :func:`default_tier`. An operator's change applies at once to every key and session of the user."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="priority_tier")
    max_priority = models.CharField(max_length=8, choices=Priorities.choices,
                                    help_text="the highest priority this user's requests may ask for, with any "
                                              "of the user's API keys or from a signed-in session")

    class Meta:
        verbose_name = "priority tier"

    def __str__(self) -> str:
        return f"{self.user}: at most {self.max_priority}"


def tier_of(user: object) -> str:
    """``user``'s tier: the operator's setting (:class:`PriorityTier`), else :func:`default_tier`."""
    try:
        return str(user.priority_tier.max_priority)  # type: ignore[attr-defined]
    except (AttributeError, ObjectDoesNotExist):  # no row (Django caches the miss), or an anonymous user
        return default_tier(user)


def lowest(*levels: str) -> str:
    return min(levels, key=PRIORITIES.index)


class ApiKey(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    # the key's own cap below its owner's tier ("": the owner's tier; see max_priority_allowed). An operator
    # may lower one key in the admin; the tier itself belongs to the user (PriorityTier), so a key set
    # higher than its owner's tier still gets the owner's.
    max_priority = models.CharField(max_length=8, blank=True, default="",
                                    choices=Priorities.choices,
                                    help_text="lower this key below its owner's priority tier (empty: the "
                                              "owner's tier; a setting above the tier has no effect)")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{KEY_PREFIX}_{self.prefix}_... ({self.user})"

    @classmethod
    def issue(cls, user: models.Model, name: str = "", expires_at: datetime | None = None) -> tuple[ApiKey, str]:
        """Create a key; returns (row, the full key). The full key is never stored or shown again."""
        prefix = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        key = cls.objects.create(user=user, name=name, prefix=prefix, secret_hash=hash_secret(secret),
                                 expires_at=expires_at)
        return key, f"{KEY_PREFIX}_{prefix}_{secret}"

    @property
    def max_priority_allowed(self) -> str:
        """The highest priority this key may use: its owner's tier (:func:`tier_of`), or the key's own
        setting where that is lower."""
        tier = tier_of(self.user)
        return lowest(self.max_priority or tier, tier)

    def matches(self, secret: str) -> bool:
        return hmac.compare_digest(self.secret_hash, hash_secret(secret))

    @property
    def active(self) -> bool:
        now = timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked_at"])


def split_key(raw: str) -> tuple[str, str] | None:
    """(prefix, secret) of a well-formed key, else None."""
    parts = raw.split("_", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


class AuditEntry(models.Model):
    """Who did what to which object: key issue/revoke, cancels, admin scaling actions."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    action = models.CharField(max_length=64, db_index=True)
    target = models.CharField(max_length=200, blank=True, db_index=True)
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"


def audit(actor: models.Model | None, action: str, target: str = "", **detail: object) -> AuditEntry:
    return AuditEntry.objects.create(actor=actor, action=action, target=target, detail=detail)
