"""What the OpenAI-style video surface records beside the ledger: which video a remix came from."""

from __future__ import annotations

from django.db import models


class Remix(models.Model):
    """A video made by ``POST /v1/videos/{id}/remix``: the source's parameters with a new prompt."""

    job = models.OneToOneField("jobs.Job", on_delete=models.CASCADE, related_name="remix")
    source_uid = models.CharField(max_length=32, help_text="the video it remixes")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.job_id} <- {self.source_uid}"
