from django.contrib import admin
from django.http import HttpRequest

from onepiece_platform.jobs import control
from onepiece_platform.jobs.models import Job, StageRun


class StageRunInline(admin.TabularInline):
    model = StageRun
    fields = readonly_fields = ["stage", "attempt", "started", "finished", "device_s", "stopped", "detail"]
    extra = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    inlines = [StageRunInline]
    list_display = ["uid", "owner", "workflow", "state", "progress", "stage", "cost_estimate_gpu_s",
                    "cost_measured_gpu_s", "created_at", "finished_at"]
    list_filter = ["state", "workflow", "api", "created_at"]
    search_fields = ["=uid", "owner__username"]
    date_hierarchy = "created_at"
    actions = ["cancel_jobs"]

    def get_readonly_fields(self, request: HttpRequest, obj: Job | None = None) -> list[str]:
        # the ledger is written by transitions only; the admin reads it
        return [f.name for f in Job._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description="Cancel selected jobs (every stage)")
    def cancel_jobs(self, request: HttpRequest, queryset) -> None:  # type: ignore[no-untyped-def]
        from onepiece_platform.accounts.models import audit

        for job in queryset:
            control.cancel(job)
            audit(request.user, "job.cancel", job.uid or "")
