"""The admin's read-only view of the job ledger with each job's stage runs, and cancelling jobs from it."""

from django.contrib import admin
from django.http import HttpRequest

from onepiece_platform.admin_base import ReadOnlyAdmin, ReadOnlyInline
from onepiece_platform.jobs import control
from onepiece_platform.jobs.models import Job, StageRun


class StageRunInline(ReadOnlyInline):
    model = StageRun
    fields = ["stage", "attempt", "started", "finished", "device_s", "stopped", "detail"]


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):  # the ledger is written by transitions only; the admin reads it
    inlines = [StageRunInline]
    list_display = ["uid", "owner", "workflow", "state", "progress", "stage", "cost_estimate_gpu_s",
                    "cost_measured_gpu_s", "created_at", "finished_at"]
    list_filter = ["state", "workflow", "api", "created_at"]
    search_fields = ["=uid", "owner__username"]
    date_hierarchy = "created_at"
    actions = ["cancel_jobs"]

    @admin.action(description="Cancel selected jobs (every stage)")
    def cancel_jobs(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        from onepiece_platform.accounts.models import audit

        for job in queryset:
            control.cancel(job)
            audit(request.user, "job.cancel", job.uid or "")
