"""The admin's page for quotas, with each user's running jobs and GPU-seconds today read from Redis."""

from django.contrib import admin

from onepiece_platform.quotas import counters
from onepiece_platform.quotas.models import Quota


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ["user", "max_concurrent_jobs", "gpu_seconds_per_day", "max_pixels", "max_frames", "max_steps",
                    "running_now", "gpu_seconds_today"]
    search_fields = ["user__username"]
    autocomplete_fields = ["user"]

    @admin.display(description="running now")
    def running_now(self, obj: Quota) -> str:
        try:
            return str(counters.usage(obj.user_id)[0])
        except Exception:  # Redis away: the page still opens
            return "?"

    @admin.display(description="GPU-s today")
    def gpu_seconds_today(self, obj: Quota) -> str:
        try:
            return f"{counters.usage(obj.user_id)[1]:.1f}"
        except Exception:
            return "?"
