"""Where the reconciler stopped reading the engine's event stream (survives web restarts)."""

from __future__ import annotations

from django.db import models


class StreamCursor(models.Model):
    name = models.CharField(max_length=64, primary_key=True)
    last_id = models.CharField(max_length=64, default="0-0")
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.name} @ {self.last_id}"
