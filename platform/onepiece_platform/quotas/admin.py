from django.contrib import admin

from onepiece_platform.quotas.models import Quota


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ["user", "max_concurrent_jobs", "gpu_seconds_per_day", "max_pixels", "max_frames", "max_steps"]
    search_fields = ["user__username"]
    autocomplete_fields = ["user"]
