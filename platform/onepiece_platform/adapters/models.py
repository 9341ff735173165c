"""The admin's record of operators' adapter actions (add, remove). The registry itself is the engine's
(engine.adapters.registry): a row is what was asked, by whom, and the registry's verdict."""

from __future__ import annotations

from django.conf import settings
from django.db import models


class AdapterAction(models.Model):
    ADD, REMOVE = "add", "remove"

    action = models.CharField(max_length=8, choices=[(ADD, "add"), (REMOVE, "remove")], default=ADD)
    name = models.CharField(max_length=64)
    workflow = models.CharField(max_length=64, blank=True, help_text="add: the workflow whose model it adapts")
    scale_default = models.FloatField(default=1.0, help_text="add: the scale of a request that names none")
    status = models.CharField(max_length=16, blank=True)  # done | refused
    detail = models.TextField(blank=True)
    digest = models.CharField(max_length=64, blank=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.action} {self.name}: {self.status}"
