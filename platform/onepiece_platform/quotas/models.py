"""Per-user limits. Users without a row get ``ONEPIECE['DEFAULT_QUOTA']``."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import models

from onepiece_platform import conf


@dataclass(frozen=True)
class Limits:
    max_concurrent_jobs: int
    gpu_seconds_per_day: float
    max_pixels: int
    max_frames: int
    max_steps: int


class Quota(models.Model):
    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="quota")
    max_concurrent_jobs = models.PositiveIntegerField(default=4)
    gpu_seconds_per_day = models.FloatField(default=3600.0)
    max_pixels = models.PositiveIntegerField(default=1280 * 720, help_text="height x width")
    max_frames = models.PositiveIntegerField(default=129)
    max_steps = models.PositiveIntegerField(default=100)

    def __str__(self) -> str:
        return f"quota of {self.user}"

    def limits(self) -> Limits:
        return Limits(self.max_concurrent_jobs, self.gpu_seconds_per_day, self.max_pixels, self.max_frames,
                      self.max_steps)


def limits_for(user_id: int) -> Limits:
    q = Quota.objects.filter(user_id=user_id).first()
    return q.limits() if q else Limits(**conf.get("DEFAULT_QUOTA"))
